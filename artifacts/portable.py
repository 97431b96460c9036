"""Write the portable engine's graphs beside the classic ones (or say why a model has none)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from ondevice.engines.contract import (
    FUSED_MAX,
    PORTABLE_NCHWC,
    PORTABLE_OPTIMIZER,
    PORTABLE_ORT,
    PORTABLE_STEP,
    PORTABLE_TRAINING,
    ort_copy_name,
)
from ondevice.engines.step_graph import fuse_step
from ondevice.manifest import Manifest

from . import passes
from ._ort_build import frozen_as_inputs_ort
from .errors import ExportError, UnsupportedOperatorError
from .frozen import FROZEN_FILE
from .optimizers import SGD, AdamW
from .passes.finite import FINITE_CHECK
from .portable_optimizer import build_optimizer_graph

__all__ = ["write_portable", "unportable_reason", "check_portable_loads"]

log = logging.getLogger(__name__)


def unportable_reason(model: onnx.ModelProto, describe: Callable[[str], str]) -> str | None:
    """None when every node of ``model`` runs on stock ONNX Runtime, else which operators and layers do not."""
    from .passes.portable import unportable

    left = unportable(model)
    if not left:
        return None
    kinds = sorted({n.op_type for n in left})
    first = {kind: next(n for n in left if n.op_type == kind) for kind in kinds}
    named = "; ".join(f"{kind} (first in layer {describe(node.name)})" for kind, node in first.items())
    return f"ONNX Runtime's training-only operators {named} have no standard-ONNX lowering yet"


def write_portable(
    work: Path,
    optimizer: AdamW | SGD,
    trainable: list[tuple[str, tuple[int, ...]]],
    opset: int,
    describe: Callable[[str], str] = lambda node: node,
    variants: bool = True,
) -> dict[str, str]:
    """Lower ``work/training_model.onnx`` (the registry's ``portable`` stage) and build the optimizer
    graph; returns the manifest's ``portable`` entry. A model that does not lower keeps the classic
    engine only, and the entry says why (an operator and its layer). With ``variants``, the registry's
    ``variant`` stage also runs on the lowered graph: convolutions on NCHWc kernels, for x86 runtimes.
    A small model (at most :data:`FUSED_MAX` trainable values) without such a variant also gets the two
    graphs fused into one, a whole step per run. Artifacts with ``frozen.bin`` also get ORT-format copies of
    the training, step and eval graphs that read the frozen weights as inputs (:data:`PORTABLE_ORT`)."""
    model = onnx.load(work / "training_model.onnx", load_external_data=False)
    context = passes.Context(opset=opset)
    passes.run_stage("portable", model, context)
    order = context.results["portable-accumulators"]
    if [name for name, _ in trainable] != order:
        return {"unsupported": f"the gradient accumulators do not follow the parameter order ({order[:3]}...)"}
    reason = unportable_reason(model, describe)
    if reason is not None:
        log.warning("no portable engine for these artifacts: %s; they train on the classic engine only", reason)
        return {"unsupported": reason}
    onnx.save(model, work / PORTABLE_TRAINING)
    size = sum(int(np.prod(shape)) for _, shape in trainable)
    update = build_optimizer_graph(optimizer, size, max(opset, 13), model.ir_version)
    onnx.save(update, work / PORTABLE_OPTIMIZER)
    entry = {"training": PORTABLE_TRAINING, "optimizer": PORTABLE_OPTIMIZER}
    if variants:
        passes.run_stage("variant", model, context)
        if context.results.get("nchwc-conv"):
            onnx.save(model, work / PORTABLE_NCHWC)
            entry["nchwc"] = PORTABLE_NCHWC
    if size <= FUSED_MAX and "nchwc" not in entry:
        lowered = onnx.load(work / PORTABLE_TRAINING, load_external_data=False)
        checked = FINITE_CHECK if any(o.name == FINITE_CHECK for o in lowered.graph.output) else None
        onnx.save(fuse_step(lowered, update, [name for name, _ in trainable], checked), work / PORTABLE_STEP)
        entry["step"] = PORTABLE_STEP
    if (work / FROZEN_FILE).exists():
        # ORT-format copies with the frozen weights as inputs: ONNX Runtime keeps less of a graph it loads from
        # that format (SmolLM2 int8 LoRA: the training session 116 against 140 MiB of RSS, the step's peak 409
        # against 429 MiB, loaded in 0.9 against 5.2 s; onnxruntime 1.32, one-off)
        graphs = {**entry, "eval": "eval_model.onnx"}
        for graph, key in PORTABLE_ORT.items():
            if graph in graphs and frozen_as_inputs_ort(work / graphs[graph], work / ort_copy_name(graphs[graph])):
                entry[key] = ort_copy_name(graphs[graph])
    return entry


def check_portable_loads(work: Path, manifest: Manifest, entry: dict[str, str]) -> None:
    """Open the portable engine once, the way a trainer does (``open_engine``): artifacts made without the
    training build have no other engine, so a model that does not lower, or graphs stock ONNX Runtime
    refuses, stop here."""
    from ondevice.engines import open_engine
    from ondevice.session import ort_error_message

    if "unsupported" in entry:
        raise UnsupportedOperatorError(f"{entry['unsupported']}, and without ONNX Runtime's training build the "
                                       "portable engine is the only one. Freeze the layers it names (--freeze).")
    try:
        engine = open_engine(work, manifest, "portable", work / "checkpoint", threads=1, lean_memory=False,
                             with_eval=True)  # fmt: skip
    except Exception as exc:
        message = ort_error_message(exc)
        raise ExportError(f"the generated portable graphs do not load in ONNX Runtime: {message}") from exc
    size = engine.get_flat().size
    if size != manifest.trainable_size:
        raise ExportError(f"the portable engine's parameter vector holds {size} values, the manifest "
                          f"{manifest.trainable_size}.")
