"""The conv-grad pass: a convolution's input gradient as a forward Conv (or ConvTranspose), not ConvGrad's."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from artifacts import MSE, generate
from artifacts.passes.convgrad import rewrite_conv_grad


class Convs(nn.Module):
    def __init__(self, layer: nn.Module, channels: int) -> None:
        super().__init__()
        self.first, self.layer = nn.Conv2d(2, channels, 3, padding=1), layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.tanh(self.first(x))).flatten(1).sum(1, keepdim=True)


LAYERS = {
    "3x3-same": lambda: nn.Conv2d(4, 5, 3, padding=1),
    "stride-2": lambda: nn.Conv2d(4, 5, 3, stride=2, padding=1),
    "stride-2-odd-size": lambda: nn.Conv2d(4, 5, 3, stride=2, padding=0),
    "1x1-no-bias": lambda: nn.Conv2d(4, 6, 1, bias=False),
    "rectangular-asymmetric": lambda: nn.Conv2d(4, 3, (2, 3), padding=(1, 0)),
    "depthwise": lambda: nn.Conv2d(4, 4, 3, padding=1, groups=4),
}


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.classic
def test_convolution_gradients_match_pytorch_without_convgrad(tmp_path, name):
    """Verification compares every gradient, the input's included, with PyTorch's; the training graph
    keeps ConvGrad for weights and biases only."""
    torch.manual_seed(0)
    manifest = generate(Convs(LAYERS[name](), 4), {"x": torch.randn(3, 2, 9, 7)}, tmp_path / "a", loss=MSE())
    assert manifest.verification.passed
    graph = onnx.load(tmp_path / "a" / "training_model.onnx", load_external_data=False).graph
    grads = [n for n in graph.node if n.op_type == "ConvGrad"]
    assert len(grads) == 2 and all(n.output[0] == "" for n in grads)  # the first layer's input needs none anyway
    assert any(n.op_type in ("Conv", "ConvTranspose") and n.name == "" and n.output[0].endswith("_grad")
               for n in graph.node)  # fmt: skip


@pytest.mark.parametrize("stride, pads, group", [(1, [1, 1, 1, 1], 1), (2, [1, 0, 1, 1], 1), (3, [0, 0, 0, 0], 1),
                                                (1, [1, 1, 1, 1], 4), (1, [0, 1, 0, 0], 4)])  # fmt: skip
@pytest.mark.classic
def test_the_input_gradient_equals_convgrads(stride, pads, group):
    """The pass alone on one ConvGrad: ORT's results before and after agree, all three gradients
    (group 4: a depthwise convolution of 4 channels)."""
    import onnxruntime as ort

    n, cin, cout, h, w, k = 2, 3 if group == 1 else group, 4, 10, 9, 3
    oh, ow = ((h + pads[0] + pads[2] - k) // stride + 1), ((w + pads[1] + pads[3] - k) // stride + 1)
    inputs = [helper.make_tensor_value_info("dy", TensorProto.FLOAT, ["n", cout, oh, ow]),
              helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", cin, h, w]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [cout, cin // group, k, k])]  # fmt: skip
    node = helper.make_node("ConvGrad", ["dy", "x", "w"], ["dx", "dw", "db"], domain="com.microsoft", pads=pads,
                            strides=[stride, stride], kernel_shape=[k, k], group=group, dilations=[1, 1])  # fmt: skip
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("dx", "dw", "db")]
    graph = helper.make_graph([node], "g", inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    rng = np.random.default_rng(stride)
    feeds = {"dy": rng.standard_normal((n, cout, oh, ow)).astype(np.float32),
             "x": rng.standard_normal((n, cin, h, w)).astype(np.float32),
             "w": rng.standard_normal((cout, cin // group, k, k)).astype(np.float32)}  # fmt: skip
    before = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    assert rewrite_conv_grad(model) == 1
    assert {n.op_type for n in model.graph.node} >= {"ConvGrad", "Conv" if stride == 1 else "ConvTranspose"}
    after = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    xt = torch.from_numpy(feeds["x"]).requires_grad_()
    y = nn.functional.conv2d(nn.functional.pad(xt, (pads[1], pads[3], pads[0], pads[2])), torch.from_numpy(feeds["w"]),
                             stride=stride, groups=group)  # fmt: skip
    y.backward(torch.from_numpy(feeds["dy"]))
    np.testing.assert_allclose(after[0], xt.grad.numpy(), rtol=1e-4, atol=1e-4)
    for a, b in zip(after, before):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["3x3-same", "1x1-no-bias", "depthwise"])
def test_the_own_builders_weight_gradients_take_the_measured_forms(tmp_path, name, monkeypatch):
    """Without the training build the gradient builder writes no shapes for the gradients it makes; dY's spatial
    sizes then come from the input's, so a weight gradient takes its windows (or im2col) as with ORT's builder,
    never the slower convolution with the batch as channels (2.2-2.3 ms a MobileNet layer). Verified against
    PyTorch."""
    from artifacts.passes import portable_conv

    def refuse(*args, **kwargs):
        raise AssertionError(f"{args[0].node.name}: its weight gradient fell back to the batch-as-channels convolution")

    monkeypatch.setattr(portable_conv, "_weight_grad_by_convolution", refuse)
    torch.manual_seed(0)
    layer = LAYERS[name]()
    model = Convs(layer, layer.in_channels)
    manifest = generate(model, {"x": torch.randn(3, 2, 6, 7)}, tmp_path / "a", loss=MSE())
    assert manifest.verification.passed and "portable" in manifest.engines
