"""Generate and verify artifacts for small models of every kind the generator promises."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from artifacts import (
    MSE,
    SGD,
    AdamW,
    BCEWithLogits,
    CrossEntropy,
    CustomLoss,
    ModelLoss,
    Tolerances,
    VerificationError,
    generate,
)
from ondevice.engines.classic import OrtTraining
from ondevice.manifest import Manifest, TensorSpec
from tests.artifacts import models


def _check(manifest: Manifest) -> None:
    assert manifest.verification is not None
    assert manifest.verification.passed, [r for r in manifest.verification.rows if not r.passed]
    checks = [r.item.split(": ")[-1] for r in manifest.verification.rows]  # without a graph's name
    assert {"eval", "train", "grad", "step"} <= {check.split()[0] for check in checks}
    grads = [check for check in checks if check.startswith("grad ")]
    assert len(grads) == len(manifest.trainable) * len(manifest.engines)  # every engine's graphs are proved


def test_mlp_classifier(tmp_path):
    manifest = generate(models.mlp(), torch.randn(8, 16), tmp_path / "mlp", input_names=["input"])
    _check(manifest)
    assert manifest.feed_names == ("input", "labels")
    assert manifest.targets == (TensorSpec("labels", "int64", ("batch",)),)
    assert manifest.outputs == (TensorSpec("output", "float32", ("batch", 4)),)
    assert manifest.num_classes == 4
    assert Manifest.load(tmp_path / "mlp") == manifest


@pytest.mark.classic
def test_cnn_with_batchnorm_dropout_and_pooling(tmp_path):
    manifest = generate(models.cnn(), torch.randn(6, 1, 12, 12), tmp_path / "cnn", ort_format=True)
    _check(manifest)
    assert [b.name for b in manifest.buffers] == [
        "features.1.running_mean",
        "features.1.running_var",
        "features.5.running_mean",
        "features.5.running_var",
    ]
    assert any(r.item == "buffer features.5.running_var" for r in manifest.verification.rows)
    assert "Dropout" in manifest.verification.note
    for name in ("training_model.ort", "eval_model.ort", "optimizer_model.ort", "required_operators.config"):
        assert name in manifest.files
    # Eval is deterministic (dropout off, running statistics): two calls agree exactly.
    session = OrtTraining(tmp_path / "cnn")
    feeds = [np.random.default_rng(0).standard_normal((4, 1, 12, 12), dtype=np.float32), np.zeros(4, np.int64)]
    np.testing.assert_array_equal(session.eval_step(feeds)[1], session.eval_step(feeds)[1])


# opset 15 has no ScatterElements add, which the portable lookup gradient needs: the training build's classic graphs
# alone (without it, generation names GatherGrad and the layer)
@pytest.mark.parametrize("opset", [pytest.param(15, marks=pytest.mark.classic), 17])
def test_transformer_encoder_classifier(tmp_path, opset):
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    manifest = generate(models.encoder(), ids, tmp_path / "enc", opset=opset)
    _check(manifest)
    assert manifest.inputs == (TensorSpec("ids", "int64", ("batch", 16)),)
    assert "embedding.weight" in [p.name for p in manifest.trainable]


def test_encoder_last_layer_and_head_only(tmp_path):
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(2))
    manifest = generate(models.encoder(), ids, tmp_path / "enc", trainable=["encoder.layers.1", "norm", "head"])
    _check(manifest)
    names = [p.name for p in manifest.trainable]
    assert all(n.startswith(("encoder.layers.1.", "norm.", "head.")) for n in names)
    assert "embedding.weight" in [p.name for p in manifest.frozen]
    assert manifest.trainable_size < manifest.frozen_size


def test_mse_regression_with_multidimensional_target(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 6), torch.nn.Unflatten(1, (2, 3))
    )
    manifest = generate(
        model,
        torch.randn(7, 5),
        tmp_path / "mse",
        loss=MSE(reduction="sum"),
        optimizer=AdamW(lr=3e-3, weight_decay=0.01, max_grad_norm=0.5),
    )
    _check(manifest)
    assert manifest.targets == (TensorSpec("target", "float32", ("batch", 2, 3)),)


def test_bce_multilabel_with_pos_weight(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 4))
    manifest = generate(
        model,
        torch.randn(9, 10),
        tmp_path / "bce",
        loss=BCEWithLogits(pos_weight=(1.0, 2.0, 0.5, 3.0)),
        optimizer=SGD(lr=0.1),
    )
    _check(manifest)
    assert manifest.loss.options["pos_weight"] == [1.0, 2.0, 0.5, 3.0]
    assert manifest.optimizer.kind == "sgd"


def test_cross_entropy_with_class_weights_and_ignore_index(tmp_path):
    manifest = generate(
        models.mlp(),
        torch.randn(8, 16),
        tmp_path / "ce",
        loss=CrossEntropy(weight=(1.0, 2.0, 0.5, 1.5), ignore_index=3),
    )
    _check(manifest)


def test_two_output_model_loss_on_named_output(tmp_path):
    manifest = generate(
        models.two_heads(), torch.randn(5, 8), tmp_path / "two", output_names=["aux", "logits"], loss_output="logits"
    )
    _check(manifest)
    assert [o.name for o in manifest.outputs] == ["aux", "logits"]
    assert manifest.targets == (TensorSpec("labels", "int64", ("batch",)),)
    assert manifest.loss_input == "logits" and manifest.num_classes == 3
    # The loss reads the logits head only, so the aux head cannot train and is frozen.
    assert {p.name for p in manifest.frozen} == {"aux.weight", "aux.bias"}
    assert {p.name for p in manifest.trainable} == {"body.weight", "body.bias", "logits.weight", "logits.bias"}


def test_model_that_returns_its_own_loss(tmp_path):
    example = {"x": torch.randn(4, 6), "target": torch.randn(4, 2)}
    manifest = generate(
        models.self_loss(),
        example,
        tmp_path / "self",
        loss=ModelLoss(),
        output_names=["loss", "prediction"],
        loss_output="loss",
    )
    _check(manifest)
    assert manifest.targets == ()
    assert manifest.feed_names == ("x", "target")
    assert [o.name for o in manifest.outputs] == ["prediction"]


@pytest.mark.classic
def test_custom_onnxblock_loss(tmp_path):
    from onnxruntime.training import onnxblock  # the training build's blocks

    class MeanAbs(onnxblock.Block):
        def build(self, output_name: str, target_name: str = "target") -> str:
            return onnxblock.blocks.ReduceMean(keepdims=False)(
                onnxblock.blocks.Abs()(
                    onnxblock.blocks.Sub()(output_name, onnxblock.blocks.InputLike(output_name)(target_name))
                )
            )

    loss = CustomLoss(
        make_block=MeanAbs,
        reference_fn=lambda out, tgt: (out - tgt).abs().mean(),
        target=TensorSpec("target", "float32", ("batch", 3)),
        name="mean_abs",
    )
    torch.manual_seed(0)
    manifest = generate(torch.nn.Linear(4, 3), torch.randn(6, 4), tmp_path / "custom", loss=loss)
    _check(manifest)
    assert manifest.loss.kind == "custom"


def test_frozen_op_without_gradient_is_fine(tmp_path):
    manifest = generate(models.hardswish_head(), torch.randn(4, 8), tmp_path / "hs", trainable=["2"])
    _check(manifest)


@pytest.mark.classic
def test_parameter_order_matches_ort_buffer(tmp_path):
    manifest = generate(models.encoder(), torch.randint(0, 50, (2, 16)), tmp_path / "enc", verify=False)
    session = OrtTraining(tmp_path / "enc")
    for index, spec in enumerate(manifest.trainable):
        session.set_parameter(spec.name, np.full(spec.shape, float(index), np.float32))
    flat = session.get_flat(trainable_only=True)
    assert flat.size == manifest.trainable_size
    for index, spec in enumerate(manifest.trainable):
        np.testing.assert_array_equal(flat[spec.offset : spec.offset + spec.size], float(index))


def test_manifest_json_round_trip(tmp_path):
    manifest = generate(models.cnn(), torch.randn(2, 1, 12, 12), tmp_path / "cnn")
    text = (tmp_path / "cnn" / "manifest.json").read_text()
    assert Manifest.from_json(text) == manifest
    assert json.loads(text)["schema_version"] == 1


def test_verification_can_fail_and_then_writes_nothing(tmp_path):
    with pytest.raises(VerificationError) as caught:
        generate(models.encoder(), torch.randint(0, 50, (4, 16)), tmp_path / "enc", tolerances=Tolerances(0.0, 0.0))
    assert "FAIL" in str(caught.value) and not caught.value.verification.passed
    assert list(tmp_path.iterdir()) == []


def test_force_replaces_existing_output(tmp_path):
    first = generate(models.mlp(), torch.randn(4, 16), tmp_path / "m", verify=False)
    second = generate(
        models.mlp(), torch.randn(4, 16), tmp_path / "m", loss=CrossEntropy(reduction="sum"), verify=False, force=True
    )
    assert Manifest.load(tmp_path / "m") == second != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_constant_index_gathers_become_slices(tmp_path):
    import onnx

    ids = torch.randint(0, 50, (2, 16))
    generate(models.encoder(), ids, tmp_path / "enc", verify=False)
    graph = onnx.load(tmp_path / "enc" / "training_model.onnx").graph
    parameters = {i.name for i in graph.initializer} | {i.name for i in graph.input}
    gathers = [n for n in graph.node if n.op_type == "Gather"]
    assert all(n.input[0] in parameters for n in gathers)  # only the embedding lookup is left
    assert any(n.name.endswith("/odt_squeeze") for n in graph.node)


def test_a_failed_shape_inference_is_said_not_swallowed(caplog, tmp_path, monkeypatch):
    """ORT's symbolic shape inference gives up on an op it does not know; the model goes on as it is,
    with a warning that names the failure (it used to pass in silence), and nothing is written into
    the working directory (ORT's own failure path saves sym_shape_infer_temp.onnx there)."""
    import logging

    import onnx
    from onnx import TensorProto, helper

    from artifacts.export import infer_shapes

    node = helper.make_node("Frobnicate", ["x"], ["y"], domain="my.domain")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1)])
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="artifacts.export"):
        assert infer_shapes(model) is model
    assert "symbolic shape inference failed (Incomplete symbolic shape inference)" in caplog.text
    assert list(tmp_path.iterdir()) == []
    assert isinstance(model, onnx.ModelProto)


def test_the_passes_page_is_the_registry_and_every_named_test_exists():
    """docs/passes.md holds `python -m artifacts.passes`; each pass names a test that exists."""
    from pathlib import Path

    from artifacts import passes

    root = Path(__file__).resolve().parents[2]
    assert passes.table() in (root / "docs" / "passes.md").read_text()
    for entry in passes.REGISTRY:
        path, _, name = entry.test.partition("::")
        assert f"def {name}(" in (root / path).read_text(), entry.test
    assert [p.stage for p in passes.REGISTRY] == sorted((p.stage for p in passes.REGISTRY), key=passes.STAGES.index)
    with pytest.raises(ValueError, match="no passes named"):
        passes.without("relu-gard")


class _TokenLinears(torch.nn.Module):
    """Linear layers on (batch, tokens, features): exported as Transpose(W) + MatMul."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(8, 16)
        self.trained = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(torch.tanh(self.frozen(x))).mean(dim=1)


def test_linear_layers_become_gemm_with_pytorchs_gradients(tmp_path):
    """The training graph reads each weight in place (no transposed copy kept for the backward),
    and loss, gradients and one optimizer step still match PyTorch at two batch sizes."""
    import onnx

    torch.manual_seed(0)
    manifest = generate(_TokenLinears(), torch.randn(3, 5, 8), tmp_path / "a", trainable=["trained"], input_names=["x"],
                        dynamic_axes={"x": {1: "tokens"}}, loss=MSE())  # fmt: skip
    _check(manifest)
    graph = onnx.load(tmp_path / "a" / "training_model.onnx").graph
    weights = {"frozen.weight", "trained.weight"}
    assert not [n.name for n in graph.node if n.op_type == "Transpose" and n.input[0] in weights]
    gemms = {n.input[1] for n in graph.node if n.op_type == "Gemm" and n.name.endswith("/odt_gemm")}
    assert gemms == weights
