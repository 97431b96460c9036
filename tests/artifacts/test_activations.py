"""Graph rewrites: operators ORT 1.19 cannot differentiate, and gradients it computes slowly, are replaced
exactly; each result is checked against PyTorch or ORT's own kernels."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from artifacts import generate

from .parity import gradients_close_then_step


def _dense(activation: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), activation, nn.Linear(16, 3))


def _conv(*layers: nn.Module, features: int = 4 * 6 * 6) -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3), *layers, nn.Flatten(), nn.Linear(features, 3))


def _train_alike(reference, candidate, names: list[str], zeroed: tuple, value: float) -> list:  # type: ignore[no-untyped-def]
    """Three AdamW steps of two sessions on the same batches (``batch[0][zeroed] = value``): their
    gradients after each backward and their weights at the end must be identical; returns the last batch."""
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = [rng.standard_normal((8, 2, 8, 8), dtype=np.float32), rng.integers(0, 3, 8)]
        batch[0][zeroed] = value
        for session in (reference, candidate):
            session.train_step(batch)
        for name in names:
            np.testing.assert_array_equal(candidate.get_gradient(name), reference.get_gradient(name), name)
        for session in (reference, candidate):
            session.optimizer_step()
            session.reset_grad()
    np.testing.assert_array_equal(candidate.get_flat(), reference.get_flat())
    return batch


CASES = [
    # MobileNetV3's classifier: Linear, Hardswish, Dropout, Linear, everything trainable
    ("HardSwish", nn.Sequential(nn.Linear(8, 16), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(16, 3))),
    ("HardSigmoid", _dense(nn.Hardsigmoid())),
    ("Mish", _dense(nn.Mish())),
    ("Softplus", _dense(nn.Softplus())),
    ("Elu", _dense(nn.ELU(alpha=0.7))),
    ("Celu", _dense(nn.CELU(alpha=0.5))),
    ("Selu", _dense(nn.SELU())),
    # PReLU's slope is itself trained
    ("PRelu", _dense(nn.PReLU(16))),
    ("PRelu", _conv(nn.PReLU(4))),
    ("GlobalMaxPool", _conv(nn.AdaptiveMaxPool2d(1), features=4)),
    ("InstanceNormalization", _conv(nn.InstanceNorm2d(4, affine=True), nn.ReLU())),
    # GroupNorm exports as InstanceNormalization between reshapes at opset 17
    ("InstanceNormalization", _conv(nn.GroupNorm(2, 4), nn.ReLU())),
]


@pytest.mark.parametrize("op, model", CASES, ids=[f"{op}-{i}" for i, (op, _) in enumerate(CASES)])
def test_rewrite_trains_everything_and_matches_pytorch(tmp_path, op, model):
    torch.manual_seed(0)
    dense = isinstance(model[0], nn.Linear)
    # wide inputs reach every branch: Softplus's large-x tail, ELU's negative side, HardSwish's flat parts
    example = torch.randn(6, 8) * 4 if dense else torch.randn(6, 2, 8, 8)
    manifest = generate(model, example, tmp_path / "a", input_names=["x"])
    assert manifest.verification.passed
    assert {p.name for p in manifest.trainable} == {n for n, _ in model.named_parameters()}
    training = onnx.load(tmp_path / "a" / "training_model.onnx")
    if op != "HardSwish":  # its own kernel comes back with PyTorch's gradient: the test below
        assert op not in {n.op_type for n in training.graph.node}


def test_frozen_path_keeps_the_original_operator(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Hardswish(), nn.Linear(8, 3))
    generate(model, torch.randn(4, 8), tmp_path / "a", trainable=["2"])
    ops = {n.op_type for n in onnx.load(tmp_path / "a" / "eval_model.onnx").graph.node}
    assert "HardSwish" in ops


@pytest.mark.classic
def test_relu_gradient_rewrite_matches_orts_relugrad_bit_for_bit(tmp_path, monkeypatch):
    import shutil

    from artifacts import passes
    from artifacts.passes.relugrad import rewrite_relu_grad
    from ondevice.engines.classic import OrtTraining

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 8), nn.ReLU(), nn.Linear(8, 3)
    )
    with torch.no_grad():
        model[0].bias.zero_()  # zero input rows then give exact zeros at the first ReLU
    monkeypatch.setattr(passes, "REGISTRY", passes.without("relu-grad"))  # keep ORT's own ReluGrad
    generate(model, torch.randn(8, 2, 8, 8), tmp_path / "ort", verify=False)
    shutil.copytree(tmp_path / "ort", tmp_path / "fast")
    graph = onnx.load(tmp_path / "fast" / "training_model.onnx")
    assert rewrite_relu_grad(graph) == 2
    assert "ReluGrad" not in {n.op_type for n in graph.graph.node}
    onnx.save(graph, tmp_path / "fast" / "training_model.onnx")

    names = [i.name for i in graph.graph.input if i.name.endswith(("weight", "bias"))]
    # exact zeros: the boundary of ReLU's gradient
    _train_alike(OrtTraining(tmp_path / "ort"), OrtTraining(tmp_path / "fast"), names, np.s_[:, :, :2], 0.0)


class _BiasGelu(nn.Module):
    """GELU after a matmul plus bias: ORT fuses it into BiasGelu, whose gradient is BiasGeluGrad_dX."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(8, 32) / 3), nn.Parameter(torch.randn(32))
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.gelu(torch.matmul(x, self.weight) + self.bias).mean(1))


@pytest.mark.parametrize(
    "model, shape, kernel",
    [
        (lambda: nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 3)), (6, 8), "GeluGrad"),
        (_BiasGelu, (6, 5, 8), "BiasGeluGrad_dX"),
    ],
    ids=["GeluGrad", "BiasGeluGrad_dX"],
)
@pytest.mark.classic
def test_gelu_gradient_rewrite_matches_pytorch_and_orts_kernel(tmp_path, monkeypatch, model, shape, kernel):
    from artifacts import passes
    from artifacts.passes.gelugrad import rewrite_gelu_grad
    from ondevice.engines.classic import OrtTraining

    torch.manual_seed(0)
    model = model()
    manifest = generate(model, torch.randn(*shape) * 4, tmp_path / "fast")  # verified against PyTorch
    assert manifest.verification.passed
    ops = [n.op_type for n in onnx.load(tmp_path / "fast" / "training_model.onnx").graph.node]
    assert kernel not in ops and ops.count("Erf") == 1  # the gradient's one Erf; the forward stays a fused GELU

    monkeypatch.setattr(passes, "REGISTRY", passes.without("gelu-grad"))
    generate(model, torch.randn(*shape), tmp_path / "ort", verify=False)
    graph = onnx.load(tmp_path / "ort" / "training_model.onnx")
    assert [n.op_type for n in graph.graph.node].count(kernel) == 1
    assert rewrite_gelu_grad(graph) == 1
    onnx.save(graph, tmp_path / "ort" / "rewritten.onnx")

    reference, candidate = OrtTraining(tmp_path / "ort"), OrtTraining(tmp_path / "ort", graph="rewritten.onnx")
    rng = np.random.default_rng(0)
    for scale in (1.0, 4.0, 30.0):  # the middle, both tails, and values where exp underflows and erf saturates
        x = (scale * rng.standard_normal(shape)).astype(np.float32)
        x[0] = 0.0  # GELU's derivative at 0 is exactly 1/2
        batch = [x, rng.integers(0, 3, shape[0])]
        for session in (reference, candidate):
            session.train_step(batch)
        gradients_close_then_step(reference, candidate, (p.name for p in manifest.trainable))
    np.testing.assert_allclose(candidate.get_flat(), reference.get_flat(), rtol=1e-5, atol=1e-6)


class _ShiftedHardswish(nn.Module):
    """Hardswish of the input plus a trained shift (zeros): the pre-activation is the input exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.hardswish(x + self.shift))


@pytest.mark.classic
def test_hardswish_runs_orts_kernel_with_pytorchs_gradient(tmp_path):
    from ondevice.engines.classic import OrtTraining

    torch.manual_seed(0)
    model = _ShiftedHardswish()
    manifest = generate(model, torch.randn(6, 16) * 4, tmp_path / "a")  # verified against PyTorch
    assert manifest.verification.passed
    ops = [n.op_type for n in onnx.load(tmp_path / "a" / "training_model.onnx").graph.node]
    # one kernel forward; the gradient recomputes the gate from x, with strict bounds (not ORT's Clip gradient)
    assert ops.count("HardSwish") == 1 and "GreaterOrEqual" not in ops and "LessOrEqual" not in ops

    # the pieces' ends and both boundaries, where PyTorch's derivative is 0 (at -3) and 1 (at 3)
    edges = np.array([-3.0, 3.0, 0.0, -2.9999, 2.9999, -3.0001, 3.0001, -10.0, 10.0, 1.5, -1.5, 0.25], np.float32)
    x = np.random.default_rng(0).standard_normal((6, 16)).astype(np.float32) * 4
    x[:, :12] = edges
    labels = np.array([0, 1, 2, 0, 1, 2])
    session = OrtTraining(tmp_path / "a")
    session.train_step([x, labels])
    reference = _ShiftedHardswish()
    reference.load_state_dict(model.state_dict())
    loss = nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(labels))
    loss.backward()
    for name, parameter in reference.named_parameters():
        np.testing.assert_allclose(session.get_gradient(name), parameter.grad.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.classic
def test_max_pooling_moves_before_relu_with_identical_values_and_gradients(tmp_path, monkeypatch):
    from artifacts import passes
    from ondevice.engines.classic import OrtTraining

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(36, 8), nn.ReLU(), nn.Linear(8, 3)
    )
    generate(model, torch.randn(8, 2, 8, 8), tmp_path / "swapped")
    monkeypatch.setattr(passes, "REGISTRY", passes.without("pool-before-relu"))
    generate(model, torch.randn(8, 2, 8, 8), tmp_path / "plain", verify=False)
    nodes = onnx.load(tmp_path / "swapped" / "training_model.onnx").graph.node
    pooled = next(n.output[0] for n in nodes if n.op_type == "MaxPool")
    assert any(n.op_type == "Relu" and n.input[0] == pooled for n in nodes)

    plain, swapped = OrtTraining(tmp_path / "plain"), OrtTraining(tmp_path / "swapped")
    names = [n for n, _ in model.named_parameters()]
    # constant rows: windows of tied maxima, positive and negative
    batch = _train_alike(plain, swapped, names, np.s_[:4, :, :5], 1.0)
    np.testing.assert_array_equal(swapped.eval_step(batch)[1], plain.eval_step(batch)[1])


@pytest.mark.classic
def test_max_pool_gradient_without_indices_equals_orts_and_pytorchs(tmp_path, monkeypatch):
    """The 2x2 pooling's gradient routed from its input: verified against PyTorch on windows of tied
    maxima, and bit for bit ORT's MaxPoolGrad over three AdamW steps; a pooling of an odd side
    (floor mode drops its last row) keeps ORT's kernels."""
    from artifacts import passes
    from ondevice.engines.classic import OrtTraining

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(),  # 8x8 -> 4x4: rewritten
        nn.Conv2d(4, 4, 2), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4, 3),  # 3x3 -> 1x1: ORT's kernels
    )  # fmt: skip
    example = torch.randn(8, 2, 8, 8)
    example[:4, :, :5] = 1.0  # constant rows: windows of tied maxima
    manifest = generate(model, example, tmp_path / "fast")  # verified against PyTorch, ties included
    assert manifest.verification.passed
    ops = [n.op_type for n in onnx.load(tmp_path / "fast" / "training_model.onnx").graph.node]
    assert ops.count("MaxPoolGrad") == 1 and ops.count("MaxPool") == 2

    monkeypatch.setattr(passes, "REGISTRY", passes.without("max-pool-grad"))
    generate(model, example, tmp_path / "ort", verify=False)
    assert [n.op_type for n in onnx.load(tmp_path / "ort" / "training_model.onnx").graph.node].count("MaxPoolGrad") == 2
    ort, fast = OrtTraining(tmp_path / "ort"), OrtTraining(tmp_path / "fast")
    _train_alike(ort, fast, [n for n, _ in model.named_parameters()], np.s_[:4, :, :5], 1.0)


def test_relu_with_another_consumer_keeps_its_place():
    from onnx import TensorProto, helper

    from artifacts.passes.relupool import pool_before_relu

    def graph(outputs: list[str]) -> onnx.ModelProto:
        nodes = [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("Identity", ["p"], ["y"]),
        ]
        value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None)  # noqa: E731
        return helper.make_model(helper.make_graph(nodes, "g", [value("x")], [value(o) for o in outputs]))

    assert pool_before_relu(shared := graph(["y", "r"])) == 0  # the ReLU's output is also a graph output
    assert [n.op_type for n in shared.graph.node] == ["Relu", "MaxPool", "Identity"]
    assert pool_before_relu(alone := graph(["y"])) == 1
    assert [(n.op_type, list(n.input), list(n.output)) for n in alone.graph.node] == [
        ("MaxPool", ["x"], ["p.odt_before_relu"]),
        ("Relu", ["p.odt_before_relu"], ["p"]),
        ("Identity", ["p"], ["y"]),
    ]
