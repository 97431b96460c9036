"""The model-independent pipeline: a forward graph in, ORT artifacts proved and published out."""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import nullcontext
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping

import onnx
import torch

import ondevice.frozen
from ondevice.files import output_refusal, publish_dir, sha256_file, staging_dir
from ondevice.locks import ARTIFACTS_LOCK, exclusive
from ondevice.manifest import (
    BATCH,
    MANIFEST_NAME,
    Adapter,
    BufferUpdate,
    DecoderSpec,
    LossSpec,
    Manifest,
    OptimizerSpec,
    ParamSpec,
    Plan,
    TensorSpec,
    TokenizerSpec,
    Verification,
)
from ondevice.session import NCHWC, ORT_VERSION

from . import passes
from ._ort_build import check_loads, convert_to_ort_format, repair_eval_model, run_ort_generator
from .decoder import Decoder
from .errors import (
    ArtifactError,
    InputSpecError,
    OptionError,
    OutputExistsError,
    SelectionError,
    VerificationError,
)
from .export import (
    check_gradient_ops,
    infer_shapes,
    on_trained_path,
    reaching,
)
from .frozen import FROZEN_FILE, externalize_frozen, lookup_tables
from .gradients import training_build, write_graphs
from .passes._nodes import light_model
from .portable import check_portable_loads, write_portable
from .progress import stage
from .selection import select_trainable
from .spec import Spec
from .verify import format_table

__all__ = ["Source", "Options", "build_artifacts", "check_output", "resolve_axes"]

NCHWC_GRAPH = "training_model.nchwc.onnx"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """A forward graph ready for the ORT pipeline, with what the generator must know about it."""

    graph: onnx.ModelProto
    outputs: list[str]
    params: list[str]
    """Initializers that may train, in the model's order."""
    states: list[str]
    """Float initializers that are model state (params and buffers such as BatchNorm statistics)."""
    padding: Mapping[str, int]
    describe: Callable[[str], tuple[str, str]]
    """Node name -> (layer, layer type), for error messages."""


Prover = Callable[[Path, Manifest, onnx.ModelProto, int], "tuple[Verification, list[str]]"]


def build_artifacts(
    source: Callable[[], Source],
    example: list[torch.Tensor],
    names: list[str],
    options: Options,
    out_dir: Path,
    name: str | None,
    prove: Prover | None,
) -> Manifest:
    """Build, prove and publish: the directory appears complete or not at all."""
    try:
        work = staging_dir(out_dir)
    except OSError as exc:
        raise ArtifactError(f"cannot write in {out_dir.parent} ({exc.strerror}). Choose a writable --out.") from None
    try:
        with stage("exporting to ONNX"):
            exported = source()
        manifest, loss_index, original = _build(exported, example, names, options, work, name or out_dir.name)
        del exported
        if prove is not None:
            with stage(f"verifying against PyTorch on {', '.join(manifest.engines)}"):
                report, causes = prove(work, manifest, original, loss_index)
            if options.decoder is not None:
                rows = (*report.rows, *options.decoder.rows)
                report = replace(report, rows=rows, passed=all(row.passed for row in rows))
            manifest = replace(manifest, verification=report)
            if not report.passed:
                raise VerificationError(
                    f"the artifacts disagree with their reference beyond tolerance; nothing was written to {out_dir}.\n"
                    + format_table(report)
                    + "".join(f"\nlikely cause: {c}" for c in causes),
                    report,
                )
        with stage("publishing"):
            manifest.save(work)
            with _replacing(out_dir):  # no trainer may hold the old artifacts while they are swapped
                publish_dir(work, out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return manifest


def _replacing(out_dir: Path) -> ContextManager[None]:
    """Hold existing artifacts in ``out_dir`` alone (InUseError naming the trainers' pids otherwise)."""
    if not (out_dir / MANIFEST_NAME).is_file():  # not artifacts (an empty folder, say): no trainer holds it
        return nullcontext()
    return exclusive(out_dir / ARTIFACTS_LOCK, f"artifacts {out_dir}",
                     "a trainer is using them: let it finish, or write the new artifacts to another --out",
                     own_holds=True)  # fmt: skip


def check_output(out_dir: str | os.PathLike[str], force: bool) -> Path:
    """The absolute output directory, once it is known that writing it destroys nothing odt did not make."""
    refusal = output_refusal(out_dir, force=force, marker=MANIFEST_NAME, extra=(ARTIFACTS_LOCK,))
    if refusal is not None:
        raise OutputExistsError(refusal + ".")
    with _replacing(Path(out_dir)):  # refused now, before the build, if a trainer holds them
        pass
    out_dir = Path(out_dir).absolute()
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArtifactError(f"cannot create {parent}: {exc.strerror}. Choose a writable --out.") from exc
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArtifactError(f"{parent} is not writable. Choose a writable --out.")
    return out_dir


def resolve_axes(
    names: list[str], example: list[torch.Tensor], given: Mapping[str, Mapping[int, str]]
) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {}
    for name, dims in given.items():
        if name not in names:
            raise InputSpecError(f"dynamic_axes names input {name!r}; the inputs are {names}.")
        rank = example[names.index(name)].dim()
        for axis, dim in dims.items():
            if not isinstance(axis, int) or not 0 < axis < rank:
                raise InputSpecError(
                    f"dynamic axis {axis!r} of {name!r} must be an integer from 1 to {rank - 1} (0 is the batch)."
                )
            if not isinstance(dim, str) or not dim.isidentifier() or dim == BATCH:
                raise InputSpecError(f"dynamic axis {axis} of {name!r} needs a name such as 'seq', got {dim!r}.")
        axes[name] = dict(dims)
    return axes


@dataclass(frozen=True, kw_only=True)
class Options:
    """What `_build` needs: the spec (with LoRA's adapters among what trains) and what the starting
    point resolved from it."""

    spec: Spec
    dynamic_axes: Mapping[str, Mapping[int, str]]
    adapters: tuple[Adapter, ...] = ()
    plan: Plan | None = None
    hf_config: Mapping[str, Any] | None = None
    decoder: Decoder | None = None


def _build(
    source: Source, example: list[torch.Tensor], input_names: list[str], o: Options, work: Path, name: str
) -> tuple[Manifest, int, onnx.ModelProto]:
    spec = o.spec
    classic = training_build()
    if spec.ort_format and not classic:  # refused before any work
        raise OptionError("ort_format=True converts the classic graphs with ONNX Runtime's training build, which is "
                          "not installed here; leave it off (the portable engine's graphs need no conversion).")
    loss, optimizer, opset = spec.loss, spec.optimizer, spec.opset
    onnx_model, outputs = source.graph, source.outputs
    original = light_model(onnx_model)  # the exported graph's structure and shapes, not a second copy of its weights
    context = passes.Context(opset=opset, recompute=spec.recompute)
    passes.run_stage("export", onnx_model, context)
    initializers = {i.name: i for i in onnx_model.graph.initializer}
    loss_output = spec.loss_output or outputs[0]
    if loss_output not in outputs:
        raise InputSpecError(f"loss output {loss_output!r} is not a model output; outputs are {outputs}.")
    reachable = reaching(onnx_model, source.params, loss_output)
    trainable = select_trainable(
        source.params, trainable=spec.trainable, freeze=spec.freeze, train_last=spec.train_last,
        bias_only=spec.bias_only, reachable=reachable,
    )  # fmt: skip
    unreachable = [n for n in trainable if n not in reachable]
    if unreachable:
        log.warning("frozen because the loss on %r does not depend on them: %s", loss_output, ", ".join(unreachable))
        trainable = [n for n in trainable if n not in unreachable]
        if not trainable:
            raise SelectionError(f"no selected parameter affects the loss output {loss_output!r}.")
    frozen = [n for n in source.states if n not in trainable]
    live = on_trained_path(onnx_model, trainable)
    context.trainable, context.frozen, context.live = trainable, frozen, lambda node: node.output[0] in live
    passes.run_stage("forward", onnx_model, context)
    if context.results["activations"]:
        log.info("rewritten for ORT's gradient builder: %s", ", ".join(sorted(set(context.results["activations"]))))
    check_gradient_ops(onnx_model, trainable, source.describe)
    onnx_model = infer_shapes(onnx_model)
    passes.run_stage("shaped", onnx_model, context)
    updates = context.results["batchnorm-statistics"]

    output_specs = {v.name: _spec(v) for v in onnx_model.graph.output}
    extra = [n for n in outputs if not (loss.kind == "model" and n == loss_output)]
    describe = lambda node: "{!r} ({})".format(*source.describe(node))  # noqa: E731
    if classic:  # ORT's own builder writes the classic graphs; the portable ones are lowered from them
        with stage("gradient graphs (ONNX Runtime's builder)"):
            run_ort_generator(onnx_model, trainable, frozen, loss, loss_output, optimizer,
                              extra + list(updates.values()), work, describe=describe)  # fmt: skip
    else:  # the generator's own builder: the same graph form, published as the portable engine's only
        moved = set() if spec.ort_format else {n for n in frozen if n not in updates and  # frozen.bin takes them
                                               initializers[n].data_type == onnx.TensorProto.FLOAT}  # fmt: skip
        with stage("gradient graphs"):
            write_graphs(onnx_model, trainable, frozen, loss, loss_output, extra + list(updates.values()), work,
                         describe=describe, stored=[n for n in frozen if n not in moved])  # fmt: skip
    padding = _finish_training_graph(work / "training_model.onnx", dict(source.padding), context)
    repair_eval_model(work / "eval_model.onnx")
    order = _parameter_order(work / "training_model.onnx")
    if spec.ort_format:  # an ORT-format graph holds its initializers itself: the frozen weights stay in the checkpoint
        convert_to_ort_format(work)
        offsets, scales, half = {}, {}, []
    else:
        in_order = [n for n in order if n in set(frozen)]
        offsets, scales, half = externalize_frozen(work, trainable, in_order, list(updates), initializers,
                                                   base=spec.base)  # fmt: skip
    variants = {} if spec.ort_format or not classic else _write_variants(work, context)
    tokenizer = _attach_tokenizer(spec.tokenizer, input_names, work)

    shapes = {n: tuple(int(d) for d in t.dims) for n, t in initializers.items()}
    trainable_specs, offset = [], 0
    for param in [n for n in order if n in set(trainable)]:
        trainable_specs.append(ParamSpec(param, shapes[param], offset))
        offset += trainable_specs[-1].size
    with stage("portable graphs"):
        portable = write_portable(work, optimizer, [(p.name, p.shape) for p in trainable_specs], opset,
                                  lambda node: "{!r} ({})".format(*source.describe(node)),
                                  variants=not spec.ort_format)  # fmt: skip
    target = loss.target_spec(output_specs[loss_output])
    decoder = o.decoder and _write_decoder(o.decoder, {*trainable, *frozen}, work)
    manifest = Manifest(
        name=name,
        files={p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file() and p.name != MANIFEST_NAME},
        inputs=tuple(
            TensorSpec(
                n, _dtype_name(t), (BATCH, *(o.dynamic_axes.get(n, {}).get(i, d) for i, d in enumerate(t.shape) if i))
            )
            for n, t in zip(input_names, example)
        ),
        targets=() if target is None else (target,),
        loss_output=_loss_output_name(work),
        loss_input=None if loss.kind == "model" else loss_output,
        outputs=tuple(output_specs[n] for n in extra),
        trainable=tuple(trainable_specs),
        frozen=tuple(ParamSpec(n, shapes[n]) for n in order if n in set(frozen)),
        buffers=tuple(BufferUpdate(b, o) for b, o in updates.items()),
        loss=LossSpec(loss.kind, loss.options()),
        optimizer=OptimizerSpec(optimizer.kind, optimizer.lr, optimizer.options()),
        padding=padding,
        finite_check=passes.FINITE_CHECK,
        adapters=o.adapters,
        labels=spec.labels,
        tokenizer=tokenizer,
        plan=o.plan,
        index_limits=_index_limits(original, input_names),
        hf_config=o.hf_config,
        frozen_file={"file": FROZEN_FILE, "offsets": offsets, "lookups": lookup_tables(work, list(offsets)),
                     **({"int8": scales} if scales else {}), **({"float16": half} if half else {}),
                     **({"block_values": ondevice.frozen.BLOCK_VALUES} if scales or half else {})}
        if offsets
        else None,
        variants=variants,
        portable=portable,
        decoder=decoder,
        versions={
            "odt": _own_version(),
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": ORT_VERSION,
            "opset": opset,
            "ir_version": int(onnx.load(work / "training_model.onnx", load_external_data=False).ir_version),
        },
    )
    if manifest.labels and manifest.num_classes != len(manifest.labels):
        raise InputSpecError(
            f"{len(manifest.labels)} class labels given, but the classifier has {manifest.num_classes} outputs."
        )
    if classic:
        check_loads(work, manifest)
    else:
        check_portable_loads(work, manifest, portable)
    return manifest, outputs.index(loss_output), original


def _write_decoder(decoder: Decoder, held: set[str], work: Path) -> DecoderSpec:
    missing = sorted(decoder.weights - held)
    if missing:
        raise ArtifactError(f"the cached decoder reads weights the artifacts do not hold: {', '.join(missing[:5])}.")
    onnx.save(decoder.graph, work / decoder.spec.file)
    return decoder.spec


def _attach_tokenizer(spec: TokenizerSpec | None, input_names: list[str], work: Path) -> TokenizerSpec | None:
    if spec is None:
        return None
    source = Path(spec.file)
    for name in (spec.ids, spec.mask, spec.labels):
        if name is not None and name not in input_names:
            raise InputSpecError(f"the tokenizer fills input {name!r}, but the model's inputs are {input_names}.")
    if not source.is_file():
        raise InputSpecError(f"tokenizer file {source} does not exist; pass the model's tokenizer.json.")
    shutil.copyfile(source, work / "tokenizer.json")
    return replace(spec, file="tokenizer.json")


def _write_variants(work: Path, context: passes.Context) -> dict[str, str]:
    """Variant training graphs (the registry's ``variant`` stage) beside the finished one, by kind."""
    model = onnx.load(work / "training_model.onnx", load_external_data=False)
    passes.run_stage("variant", model, context)
    if not context.results.get("nchwc-conv"):
        return {}
    onnx.save(model, work / NCHWC_GRAPH)
    return {NCHWC: NCHWC_GRAPH}


def _finish_training_graph(training_model: Path, rows: dict[str, int], context: passes.Context) -> dict[str, int]:
    """Run the training-graph passes (padding rows, ReLU and lookup gradients, the finite check);
    returns the padding rows masked."""
    context.padding = {name: row for name, row in rows.items() if name in context.trainable}
    model = onnx.load(training_model)
    passes.run_stage("training", model, context)
    done = context.results["padding-rows"]
    if done:
        log.info("padding rows get no gradient: %s", ", ".join(f"{n}[{context.padding[n]}]" for n in done))
    layers = context.results["recompute"]
    if layers:
        log.info("recomputed in the backward: %d layers (%s ... %s)", len(layers), layers[0], layers[-1])
    elif context.recompute:
        log.warning("recompute: no repeated layer found (nodes named by module paths ending in name.N, as "
                    "PyTorch's exporter writes them); every activation is kept")
    onnx.save(model, training_model)
    return {name: context.padding[name] for name in done}


def _parameter_order(training_model: Path) -> list[str]:
    """Parameters in the order of the training graph's inputs (= ORT's contiguous buffer order)."""
    model = onnx.load(training_model, load_external_data=False)
    return [i.name for i in model.graph.input]


def _loss_output_name(work: Path) -> str:
    model = onnx.load(work / "training_model.onnx", load_external_data=False)
    return model.graph.output[0].name


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    tensor = value.type.tensor_type
    dims: list[int | str] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim]
    return TensorSpec(value.name, str(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)), tuple(dims))


def _index_limits(model: onnx.ModelProto, inputs: list[str]) -> dict[str, int]:
    """Integer inputs that Gather rows of a weight (directly or through Cast): input -> the fewest rows."""
    tables = {i.name: i for i in model.graph.initializer}
    carries = {name: name for name in inputs}  # tensor -> the input whose values it holds
    limits: dict[str, int] = {}
    for node in model.graph.node:  # topological order
        if node.op_type == "Cast" and node.input[0] in carries:
            carries[node.output[0]] = carries[node.input[0]]
        elif node.op_type == "Gather" and node.input[1] in carries and node.input[0] in tables:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            dims = tables[node.input[0]].dims
            source = carries[node.input[1]]
            limits[source] = min(limits.get(source, dims[axis]), int(dims[axis]))
    return limits


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _own_version() -> str:
    try:
        return metadata.version("ondevice-training")
    except metadata.PackageNotFoundError:
        return "unknown"
