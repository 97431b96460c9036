"""ConvTranspose as an ordinary Conv ORT 1.19 can train: exact against PyTorch's layers, then verified."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from artifacts import generate
from artifacts.upsampling import ConvTransposeAsConv

LAYERS = [  # each row: a layer and an input; strides, paddings, output paddings, groups and dilations mixed
    (lambda: nn.ConvTranspose1d(4, 6, 3), (2, 4, 9)),
    (lambda: nn.ConvTranspose1d(4, 6, 4, stride=3, padding=2, output_padding=1), (2, 4, 9)),
    (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, groups=2, dilation=2, bias=False), (2, 4, 9)),
    (lambda: nn.ConvTranspose2d(3, 4, 2, stride=2), (2, 3, 5, 6)),
    (lambda: nn.ConvTranspose2d(4, 8, (3, 2), stride=(2, 3), padding=(1, 0), output_padding=(1, 2)), (2, 4, 5, 4)),
    (lambda: nn.ConvTranspose2d(4, 4, 3, stride=2, padding=3, dilation=(2, 1), groups=4), (1, 4, 6, 6)),
    (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2, padding=1), (1, 2, 3, 4, 3)),
    # kernel == stride (the U-Net's upsampling): a 1x1 convolution and a pixel shuffle, no inserted zeros
    (lambda: nn.ConvTranspose1d(4, 6, 3, stride=3), (2, 4, 5)),
    (lambda: nn.ConvTranspose2d(3, 5, (2, 3), stride=(2, 3), bias=False), (2, 3, 4, 3)),
    (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (1, 2, 3, 2, 2)),
]
BLOCKS = {3, 7, 8, 9}
"""Rows whose every input sample maps to its own block of outputs (the shuffled form)."""


@pytest.mark.parametrize("make, shape", LAYERS, ids=[f"row{i}" for i in range(len(LAYERS))])
def test_the_conv_form_equals_pytorchs_transposed_convolution(make, shape):
    torch.manual_seed(0)
    original = make()
    rewritten = ConvTransposeAsConv(copy.deepcopy(original))
    assert [n for n, _ in rewritten.named_parameters()] == [n for n, _ in original.named_parameters()]
    assert rewritten._blocks() == (LAYERS.index((make, shape)) in BLOCKS)
    x = torch.randn(shape)
    results = []
    for layer in (original, rewritten):
        x_ = x.clone().requires_grad_(True)
        out = layer(x_)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        results.append((out.detach(), x_.grad, [p.grad.clone() for p in layer.parameters()]))
        layer.zero_grad()
    (out_a, dx_a, grads_a), (out_b, dx_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx_b, dx_a, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


class Decoder(nn.Module):
    """A small upsampling decoder: Linear -> reshape -> two strided ConvTranspose2d layers."""

    def __init__(self) -> None:
        super().__init__()
        self.seed = nn.Linear(6, 4 * 4 * 4)
        self.up1 = nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1)
        self.up2 = nn.ConvTranspose2d(4, 1, 2, stride=2)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.seed(z).reshape(z.shape[0], 4, 4, 4)
        return self.up2(torch.relu(self.up1(x))).flatten(1)


def test_an_upsampling_decoder_generates_verifies_and_trains(tmp_path):
    import numpy as np

    from artifacts import MSE, AdamW
    from ondevice import Trainer

    torch.manual_seed(0)
    manifest = generate(Decoder(), {"z": torch.randn(8, 6)}, tmp_path / "a", loss=MSE(), optimizer=AdamW(lr=0.01))
    assert manifest.verification.passed and {"up1.weight", "up2.bias"} <= {p.name for p in manifest.trainable}
    rng = np.random.default_rng(0)
    z = rng.normal(size=(32, 6)).astype(np.float32)
    target = np.tile(np.linspace(0, 1, 256, dtype=np.float32), (32, 1))
    trainer = Trainer.load(tmp_path / "a")
    before = trainer.evaluate({"z": z, "target": target})["loss"]
    trainer.fit({"z": z, "target": target}, epochs=20, batch_size=8, progress=False)
    assert trainer.evaluate({"z": z, "target": target})["loss"] < before * 0.5
    import onnx

    if "unsupported" in manifest.portable:  # ORT's builder (the training build) writes a GatherGrad of up1
        return
    portable = onnx.load(tmp_path / "a" / "training_model.portable.onnx", load_external_data=False).graph
    kinds = [node.op_type for node in portable.node]
    assert kinds.count("DepthToSpace") == kinds.count("SpaceToDepth") == 1  # up2's shuffle, forward and back


def test_a_pixel_shuffle_moves_the_values_its_transposes_move():
    """The portable-pixel-shuffle pass: DepthToSpace forward, SpaceToDepth and a block Transpose backward, the
    very values of the six-axis transposes they replace; unequal block sizes keep their Transpose."""
    import numpy as np
    from onnx import TensorProto, helper

    from artifacts.passes.pixelshuffle import BACKWARD, FORWARD, shuffle_as_depth_to_space
    from ondevice.session import ort

    c, h, w = 5, 3, 4
    shapes = {"x": ["n", c, 2, 2, h, w], "g": ["n", c, h, 2, w, 2], "r": ["n", c, 2, 3, h, w]}
    perms = {"x": FORWARD, "g": BACKWARD, "r": FORWARD}
    graph = helper.make_graph(
        [helper.make_node("Transpose", [name], [f"{name}.t"], perm=perms[name]) for name in shapes], "shuffles",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in shapes.items()],
        [helper.make_tensor_value_info(f"{name}.t", TensorProto.FLOAT, None) for name in shapes])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal([3, *shape[1:]]).astype(np.float32) for name, shape in shapes.items()}
    before = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    assert shuffle_as_depth_to_space(model, 17) == 2
    kinds = [node.op_type for node in model.graph.node]
    assert "DepthToSpace" in kinds and "SpaceToDepth" in kinds and kinds.count("Transpose") == 2  # swap + "r"
    after = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    for old, new in zip(before, after):
        np.testing.assert_array_equal(new, old)
    assert shuffle_as_depth_to_space(model, 10) == 0  # no DepthToSpace mode before opset 11


class Head(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).flatten(1).sum(1, keepdim=True)


@pytest.mark.parametrize(
    "row", [1, 2, 4, 5, 8], ids=["stride-pad-outpad", "groups-dilation", "2d-rect", "2d-crop", "2d-blocks"]
)
@pytest.mark.classic
def test_every_kind_of_transposed_convolution_verifies_in_ort(tmp_path, row):
    """Crops (padding over the kernel's reach), groups, dilations and output padding through ORT's gradients."""
    from artifacts import MSE

    make, shape = LAYERS[row]
    torch.manual_seed(0)
    manifest = generate(Head(make()), {"x": torch.randn(shape)}, tmp_path / "a", loss=MSE())
    assert manifest.verification.passed


class Upsampler(nn.Module):
    def __init__(self, scale, mode: str = "nearest", align_corners: bool | None = None) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        up = nn.Upsample(scale_factor=scale, mode=mode, align_corners=align_corners)
        self.conv, self.up = nn.Conv2d(2, 3, 3, padding=1), up
        self.out = nn.Conv2d(3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.up(torch.relu(self.conv(x)))).flatten(1).mean(1, keepdim=True)


@pytest.mark.parametrize("scale", [2, (2, 3)], ids=["x2", "x2-x3"])
def test_nearest_upsampling_equals_pytorchs_and_verifies(tmp_path, scale):
    from artifacts import MSE
    from artifacts.upsampling import NearestUpsample

    x = torch.randn(2, 3, 4, 5)
    torch.testing.assert_close(NearestUpsample(nn.Upsample(scale_factor=scale))(x), nn.Upsample(scale_factor=scale)(x))
    torch.manual_seed(0)
    manifest = generate(Upsampler(scale), {"x": torch.randn(4, 2, 4, 5)}, tmp_path / "a", loss=MSE())
    assert manifest.verification.passed


@pytest.mark.parametrize(
    "mode, shape", [("linear", (2, 3, 7)), ("bilinear", (2, 3, 4, 5)), ("trilinear", (1, 2, 3, 4, 5))]
)
@pytest.mark.parametrize("scale", [2, 3])
@pytest.mark.parametrize("align_corners", [False, True])
def test_linear_upsampling_equals_pytorchs_values_and_gradients(mode, shape, scale, align_corners):
    from artifacts.upsampling import LinearUpsample

    reference = nn.Upsample(scale_factor=scale, mode=mode, align_corners=align_corners)
    x = torch.randn(*shape, requires_grad=True, generator=torch.Generator().manual_seed(0))
    ours, theirs = LinearUpsample(reference)(x), reference(x)
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)
    upstream = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(1))
    (mine,) = torch.autograd.grad(ours, x, upstream)
    (pytorchs,) = torch.autograd.grad(theirs, x, upstream)
    torch.testing.assert_close(mine, pytorchs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("align_corners", [False, True])
def test_bilinear_upsampling_generates_and_verifies(tmp_path, align_corners):
    from artifacts import MSE

    torch.manual_seed(0)
    model = Upsampler(2, "bilinear", align_corners)
    manifest = generate(model, {"x": torch.randn(4, 2, 4, 5)}, tmp_path / "a", loss=MSE())
    assert manifest.verification.passed


def test_bicubic_upsampling_still_stops_with_the_layer_the_op_and_the_remedy(tmp_path):
    from artifacts import MSE, UnsupportedOperatorError

    torch.manual_seed(0)
    expected = r"layer 'up' .*Resize.*mode nearest, linear, bilinear or trilinear"
    with pytest.raises(UnsupportedOperatorError, match=expected):
        generate(Upsampler(2, "bicubic", False), {"x": torch.randn(4, 2, 4, 5)}, tmp_path / "a", loss=MSE())
    assert not (tmp_path / "a").exists()
