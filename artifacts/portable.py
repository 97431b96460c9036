"""Write the portable engine's graphs beside the classic ones (or say why a model has none)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from ondevice.engines.contract import FUSED_MAX, PORTABLE_NCHWC, PORTABLE_OPTIMIZER, PORTABLE_STEP, PORTABLE_TRAINING
from ondevice.engines.step_graph import fuse_step

from . import passes
from .optimizers import SGD, AdamW
from .passes.finite import FINITE_CHECK
from .portable_optimizer import build_optimizer_graph

__all__ = ["write_portable", "unportable_reason"]

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
    graphs fused into one, a whole step per run."""
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
    return entry
