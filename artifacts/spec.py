"""The generation spec: everything a generation needs besides the model and where the artifacts go.

`generate`, `generate_from_onnx`, the planner and `odt generate` all read this one value; the
CLI maps its flags onto it in one place. Keywords given to `generate(...)` are shorthand for
its fields (``generate(model, x, "out", lora=Lora(8))`` is ``spec=Spec(lora=Lora(8))``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from ondevice.manifest import TokenizerSpec

from .errors import InputSpecError
from .lora import Lora
from .losses import CrossEntropy, Loss
from .optimizers import SGD, AdamW
from .verify import Tolerances

__all__ = ["Spec", "FD_TOLERANCES"]

FD_TOLERANCES = Tolerances(atol=1e-3, rtol=5e-2)
"""An .onnx model's finite-difference gradient rows (``--fd-atol/--fd-rtol``), widened per row by
twice the difference between the estimates at two step sizes (their own error: ReLU kinks, float32)."""


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What to build: graph, loss, optimizer, what trains, what travels with the artifacts, the proof."""

    # The graph (a PyTorch model's; an .onnx file brings its own)
    input_names: tuple[str, ...] | None = None
    """Names of the example inputs when they are given in order (default: ``forward``'s parameters)."""
    dynamic_axes: Mapping[str, Mapping[int, str]] = field(default_factory=dict)
    """Axes besides the batch that stay dynamic, e.g. ``{"ids": {1: "seq"}}``."""
    output_names: tuple[str, ...] | None = None
    opset: int = 17

    # Loss and optimizer
    loss: Loss = field(default_factory=CrossEntropy)
    loss_output: str | None = None
    """Which output the loss reads (default: the first)."""
    optimizer: AdamW | SGD = field(default_factory=AdamW)
    adapter_lr: float | None = None
    """The optimizer's rate when LoRA adapters are what trains, chosen by ``lora`` or by the memory
    plan, and when the plan picks a small set (at most 1 % of the parameters: the head and a few
    modules, or biases), which learns from scratch like adapters do (default: ``optimizer.lr``).
    ``odt generate --model hf:...`` without ``--lr`` sets 2e-3 here beside 1e-4 for the model's own
    weights, so a budget that picks LoRA trains at the adapter rate (on Spanish commands a plan of
    the head and the last LayerNorm reached 0.2277 on unseen homes at 1e-4, 0.8886 at 2e-3)."""

    # What trains (default: every parameter)
    trainable: tuple[str, ...] = ()
    """Globs of parameters that train (with ``lora``: what trains beside the adapters, e.g. a head)."""
    freeze: tuple[str, ...] = ()
    train_last: int | None = None
    bias_only: bool = False
    lora: Lora | None = None
    lora_from: str | os.PathLike[str] | None = None
    """A PEFT adapter folder: its rank, alpha, targets and weights start the adapters."""
    memory_budget: int | str | None = None
    """``"200MB"``: the planner measures candidates and picks what trains (see `artifacts.planner`)."""
    batch_size: int = 16
    """The batch the memory plan is measured at."""

    # What travels with the artifacts
    labels: tuple[str, ...] = ()
    tokenizer: TokenizerSpec | None = None
    ort_format: bool = False
    base: str = "float32"
    """How the frozen weights are stored: ``"float32"``; ``"int8"``: every frozen matrix read only by
    matrix products and row lookups as int8 rows with a float32 scale per row (a quarter of the memory);
    ``"float16"``: those matrices in float16 (a half, faster to widen on stock onnxruntime). Either is
    widened just before each product (:mod:`artifacts.narrow_base`). Verification compares PyTorch with
    the same widened weights."""
    recompute: bool = False
    """Recompute each repeated layer (``layers.N``, ``layer.N``, ``h.N``) in the backward from its input
    instead of keeping its activations from the forward (gradient checkpointing,
    :mod:`artifacts.passes.recompute`): the step's activations shrink to about one layer's, for a second
    forward of each layer. The same values."""
    decoder: bool = True
    """A causal language model also gets its cached inference graph (``odt export``, ``odt predict --prompt``)."""

    # The proof
    verify: bool = True
    tolerances: Tolerances = field(default_factory=Tolerances)
    fd_tolerances: Tolerances = FD_TOLERANCES
    """Only an .onnx model's finite-difference rows."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("input_names", "output_names", "trainable", "freeze", "labels"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                if isinstance(value, str):
                    raise InputSpecError(f"{name} takes a list of names, got the string {value!r}.")
                object.__setattr__(self, name, tuple(value))

        repeated = sorted({label for label in self.labels if self.labels.count(label) > 1})
        if repeated or any(not str(label).strip() for label in self.labels):
            problem = f"{', '.join(map(repr, repeated))} appear{'s' if len(repeated) == 1 else ''} more than once" \
                if repeated else "one is empty"  # fmt: skip
            raise InputSpecError(f"labels must be distinct, non-empty class names (the device refuses others): "
                                 f"{problem} in {list(self.labels)}.")  # fmt: skip
        if self.base not in BASES:
            raise InputSpecError(f"base must be one of {', '.join(BASES)}, got {self.base!r}.")
        if self.base != "float32" and self.ort_format:
            raise InputSpecError(f"a {self.base} base needs the frozen weights in frozen.bin, which ORT-format "
                                 "artifacts do not have: drop ort_format (--ort-format) or keep "
                                 "base='float32'.")  # fmt: skip
        if self.base == "int8" and self.opset < 13:
            raise InputSpecError(f"an int8 base widens its rows with DequantizeLinear per axis (opset 13); "
                                 f"opset is {self.opset}: raise it.")  # fmt: skip
        if self.adapter_lr is not None and not (
            isinstance(self.adapter_lr, (int, float)) and math.isfinite(self.adapter_lr) and self.adapter_lr > 0
        ):
            raise InputSpecError(f"adapter_lr must be a positive finite rate or None, got {self.adapter_lr!r}.")

    def but(self, **changes: Any) -> Spec:
        """This spec with ``changes`` (field names); an unknown name is an error that lists the fields."""
        unknown = sorted(set(changes) - FIELDS)
        if unknown:
            raise InputSpecError(
                f"unknown generation option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"the options are the fields of artifacts.Spec: {', '.join(sorted(FIELDS))}."
            )
        return replace(self, **changes) if changes else self

    def changed(self, names: tuple[str, ...]) -> list[str]:
        """Which of ``names`` differ from a default Spec (to refuse what a starting point cannot use)."""
        default = Spec()
        return [n for n in names if getattr(self, n) != getattr(default, n)]


FIELDS = frozenset(f.name for f in fields(Spec))
BASES = ("float32", "float16", "int8")
TORCH_ONLY = ("input_names", "dynamic_axes", "output_names", "opset", "lora", "lora_from", "tokenizer",
              "memory_budget")  # fmt: skip
"""Fields that shape a PyTorch model's export and mean nothing to an existing .onnx file."""
