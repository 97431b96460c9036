"""LoRA adapters: low-rank updates of chosen Linear layers, inserted before export.

A target layer computes ``x W^T + b + scale * (x A^T) B^T`` with ``A`` (rank x in) random and
``B`` (out x rank) zero, so the adapted model starts equal to the original. Only the adapters
(and layers named trainable) train; ``odt export`` folds ``W + scale * B A`` back into ``W``.
The base parameters keep their names (``layer.weight``); the adapters are ``layer.lora_A`` and
``layer.lora_B``.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from ondevice.manifest import Adapter

from .errors import SelectionError
from .selection import matches

__all__ = ["Lora", "LoraLinear", "add_adapters", "with_targets", "read_peft", "load_peft", "saved_modules",
           "ATTENTION_TARGETS"]

PEFT_PREFIX = "base_model.model."


MAX_SCALE = 1e3
"""The largest ``alpha / rank`` accepted (PEFT's examples use 1 to 4; 1e30 made every verification row overflow)."""


@dataclass(frozen=True)
class Lora:
    """Adapters of ``rank`` on every Linear whose name ends with one of ``targets`` (or matches a glob).

    ``scale = alpha / rank``; give tiers of one federation the same ratio so their adapters agree.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ()
    """Linear layer names or globs; empty (the default): the architecture's attention projections,
    as PEFT names them (:data:`ATTENTION_TARGETS`, resolved by :func:`with_targets`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise SelectionError(f"LoRA rank must be an integer >= 1, got {self.rank!r}.")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0 and math.isfinite(self.alpha)):
            raise SelectionError(f"LoRA alpha must be a positive number, got {self.alpha!r}.")
        if self.alpha / self.rank > MAX_SCALE:
            raise SelectionError(
                f"LoRA alpha {self.alpha:g} at rank {self.rank} scales the adapters by {self.alpha / self.rank:.3g}, "
                f"more than {MAX_SCALE:g}: their first steps would swamp the layer (or overflow float32). Usual "
                "values are alpha = rank to 2 x rank (PEFT's default 8 at rank 8)."
            )
        if isinstance(self.targets, str) or not all(isinstance(t, str) and t for t in self.targets):
            raise SelectionError(f"LoRA targets must be a list of layer names, got {self.targets!r}.")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraLinear(nn.Module):
    """A Linear layer with a low-rank adapter; shares the original layer's weight and bias."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, generator: torch.Generator) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.scale = scale
        a = torch.empty(rank, base.in_features, dtype=base.weight.dtype)
        bound = 1.0 / math.sqrt(base.in_features)  # kaiming_uniform(a=sqrt(5)) as in nn.Linear and peft
        self.lora_A = nn.Parameter(a.uniform_(-bound, bound, generator=generator))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale

    def merged_weight(self) -> torch.Tensor:
        return self.weight + self.scale * (self.lora_B @ self.lora_A)


ATTENTION_TARGETS = (
    ("query", "value"),  # BERT, RoBERTa, MiniLM, ViT
    ("q_proj", "v_proj"),  # Llama, Qwen, Mistral, Gemma, SmolLM, Phi
    ("qkv_proj",),  # Phi-3 (one fused projection)
    ("q_lin", "v_lin"),  # DistilBERT
    ("q", "v"),  # T5
)
"""The query and value projections PEFT adapts by default, per architecture, tried in this order."""


def with_targets(lora: Lora, model: nn.Module) -> Lora:
    """``lora`` with its targets resolved: as given, or (empty) the first of :data:`ATTENTION_TARGETS`
    whose names are all Linear layers of ``model``. Raises SelectionError listing the Linear layers
    when no known names fit, or when given names match none."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if lora.targets:
        targets = lora.targets
        missing = [t for t in targets if not any(_is_target(n, (t,)) for n in linears)]
        if len(missing) == len(targets):
            raise SelectionError(f"LoRA targets {list(targets)} match no Linear layer. {_listing(linears)}")
        return lora
    for targets in ATTENTION_TARGETS:
        if all(any(_is_target(n, (t,)) for n in linears) for t in targets):
            return Lora(lora.rank, lora.alpha, targets)
    known = ", ".join("/".join(t) for t in ATTENTION_TARGETS)
    raise SelectionError(f"no attention projections of a known architecture ({known}) in this model: name the "
                         f"layers (--lora-targets). {_listing(linears)}")  # fmt: skip


def _listing(linears: list[str]) -> str:
    """The model's Linear layer names, shortened to their distinct last parts when there are many."""
    if not linears:
        return "It has no Linear layers."
    ends = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in linears))
    shown = ", ".join(ends[:12]) + (", ..." if len(ends) > 12 else "")
    return f"Its Linear layers end in: {shown}."


def _is_target(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith("." + t) or matches(t, name) for t in targets)


def add_adapters(model: nn.Module, lora: Lora, seed: int = 0) -> tuple[nn.Module, list[Adapter]]:
    """A copy of ``model`` with adapters on its target Linear layers, and the adapters' records.

    The caller's model is not changed. Raises SelectionError when no Linear matches.
    """
    lora = with_targets(lora, model)
    adapted = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    linears = [(n, m) for n, m in adapted.named_modules() if isinstance(m, nn.Linear)]
    chosen = [(n, m) for n, m in linears if _is_target(n, lora.targets)]
    small = [(n, m) for n, m in chosen if lora.rank > min(m.in_features, m.out_features)]
    if small:
        name, module = small[0]
        raise SelectionError(
            f"LoRA rank {lora.rank} is larger than layer {name!r} ({module.in_features} in, {module.out_features} "
            f"out): a rank up to {min(module.in_features, module.out_features)} is possible there. Lower the rank."
        )
    adapters = []
    for name, module in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = adapted.get_submodule(parent_name) if parent_name else adapted
        setattr(parent, attr, LoraLinear(module, lora.rank, lora.scale, generator))
        prefix = f"{name}."
        adapters.append(Adapter(prefix + "weight", prefix + "lora_A", prefix + "lora_B", lora.scale))
    return adapted, adapters


MAX_ADAPTER_VALUE = 1e4
"""The largest magnitude a starting adapter's value may have: trained LoRA weights stay near 1;
beyond this the file is damaged (1e20 once passed, then failed verification far from its cause)."""


VARIANTS = {
    "use_dora": "DoRA scales each adapted weight's columns by a learned magnitude, which plain LoRA has not",
    "use_rslora": "rsLoRA scales the adapters by alpha / sqrt(rank), not alpha / rank",
    "lora_bias": "a bias on lora_B adds a term plain LoRA has not",
    "layers_to_transform": "adapters on some layers only, where the targets here name every matching layer",
}
"""PEFT options that change what an adapted layer computes, with what each changes."""


def read_peft(directory: str | os.PathLike[str]) -> tuple[Lora, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter folder as (this SDK's Lora, tensors by this SDK's names).

    ``layer.lora_A.weight`` becomes ``layer.lora_A``; the weights of ``modules_to_save`` keep their
    names. One rank and alpha for every layer (PEFT's ``rank_pattern``/``alpha_pattern`` are refused).
    Every failure is a SelectionError naming the folder: unreadable files, a config without an
    integer rank, a positive alpha or target names, tensors that are not finite or not small.
    """
    import json

    from safetensors.torch import load_file

    directory = Path(directory)
    folder = f"{directory} is not a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)"
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise SelectionError(f"{folder}: adapter_config.json: {getattr(exc, 'strerror', None) or exc}.") from None
    if not isinstance(config, dict):
        raise SelectionError(f"{folder}: adapter_config.json holds {type(config).__name__}, not an object.")
    try:
        tensors = load_file(directory / "adapter_model.safetensors")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError for a damaged file
        reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:200]
        raise SelectionError(f"{folder}: adapter_model.safetensors cannot be read ({reason}).") from None
    if config.get("peft_type") != "LORA" or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise SelectionError(f"{directory}: only plain LoRA adapters (one rank and alpha) can start the adapters.")
    variants = [key for key in VARIANTS if config.get(key) not in (None, False, [], "")]
    if variants:  # each changes the adapted layer's forward: loaded as plain LoRA it would compute something else
        raise SelectionError(
            f"{directory}/adapter_config.json sets {', '.join(f'{k}={config[k]!r}' for k in variants)}: "
            f"{'; '.join(VARIANTS[k] for k in variants)}. Only plain LoRA adapters can start the adapters here; "
            "train one without it, or start from fresh adapters (--lora RANK)."
        )
    targets = config.get("target_modules")
    targets = (targets,) if isinstance(targets, str) else tuple(targets) if isinstance(targets, list) else ()
    if not targets:
        raise SelectionError(f"{directory}/adapter_config.json: LoRA targets must be a non-empty list of layer "
                             f"names, got {config.get('target_modules')!r}.")  # fmt: skip
    try:
        lora = Lora(rank=config.get("r"), alpha=config.get("lora_alpha"), targets=targets)  # type: ignore[arg-type]
    except SelectionError as exc:
        raise SelectionError(f"{directory}/adapter_config.json: {exc}") from None
    state = {}
    for key, value in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}")
        if not value.is_floating_point() or not torch.isfinite(value).all():
            raise SelectionError(f"{directory}: tensor {key} is not finite numbers: the adapter is damaged.")
        if value.numel() and float(value.abs().max()) > MAX_ADAPTER_VALUE:
            raise SelectionError(f"{directory}: tensor {key} holds values up to {float(value.abs().max()):.3g}; a "
                                 f"trained adapter's stay far below {MAX_ADAPTER_VALUE:g}: the adapter is damaged.")
        state[name] = value
    return lora, state


def saved_modules(state: dict[str, torch.Tensor]) -> tuple[str, ...]:
    """The modules an adapter saved beside its LoRA tensors (PEFT's ``modules_to_save``: a head it
    trains), by module name."""
    return tuple(dict.fromkeys(n.rsplit(".", 1)[0] for n in state if not n.endswith((".lora_A", ".lora_B"))))


def load_peft(model: nn.Module, state: dict[str, torch.Tensor], adapters: list[Adapter]) -> None:
    """Copy a PEFT adapter's tensors (from :func:`read_peft`) into a model adapted with ``adapters``:
    every tensor must fit, and every adapter's A and B must be there (half an adapter trains wrong)."""
    missing = [n for a in adapters for n in (a.a, a.b) if n not in state]
    if missing:
        raise SelectionError(
            f"the PEFT adapter lacks {len(missing)} of the {2 * len(adapters)} tensors its config implies "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): it is damaged or partial. "
            "Export it again from where it was trained."
        )
    own = model.state_dict()
    misfits = [f"{n} {tuple(t.shape)}" for n, t in state.items() if n not in own or own[n].shape != t.shape]
    if misfits:
        raise SelectionError(
            f"the PEFT adapter does not fit this model: {misfits[:5]} are not (or not so shaped) in it. "
            "Start from the adapter of the same base model, targets and rank."
        )
    model.load_state_dict(state, strict=False)
