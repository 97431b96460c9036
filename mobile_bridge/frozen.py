"""Frozen weights back into the checkpoint, for runtimes that cannot memory-map ``frozen.bin``.

Artifacts keep frozen weights in ``frozen.bin`` as ONNX external data (see ``artifacts.frozen``).
onnxruntime-web and the mobile packages load graphs and checkpoints from bytes, and an ORT-format
graph would hold its initializers itself (twice: training and eval). A bundle therefore carries
them as ORT always did: frozen parameters in the checkpoint, graph inputs in every graph. The
browser's copies of the portable graphs read them as initializers from ``parameters.bin`` instead
(:func:`read_from_parameters`).

An int8 base (``odt generate --base int8``) travels as it is stored: each matrix as int8 with its
per-row scales (``W::scale``) and, for a large one, its row blocks (``W::rows{start}``), each a graph
input of its own dtype, so the device holds a quarter of the float32 bytes and the graphs widen them
as they do in the artifacts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from ondevice import Manifest, Trainer
from ondevice.frozen import stored_arrays
from ondevice.ort_checkpoint import CheckpointData, write_checkpoint

__all__ = ["internalize_frozen", "frozen_arrays", "read_from_parameters"]


def frozen_arrays(source: Path, manifest: Manifest, trainer: Trainer) -> dict[str, np.ndarray]:
    """Every frozen array the graphs of ``source`` read, by graph name, as stored: ``frozen.bin``'s tensors
    (views of one read-only mapping; an int8 base's matrices, scales and row blocks as they are) and the
    checkpoint's other frozen parameters (``trainer``, over ``source``, reads them)."""
    stored = manifest.frozen_file
    arrays = {} if stored is None else stored_arrays(np.memmap(source / stored["file"], np.uint8, "r"), manifest)
    return {**{p.name: trainer.parameter(p.name) for p in manifest.frozen if p.name not in arrays}, **arrays}


def internalize_frozen(source: Path, work: Path, manifest: Manifest, graphs: tuple[str, ...], trainer: Trainer,
                       arrays: dict[str, np.ndarray]) -> None:  # fmt: skip
    """Write ``graphs`` and ``checkpoint`` of ``source`` into ``work`` with every frozen array (``arrays``:
    :func:`frozen_arrays`) back in the checkpoint and a graph input where a graph reads it."""
    assert manifest.frozen_file is not None, "artifacts without frozen.bin are copied as they are"
    for graph in graphs:
        model = onnx.load(source / graph, load_external_data=False)
        kept = [i for i in model.graph.initializer if i.name not in arrays]
        used = {name for node in model.graph.node for name in node.input}
        inputs = {i.name for i in model.graph.input}
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        model.graph.input.extend(
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for n, a in arrays.items() if n in used and n not in inputs
        )  # fmt: skip
        onnx.save(model, work / graph)
    trained = {p.name: trainer.parameter(p.name) for p in manifest.trainable}
    frozen = {n: np.ascontiguousarray(a) for n, a in arrays.items()}
    (work / "checkpoint").write_bytes(write_checkpoint(CheckpointData(trainable=trained, frozen=frozen)))


def read_from_parameters(model: onnx.ModelProto, layout: list[dict], parameters: str) -> onnx.ModelProto:
    """``model`` with each frozen graph input of ``layout`` (``_write_parameters``'s entries: name, shape, dtype,
    byte offset) made an initializer stored as external data in ``parameters`` at its offset: the browser's
    copy of a portable graph. onnxruntime-web copies a run's inputs into its WebAssembly memory on every
    run (MiniLM's 90 MB of frozen weights each step); an initializer is read once, when the session opens
    (``externalData``), and ORT may then pre-pack it. The input copies stay for phones, whose ORT binds them."""
    places = {t["name"]: t for t in layout}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    moved = [i.name for i in graph.input if i.name in places]
    kept = [i for i in graph.input if i.name not in places]
    del graph.input[:]
    graph.input.extend(kept)
    for name in moved:
        place = places[name]
        dtype = np.dtype(place["dtype"])
        tensor = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(dtype), dims=place["shape"])
        tensor.data_location = onnx.TensorProto.EXTERNAL
        length = int(np.prod(place["shape"], dtype=np.int64)) * dtype.itemsize
        for key, value in (("location", parameters), ("offset", place["byte_offset"]), ("length", length)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        graph.initializer.append(tensor)
    return out
