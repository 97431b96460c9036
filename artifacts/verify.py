"""Prove artifacts against PyTorch: eval outputs, loss, every gradient, the weights after one step."""

from __future__ import annotations

import copy
import math
import os
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx
import torch
from onnx import helper
from torch import nn

from ondevice.engines import open_engine
from ondevice.engines.contract import PORTABLE_OPTIMIZER, PORTABLE_TRAINING, gradient_output
from ondevice.manifest import Manifest, Verification, VerificationRow
from ondevice.session import TRAINING_GRAPH, ort_error_message, training_graph

from .errors import ToleranceError, VerificationError
from .export import zero_dropout
from .frozen import FROZEN_FILE
from .kinks import ULPS, Kink, kink_outputs, near_kinks, with_torch_side
from .losses import Loss
from .optimizers import SGD, AdamW, ReferenceOptimizer
from .replay import piecewise_inputs, replayed_dropout

__all__ = [
    "Tolerances",
    "compare",
    "make_targets",
    "verify_artifacts",
    "verify_batches",
    "merge_reports",
    "dropout_free_twin",
    "GraphRun",
    "engine_graphs",
    "format_table",
]


@dataclass(frozen=True)
class Tolerances:
    """Pass when ``|ort - torch| <= atol + rtol * |torch|`` element-wise, for every item."""

    atol: float = 1e-5
    rtol: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("atol", "rtol"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ToleranceError(f"{name} must be a finite number >= 0, got {value!r}.")


class GraphRun:
    """One engine over an artifact directory (or its twin), opened as a trainer opens it (``open_engine``):
    ``graph``'s file names the engine, ``training_model.portable*`` the portable one, else the classic one."""

    def __init__(self, directory: Path, manifest: Manifest, graph: str, with_eval: bool = False) -> None:
        self.portable = graph.startswith(PORTABLE_TRAINING.removesuffix(".onnx"))
        if self.portable:  # this graph alone, never the fused step (it holds the same graph and the update)
            manifest = replace(manifest, portable={"training": graph, "optimizer": PORTABLE_OPTIMIZER})
        self.engine = open_engine(directory, manifest, "portable" if self.portable else "classic",
                                  directory / "checkpoint", threads=None, lean_memory=False, with_eval=with_eval,
                                  graph=graph)  # fmt: skip
        if self.portable:
            grads = {gradient_output(p.name) for p in manifest.trainable}
            outputs = onnx.load(directory / graph, load_external_data=False).graph.output
            self.names = [o.name for o in outputs if o.name not in grads]
        else:
            self.names = list(self.engine.output_names())  # type: ignore[attr-defined]

    def gradient(self, name: str) -> np.ndarray | None:
        if self.portable:
            view = self.engine.gradient_view(name)
            return None if view is None else np.array(view)
        return self.engine.get_gradient(name)  # type: ignore[attr-defined]


def engine_graphs(manifest: Manifest) -> list[str]:
    """The training graphs verification runs: per engine the manifest lists, the plain graph and the variant
    this ONNX Runtime loads."""
    graphs = [TRAINING_GRAPH, training_graph(manifest.variants)] if "classic" in manifest.engines else []
    if "portable" in manifest.engines:
        graphs += [PORTABLE_TRAINING, training_graph(manifest.portable_variants, PORTABLE_TRAINING)]
    return list(dict.fromkeys(graphs))


def compare(item: str, ort: np.ndarray, ref: np.ndarray, tol: Tolerances) -> VerificationRow:
    """One verification row; a shape mismatch is an error, not a row."""
    ort = np.asarray(ort, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if ort.shape != ref.shape:
        raise VerificationError(f"{item}: ONNX Runtime gives shape {ort.shape}, PyTorch {ref.shape}.")
    diff = np.abs(ort - ref)
    max_abs = float(diff.max()) if diff.size else 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / np.maximum(np.abs(ref), np.finfo(np.float32).tiny))
    max_rel = float(rel.max()) if diff.size else 0.0
    passed = bool(np.all(diff <= tol.atol + tol.rtol * np.abs(ref))) and bool(np.all(np.isfinite(ort)))
    return VerificationRow(item, max_abs, max_rel, tol.atol, tol.rtol, passed)


def make_targets(manifest: Manifest, loss: Loss, sizes: Mapping[str, int], seed: int) -> list[np.ndarray]:
    """Deterministic targets for the loss inputs that are not model inputs.

    ``sizes`` gives the size of each named dimension (``batch`` and any dynamic axis).
    """
    rng = np.random.default_rng(seed)
    targets = []
    for spec in manifest.targets:
        shape = tuple(sizes.get(d, 1) if isinstance(d, str) else d for d in spec.shape)
        if spec.dtype == "int64":
            high = manifest.num_classes or 2
            targets.append(rng.integers(0, high, size=shape, dtype=np.int64))
        elif loss.kind == "bce_with_logits":
            targets.append(rng.integers(0, 2, size=shape).astype(np.float32))
        else:
            targets.append(rng.standard_normal(shape).astype(np.float32))
    return targets


def axis_sizes(manifest: Manifest, example: Sequence[torch.Tensor]) -> dict[str, int]:
    """Size of every named dimension of the inputs in ``example``."""
    return {
        dim: int(tensor.shape[axis])
        for spec, tensor in zip(manifest.inputs, example)
        for axis, dim in enumerate(spec.shape)
        if isinstance(dim, str)
    }


def verify_batches(
    directory: Path,
    manifest: Manifest,
    model: nn.Module,
    examples: Sequence[Sequence[torch.Tensor]],
    loss: Loss,
    loss_index: int,
    optimizer: AdamW | SGD,
    tol: Tolerances,
    seed: int,
) -> tuple[Verification, list[str]]:
    """Verify on each example batch; one row per item (the worst over batches) and the likely causes."""
    reports, kinks = [], []
    for index, example in enumerate(examples):
        targets = make_targets(manifest, loss, axis_sizes(manifest, example), seed)
        try:
            report = verify_artifacts(directory, manifest, model, example, targets, loss, loss_index, optimizer, tol)
            if not report.passed:
                report, said = _retry_at_kinks(report, directory, manifest, model, example, targets, loss,
                                               loss_index, optimizer, tol, seed)  # fmt: skip
                kinks += [f"at input shape {_shape(example)}: {said}"] if said else []
            reports.append(report)
        except VerificationError:
            raise
        except Exception as exc:
            if not index:
                raise VerificationError(_step_failure(exc)) from exc
            raise VerificationError(
                f"the artifacts fail at input shape {_shape(example)} (another batch size or length than the example): "
                f"{ort_error_message(exc)}. A size is baked into the graph, e.g. a reshape to a constant; "
                "use x.shape[...] in forward or name the axis dynamic."
            ) from exc
    report = merge_reports(reports, examples)
    report = replace(report, note="; ".join([report.note, *kinks]))
    return report, likely_causes(report, manifest, [r.passed for r in reports])


def _step_failure(exc: Exception) -> str:
    """ORT's failure of the first step, with the node and the layer its name carries (a gradient
    node is named after the forward node it differentiates: ``/encoder/block.0/.../Unsqueeze_14_Grad``)."""
    text = ort_error_message(exc)
    found = re.search(r"Name:'([^']+)'", str(exc))
    if found is None:
        return f"ONNX Runtime cannot run the generated training step: {text}."
    node = found.group(1)
    layer = node.split("_Grad")[0].rsplit("/", 1)[0] or node
    kind = "the gradient of" if "_Grad" in node else "node"
    return (f"ONNX Runtime cannot run the generated training step: {kind} {node.split('_Grad')[0]!r} in layer "
            f"{layer!r} failed ({text}). A shape error in a gradient usually means a broadcast input whose gradient "
            "ORT does not sum: freeze that layer, or report the model.")


def _shape(example: Sequence[torch.Tensor]) -> str:
    return "x".join(str(d) for d in example[0].shape)


def _retry_at_kinks(
    report: Verification,
    directory: Path,
    manifest: Manifest,
    model: nn.Module,
    example: Sequence[torch.Tensor],
    targets: Sequence[np.ndarray],
    loss: Loss,
    loss_index: int,
    optimizer: AdamW | SGD,
    tol: Tolerances,
    seed: int,
) -> tuple[Verification, str]:
    """A train step that fails where ORT's forward has inputs at a kink is tried once more on nearby data.

    One rounding step at a ReLU / Hardswish / clip / max-pooling kink picks the other branch in one
    of the two frameworks, a false alarm that another draw of the data does not repeat; a wrong
    gradient fails again. Returns the report to keep and what was found ("" when no kink is near).
    """
    failed = [r for r in report.rows if not r.passed]
    if any(r.item.split(": ")[-1].startswith("eval ") for r in failed):
        return report, ""
    graphs = {r.item.split(": ")[0] if ": " in r.item else TRAINING_GRAPH for r in failed}
    feeds = [t.detach().numpy() for t in example] + list(targets)
    kinks, inputs = [], {}
    for graph in sorted(graphs):
        found, arrays = _kinks(directory, manifest, graph, feeds)
        seen = {(k.node, k.item, k.index) for k in kinks}  # one forward node in each engine's graph: counted once
        kinks += [k for k in found if (k.node, k.item, k.index) not in seen]
        inputs.update(arrays)
    if not kinks:
        return report, ""
    worst = max(failed, key=lambda r: r.max_abs)
    closest = min(kinks, key=lambda k: abs(k.value - k.at))
    reference = copy.deepcopy(model).train()
    with torch.no_grad(), replayed_dropout(None, ()), piecewise_inputs() as seen:
        reference(*example)  # PyTorch's side of the same element
    closest = with_torch_side(closest, inputs[closest.node], seen)
    found = (f"{worst.item} was off by {worst.max_abs:.3g} ({len(failed)} rows) where ORT's forward has "
             f"{len(kinks)} input(s) within {ULPS} float32 steps of a kink, closest {closest}")  # fmt: skip
    nearby = _nearby(example, seed + 1)
    if nearby is None:
        return report, f"{found}; no float input to retry on other data"
    retargets = make_targets(manifest, loss, axis_sizes(manifest, nearby), seed + 1)
    retry = verify_artifacts(directory, manifest, model, nearby, retargets, loss, loss_index, optimizer, tol)
    if retry.passed:
        return retry, f"retried on nearby data (seed {seed + 1}), which passes, because {found}"
    return report, f"{found}, but it fails on nearby data (seed {seed + 1}) as well: not a kink"


def _nearby(example: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor] | None:
    """The example with its float inputs moved by 0.1 % of their spread (None: nothing to move)."""
    if not any(t.is_floating_point() for t in example):
        return None
    generator = torch.Generator().manual_seed(seed)
    return [
        t + 1e-3 * t.std() * torch.randn(t.shape, generator=generator, dtype=t.dtype) if t.is_floating_point() else t
        for t in example
    ]


def _kinks(directory: Path, manifest: Manifest, graph: str, feeds: list[np.ndarray]
           ) -> tuple[list[Kink], dict[str, np.ndarray]]:  # fmt: skip
    """Inputs at a kink in the forward of ``graph`` (its twin with dropout off) on ``feeds``, and
    every piecewise node's input by node name."""
    with tempfile.TemporaryDirectory(prefix="odt-verify-") as tmp:
        twin, _ = dropout_free_twin(directory, Path(tmp), graph, keep=True)
        training = onnx.load(twin / graph, load_external_data=False)
        nodes = kink_outputs(training)
        names = list(dict.fromkeys(node.input[0] for node, _ in nodes))
        if not names:
            return [], {}
        known = {o.name for o in training.graph.output}
        training.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                                     for n in names if n not in known)  # fmt: skip
        onnx.save(training, twin / graph)
        run = GraphRun(twin, manifest, graph)
        by_name = dict(zip(run.names, run.engine.train_step(feeds)))
    arrays = {node.name: np.asarray(by_name[node.input[0]]) for node, _ in nodes}
    return near_kinks(nodes, [arrays[node.name] for node, _ in nodes]), arrays


def merge_reports(reports: Sequence[Verification], examples: Sequence[Sequence[torch.Tensor]]) -> Verification:
    """One row per item, the worst over the reports of each example batch."""
    rows = []
    for item in [r.item for r in reports[0].rows]:
        same = [r for report in reports for r in report.rows if r.item == item]
        worst = max(same, key=lambda r: (not r.passed, r.max_abs))
        rows.append(
            replace(
                worst,
                max_abs=max(r.max_abs for r in same),
                max_rel=max(r.max_rel for r in same),
                passed=all(r.passed for r in same),
            )
        )
    shapes = " and ".join("x".join(str(d) for d in example[0].shape) for example in examples)
    note = "; ".join(n for n in (reports[0].note, f"checked at input shapes {shapes}") if n)
    return Verification(passed=all(r.passed for r in rows), rows=tuple(rows), note=note)


def likely_causes(report: Verification, manifest: Manifest, per_batch: Sequence[bool]) -> list[str]:
    """What a failed verification most likely means, from which rows failed."""
    failed = [r.item for r in report.rows if not r.passed]
    checks = [i.split(": ")[-1] for i in failed]  # without the graph's name ("training_model.portable.onnx: ")
    causes = []
    if per_batch[0] and not all(per_batch):
        causes.append(
            "only the second batch (another batch size or sequence length) fails: a size is baked into the "
            "graph, e.g. a reshape to a constant; use x.shape[...] in forward or name the axis dynamic"
        )
    weights = _embedding_weights(manifest)
    embeddings = [i for i, check in zip(failed, checks) if check.removeprefix("dropout ").startswith("grad ")
                  and check.removeprefix("dropout ")[5:] in weights]  # fmt: skip
    if embeddings:
        causes.append(
            f"{', '.join(embeddings)}: an embedding's padding row gets a gradient in ORT but not in PyTorch "
            "(a padding_idx passed to F.embedding is not seen; use nn.Embedding(padding_idx=...))"
        )
    if any(check.startswith("buffer ") for check in checks):
        causes.append(
            "BatchNorm running statistics differ: momentum=None (cumulative average) is not supported; "
            "set a momentum or freeze the statistics (model.eval() on that layer)"
        )
    dropout = [check for check in checks if check.startswith("dropout ")]
    if dropout and len(dropout) == len(failed):
        causes.append(
            "only the train step with dropout on fails: a Dropout in the training graph does not drop where "
            "PyTorch does (or drops where it does not), or its gradient is scaled differently; a Dropout2d or "
            "AlphaDropout variant, or random code that tracing does not see, would do this"
        )
    train_only = [check for check in checks if check.startswith(("train ", "grad ", "step "))]
    if train_only and not any(check.startswith("eval ") for check in checks) and not embeddings:
        causes.append(
            "eval agrees but the train step does not: a layer behaves differently in training mode "
            "(Dropout variants other than nn.Dropout, BatchNorm on a batch of 1, custom train-mode code)"
        )
    return causes


def _embedding_weights(manifest: Manifest) -> set[str]:
    return {p.name for p in manifest.trainable if len(p.shape) == 2} & (
        set(manifest.padding) | {p.name for p in manifest.trainable if "embed" in p.name}
    )


def verify_artifacts(
    directory: Path,
    manifest: Manifest,
    model: nn.Module,
    example: Sequence[torch.Tensor],
    targets: Sequence[np.ndarray],
    loss: Loss,
    loss_index: int,
    optimizer: AdamW | SGD,
    tol: Tolerances,
) -> Verification:
    """Run the artifacts and ``model`` side by side on one batch and compare everything.

    The train step is checked twice. With dropout off: a twin of the training graph whose
    Dropout ratios are 0 (the graph is otherwise byte-identical) against ``model`` with every
    dropout off (modules, ``F.dropout`` calls and attention rates alike), the optimizer step
    included. With dropout on: the training graph as shipped, its Dropout masks fetched and
    replayed in PyTorch's forward (rows ``dropout ...``). The eval graph is checked as shipped.
    """
    feeds = [t.detach().numpy() for t in example] + list(targets)
    target = torch.from_numpy(targets[0]) if targets else None
    graphs = engine_graphs(manifest)
    rows = _compare_eval(directory, manifest, model, example, feeds, target, loss, loss_index, tol, graphs[0])
    for graph in graphs:
        with tempfile.TemporaryDirectory(prefix="odt-verify-") as tmp:
            twin, dropouts = dropout_free_twin(directory, Path(tmp), graph)
            compared = _compare_train(twin, manifest, model, example, feeds, target, loss, loss_index, optimizer, tol,
                                      graph)  # fmt: skip
        with tempfile.TemporaryDirectory(prefix="odt-verify-") as tmp:
            twin, masks = _mask_twin(directory, Path(tmp), graph)
            if masks:
                compared += _compare_train_with_dropout(twin, manifest, model, example, feeds, target, loss,
                                                        loss_index, tol, graph, masks)  # fmt: skip
        tag = "" if graph == TRAINING_GRAPH else f"{graph}: "
        rows += [replace(row, item=tag + row.item) for row in compared]
    note = f"train step checked with {dropouts} Dropout(s) off, and on with ORT's masks replayed" if dropouts else ""
    return Verification(passed=all(r.passed for r in rows), rows=tuple(rows), note=note)


def _outputs(result: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _compare_eval(
    directory: Path,
    manifest: Manifest,
    model: nn.Module,
    example: Sequence[torch.Tensor],
    feeds: list[np.ndarray],
    target: torch.Tensor | None,
    loss: Loss,
    loss_index: int,
    tol: Tolerances,
    graph: str = TRAINING_GRAPH,
) -> list[VerificationRow]:
    ort = GraphRun(directory, manifest, graph, with_eval=True).engine.eval_step(feeds)
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        outputs = _outputs(reference(*example))
        ref_loss = loss.reference(outputs[loss_index], target)
    rows = [compare("eval loss", ort[0], ref_loss.numpy(), tol)]
    by_name = _model_outputs_by_name(manifest, outputs, loss, loss_index)
    for spec, value in zip(manifest.outputs, ort[1:]):
        rows.append(compare(f"eval {spec.name}", value, by_name[spec.name].numpy(), tol))
    return rows


def _model_outputs_by_name(
    manifest: Manifest, outputs: list[torch.Tensor], loss: Loss, loss_index: int
) -> dict[str, torch.Tensor]:
    rest = [o for i, o in enumerate(outputs) if not (loss.kind == "model" and i == loss_index)]
    return {spec.name: value.detach() for spec, value in zip(manifest.outputs, rest)}


def _compare_train(
    directory: Path,
    manifest: Manifest,
    model: nn.Module,
    example: Sequence[torch.Tensor],
    feeds: list[np.ndarray],
    target: torch.Tensor | None,
    loss: Loss,
    loss_index: int,
    optimizer: AdamW | SGD,
    tol: Tolerances,
    graph: str = TRAINING_GRAPH,
) -> list[VerificationRow]:
    run = GraphRun(directory, manifest, graph)
    session = run.engine
    session.set_learning_rate(optimizer.lr)
    fetched = session.train_step(feeds)
    gradients = {p.name: run.gradient(p.name) for p in manifest.trainable}
    session.optimizer_step()
    stepped = {p.name: np.array(session.get_parameter(p.name)) for p in manifest.trainable}

    with replayed_dropout(None, ()):
        outputs, ref_loss, trained, state = _reference_step(model, manifest, example, target, loss, loss_index)
    rows = _step_rows("", manifest, fetched, gradients, outputs, ref_loss, trained, state, loss, loss_index, tol)
    # The step is checked from ORT's own gradients: AdamW's first step is ~lr * sign(g), so a
    # gradient that is zero in exact arithmetic (a bias before BatchNorm) would otherwise turn
    # float noise into lr-sized differences. The gradients themselves are compared above.
    for spec, param in zip(manifest.trainable, trained):
        grad = gradients[spec.name]
        param.grad = torch.zeros_like(param) if grad is None else torch.from_numpy(grad.copy())
    ReferenceOptimizer(optimizer, trained).step()
    rows += [
        compare(f"step {s.name}", stepped[s.name], p.detach().numpy(), tol) for s, p in zip(manifest.trainable, trained)
    ]
    return rows


def _compare_train_with_dropout(
    directory: Path,
    manifest: Manifest,
    model: nn.Module,
    example: Sequence[torch.Tensor],
    feeds: list[np.ndarray],
    target: torch.Tensor | None,
    loss: Loss,
    loss_index: int,
    tol: Tolerances,
    graph: str,
    masks: Sequence[tuple[str, str]],
) -> list[VerificationRow]:
    """The train step with every Dropout drawing its own mask, PyTorch replaying those masks."""
    run = GraphRun(directory, manifest, graph)
    fetched = run.engine.train_step(feeds)
    by_output = dict(zip(run.names, fetched))
    gradients = {p.name: run.gradient(p.name) for p in manifest.trainable}
    drawn = [np.asarray(by_output[output], dtype=bool) for _, output in masks]
    with replayed_dropout(drawn, [node for node, _ in masks]):
        outputs, ref_loss, trained, state = _reference_step(model, manifest, example, target, loss, loss_index)
    return _step_rows("dropout ", manifest, fetched, gradients, outputs, ref_loss, trained, state, loss, loss_index,
                      tol)  # fmt: skip


def _reference_step(
    model: nn.Module,
    manifest: Manifest,
    example: Sequence[torch.Tensor],
    target: torch.Tensor | None,
    loss: Loss,
    loss_index: int,
) -> tuple[list[torch.Tensor], torch.Tensor, list[nn.Parameter], dict[str, torch.Tensor]]:
    """PyTorch's training-mode forward and backward on a copy of ``model``: outputs, loss, trained
    parameters (with their gradients) and the state after the forward (BatchNorm statistics)."""
    reference = copy.deepcopy(model).train()
    params = dict(reference.named_parameters())
    for p in params.values():
        p.requires_grad_(False)
    trained = [params[p.name].requires_grad_(True) for p in manifest.trainable]
    outputs = _outputs(reference(*example))
    ref_loss = loss.reference(outputs[loss_index], target)
    ref_loss.backward()
    return outputs, ref_loss, trained, reference.state_dict()


def _step_rows(
    prefix: str,
    manifest: Manifest,
    fetched: Sequence[np.ndarray],
    gradients: Mapping[str, np.ndarray | None],
    outputs: list[torch.Tensor],
    ref_loss: torch.Tensor,
    trained: Sequence[nn.Parameter],
    state: Mapping[str, torch.Tensor],
    loss: Loss,
    loss_index: int,
    tol: Tolerances,
) -> list[VerificationRow]:
    """Loss, outputs, BatchNorm statistics and gradients of one train step, ORT against PyTorch."""
    rows = [compare(f"{prefix}train loss", fetched[0], ref_loss.detach().numpy(), tol)]
    by_name = _model_outputs_by_name(manifest, outputs, loss, loss_index)
    extra = fetched[1 : 1 + len(manifest.outputs)]
    rows += [
        compare(f"{prefix}train {s.name}", v, by_name[s.name].numpy(), tol) for s, v in zip(manifest.outputs, extra)
    ]
    updates = fetched[1 + len(manifest.outputs) : 1 + len(manifest.outputs) + len(manifest.buffers)]
    rows += [
        compare(f"{prefix}buffer {b.name}", v, state[b.name].numpy(), tol) for b, v in zip(manifest.buffers, updates)
    ]
    for spec, param in zip(manifest.trainable, trained):
        grad = gradients[spec.name]
        ref_grad = param.grad if param.grad is not None else torch.zeros_like(param)
        rows.append(
            compare(
                f"{prefix}grad {spec.name}", np.zeros_like(ref_grad) if grad is None else grad, ref_grad.numpy(), tol
            )  # fmt: skip
        )
    return rows


def dropout_free_twin(directory: Path, tmp: Path, graph: str = TRAINING_GRAPH, keep: bool = False) -> tuple[Path, int]:
    """The training graph with every Dropout ratio 0, in ``tmp`` (or ``directory`` itself when it has
    no Dropout, unless ``keep``: a copy the caller may change)."""
    training = onnx.load(directory / graph, load_external_data=False)
    count = zero_dropout(training)
    if not count and not keep:
        return directory, 0
    onnx.save(training, tmp / graph)
    _link_the_rest(directory, tmp)
    return tmp, count


def _mask_twin(directory: Path, tmp: Path, graph: str = TRAINING_GRAPH) -> tuple[Path, list[tuple[str, str]]]:
    """A twin of the training graph that also returns every Dropout's mask: ``(node, mask output)``
    in graph order (the order the exporter wrote them, which is the order the forward ran them)."""
    training = onnx.load(directory / graph, load_external_data=False)
    masks = []
    for node in training.graph.node:
        if node.op_type == "Dropout":
            while len(node.output) < 2:
                node.output.append("")
            if not node.output[1]:
                node.output[1] = f"{node.output[0]}/verify_mask"
            masks.append((node.name, node.output[1]))
            training.graph.output.append(helper.make_tensor_value_info(node.output[1], onnx.TensorProto.BOOL, None))
    if masks:
        onnx.save(training, tmp / graph)
        _link_the_rest(directory, tmp)
    return tmp, masks


def _link_the_rest(directory: Path, tmp: Path) -> None:
    # hard links where the file system allows them: stock ONNX Runtime refuses external data (frozen.bin)
    # reached through a symbolic link
    for name in ("eval_model.onnx", "optimizer_model.onnx", PORTABLE_OPTIMIZER, "checkpoint", FROZEN_FILE):
        if (directory / name).exists():
            try:
                os.link((directory / name).resolve(), tmp / name)
            except OSError:
                os.symlink((directory / name).resolve(), tmp / name)


def format_table(verification: Verification) -> str:
    """The verification as an aligned text table with a verdict line."""
    width = max([len(r.item) for r in verification.rows] + [4])
    lines = [f"{'item':<{width}}  {'max abs':>10}  {'max rel':>10}  {'atol':>8}  {'rtol':>8}  ok"]
    for r in verification.rows:
        mark = "yes" if r.passed else "NO"
        lines.append(f"{r.item:<{width}}  {r.max_abs:10.3e}  {r.max_rel:10.3e}  {r.atol:8.1e}  {r.rtol:8.1e}  {mark}")
    failed = sum(not r.passed for r in verification.rows)
    verdict = "PASS" if verification.passed else f"FAIL ({failed} of {len(verification.rows)} items beyond tolerance)"
    lines.append(f"verification: {verdict}" + (f"; {verification.note}" if verification.note else ""))
    return "\n".join(lines)
