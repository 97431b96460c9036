"""Start from an existing ONNX model instead of a PyTorch module.

The same losses, optimizers, selection and manifest as :func:`artifacts.build`. With no
PyTorch model to compare against, the proof uses ONNX Runtime inference of the ORIGINAL file:
the eval graph's outputs and loss against it, each trainable tensor's gradient against central
finite differences of the original model's loss along a random direction, and the optimizer
step against the reference optimizer applied to ORT's gradients.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import onnx
import torch
from onnx import helper

from ondevice.engines.contract import PORTABLE_TRAINING
from ondevice.manifest import BATCH, Manifest, Verification
from ondevice.session import ort_error_message

from ._edges import edge_batches, embedding_inputs
from .errors import InputSpecError, ModelLoadError
from .export import zero_dropout
from .losses import Loss
from .optimizers import SGD, AdamW, ReferenceOptimizer
from .pipeline import Options, Source, build_artifacts, check_output, resolve_axes
from .spec import TORCH_ONLY, Spec
from .verify import (
    GraphRun,
    Tolerances,
    axis_sizes,
    compare,
    dropout_free_twin,
    engine_graphs,
    likely_causes,
    make_targets,
    merge_reports,
)

__all__ = ["generate_from_onnx", "onnx_example"]

EPSILON = 3e-4
"""Finite-difference step, relative to a tensor's largest value (measured best between float32
rounding and ReLU kinks on a small CNN)."""

_TORCH = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.BOOL: torch.bool,
}


def generate_from_onnx(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    example_inputs: Mapping[str, torch.Tensor] | None = None,
    spec: Spec = Spec(),
    force: bool = False,
    name: str | None = None,
    **changes: Any,
) -> Manifest:
    """Build verified ORT training artifacts from the ONNX model at ``path``.

    Float initializers with at least one dimension are the parameters (scalars stay constants).
    The first dimension of every input is the batch; other named (symbolic) dimensions stay
    dynamic. ``example_inputs`` default to seeded random data of the input shapes (batch 8),
    which needs every other dimension fixed. ``spec`` (keywords are shorthand for its fields) says
    what to build, as for :func:`artifacts.generate`; the fields that shape a PyTorch export
    (names, axes, opset, LoRA, tokenizer, memory budget) are refused. ``spec.fd_tolerances`` bound
    the finite-difference rows (float32 differences are approximate; the others use ``tolerances``).

    Examples
    --------
    >>> generate_from_onnx("model.onnx", "out/from-onnx", trainable=["classifier.*"])  # doctest: +SKIP
    """
    spec = spec.but(**changes)
    if spec.base != "float32":
        raise InputSpecError(
            f"base={spec.base!r} is built for PyTorch models so far (verification compares PyTorch holding the "
            "dequantized weights); generate from the PyTorch model, or drop --base for this .onnx file."
        )
    torch_only = spec.changed(TORCH_ONLY)
    if torch_only:
        raise InputSpecError(
            f"{', '.join(torch_only)} shape a PyTorch model's export; an .onnx file brings its own graph: drop them."
        )
    path = Path(path)
    original = _load(path)
    out_dir = check_output(out_dir, force)
    example = dict(example_inputs) if example_inputs is not None else onnx_example(original, spec.seed)
    names = [i.name for i in _inputs(original)]
    if sorted(example) != sorted(names):
        raise InputSpecError(f"example inputs must be named {names}, got {sorted(example)}.")
    tensors = [example[n] for n in names]
    axes = resolve_axes(names, tensors, _named_axes(original))
    opset = next((o.version for o in original.opset_import if o.domain in ("", "ai.onnx")), 17)
    options = Options(spec=spec.but(opset=opset), dynamic_axes=axes)
    floats = [i.name for i in original.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and i.dims]
    statistics = {n.input[i] for n in original.graph.node if n.op_type == "BatchNormalization" for i in (3, 4)}
    params = [n for n in floats if n not in statistics]

    def source() -> Source:
        graph = _with_dynamic_batch(original)
        return Source(graph, [o.name for o in graph.graph.output], params, floats, {}, _describe(graph))

    def prove(work: Path, manifest: Manifest, graph: onnx.ModelProto, loss_index: int):  # type: ignore[no-untyped-def]
        examples = edge_batches(names, tensors, axes, embedding_inputs(graph, {}))
        reports = [
            _prove(
                work,
                manifest,
                original,
                e,
                spec.loss,
                loss_index,
                spec.optimizer,
                spec.tolerances,
                spec.fd_tolerances,
                spec.seed,
            )
            for e in examples
        ]
        report = merge_reports(reports, examples)
        causes = likely_causes(report, manifest, [r.passed for r in reports])
        if any(not r.passed and r.item.endswith("(finite difference)") for r in report.rows):
            causes.append(
                "finite differences of a float32 model are approximate where ReLU/max kinks are crossed: if only "
                "those rows miss by a little, pass --fd-atol/--fd-rtol (fd_tolerances=Tolerances(...)) or --no-verify"
            )
        return report, causes

    return build_artifacts(source, tensors, names, options, out_dir, name or out_dir.name,
                           prove if spec.verify else None)  # fmt: skip


def _load(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise ModelLoadError(f"ONNX model {path} does not exist.")
    try:
        model = onnx.load(path)
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ModelLoadError(f"{path} is not a valid ONNX model: {exc}") from exc
    if not _inputs(model) or not model.graph.output:
        raise ModelLoadError(f"{path} has no inputs or no outputs to train.")
    return model


def _inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    initializers = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in initializers]


def _named_axes(model: onnx.ModelProto) -> dict[str, dict[int, str]]:
    return {
        i.name: {a: d.dim_param for a, d in enumerate(i.type.tensor_type.shape.dim) if a and d.dim_param}
        for i in _inputs(model)
        if any(a and d.dim_param for a, d in enumerate(i.type.tensor_type.shape.dim))
    }


def onnx_example(model: onnx.ModelProto, seed: int, batch: int = 8) -> dict[str, torch.Tensor]:
    """Seeded example inputs for ``model``'s inputs (floats: normal; integers: 0 and 1)."""
    generator = torch.Generator().manual_seed(seed)
    example = {}
    for value in _inputs(model):
        tensor = value.type.tensor_type
        dims = list(tensor.shape.dim)
        shape = [batch] + [d.dim_value for d in dims[1:]]
        if any(s <= 0 for s in shape):
            raise InputSpecError(
                f"input {value.name!r} has dynamic dimensions besides the batch; give example inputs "
                f"(--input {value.name}:8x...:DTYPE)."
            )
        dtype = _TORCH.get(tensor.elem_type)
        if dtype is None:
            raise InputSpecError(f"input {value.name!r} has an element type ONNX Runtime training cannot feed here.")
        if dtype.is_floating_point:
            example[value.name] = torch.randn(shape, generator=generator)
        else:
            example[value.name] = torch.randint(0, 2, shape, generator=generator).to(dtype)
    return example


def _with_dynamic_batch(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = onnx.ModelProto()
    graph.CopyFrom(model)
    for value in (*_inputs(graph), *graph.graph.output):
        dims = value.type.tensor_type.shape.dim
        if len(dims):
            dims[0].Clear()
            dims[0].dim_param = BATCH
    return graph


def _describe(model: onnx.ModelProto):  # type: ignore[no-untyped-def]
    kinds = {n.name: n.op_type for n in model.graph.node}
    return lambda node: (node, kinds.get(node, "node"))


def _central_difference(reference, feeds, targets, loss, loss_index, name, weight, direction, step):  # type: ignore[no-untyped-def]
    """The loss's derivative along ``direction`` at ``weight``, by central differences of width ``step``."""
    moved = [
        reference.loss(reference.outputs(feeds, {name: weight + sign * step * direction}), loss, loss_index, targets)
        for sign in (1.0, -1.0)
    ]
    return (moved[0] - moved[1]) / (2 * step)


def _prove(
    work: Path,
    manifest: Manifest,
    original: onnx.ModelProto,
    example: list[torch.Tensor],
    loss: Loss,
    loss_index: int,
    optimizer: AdamW | SGD,
    tol: Tolerances,
    fd_tol: Tolerances,
    seed: int,
) -> Verification:
    feeds = [t.numpy() for t in example]
    targets = make_targets(manifest, loss, axis_sizes(manifest, example), seed)
    reference = _Reference(original, [p.name for p in manifest.trainable])
    outputs = reference.outputs(feeds, None)
    ref_loss = reference.loss(outputs, loss, loss_index, targets)
    graphs = [g for g in engine_graphs(manifest) if g in ("training_model.onnx", PORTABLE_TRAINING)]
    ort = GraphRun(work, manifest, graphs[0], with_eval=True).engine.eval_step(feeds + targets)
    rows = [compare("eval loss", ort[0], np.float32(ref_loss), tol)]
    by_name = dict(zip(reference.output_names, outputs))
    rows += [compare(f"eval {s.name}", v, by_name[s.name], tol) for s, v in zip(manifest.outputs, ort[1:])]
    dropouts = 0
    for graph in graphs:  # every engine the manifest lists
        tag = "" if graph == graphs[0] else f"{graph}: "
        graph_rows, dropouts = _prove_step(work, manifest, graph, reference, feeds, targets, ref_loss, loss, loss_index,
                                           optimizer, tol, fd_tol, seed)  # fmt: skip
        rows += [replace(row, item=tag + row.item) for row in graph_rows]
    report = Verification(
        passed=all(r.passed for r in rows),
        rows=tuple(rows),
        note="reference: ONNX Runtime inference of the original model; gradients by central finite differences"
        + (f"; train step checked with {dropouts} Dropout(s) off" if dropouts else ""),
    )
    return report


def _prove_step(work, manifest, graph, reference, feeds, targets, ref_loss, loss, loss_index, optimizer, tol, fd_tol,
                seed):  # type: ignore[no-untyped-def]  # fmt: skip
    """One engine's train step (``graph``) with every Dropout off: loss, gradients by finite differences, the step."""
    with tempfile.TemporaryDirectory(prefix="odt-verify-") as tmp:
        twin, dropouts = dropout_free_twin(work, Path(tmp), graph)
        run = GraphRun(twin, manifest, graph)
        session = run.engine
        session.set_learning_rate(optimizer.lr)
        fetched = session.train_step(feeds + targets)
        gradients = {p.name: run.gradient(p.name) for p in manifest.trainable}
        session.optimizer_step()
        stepped = {p.name: np.array(session.get_parameter(p.name)) for p in manifest.trainable}
        del run, session
    rows = [compare("train loss", fetched[0], np.float32(ref_loss), tol)]
    rng = np.random.default_rng(seed)
    weights = reference.weights()
    for spec in manifest.trainable:
        direction = rng.standard_normal(spec.shape).astype(np.float64)
        direction /= np.linalg.norm(direction)
        epsilon = EPSILON * max(1.0, float(np.abs(weights[spec.name]).max()))
        at = {
            step: _central_difference(reference, feeds, targets, loss, loss_index, spec.name, weights[spec.name],
                                      direction, step)
            for step in (epsilon, epsilon / 2)
        }  # fmt: skip
        finite_difference = at[epsilon / 2]
        # Two step sizes agree where the loss is smooth and float32 rounding is small; where they
        # differ (a ReLU kink crossed, rounding), that difference bounds the estimate's own error.
        noise = abs(at[epsilon] - at[epsilon / 2])
        widened = Tolerances(fd_tol.atol + 2 * noise, fd_tol.rtol)
        grad = gradients[spec.name]
        analytic = 0.0 if grad is None else float(np.sum(grad.astype(np.float64) * direction))
        rows.append(compare(f"grad {spec.name} (finite difference)", np.float64(analytic), finite_difference,
                            widened))  # fmt: skip
    params = [torch.from_numpy(weights[p.name].astype(np.float32)).requires_grad_(True) for p in manifest.trainable]
    for spec, param in zip(manifest.trainable, params):
        grad = gradients[spec.name]
        param.grad = torch.zeros_like(param) if grad is None else torch.from_numpy(grad.copy())
    ReferenceOptimizer(optimizer, params).step()
    rows += [
        compare(f"step {s.name}", stepped[s.name], p.detach().numpy(), tol) for s, p in zip(manifest.trainable, params)
    ]
    return rows, dropouts


class _Reference:
    """The original model in an ORT inference session whose trainable initializers are inputs."""

    def __init__(self, model: onnx.ModelProto, trainable: list[str]) -> None:
        import onnxruntime as ort

        graph = onnx.ModelProto()
        graph.CopyFrom(model)
        zero_dropout(graph)  # a training-mode export's Dropout would make the reference random
        self._weights = {}
        kept = []
        for init in graph.graph.initializer:
            if init.name in trainable:
                self._weights[init.name] = onnx.numpy_helper.to_array(init).astype(np.float64)
                graph.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
            else:
                kept.append(init)
        del graph.graph.initializer[:]
        graph.graph.initializer.extend(kept)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ModelLoadError(f"ONNX Runtime cannot run the original model: {ort_error_message(exc)}") from exc
        self._inputs = [i.name for i in _inputs(model)]
        self.output_names = [o.name for o in model.graph.output]

    def weights(self) -> dict[str, np.ndarray]:
        return dict(self._weights)

    def outputs(self, feeds: list[np.ndarray], override: dict[str, np.ndarray] | None) -> list[np.ndarray]:
        weights = {**self._weights, **(override or {})}
        run = {**dict(zip(self._inputs, feeds)), **{k: v.astype(np.float32) for k, v in weights.items()}}
        return self._session.run(self.output_names, run)

    def loss(self, outputs: list[np.ndarray], loss: Loss, index: int, targets: list[np.ndarray]) -> float:
        target = torch.from_numpy(targets[0]) if targets else None
        return float(loss.reference(torch.from_numpy(outputs[index]), target))
