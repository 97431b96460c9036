"""The private parts of pinned dependencies the SDK relies on, each named with the version it was
written for: an upgrade that moves or changes one fails here, by name, instead of somewhere deep.
"""

from __future__ import annotations

from importlib import metadata

import numpy as np
import pytest

PINS = {"onnxruntime-training": "1.19.2", "onnx": "1.17.0", "flwr": "1.41.0"}


@pytest.mark.parametrize("package, version", PINS.items())
@pytest.mark.classic
def test_the_pinned_versions_are_installed(package, version):
    assert metadata.version(package) == version, f"the SDK's private uses below were checked on {package} {version}"


@pytest.mark.classic
def test_ort_1_19_private_bindings_the_runtime_uses(digits_artifacts):
    """ondevice.session reaches into onnxruntime.capi._pybind_state (CheckpointState, Module,
    Optimizer, save_checkpoint, the logger) and passes OrtValue._ortvalue to Module's buffer copies:
    ORT's public training API imports torch, which the device side must not need."""
    from onnxruntime.capi import _pybind_state as C
    from onnxruntime.capi.onnxruntime_inference_collection import OrtValue

    for name in (
        "CheckpointState",
        "Module",
        "Optimizer",
        "save_checkpoint",
        "set_default_logger_severity",
        "OrtDevice",
    ):
        assert hasattr(C, name), f"onnxruntime 1.19.2's _pybind_state.{name} is gone"
    assert hasattr(OrtValue.ortvalue_from_numpy(np.zeros(2, np.float32)), "_ortvalue")

    from ondevice import Trainer

    trainer = Trainer.load(digits_artifacts)  # built on those bindings: the flat buffer round-trips
    flat = trainer.get_flat_weights()
    trainer.set_weights(flat + 1.0)
    np.testing.assert_array_equal(trainer.get_flat_weights(), flat + 1.0)


def test_ort_1_19_symbolic_shape_inference_internals():
    """artifacts.export runs SymbolicShapeInference's own steps (its infer_shapes saves a file into
    the working directory when it gives up): the constructor's arguments and the step methods."""
    import inspect

    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    assert list(inspect.signature(SymbolicShapeInference.__init__).parameters)[1:] == [
        "int_max", "auto_merge", "guess_output_rank", "verbose", "prefix"]  # fmt: skip
    for name in ("_preprocess", "_infer_impl", "_update_output_from_vi"):
        assert callable(getattr(SymbolicShapeInference, name, None)), f"SymbolicShapeInference.{name} is gone"
    source = inspect.getsource(SymbolicShapeInference.infer_shapes)
    assert "while symbolic_shape_inference.run_:" in source and "out_mp_" in source


def test_flower_1_41_internals_the_apps_use():
    """federated.flower_internals, the one module that reaches into Flower: DP noise recalibrated
    through DifferentialPrivacyFixedClippingBase's attributes, metrics averaged with
    strategy_utils.aggregate_metricrecords, node sampling repeated by seeding the `random` module
    Flower samples with; the client reads KEY_CLIPPING_NORM."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.supercore.task_identity import TaskIdentity

    from federated.flower_internals import (
        KEY_CLIPPING_NORM,
        act_as_server_app,
        aggregate_metricrecords,
        calibrate_dp_noise,
        seeded_sampling,
    )
    from tests.federated.test_statistics_and_dp import Nodes

    assert isinstance(KEY_CLIPPING_NORM, str)
    dp = DifferentialPrivacyServerSideFixedClipping(FedAvg(), noise_multiplier=1.0, clipping_norm=2.0,
                                                    num_sampled_clients=3)  # fmt: skip
    assert calibrate_dp_noise(dp, 4) == pytest.approx(0.5) and dp.num_sampled_clients == 4

    records = [RecordDict({"m": MetricRecord({"num-examples": n, "loss": v})}) for n, v in ((10, 1.0), (30, 3.0))]
    merged = aggregate_metricrecords(records, "num-examples")
    assert merged["loss"] == pytest.approx(np.average([1.0, 3.0], weights=[10, 30]))

    TaskIdentity._run_id = None  # a fresh process: Flower refuses to make Messages...
    with pytest.raises(RuntimeError, match="run_id is not set"):
        FedAvg().configure_train(1, ArrayRecord(), ConfigRecord(), Nodes(2))
    act_as_server_app()  # ...until it has a ServerApp's task identity

    def sample(seed: int) -> list[int]:
        with seeded_sampling(seed, 1, "train"):
            messages = FedAvg(fraction_train=0.5).configure_train(1, ArrayRecord(), ConfigRecord(), Nodes(10))
        return sorted(m.metadata.dst_node_id for m in messages)

    samples = {seed: sample(seed) for seed in range(6)}
    assert all(sample(seed) == nodes for seed, nodes in samples.items()), (
        "Flower 1.41 sampled nodes with the `random` module; seeding no longer fixes it"
    )
    assert len({tuple(nodes) for nodes in samples.values()}) > 1, "the sample no longer depends on the seed"


def test_flower_1_41_secagg_pieces_the_secure_rounds_use():
    """federated.secure runs SecAgg+ with the stage functions and state of Flower's legacy client mod
    (private module flwr.client.mod.secure_aggregation.secaggplus_mod) and its server's primitives."""
    import dataclasses
    import inspect

    from federated.flower_internals import SecAgg

    stages = {"setup": ["state", "configs"], "unmask": ["state", "configs"],
              "collect_masked_vectors": ["state", "configs", "num_examples", "updated_parameters"]}  # fmt: skip
    for name, parameters in stages.items():
        assert list(inspect.signature(getattr(SecAgg, name)).parameters) == parameters, name
    assert tuple(SecAgg.Stage.all()) == ("setup", "share_keys", "collect_masked_vectors", "unmask")
    state = SecAgg.State(current_stage="setup", nid=3)
    assert SecAgg.State(**state.to_dict()).nid == 3  # the state round-trips through a ConfigRecord's values
    # the fields federated.secure_client's share_keys stage fills in for Flower's later stages
    fields = {"nid", "sk1", "sk2", "pk1", "pk2", "threshold", "share_num", "rd_seed", "public_keys_dict",
              "rd_seed_share_dict", "sk1_share_dict", "ss2_dict"}  # fmt: skip
    assert fields <= {f.name for f in dataclasses.fields(SecAgg.State)}
    secret, public = SecAgg.generate_key_pairs()  # a one-off key pair, revealed as PEM and loaded back
    again = SecAgg.bytes_to_private_key(SecAgg.private_key_to_bytes(secret))
    assert SecAgg.public_key_to_bytes(again.public_key()) == SecAgg.public_key_to_bytes(public)
    key = SecAgg.generate_shared_key(secret, public)
    plaintext = SecAgg.share_keys_plaintext_concat(5, 6, b"seed share", b"key share")
    opened = SecAgg.share_keys_plaintext_separate(SecAgg.decrypt(key, SecAgg.encrypt(key, plaintext)))
    assert list(opened) == [5, 6, b"seed share", b"key share"]
    seed = bytes(range(32))
    masks = SecAgg.pseudo_rand_gen(seed, 2**32, [(3,)])
    assert np.array_equal(masks[0], SecAgg.pseudo_rand_gen(seed, 2**32, [(3,)])[0])  # the same seed, the same mask
    from flwr.common.secure_aggregation.crypto.shamir import create_shares

    assert SecAgg.combine_shares(create_shares(seed, 2, 3)[1:]) == seed  # any 2 of 3 shares rebuild the secret
