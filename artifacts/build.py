"""One call from an nn.Module to a verified artifact directory with its manifest."""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Mapping, Sequence

import onnx
import torch
from torch import nn

from ondevice.manifest import Manifest, TokenizerSpec

from ._edges import edge_batches, embedding_inputs
from .errors import InputSpecError, ModelLoadError, SelectionError
from .export import (
    export_onnx,
    torch_module,
)
from .lora import Lora, add_adapters
from .losses import CrossEntropy, Loss
from .optimizers import SGD, AdamW
from .passes import padding_rows
from .pipeline import Options, Source, build_artifacts, check_output, resolve_axes
from .recurrent import unroll_recurrent
from .upsampling import rewrite_conv_transpose
from .verify import Tolerances, verify_batches

__all__ = ["generate"]

log = logging.getLogger(__name__)


def generate(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike[str],
    *,
    input_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    output_names: Sequence[str] | None = None,
    loss: Loss = CrossEntropy(),
    loss_output: str | None = None,
    optimizer: AdamW | SGD = AdamW(),
    trainable: Sequence[str] = (),
    freeze: Sequence[str] = (),
    train_last: int | None = None,
    bias_only: bool = False,
    lora: Lora | None = None,
    lora_from: str | os.PathLike[str] | None = None,
    labels: Sequence[str] = (),
    tokenizer: TokenizerSpec | None = None,
    memory_budget: int | str | None = None,
    batch_size: int = 16,
    opset: int = 17,
    ort_format: bool = False,
    verify: bool = True,
    tolerances: Tolerances = Tolerances(),
    force: bool = False,
    name: str | None = None,
    seed: int = 0,
) -> Manifest:
    """Export ``model``, build ORT training artifacts in ``out_dir`` and prove them against PyTorch.

    ``example_inputs`` are the inputs of ``forward`` in order (or by name); their first dimension
    is the batch and becomes dynamic, as do the axes named in ``dynamic_axes``
    (``{"ids": {1: "seq"}}``). The directory appears complete or not at all.

    ``lora`` adds low-rank adapters to the target Linear layers (``model`` itself is not changed);
    then the adapters train, plus whatever ``trainable`` names (e.g. a new head). ``lora_from`` (a
    PEFT adapter folder) sets rank, alpha and targets from its config and starts the adapters (and
    its ``modules_to_save``) from its weights instead of random A and zero B. ``labels`` names
    the classes; ``tokenizer`` (a ``tokenizer.json`` and the inputs it fills) travels with the
    artifacts so a device can train on text.

    ``memory_budget`` (``"200MB"``) lets the planner choose what trains: it measures the peak RSS
    of training steps at ``batch_size`` for candidate trainable sets (LoRA ranks on ``lora``'s
    targets plus ``trainable``, last-N modules, biases, everything) and keeps the most trainable
    one that fits; the manifest's ``plan`` records the table.

    Examples
    --------
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    >>> manifest = generate(model, torch.randn(16, 64), "out/mlp", input_names=["input"])  # doctest: +SKIP
    >>> manifest.verification.passed  # doctest: +SKIP
    True
    """
    out_dir = check_output(out_dir, force)
    _check_finite(model)
    names, example = _examples(model, example_inputs, input_names)
    axes = resolve_axes(names, example, dynamic_axes or {})
    # Layers ORT 1.19 cannot train, as the same computation over the same parameters in ops it can
    model = rewrite_conv_transpose(unroll_recurrent(model, axes))
    plan_record = None
    if memory_budget is not None:
        from .planner import chosen_options, format_plan, plan

        result = plan(
            model,
            dict(zip(names, example)),
            budget=memory_budget,
            batch_size=batch_size,
            generate_options={"dynamic_axes": dynamic_axes, "output_names": output_names, "loss": loss,
                              "loss_output": loss_output, "optimizer": optimizer, "freeze": freeze, "opset": opset},
            generate=generate,
            lora=lora or Lora(),
            head=tuple(trainable),
        )  # fmt: skip
        log.info("%s", format_plan(result))
        chosen = chosen_options(result)
        lora, trainable = chosen.get("lora"), chosen.get("trainable", ())
        train_last, bias_only = chosen.get("train_last"), chosen.get("bias_only", False)
        plan_record = result.record()
    adapters: list = []
    start = None
    if lora_from is not None:
        from .lora import read_peft

        lora_given, (lora, start) = lora, read_peft(lora_from)
        if lora_given is not None and lora_given != lora:
            raise SelectionError(f"lora={lora_given} differs from the adapter in {lora_from} ({lora}): give one.")
    if lora is not None:
        if train_last is not None or bias_only:
            raise SelectionError(
                "LoRA chooses what trains: combine it with trainable=[...] only, not train_last/bias_only."
            )
        model, adapters = add_adapters(model, lora, seed)
        if start is not None:
            from .lora import load_peft

            load_peft(model, start)  # the adapters (and saved modules) start where that adapter ended
        trainable = [*(n for a in adapters for n in (a.a, a.b)), *trainable]
    options = Options(
        output_names=output_names, loss=loss, loss_output=loss_output, optimizer=optimizer,
        trainable=tuple(trainable), freeze=tuple(freeze), train_last=train_last, bias_only=bias_only, opset=opset,
        ort_format=ort_format, dynamic_axes=axes, adapters=tuple(adapters), labels=tuple(labels),
        tokenizer=tokenizer, plan=plan_record, hf_config=_hf_config(model),
    )  # fmt: skip

    def source() -> Source:
        graph, outputs = export_onnx(model, example, names, output_names, opset, axes)
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
        return verify_batches(work, manifest, model, examples, loss, loss_index, optimizer, tolerances, seed)

    return build_artifacts(source, example, names, options, out_dir, name, prove if verify else None)


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
