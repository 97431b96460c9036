"""A frozen base narrower than float32: each frozen matrix stored as int8 rows with one float32 scale
per row, or as float16, and widened to float32 inside the step graph just before each product that reads it.

A frozen float32 base is most of a language model's memory on the device (SmolLM2-135M: 513 MiB of the pages
every step reads). In int8 it is a quarter, in float16 a half. The widening (:mod:`ondevice.widen`) is the
hard part: ONNX Runtime constant-folds ``DequantizeLinear`` (or ``Cast``) of an initializer back into a
float32 copy when a session loads, and orders a node with no activation input early, so every widened matrix
would live from the start of the step to its backward use: the float32 base again. So each product gets its
own widening, made to wait for the product's activation input ``x``: an int8 matrix's scale is read as ``scale
+ 0 * x[0]`` (exact), a float16 matrix is reshaped to a shape computed as ``shape + int(0 * x[0])`` before its
``Cast``. It runs just in time, its float32 output dies with the product, and nothing folds. The backward's
products widen again (the base is read twice a step, as a quarter or a half of the bytes). A matrix too large
to widen at once (a tied 49,152-row embedding: 113 MB in float32) is widened and multiplied in blocks of rows.
Lookups (Gather of rows) widen only the rows they read.

Which to choose: int8 is the smaller file; float16 widens faster where ONNX Runtime converts float16
on all its threads (stock onnxruntime 1.32, whose ``DequantizeLinear`` runs on one: SmolLM2's portable
step 1.14x as fast as on int8, trainers of both alternating in one process), and keeps more of the
weights' precision. onnxruntime-training 1.19.2 converts float16 slowly, so on the classic engine
int8 is the faster base.

The values are ``float(q) * scale`` (what ONNX's ``DequantizeLinear`` computes) or the float16 value, so
the graph computes exactly what PyTorch computes with the widened weights (:func:`dequantized_base`),
which is what verification compares.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx
import torch

from ondevice.frozen import (
    SCALE_SUFFIX,
    dequantize_rows,
    narrow_matrices,
    stored_arrays,
    widened,
)
from ondevice.manifest import Manifest
from ondevice.widen import reads, widen_in_graph

__all__ = ["NARROW", "quantize_rows", "dequantize_rows", "quantizable", "widen_in_graph", "dequantized_base",
           "SCALE_SUFFIX"]

NARROW = {"int8": np.dtype(np.int8), "float16": np.dtype("<f2")}
"""The narrow bases (``--base``) and the type each stores its matrices in."""


def quantize_rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row: ``scale = max|row| / 127`` (1 for a row of zeros), ``q = round(row / scale)``."""
    matrix = np.asarray(matrix, np.float32)
    largest = np.abs(matrix).max(axis=1)
    scale = np.where(largest > 0, largest / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(matrix / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


@contextlib.contextmanager
def dequantized_base(model: torch.nn.Module, work: Path, manifest: Manifest) -> Iterator[None]:
    """Within the block, ``model``'s parameters that ``work`` stores as a narrow base (int8 or float16)
    hold their widened values (what the step graphs compute with); afterwards their own values again."""
    narrow = narrow_matrices(manifest)
    if not narrow:
        yield
        return
    arrays = stored_arrays(np.memmap(work / manifest.frozen_file["file"], np.uint8, "r"), manifest)
    state = model.state_dict(keep_vars=True)
    kept = {name: state[name].detach().clone() for name in narrow}
    try:
        with torch.no_grad():
            for name in narrow:
                state[name].copy_(torch.from_numpy(widened(arrays, name)))
        yield
    finally:
        with torch.no_grad():
            for name, value in kept.items():
                state[name].copy_(value)


def quantizable(graphs: Iterable[onnx.ModelProto], candidates: Mapping[str, Sequence[int]]) -> list[str]:
    """The matrices among ``candidates`` (name -> shape) that every graph reads only as the second
    factor of a Gemm/MatMul or as a row lookup (Gather on axis 0): the ones :func:`widen_in_graph`
    can widen. Others stay float32."""
    uses: dict[str, list[bool]] = {}
    for model in graphs:
        for node in model.graph.node:
            for position, name in enumerate(node.input):
                uses.setdefault(name, []).append(reads(node, position))
    return [n for n, shape in candidates.items() if len(shape) == 2 and uses.get(n) and all(uses[n])]
