"""The guard's pieces, each alone: norm bounds, partial admission, DP calibration, seeded sampling."""

from __future__ import annotations

import random

import numpy as np
import pytest
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)

from federated.flower_internals import OrderedGrid, calibrate_dp_noise, seeded_sampling
from federated.validation import bound_updates, partial_update_problem
from ondevice.manifest import Manifest, ParamSpec
from tests.federated.test_statistics_and_dp import Nodes

RNG = np.random.default_rng(0)
GLOBAL = {"w": RNG.standard_normal((4, 3)).astype(np.float32), "b": RNG.standard_normal(3).astype(np.float32)}


def _moved(scale: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: v + np.float32(scale) * rng.standard_normal(v.shape).astype(np.float32) for k, v in GLOBAL.items()}


def _norm(update: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((update[k].astype(np.float64) - GLOBAL[k]) ** 2) for k in update)))


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_bound_updates_rejects_or_clips_only_the_outlier(action):
    updates = {1: _moved(0.1, 1), 2: _moved(0.1, 2), 3: _moved(0.1, 3), 4: _moved(100.0, 4)}
    bound = 10 * sorted(_norm(u) for u in updates.values())[1]  # 10 x the low median
    bounded = bound_updates(updates, GLOBAL, multiple=10, absolute=0, action=action)
    for node in (1, 2, 3):
        assert all(np.array_equal(bounded.kept[node][k], updates[node][k]) for k in GLOBAL)
    if action == "reject":
        assert 4 not in bounded.kept and list(bounded.excluded) == [4] and not bounded.clipped
    else:
        clipped = bounded.kept[4]
        assert _norm(clipped) == pytest.approx(bound, rel=1e-5)
        direction = np.concatenate([(updates[4][k] - GLOBAL[k]).ravel() for k in GLOBAL])
        kept = np.concatenate([(clipped[k] - GLOBAL[k]).ravel() for k in GLOBAL])
        assert np.allclose(kept / np.linalg.norm(kept), direction / np.linalg.norm(direction), atol=1e-5)
        assert list(bounded.clipped) == [4] and not bounded.excluded
    assert f"over its bound {bound:.3g}" in {**bounded.excluded, **bounded.clipped}[4]


def test_bound_updates_clips_a_lower_rank_slice_against_its_leading_part():
    small = {"w": GLOBAL["w"][:2] + 50.0}  # a tier training the first two rows only
    bounded = bound_updates({1: small}, GLOBAL, multiple=0, absolute=1.0, action="clip")
    delta = bounded.kept[1]["w"] - GLOBAL["w"][:2]
    assert bounded.kept[1]["w"].shape == (2, 3) and np.linalg.norm(delta) == pytest.approx(1.0, rel=1e-5)


@pytest.fixture(scope="module")
def tier() -> Manifest:
    from dataclasses import replace

    base = Manifest.from_json(_minimal_manifest())
    return replace(base, trainable=(ParamSpec("w", (2, 3), 0),))


@pytest.mark.parametrize(
    ("payload", "known", "count", "problem"),
    [
        ({"w": GLOBAL["w"][:2].copy()}, True, 10, None),
        ({"w": GLOBAL["w"][:2].copy()}, False, 10, "no tier of this run"),
        ({"w": GLOBAL["w"][:2].copy()}, True, 0, "outside 1..100"),
        ({"w": GLOBAL["w"][:2].copy()}, True, True, "outside 1..100"),
        ({"w": GLOBAL["w"].copy()}, True, 10, "is not one its tier trains"),
        ({"b": GLOBAL["b"].copy()}, True, 10, "is not one its tier trains"),
    ],
)
def test_partial_admission(tier, payload, known, count, problem):
    found = partial_update_problem(payload, tier if known else None, GLOBAL, num_examples=count, max_examples=100)
    assert (found is None) if problem is None else (problem in found), found


@pytest.mark.parametrize(
    "wrapper", [DifferentialPrivacyServerSideFixedClipping, DifferentialPrivacyClientSideFixedClipping]
)
def test_dp_noise_follows_the_sampled_nodes(wrapper):
    strategy = wrapper(FedAvg(), noise_multiplier=1.5, clipping_norm=2.0, num_sampled_clients=10)
    for sampled in (10, 3, 1):
        assert calibrate_dp_noise(strategy, sampled) == pytest.approx(1.5 * 2.0 / sampled)
        assert strategy.num_sampled_clients == sampled
    assert calibrate_dp_noise(FedAvg(), 3) is None


def test_seeded_sampling_repeats_and_restores_the_global_random_state():
    def draws(seed, server_round, phase):
        with seeded_sampling(seed, server_round, phase):
            return [random.random() for _ in range(3)]

    random.seed(123)
    outside = random.getstate()
    first = draws(7, 1, "train")
    assert random.getstate() == outside  # the caller's random sequence goes on untouched
    assert draws(7, 1, "train") == first
    assert draws(7, 2, "train") != first and draws(7, 1, "evaluate") != first and draws(8, 1, "train") != first
    random.seed(5)
    expected = [random.random() for _ in range(3)]
    random.seed(5)
    assert draws(None, 1, "train") == expected  # no seed: the global sequence itself


def test_ordered_grid_lists_nodes_by_partition_then_id():
    grid = OrderedGrid(Nodes(5), {4: 0, 2: 1, 5: 2})
    assert grid.get_node_ids() == [4, 2, 5, 1, 3]
    assert grid.count == 5  # everything else is the grid's


def _minimal_manifest() -> str:
    import json

    digest = "0" * 64
    return json.dumps({
        "schema_version": 1, "name": "t",
        "files": {f: digest for f in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}], "targets": [], "outputs": [],
        "loss_output": "loss", "loss_input": None, "trainable": [{"name": "w", "shape": [4, 3], "offset": 0}],
        "frozen": [],
        "buffers": [], "loss": {"kind": "mse", "options": {}}, "optimizer": {"kind": "sgd", "lr": 0.1, "options": {}},
        "versions": {},
    })  # fmt: skip
