"""A convolution's gradient (what the conv-grad pass leaves of ORT's ``ConvGrad``) in standard operators, each
form chosen by measurement (see :mod:`artifacts.passes.portable` and :mod:`artifacts.passes.convgrad`)."""

from __future__ import annotations

import numpy as np
from onnx import helper

from ._lowering import Builder, Unlowerable, output
from ._nodes import attributes

__all__ = ["conv_grad"]


def conv_grad(b: Builder, shapes: dict[str, list[int]]) -> None:
    # dX as a transposed convolution; dW with static sizes as products of dY with the input's windows (a
    # one-group convolution's channels last from 16 channels, else im2col; a depthwise one's at stride 1),
    # otherwise as a convolution of the input with dY, batch as channels; dB sums dY.
    node = b.node
    dy, x, w = node.input[:3]
    a = attributes(node)
    w_shape = shapes.get(w)
    if w_shape is None or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise Unlowerable("ConvGrad with an unknown kernel shape or auto_pad")
    spatial = len(w_shape) - 2
    group = int(a.get("group", 1))
    depthwise = group > 1 and group == w_shape[0] and w_shape[1] == 1
    if group != 1 and not depthwise:
        raise Unlowerable("a grouped convolution that is not depthwise")
    strides = list(a.get("strides") or [1] * spatial)
    dilations = list(a.get("dilations") or [1] * spatial)
    pads = list(a.get("pads") or [0] * 2 * spatial)
    if output(node, 0):
        _conv_input_grad(b, w_shape, strides, dilations, pads, group)
    if depthwise:  # a strided one keeps the convolution: its windows copied slowly (0.42-0.68x), and from the
        # input's phases it took 1.15-1.5x as long in the MobileNet-style step (the convolution runs on NCHWc there)
        by_products = _depthwise_weight_grad_by_windows if set(strides) == {1} else None
    else:
        by_windows = w_shape[1] >= WINDOWS_FROM_CHANNELS and int(np.prod(w_shape[2:])) > 1
        by_products = _weight_grad_by_windows if by_windows else _weight_grad_by_columns
    if output(node, 1) and not (by_products and by_products(b, w_shape, strides, dilations, pads)):
        _weight_grad_by_convolution(b, w_shape, strides, dilations, pads, group, depthwise)
    if output(node, 2):
        b.reduce("ReduceSum", dy, [0, *range(2, spatial + 2)], 0, node.output[2])


WINDOWS_FROM_CHANNELS = 16
"""Input channels from which a one-group convolution's weight gradient takes channels-last windows, one
product per kernel offset (``_weight_grad_by_windows``): a window's rows are then runs of C values, and
each product sums over batch and positions at once. Measured against im2col (onnxruntime 1.32, 2 threads,
interleaved, one-off): 3x3 layers 32 -> 64 at 14x14 1.28x, 32 -> 16 at 28x28 2.26x, 16 -> 32 stride 2
1.93x faster; with 1 or 3 input channels 0.59-0.71x (im2col kept there)."""


def _windows(b: Builder, w_shape: list[int], strides: list[int], dilations: list[int], pads: list[int],
             channels_last: bool = False) -> list[str] | None:
    """The convolution input's shifted, strided window at each kernel offset (row-major), shaped like dY's
    spatial extent: [N, C, *out], or [N, *out, C] with ``channels_last``. None (nothing emitted) where
    neither dY's spatial sizes nor the input's are static."""
    dy, x = b.node.input[:2]
    kernel = w_shape[2:]
    spatial = len(kernel)
    out_size = (b.dims.get(dy) or [None])[2:]
    if len(out_size) != spatial or any(s is None for s in out_size):
        out_size = _output_size(b, w_shape, strides, dilations, pads)
    if len(out_size) != spatial or any(s is None for s in out_size):
        return None
    if not channels_last and _phased(b, strides):
        return _phase_windows(b, kernel, strides[0], dilations, pads, out_size)
    first = 1 if channels_last else 2  # the first spatial axis
    padded = b.op("Transpose", [x], perm=[0, *range(2, spatial + 2), 1]) if channels_last else x
    if any(pads):
        around = [0] * (first - 1) + pads[:spatial] + [0] * (2 - first)
        ahead = [0] * (first - 1) + pads[spatial:] + [0] * (2 - first)
        padded = b.op("Pad", [padded, b.const(np.array([0, *around, 0, *ahead], np.int64))])
    axes = b.const(np.arange(first, first + spatial, dtype=np.int64))
    steps = b.const(np.array(strides, np.int64))
    windows = []
    for offset in np.ndindex(*kernel):
        begin = [offset[i] * dilations[i] for i in range(spatial)]
        stop = [begin[i] + (out_size[i] - 1) * strides[i] + 1 for i in range(spatial)]
        windows.append(b.op("Slice", [padded, b.const(np.array(begin, np.int64)), b.const(np.array(stop, np.int64)),
                                      axes, steps]))  # fmt: skip
    return windows


def _phased(b: Builder, strides: list[int]) -> bool:
    """Whether a strided convolution's windows come from its input's phases (:func:`_phase_windows`): 2-D,
    one stride > 1 for both axes, the input's spatial sizes static."""
    size = (b.dims.get(b.node.input[1]) or [None])[2:]
    return len(strides) == 2 == len(size) and strides[0] == strides[1] > 1 and b.opset >= 13 \
        and all(isinstance(s, int) for s in size)


def _phase_windows(b: Builder, kernel: list[int], stride: int, dilations: list[int], pads: list[int],
                   out_size: list[int]) -> list[str]:  # fmt: skip
    """The strided windows of a 2-D convolution's input ([N, C, *out] each) as stride-1 windows of its phases:
    the padded input (and zeros up to a multiple of ``stride``) in ``stride`` x ``stride`` blocks, one phase per
    position in a block (``SpaceToDepth``). A strided Slice copies element by element; a phase's window is
    runs of whole rows. MobileNet-style's first layer (3 -> 16 channels at stride 2 over 64x64, batch 32, im2col):
    its gradient's nodes took 631 against 1055 us a step in ORT's profile (onnxruntime 1.32, 2 threads, one-off).
    For a depthwise layer these windows lost to the convolution with the batch as channels in the step (see
    :func:`conv_grad`), though alone they won (32 channels of 32x32: 2.0 against 5.9 ms)."""
    x = b.node.input[1]
    size = b.dims[x][2:]
    ahead = [pads[2 + i] + (-(size[i] + pads[i] + pads[2 + i]) % stride) for i in range(2)]
    padded = b.op("Pad", [x, b.const(np.array([0, 0, *pads[:2], 0, 0, *ahead], np.int64))]) \
        if any([*pads[:2], *ahead]) else x  # fmt: skip
    blocks = [(size[i] + pads[i] + ahead[i]) // stride for i in range(2)]
    phases = b.op("Reshape", [b.op("SpaceToDepth", [padded], blocksize=stride),
                              b.const(np.array([0, stride * stride, -1, *blocks], np.int64))])  # fmt: skip
    axes, one = b.const(np.array([1, 3, 4], np.int64)), b.const(np.array([1], np.int64))
    windows = []
    for offset in np.ndindex(*kernel):
        reach = [offset[i] * dilations[i] for i in range(2)]  # = stride * shift + position in the block
        phase = (reach[0] % stride) * stride + reach[1] % stride
        shift = [reach[i] // stride for i in range(2)]
        begin = b.const(np.array([phase, *shift], np.int64))
        end = b.const(np.array([phase + 1, shift[0] + out_size[0], shift[1] + out_size[1]], np.int64))
        windows.append(b.op("Squeeze", [b.op("Slice", [phases, begin, end, axes]), one]))
    return windows


def _output_size(b: Builder, w_shape: list[int], strides: list[int], dilations: list[int],
                 pads: list[int]) -> list[int | None]:  # fmt: skip
    """dY's spatial sizes from the convolution input's, where dY's are unknown (a gradient builder that writes
    no shapes for the tensors it makes: artifacts.gradients). Without them every weight gradient fell back to the
    convolution with the batch as channels: on the MobileNet-style model 2.2-2.3 ms a layer where its windows
    took a fraction of that."""
    size = (b.dims.get(b.node.input[1]) or [None])[2:]
    spatial = len(w_shape) - 2
    if len(size) != spatial or any(s is None for s in size):
        return [None]
    reach = [dilations[i] * (w_shape[2 + i] - 1) + 1 for i in range(spatial)]
    return [(size[i] + pads[i] + pads[i + spatial] - reach[i]) // strides[i] + 1 for i in range(spatial)]


def _weight_grad_by_windows(b: Builder, w_shape: list[int], strides: list[int], dilations: list[int],
                            pads: list[int]) -> bool:  # fmt: skip
    """dW of a one-group convolution as, for each kernel offset, dY ([O, N P]) times the input's shifted,
    strided window taken channels last ([N P, C]): the same products summed in another order. False
    (nothing emitted) without static spatial sizes."""
    windows = _windows(b, w_shape, strides, dilations, pads, channels_last=True)
    if windows is None:
        return False
    dy, spatial = b.node.input[0], len(w_shape) - 2
    grads = b.op("Transpose", [dy], perm=[1, 0, *range(2, spatial + 2)])  # [O, N, *out]
    grads = b.op("Reshape", [grads, b.const(np.array([int(w_shape[0]), -1], np.int64))])
    rows = b.const(np.array([-1, int(w_shape[1])], np.int64))
    products = [b.op("MatMul", [grads, b.op("Reshape", [window, rows])]) for window in windows]  # [O, C] each
    stacked = b.op("Concat", [b.op("Unsqueeze", [p, b.const(np.array([2], np.int64))]) for p in products], axis=2)
    b.op("Reshape", [stacked, b.const(np.array(w_shape, np.int64))], b.node.output[1])  # [O, C, K] -> OIHW
    return True


def _depthwise_weight_grad_by_windows(b: Builder, w_shape: list[int], strides: list[int], dilations: list[int],
                                      pads: list[int]) -> bool:  # fmt: skip
    """dW of a depthwise convolution as, for each kernel offset, the input's shifted window times dY, summed
    over batch and positions per channel: the same products summed in another order. Measured against the
    grouped convolution with the batch as channels at stride 1 (onnxruntime 1.32, 2 threads, interleaved,
    one-off): 16 channels of 32x32 1.73x, 64 of 16x16 1.84x, 128 of 8x8 1.22x faster. False (nothing emitted)
    without static spatial sizes."""
    windows = _windows(b, w_shape, strides, dilations, pads)
    if windows is None:
        return False
    dy, spatial = b.node.input[0], len(w_shape) - 2
    sums = [b.reduce("ReduceSum", b.op("Mul", [window, dy]), [0, *range(2, spatial + 2)], 0) for window in windows]
    stacked = b.op("Concat", [b.op("Unsqueeze", [v, b.const(np.array([1], np.int64))]) for v in sums], axis=1)
    b.op("Reshape", [stacked, b.const(np.array(w_shape, np.int64))], b.node.output[1])  # [C, K] -> [C, 1, *k]
    return True


def _weight_grad_by_columns(b: Builder, w_shape: list[int], strides: list[int], dilations: list[int],
                            pads: list[int]) -> bool:  # fmt: skip
    """dW of a one-group convolution as im2col and a batched matrix product: the input's K = kh kw shifted,
    strided windows stacked ([N, C K, P]), times dY ([N, O, P]) transposed, summed over the batch. False
    (nothing emitted) without static spatial sizes."""
    windows = _windows(b, w_shape, strides, dilations, pads)
    if windows is None:
        return False
    dy, kernel = b.node.input[0], w_shape[2:]
    windows = [b.op("Unsqueeze", [window, b.const(np.array([2], np.int64))]) for window in windows]
    columns = b.op("Concat", windows, axis=2)  # [N, C, K, *out]
    rows = int(w_shape[1]) * int(np.prod(kernel))
    columns = b.op("Reshape", [columns, b.const(np.array([0, rows, -1], np.int64))])
    grads = b.op("Reshape", [dy, b.const(np.array([0, int(w_shape[0]), -1], np.int64))])
    products = f"{b.prefix}.products"  # [N, O, C K]: FusedMatMul transposes the columns as it reads them
    b.nodes.append(helper.make_node("FusedMatMul", [grads, columns], [products], domain="com.microsoft", transB=1))
    summed = b.reduce("ReduceSum", products, [0], 0)
    b.op("Reshape", [summed, b.const(np.array(w_shape, np.int64))], b.node.output[1])
    return True


def _weight_grad_by_convolution(b: Builder, w_shape: list[int], strides: list[int], dilations: list[int],
                                pads: list[int], group: int, depthwise: bool) -> None:  # fmt: skip
    """dW as a convolution of the input with dY, the batch axis as channels (see conv_grad)."""
    node = b.node
    dy, x = node.input[:2]
    spatial = len(w_shape) - 2
    swap = [1, 0, *range(2, spatial + 2)]
    xt, gt = b.op("Transpose", [x], perm=swap), b.op("Transpose", [dy], perm=swap)
    settings = {"strides": dilations, "dilations": strides, "pads": pads}
    if depthwise:
        folded = b.op("Reshape", [xt, b.const(np.array([1, -1] + [0] * spatial, np.int64))])
        full = b.op("Conv", [folded, gt], group=group, **settings)
        full = b.op("Reshape", [full, b.const(np.array([-1, 1] + [0] * spatial, np.int64))])
    else:
        full = b.op("Transpose", [b.op("Conv", [xt, gt], **settings)], perm=swap)
    kernel = list(w_shape[2:])
    cropped = [b.const(np.zeros(spatial, np.int64)), b.const(np.array(kernel, np.int64)),
               b.const(np.arange(2, spatial + 2, dtype=np.int64))]  # fmt: skip
    b.op("Slice", [full, *cropped], node.output[1])


def _conv_input_grad(b: Builder, w_shape: list[int], strides: list[int], dilations: list[int], pads: list[int],
                     group: int) -> None:  # fmt: skip
    # dX is the transposed convolution of dY with the same weight; output_padding restores the
    # input's size (the rows a strided window never reached), which needs static spatial sizes.
    dy, x, w = b.node.input[:3]
    size = (b.dims.get(x) or [None])[2:]
    if len(size) != len(strides) or any(s is None for s in size):
        raise Unlowerable(f"ConvGrad's input gradient needs the static spatial size of {x!r}")
    kernel = w_shape[2:]
    spatial = len(kernel)
    reach = [dilations[i] * (kernel[i] - 1) + 1 for i in range(spatial)]
    out = [(size[i] + pads[i] + pads[i + spatial] - reach[i]) // strides[i] + 1 for i in range(spatial)]
    extra = [size[i] - ((out[i] - 1) * strides[i] + reach[i] - pads[i] - pads[i + spatial]) for i in range(spatial)]
    b.op("ConvTranspose", [dy, w], b.node.output[0], strides=strides, dilations=dilations, pads=pads, group=group,
         kernel_shape=kernel, output_padding=extra)  # fmt: skip
