"""Frozen weights in a file of their own, memory-mapped on the device, instead of in the checkpoint.

ORT 1.19 loads a checkpoint by reading the whole file into a buffer and then copying every
tensor out of it: the weights are held twice while loading (MiniLM: peak 225 MB, 139 MB after).
Every checkpoint a device saves carries them again (91 MB for 338 KB of LoRA adapters), and
the ``.previous`` copy doubles that. Weights that never change need none of this: here they
become initializers of the training and eval graphs whose data is ONNX external data in
``frozen.bin`` (float32, C order, one tensor after the other). The device runtime maps that
file once and hands every session its tensors (``ondevice.frozen``), so nothing is copied; the
checkpoint keeps only what training changes (trainable tensors, BatchNorm statistics, and later
the optimizer state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ondevice.frozen import SCALE_SUFFIX, block_name, row_blocks
from ondevice.ort_checkpoint import CheckpointData, write_checkpoint

from .narrow_base import NARROW, quantizable, quantize_rows, widen_in_graph

__all__ = ["FROZEN_FILE", "externalize_frozen", "lookup_tables"]

FROZEN_FILE = "frozen.bin"
_GRAPHS = ("training_model.onnx", "eval_model.onnx")


def externalize_frozen(
    work: Path,
    trainable: Sequence[str],
    frozen: Sequence[str],
    buffers: Sequence[str],
    initializers: Mapping[str, onnx.TensorProto],
    base: str = "float32",
) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """Move the float32 tensors of ``frozen`` (but not ``buffers``, which the train step updates)
    from ORT's checkpoint into ``frozen.bin`` and rewrite the checkpoint without them. With ``base``
    ``"int8"`` or ``"float16"``, every frozen matrix the graphs read only in products and row lookups is
    stored as int8 rows with a scale per row, or as float16, and widened in the graphs
    (:mod:`artifacts.narrow_base`).

    Returns (name -> offset, int8 name -> offset of its scales, float16 names), offsets in 4-byte words
    (the tensors tile the file in ``frozen`` order, an int8 or float16 matrix padded to whole words, an
    int8 one followed by its scales); empty when nothing moved.
    """
    moving = [n for n in frozen if n not in buffers and initializers[n].data_type == onnx.TensorProto.FLOAT]
    if not moving:
        return {}, {}, []
    models = {graph: onnx.load(work / graph, load_external_data=False) for graph in _GRAPHS}
    narrow = base in NARROW
    quantized = set(quantizable(models.values(), {n: initializers[n].dims for n in moving})) if narrow else set()
    offsets: dict[str, int] = {}
    scales: dict[str, int] = {}
    added: list[onnx.TensorProto] = []
    position = 0
    with open(work / FROZEN_FILE, "wb") as out:
        for name in moving:
            array = np.ascontiguousarray(numpy_helper.to_array(initializers[name]), dtype="<f4")
            offsets[name] = position
            if name in quantized:
                q, scale = quantize_rows(array) if base == "int8" else (array.astype(NARROW[base]), None)
                dtype = helper.np_dtype_to_tensor_dtype(q.dtype)
                padded = -q.nbytes % 4
                out.write(q.tobytes() + bytes(padded))
                position += (q.nbytes + padded) // 4
                added.append(_external(name, dtype, array.shape, offsets[name], q.nbytes))
                if scale is not None:
                    scales[name] = position
                    out.write(scale.astype("<f4").tobytes())
                    added.append(_external(name + SCALE_SUFFIX, onnx.TensorProto.FLOAT, scale.shape, position,
                                           4 * scale.size))  # fmt: skip
                    position += scale.size
                blocks = row_blocks(q.shape)
                row = q.itemsize * q.shape[1]
                added += [_external(block_name(name, a), dtype, (b - a, q.shape[1]), offsets[name],
                                    (b - a) * row, skip=a * row) for a, b in blocks if len(blocks) > 1]  # fmt: skip
            else:
                out.write(array.tobytes())
                added.append(_external(name, onnx.TensorProto.FLOAT, array.shape, position, 4 * array.size))
                position += array.size
    rows = {n: tuple(int(d) for d in initializers[n].dims) for n in quantized}
    half = [n for n in moving if n in quantized and base == "float16"]
    for graph, model in models.items():
        inputs = [i for i in model.graph.input if i.name not in offsets]
        del model.graph.input[:]
        model.graph.input.extend(inputs)
        model.graph.initializer.extend(added)
        if rows:
            widen_in_graph(model, rows, half)
        onnx.save(model, work / graph)
    (work / "checkpoint").write_bytes(write_checkpoint(CheckpointData(  # the layout ORT's SaveCheckpoint writes
        trainable={n: numpy_helper.to_array(initializers[n]) for n in trainable},
        frozen={n: numpy_helper.to_array(initializers[n]) for n in frozen if n not in offsets})))
    return offsets, scales, half


def _external(name: str, dtype: int, shape: Sequence[int], words: int, length: int, skip: int = 0) -> onnx.TensorProto:
    """An initializer whose data is ``length`` bytes of ``frozen.bin`` from word ``words`` (and ``skip`` bytes)."""
    tensor = onnx.TensorProto(name=name, data_type=dtype, dims=shape)
    tensor.data_location = onnx.TensorProto.EXTERNAL  # by hand: onnx's set_external_data wants raw_data first
    for key, value in (("location", FROZEN_FILE), ("offset", str(4 * words + skip)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def lookup_tables(work: Path, names: Sequence[str]) -> list[str]:
    """The tensors of ``names`` that the training graph only reads a row at a time (the data input
    of Gather on axis 0: embedding tables). A step touches a few rows of them, so the runtime asks
    the kernel to page those rows in one by one (``ondevice.frozen``) instead of whole regions."""
    graph = onnx.load(work / _GRAPHS[0], load_external_data=False).graph
    uses: dict[str, list[bool]] = {}
    for node in graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        for position, name in enumerate(node.input):
            uses.setdefault(name, []).append(node.op_type == "Gather" and position == 0 and axis == 0)
    return [n for n in names if uses.get(n) and all(uses[n])]
