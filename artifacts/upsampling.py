"""Transposed convolutions as ordinary ones, so ONNX Runtime 1.19 can train them.

ORT 1.19 has no CPU gradient kernel for ``ConvTranspose``. A transposed convolution equals an
ordinary convolution, with the kernel flipped and its two channel axes swapped (per group), over
the input with ``stride - 1`` zeros inserted between its samples and padded by
``dilation * (kernel - 1) - padding`` on each side (plus ``output_padding`` at the end).
:class:`ConvTransposeAsConv` computes that with Reshape, Pad, Slice and Conv (all with
gradients) over the very same ``weight`` and ``bias``, so names and checkpoints read like the
original model's. Exactness against PyTorch's layers (outputs and gradients) is tested.

The U-Net case, a kernel as large as its stride (``ConvTranspose2d(c, c2, 2, stride=2)``), maps
each input sample to its own block of outputs, with no overlap: there it is a 1x1 convolution into
``out x kernel`` channels followed by a pixel shuffle (Reshape + Transpose + Reshape), with no
inserted zeros (which cost ``stride ** dims`` times the multiply-adds, 3 of 4 of them on zeros).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ._modules import replace_modules
from .errors import UnsupportedOperatorError

__all__ = ["ConvTransposeAsConv", "NearestUpsample", "LinearUpsample", "rewrite_conv_transpose", "CONV_TRANSPOSE"]

CONV_TRANSPOSE = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class ConvTransposeAsConv(nn.Module):
    """What ``layer`` (an ``nn.ConvTranspose1d/2d/3d``) computes, as a Conv over its own parameters."""

    def __init__(self, layer: nn.modules.conv._ConvTransposeNd) -> None:
        super().__init__()
        if layer.padding_mode != "zeros":
            raise UnsupportedOperatorError(
                f"ConvTranspose with padding_mode={layer.padding_mode!r} has no exact rewrite: use 'zeros'."
            )
        self.weight, self.bias = layer.weight, layer.bias  # the same tensors, the same names
        self.stride, self.padding, self.dilation = layer.stride, layer.padding, layer.dilation
        self.output_padding, self.groups = layer.output_padding, layer.groups
        self.kernel_size = layer.kernel_size

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        if output_size is not None:
            raise UnsupportedOperatorError("ConvTranspose called with output_size has no rewrite: use output_padding.")
        nd = len(self.kernel_size)
        if self._blocks():
            return self._shuffled(x)
        x = _insert_zeros(x, self.stride)  # each sample followed by stride - 1 zeros, the last one too
        for axis in range(nd):  # pad (or crop) each spatial axis: the full correlation's border
            left = self.dilation[axis] * (self.kernel_size[axis] - 1) - self.padding[axis]
            # the last sample's stride - 1 trailing zeros already stand for part of the right border
            right = left + self.output_padding[axis] - (self.stride[axis] - 1)
            x = _pad_axis(x, 2 + axis, left, right)
        return _CONV[nd](x, _as_conv_weight(self.weight, self.groups), self.bias, 1, 0, self.dilation, self.groups)

    def _blocks(self) -> bool:
        """Whether every input sample maps to its own block of outputs (kernel == stride, nothing else)."""
        nd = len(self.kernel_size)
        return (tuple(self.kernel_size) == tuple(self.stride) and self.groups == 1
                and tuple(self.padding) == (0,) * nd and tuple(self.output_padding) == (0,) * nd
                and tuple(self.dilation) == (1,) * nd)  # fmt: skip

    def _shuffled(self, x: torch.Tensor) -> torch.Tensor:
        """A 1x1 convolution into (out, *kernel) channels, each block's outputs then moved into place."""
        cin, cout, *kernel = self.weight.shape
        nd = len(kernel)
        w = self.weight.reshape(cin, -1).t().reshape(-1, cin, *([1] * nd))  # (out * prod(kernel), in, 1...)
        y = _CONV[nd](x, w)
        n, _, *sizes = y.shape
        y = y.reshape(n, cout, *kernel, *sizes)
        # (n, out, k1..kd, s1..sd) -> (n, out, s1, k1, ..., sd, kd): each sample's block after it
        order = [0, 1] + [axis for d in range(nd) for axis in (2 + nd + d, 2 + d)]
        y = y.permute(order).reshape(n, cout, *(size * k for size, k in zip(sizes, kernel)))
        if self.bias is not None:
            y = y + self.bias.reshape(1, cout, *([1] * nd))
        return y


def _as_conv_weight(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """(in, out/groups, *k) -> (out, in/groups, *k), each group's channel axes swapped, the kernel flipped."""
    cin, cout_g, *kernel = weight.shape
    w = weight.reshape(groups, cin // groups, cout_g, *kernel).transpose(1, 2)
    w = w.reshape(groups * cout_g, cin // groups, *kernel)
    for axis, size in enumerate(kernel):  # not flip(): it exports as a Slice with step -1, whose
        w = w.index_select(2 + axis, torch.arange(size - 1, -1, -1))  # gradient ORT 1.19 fails on
    return w


def _insert_zeros(x: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``stride - 1`` zeros after every sample of every spatial axis (Reshape + Pad + Reshape)."""
    if all(s == 1 for s in stride):
        return x
    n, c, *sizes = x.shape
    interleaved = [n, c]
    for size in sizes:
        interleaved += [size, 1]
    x = x.reshape(interleaved)
    pads: list[int] = []
    for s in reversed(stride):  # F.pad lists the last axis first: (unit axis, then the sample axis)
        pads += [0, s - 1, 0, 0]
    x = F.pad(x, pads)
    return x.reshape([n, c, *(size * s for size, s in zip(sizes, stride))])


def _pad_axis(x: torch.Tensor, axis: int, left: int, right: int) -> torch.Tensor:
    """Zero-pad ``axis`` by ``left``/``right`` (a negative amount crops)."""
    if left < 0:
        x = x.narrow(axis, -left, x.shape[axis] + left)
    if right < 0:
        x = x.narrow(axis, 0, x.shape[axis] + right)
    if left > 0 or right > 0:
        pads = [0, 0] * (x.dim() - 1 - axis) + [max(left, 0), max(right, 0)]
        x = F.pad(x, pads)
    return x


class NearestUpsample(nn.Module):
    """``nn.Upsample(scale_factor=k, mode="nearest")`` with integer factors, as Unsqueeze + Expand +
    Reshape (whose gradients ORT 1.19 has; its ``Resize`` has no CPU gradient kernel)."""

    def __init__(self, layer: nn.Upsample) -> None:
        super().__init__()
        self.scale = layer.scale_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spatial = x.dim() - 2
        scales = self.scale if isinstance(self.scale, tuple) else (self.scale,) * spatial
        for axis, factor in enumerate(int(s) for s in scales):
            dim = 2 + axis
            shape = list(x.shape)
            x = x.unsqueeze(dim + 1).expand(*shape[: dim + 1], factor, *shape[dim + 1 :])
            x = x.reshape(*shape[:dim], shape[dim] * factor, *shape[dim + 1 :])
        return x


class LinearUpsample(nn.Module):
    """``nn.Upsample(scale_factor=k, mode="linear" | "bilinear" | "trilinear")`` with integer factors,
    axis by axis as weighted sums of shifted slices interleaved by Stack + Reshape (ops whose
    gradients ORT 1.19 has). Output sample ``j`` of an axis reads source position
    ``(j + 0.5) / k - 0.5`` (``j * (n - 1) / (n * k - 1)`` with ``align_corners``), clamped at the
    edges, exactly as PyTorch computes it."""

    def __init__(self, layer: nn.Upsample) -> None:
        super().__init__()
        self.scale = layer.scale_factor
        self.align_corners = bool(layer.align_corners)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spatial = x.dim() - 2
        scales = self.scale if isinstance(self.scale, tuple) else (self.scale,) * spatial
        for axis, factor in enumerate(int(s) for s in scales):
            x = self._axis(x, 2 + axis, factor)
        return x

    def _axis(self, x: torch.Tensor, dim: int, factor: int) -> torch.Tensor:
        n = x.shape[dim]
        if factor == 1:
            return x
        if self.align_corners:  # output j reads j * (n - 1) / (n * factor - 1): no fixed phase, one gather
            source = torch.arange(n * factor, dtype=torch.float64) * (n - 1) / max(n * factor - 1, 1)
            low = source.floor().long().clamp(max=n - 1)
            high = (low + 1).clamp(max=n - 1)
            weight = (source - low).to(x.dtype).reshape([-1] + [1] * (x.dim() - 1 - dim))
            return x.index_select(dim, low) * (1 - weight) + x.index_select(dim, high) * weight
        first, last = x.narrow(dim, 0, 1), x.narrow(dim, n - 1, 1)
        padded = torch.cat([first, x, last], dim)  # the clamp at both edges
        phases = []
        for k in range(factor):
            d = (k + 0.5) / factor - 0.5  # offset of phase k from its source sample, in (-0.5, 0.5)
            if d < 0:
                phases.append(padded.narrow(dim, 0, n) * -d + padded.narrow(dim, 1, n) * (1 + d))
            else:
                phases.append(padded.narrow(dim, 1, n) * (1 - d) + padded.narrow(dim, 2, n) * d)
        shape = list(x.shape)
        return torch.stack(phases, dim + 1).reshape(*shape[:dim], n * factor, *shape[dim + 1 :])


_LINEAR_MODES = ("linear", "bilinear", "trilinear")


def _integer_upsample(module: nn.Module) -> bool:
    if not isinstance(module, nn.Upsample) or module.scale_factor is None:
        return False
    if module.mode not in ("nearest", *_LINEAR_MODES):
        return False
    scales = module.scale_factor if isinstance(module.scale_factor, tuple) else (module.scale_factor,)
    return all(float(s).is_integer() and s >= 1 for s in scales)


def _rewritten(module: nn.Module) -> nn.Module:
    if isinstance(module, CONV_TRANSPOSE):
        return ConvTransposeAsConv(module)  # type: ignore[arg-type]
    return LinearUpsample(module) if module.mode in _LINEAR_MODES else NearestUpsample(module)  # type: ignore[arg-type]


def rewrite_conv_transpose(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every ConvTranspose1d/2d/3d as a Conv and every integer-factor
    ``nn.Upsample`` (nearest, linear, bilinear, trilinear) in ops that train (``model`` itself when it
    has none). Other upsampling (bicubic, fractional factors, ``F.interpolate`` calls) still stops at
    generation with ORT's Resize named."""
    return replace_modules(model, lambda m: isinstance(m, CONV_TRANSPOSE) or _integer_upsample(m), _rewritten)
