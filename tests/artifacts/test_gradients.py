"""The generator's own gradient builder (artifacts/gradients): each operator's rule against torch autograd,
the artifacts it makes against those of ONNX Runtime's builder, and what it refuses."""

from __future__ import annotations

import copy
import math

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import artifacts.pipeline
from artifacts import L1, MSE, BCEWithLogits, CrossEntropy, generate
from artifacts.errors import UnsupportedOperatorError, VerificationError
from artifacts.gradients import RULES
from artifacts.gradients._emit import Emitter
from artifacts.gradients.builder import differentiate
from artifacts.gradients.loss_graphs import LossGraph
from benchmarks.models import cases
from ondevice import Trainer
from ondevice.engines import open_engine
from ondevice.session import ort


@pytest.fixture
def own_builder(monkeypatch):
    """Generation as on a machine without ONNX Runtime's training build."""
    monkeypatch.setattr(artifacts.pipeline, "training_build", lambda: False)


class Attention(nn.Module):
    """Batched MatMul, Transpose, Softmax, Div, Sqrt, Reshape: one attention head over a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(8, dim=-1)
        scores = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(8.0), dim=-1)
        return self.out((scores @ v).mean(dim=1))


class Text(nn.Module):
    """Gather (an embedding), LayerNorm, GELU (Erf), Pow, ReduceMean, Where, Concat, Slice, Expand."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.ones(8) * 0.9)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.norm(self.embedding(ids)))
        rms = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        gated = torch.where(ids.unsqueeze(-1) > 3, rms, -rms)
        both = torch.cat([gated[:, :1].expand(-1, ids.shape[1], -1), gated], dim=-1)
        return self.head(both.sum(dim=1))


class Elementwise(nn.Module):
    """Sigmoid, Tanh, Exp, Log, Abs, Clip, Neg, Sub, Div between trained tensors, broadcast biases."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.bias = nn.Parameter(torch.randn(1, 6))
        self.gain = nn.Parameter(torch.rand(6) + 0.5)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.a(x)) - torch.tanh(x + self.bias)
        h = torch.log(torch.exp(h) + 1.0) + torch.abs(h) / self.gain
        return self.head(torch.clamp(-h, -0.8, 0.8))


def _conv() -> nn.Module:
    """Conv, BatchNorm, MaxPool, global average pooling, Flatten."""
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(4, 4, 3, stride=2, groups=4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3))  # fmt: skip


class Recurrent(nn.Module):
    """An LSTM (unrolled: Split, Concat, Sigmoid, Tanh, Mul, Gemm per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 6, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class Shapes(nn.Module):
    """Pad, Max (an element-wise maximum of trained tensors), Tile (repeat), Min (ELU, rewritten as a formula)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(6, 5)
        self.head = nn.Linear(16, 3)
        self.elu = nn.ELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.maximum(self.a(x), self.b(x))
        h = nn.functional.pad(self.elu(h), (1, 2)).repeat(1, 2)
        return self.head(h)


class Pick(nn.Module):
    """Gather of an activation (channels picked by a tensor of indices) after a 3x3 max pooling of stride 1."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.register_buffer("order", torch.tensor([3, 0, -2]))
        self.head = nn.Linear(3 * 5 * 5, 3)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.conv(image))[:, self.order].flatten(1))


def _seeded(build):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return build()


OPERATORS = [
    # (case, model, example inputs, loss, target)
    ("linear-relu", lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), {"x": (5, 6)}, None, None),
    ("attention", Attention, {"x": (4, 5, 8)}, None, None),
    ("text", Text, {"ids": "ids"}, None, None),
    ("elementwise", Elementwise, {"x": (5, 6)}, None, None),
    ("convolution", _conv, {"image": (4, 2, 8, 8)}, None, None),
    ("recurrent", Recurrent, {"x": (3, 4, 5)}, None, None),
    ("pad-max-tile-min", Shapes, {"x": (5, 6)}, None, None),
    ("pick-maxpool", Pick, {"image": (4, 2, 5, 5)}, None, None),
    ("mse", lambda: nn.Linear(6, 3), {"x": (5, 6)}, MSE(), "float"),
    ("l1-sum", lambda: nn.Linear(6, 3), {"x": (5, 6)}, L1(reduction="sum"), "float"),
    ("bce-weighted", lambda: nn.Linear(6, 3), {"x": (5, 6)},
     BCEWithLogits(weight=(1.0, 2.0, 0.5), pos_weight=(3.0, 1.0, 2.0)), "binary"),
    ("cross-entropy-ignore", lambda: nn.Linear(6, 3), {"x": (5, 6)},
     CrossEntropy(weight=(1.0, 2.0, 0.5), ignore_index=1), None),
]  # fmt: skip


def _inputs(shapes: dict) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {name: torch.randint(0, 20, (4, 6), generator=generator) if shape == "ids"
            else torch.randn(*shape, generator=generator) for name, shape in shapes.items()}  # fmt: skip


def _target(kind: str | None, output: torch.Tensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    if kind == "float":
        return torch.randn(output.shape, generator=generator)
    if kind == "binary":
        return torch.randint(0, 2, output.shape, generator=generator).float()
    return torch.randint(0, output.shape[-1], output.shape[:-1], generator=generator)


@pytest.mark.parametrize("case, build, shapes, loss, target_kind", OPERATORS, ids=[c[0] for c in OPERATORS])
def test_each_operators_gradient_matches_torch_autograd(case, build, shapes, loss, target_kind, own_builder, tmp_path):
    model = _seeded(build).train()
    inputs = _inputs(shapes)
    loss = loss or CrossEntropy()
    manifest = generate(copy.deepcopy(model), inputs, tmp_path / case, loss=loss)
    assert manifest.engines == ("portable",) and "optimizer_model.onnx" not in manifest.files
    assert manifest.verification.passed  # generate proved it on the portable engine; now the same, by hand

    reference = copy.deepcopy(model).train()
    output = reference(*inputs.values())
    target = _target(target_kind, output)
    loss.reference(output, target).backward()
    engine = open_engine(tmp_path / case, manifest, "portable", tmp_path / case / "checkpoint", threads=1,
                         lean_memory=False, with_eval=False)  # fmt: skip
    fetched = engine.train_step([t.numpy() for t in inputs.values()] + [target.numpy()])
    np.testing.assert_allclose(fetched[0], loss.reference(output, target).item(), rtol=1e-5, atol=1e-6)
    grads = dict(reference.named_parameters())
    assert [p.name for p in manifest.trainable] == [n for n in grads if grads[n].requires_grad]
    for spec in manifest.trainable:
        np.testing.assert_allclose(engine.gradient_view(spec.name), grads[spec.name].grad.numpy(), rtol=1e-4,
                                   atol=1e-5, err_msg=spec.name)  # fmt: skip


COMPARED = ["digits sample", "CNN + BatchNorm", "encoder (last layer + head)", "U-Net-style (ConvTranspose)"]


@pytest.mark.parametrize("name", COMPARED)
def test_own_builder_trains_like_orts_builder_for_20_steps(name, tmp_path, monkeypatch):
    case = next(c for c in cases() if c.name == name)
    model, example = case.build(), case.inputs(case.batch)
    options = {"trainable": case.trainable} if case.trainable else {}
    generate(copy.deepcopy(model), example, tmp_path / "ort", verify=False, **options)
    monkeypatch.setattr(artifacts.pipeline, "training_build", lambda: False)
    own = generate(copy.deepcopy(model), example, tmp_path / "own", **options)
    assert own.engines == ("portable",)
    losses = {}
    for which in ("ort", "own"):
        trainer = Trainer.load(tmp_path / which, engine="portable")
        rng = np.random.default_rng(0)
        losses[which] = []
        for step in range(20):
            torch.manual_seed(step)
            feeds = {k: v.numpy() for k, v in case.inputs(case.batch).items()}
            feeds["labels"] = rng.integers(0, case.classes, size=case.batch).astype(np.int64)
            losses[which].append(trainer.train_step(feeds).loss)
    np.testing.assert_allclose(losses["own"], losses["ort"], rtol=1e-5)


def test_a_wrong_gradient_is_refused_and_nothing_is_published(own_builder, tmp_path, monkeypatch):
    relu = RULES["Relu"]

    def off_by_two_percent(e, node, dy, need):  # type: ignore[no-untyped-def]
        return [e.one("Mul", relu(e, node, dy, need)[0], e.const(1.02))]

    monkeypatch.setitem(RULES, "Relu", off_by_two_percent)
    model = _seeded(lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    with pytest.raises(VerificationError, match=r"grad 0\.weight"):
        generate(model, {"x": torch.randn(5, 6)}, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_options_only_the_training_build_can_make_are_refused_before_any_work(own_builder, tmp_path):
    from artifacts import CustomLoss
    from artifacts.errors import OptionError

    model = _seeded(lambda: nn.Linear(6, 3))
    with pytest.raises(OptionError, match="ort_format=True converts the classic graphs"):
        generate(model, {"x": torch.randn(5, 6)}, tmp_path / "ort", ort_format=True)
    custom = CustomLoss(make_block=lambda: None, reference_fn=lambda o, t: o.sum())
    with pytest.raises(OptionError, match="onnxblock of ONNX Runtime's training build"):
        generate(model, {"x": torch.randn(5, 6)}, tmp_path / "custom", loss=custom)
    assert list(tmp_path.iterdir()) == []


def _forward(op: str, **attrs) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    """x [2, 3] -> op(x, w) -> ReduceSum -> loss, w [3, 3] trainable."""
    w = numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")
    nodes = [helper.make_node(op, ["x", "w"], ["y"], name="layer/op", **attrs),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_operator_without_a_rule_is_a_typed_error_naming_it_and_its_layer():
    model = _forward("Einsum", equation="ij,jk->ik")
    with pytest.raises(UnsupportedOperatorError, match=r"layer 'layer/op'.*Einsum.*--freeze"):
        differentiate(model, LossGraph("loss"), ["w"], [], [], describe=repr)
    # the same graph with a product that has a rule differentiates
    assert any(n.op_type == "InPlaceAccumulatorV2" for n in differentiate(_forward("MatMul"), LossGraph("loss"),
                                                                         ["w"], [], []).graph.node)  # fmt: skip


@pytest.mark.parametrize("grad_shape, target_shape", [((2, 3, 4), (3, 1)), ((2, 3, 4), (1, 3, 4)), ((5, 1, 4), (4,)),
                                                      ((2, 3), (2, 3))])  # fmt: skip
def test_the_sum_over_broadcast_axes_found_when_the_graph_runs_equals_numpys(grad_shape, target_shape):
    e = Emitter({"g": [None] * len(grad_shape), "t": [None] * len(target_shape)}, {}, {}, 17, {"g", "t"})
    out = e._dynamic_sum_to("g", "t", "g")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("g", "t")]
    outputs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)]
    graph = helper.make_graph(e.nodes, "sum", inputs, outputs, e.initializers)
    session = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
                                   .SerializeToString(), providers=["CPUExecutionProvider"])  # fmt: skip
    g = np.random.default_rng(0).standard_normal(grad_shape).astype(np.float32)
    (found,) = session.run(None, {"g": g, "t": np.zeros(target_shape, np.float32)})
    lead = len(grad_shape) - len(target_shape)
    broadcast = [lead + i for i, d in enumerate(target_shape) if d == 1 and grad_shape[lead + i] != 1]
    axes = (*range(lead), *broadcast)
    np.testing.assert_allclose(found, g.sum(axis=axes, keepdims=True).reshape(target_shape), rtol=1e-6)
