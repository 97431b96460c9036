"""Partitions, codecs and update validation as pure functions, against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from federated.codec import decode, encode, payload_bytes
from federated.errors import CodecError, PartitionError
from federated.partitions import dirichlet, iid, partition
from federated.protocol import hash_tag
from federated.task import local_epochs
from federated.validation import update_problem
from ondevice.manifest import Manifest

LABELS = np.repeat(np.arange(10), 50)


@pytest.mark.parametrize(
    ("epochs", "steps", "examples", "batch", "expected"),
    [
        (1, 20, 12, 32, 20),  # one step per epoch: 20 epochs
        (1, 20, 251, 16, 2),  # 16 steps per epoch: 2 epochs reach 20
        (1, 20, 320, 32, 2),  # exactly 10 per epoch
        (1, 20, 321, 32, 2),  # 11 per epoch (a short last batch counts)
        (3, 20, 1000, 32, 3),  # local-epochs already gives 96 steps
        (2, 0, 5, 32, 2),  # local-steps 0: local-epochs alone
    ],
)
def test_local_epochs_reach_the_minimum_steps(epochs, steps, examples, batch, expected):
    got = local_epochs(epochs, steps, examples, batch)
    assert got == expected
    per_epoch = -(-examples // min(batch, examples))
    assert got * per_epoch >= steps and (got == epochs or (got - 1) * per_epoch < steps)  # the fewest that do


def test_iid_covers_everything_once_and_is_reproducible():
    parts = iid(503, 7, seed=3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(503))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert all(np.array_equal(a, b) for a, b in zip(parts, iid(503, 7, seed=3)))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, iid(503, 7, seed=4)))


def test_dirichlet_is_a_partition_with_label_skew():
    parts = dirichlet(LABELS, 10, alpha=0.5, seed=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(LABELS)))
    assert all(np.array_equal(a, b) for a, b in zip(parts, dirichlet(LABELS, 10, alpha=0.5, seed=0)))
    # Skew: the largest class share per partition is well above the IID 10 %.
    share = [np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts]
    iid_share = [np.bincount(LABELS[p], minlength=10).max() / len(p) for p in iid(len(LABELS), 10, seed=0)]
    assert np.mean(share) > 2 * np.mean(iid_share)
    # Larger alpha is closer to IID.
    flat = [np.bincount(LABELS[p], minlength=10).max() / len(p) for p in dirichlet(LABELS, 10, 100.0, seed=0)]
    assert np.mean(flat) < np.mean(share)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: iid(5, 6, 0), "cannot cut 5 examples into 6"),  # more partitions than examples
        (lambda: dirichlet(LABELS, 3, 0.0, 0), "alpha must be > 0"),  # invalid alpha
        (lambda: dirichlet(LABELS[:10], 6, 0.5, 0), "partitions of at least 2"),  # too small
        (lambda: partition(LABELS, 2, scheme="pathological"), "'iid' or 'dirichlet'"),  # unknown scheme
    ],
)
def test_partition_errors(call, message):
    with pytest.raises(PartitionError, match=message):
        call()


@pytest.fixture()
def tensors():
    rng = np.random.default_rng(0)
    reference = {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": rng.standard_normal(32).astype(np.float32)}
    weights = {k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32) for k, v in reference.items()}
    return weights, reference


def test_codec_none_is_exact(tensors):
    weights, reference = tensors
    decoded = decode(encode(weights, reference, "none"), reference, "none")
    for k in weights:
        np.testing.assert_array_equal(decoded[k], weights[k])


def test_codec_fp16_halves_bytes_within_half_precision(tensors):
    weights, reference = tensors
    payload = encode(weights, reference, "fp16")
    assert payload_bytes(payload) * 2 == payload_bytes(encode(weights, reference, "none"))
    decoded = decode(payload, reference, "fp16")
    for k in weights:
        delta = weights[k] - reference[k]
        np.testing.assert_allclose(decoded[k] - reference[k], delta, rtol=2**-10, atol=1e-7)


def test_codec_int8_quarters_bytes_within_half_a_step(tensors):
    weights, reference = tensors
    payload = encode(weights, reference, "int8")
    full = payload_bytes(encode(weights, reference, "none"))
    assert payload_bytes(payload) == full // 4 + 4 * len(weights)  # int8 values + one float32 scale per tensor
    decoded = decode(payload, reference, "int8")
    for k in weights:
        delta = weights[k] - reference[k]
        step = np.abs(delta).max() / 127
        assert np.abs(decoded[k] - weights[k]).max() <= step / 2 + 1e-6
        assert payload[k + "::scale"][0] == pytest.approx(step)


def test_codec_int8_zero_delta():
    reference = {"w": np.ones(4, np.float32)}
    np.testing.assert_array_equal(decode(encode(reference, reference, "int8"), reference, "int8")["w"], reference["w"])


@pytest.mark.parametrize(
    ("payload", "codec", "message"),
    [
        ({"w": np.zeros(4, np.int8)}, "int8", "has no scale"),  # scale missing
        ({"w": np.zeros(4, np.float32)}, "fp16", "the codec sends float16"),  # wrong dtype for codec
        ({"other": np.zeros(4, np.float32)}, "none", "does not have"),  # unknown tensor
        ({"w": np.zeros(4, np.float32)}, "zip", "codec must be one of"),  # unknown codec
    ],
)
def test_codec_errors(payload, codec, message):
    with pytest.raises(CodecError, match=message):
        decode(payload, {"w": np.zeros(4, np.float32)}, codec)


@pytest.fixture()
def manifest(digits_artifacts) -> Manifest:
    return Manifest.load(digits_artifacts)


def _weights(manifest, fill=0.0):
    return {p.name: np.full(p.shape, fill, np.float32) for p in manifest.trainable}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda w, m: ({**w, "5.bias": np.full(10, np.nan, np.float32)}, {}), "holds NaN/Inf"),  # NaN
        (lambda w, m: ({**w, "5.bias": np.zeros(11, np.float32)}, {}), "has shape (11,)"),  # wrong size
        (lambda w, m: ({k: v for k, v in w.items() if k != "5.bias"}, {}), "names differ"),  # missing tensor
        (lambda w, m: (w, {"num_examples": 10**9}), "outside 1..5000"),  # absurd example count
        (lambda w, m: (w, {"num_examples": 0}), "outside 1..5000"),  # non-positive count
        (lambda w, m: (w, {"num_examples": 3.5}), "must be an integer"),  # fractional count
        (lambda w, m: (w, {"tag": 12345}), "other artifacts"),  # foreign manifest hash
    ],
)
def test_update_problems(manifest, change, message):
    weights, overrides = change(_weights(manifest), manifest)
    args = {"num_examples": 100, "tag": hash_tag("ab" * 32), **overrides}
    problem = update_problem(weights, manifest, max_examples=5000, expected_tag=hash_tag("ab" * 32), **args)
    assert problem is not None and message in problem


def test_sound_update_passes(manifest):
    tag = hash_tag("cd" * 32)
    problem = update_problem(_weights(manifest), manifest, num_examples=10, max_examples=10, tag=tag, expected_tag=tag)
    assert problem is None


def test_codec_refuses_to_encode_non_finite(tensors):
    weights, reference = tensors
    weights["b"][0] = np.inf
    with pytest.raises(CodecError, match="NaN/Inf"):
        encode(weights, reference, "int8")


@pytest.mark.parametrize(
    "replies, kept, min_nodes, excluded, message",
    [
        (0, 0, 2, {}, "no client replied within round-timeout"),
        (1, 1, 2, {}, "only 1 of the 2 nodes it needs (min-nodes) replied"),
        # every client failed: the first failure is quoted, from a traceback its last line
        (
            3,
            0,
            2,
            {7: "Traceback (most recent call last):\n  File x\nDataError: train.npz is not an .npz archive"},
            "every one of the 3 clients failed or was excluded, so nothing was trained. The first: node 7: "
            "DataError: train.npz is not an .npz archive",
        ),
        (2, 1, 2, {5: "norm over bound"}, None),  # one excluded, one kept: the round goes on
        (3, 2, 2, {}, None),
    ],
)
def test_round_problems(replies, kept, min_nodes, excluded, message):
    from federated.strategy import round_problem

    problem = round_problem(replies, kept, min_nodes, excluded)
    assert problem == message if message is None else message in problem


def test_a_report_counts_only_for_the_run_that_wrote_it(tmp_path):
    """An old metrics.json in --out is never this run's report; a failure is taken over a report."""
    from federated.report import read_outcome, record_failure, write_report

    write_report([{"round": 0, "central.loss": 1.0}], tmp_path, {"run_id": "old"})
    assert read_outcome(tmp_path, "new") == (None, None)
    assert read_outcome(tmp_path, "old")[0]["settings"]["run_id"] == "old"
    record_failure(tmp_path, "new", ValueError("boom"))
    assert read_outcome(tmp_path, "new") == (None, "ValueError: boom")
    assert read_outcome(tmp_path, "old")[1] is None


def test_the_server_stops_waiting_for_nodes_that_never_connect():
    """It slept in a loop for ever while fewer than min-nodes were connected."""
    from federated.errors import RoundFailedError
    from federated.server_app import node_partitions

    class OneNode:  # only what the wait reads of Flower's Grid: the connected node ids
        def get_node_ids(self):
            return [7]

    with pytest.raises(RoundFailedError, match="only 1 of the 3 nodes a round needs"):
        node_partitions(OneNode(), 3, timeout=0.3)
