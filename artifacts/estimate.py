"""The memory planner's estimate of a training step's peak RSS, before anything is built.

peak = BASE_BYTES                           Python, numpy, ONNX Runtime, a session's fixed cost
     + 4 bytes x frozen weights read whole   (frozen embedding tables are paged in by the row: ~0;
                                             1 or 2 bytes for the matrices of an int8 or float16 base)
     + 16 bytes x trainable weights           weight, gradient, AdamW's two moments
     + 4 bytes x trainable embedding tables   the dense gradient of a lookup
     + the larger of ACTIVATION_FACTOR x what PyTorch saves for the candidate's backward
                 and FORWARD_FACTOR x what it saves when every weight trains (the whole forward)

With layers recomputed (``Spec.recompute``) what a repeated layer saves counts once, for the layer
that saves the most, and every layer's input is kept instead.

The saved tensors are counted, not guessed: one forward of the model in PyTorch (the candidate's
trainable set and LoRA adapters, then every weight trainable) under ``saved_tensors_hooks``, at 1
and 2 rows, gives a line in the micro-batch. ORT's step holds more than PyTorch saves (the
activation gradients of the backward, its arena's chunks); and when only the top layers train it
still holds a share of the whole forward's activations (measured on MiniLM: about 10 MB a row
with the last 8 modules training, where PyTorch saves 1.8 MB a row for them). The constants were
chosen against ``ondevice.measure`` on MiniLM and the benchmark models (``python -m
benchmarks.planner``, docs/performance.md): within 25 % of the measured peaks on all 18 rows
(largest 15 %). FORWARD_FACTOR comes from MiniLM's three partly trained rows, the only ones it
changes; before it, the last 8 modules at 8 rows were estimated 21-26 % low.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from .lora import Lora, add_adapters
from .narrow_base import NARROW
from .passes.recompute import LAYER_NAME
from .selection import select_trainable

__all__ = ["BASE_BYTES", "ACTIVATION_FACTOR", "FORWARD_FACTOR", "Footprint", "footprint"]

BASE_BYTES = 70_000_000
ACTIVATION_FACTOR = 1.5
FORWARD_FACTOR = 0.7


@dataclass(frozen=True)
class Footprint:
    """One candidate's estimate as a function of the micro-batch size: saved bytes are lines
    ``constant + per_row x rows``, the candidate's own and (``forward_*``) the whole forward's."""

    fixed: int
    per_row: float
    constant_saved: float
    forward_per_row: float = 0.0
    forward_constant: float = 0.0
    frozen: int = 0
    """the frozen weights' bytes within ``fixed``: streamed (``ondevice.frozen``), a step holds few of them"""

    def at(self, rows: int) -> int:
        own = ACTIVATION_FACTOR * (max(self.constant_saved, 0.0) + self.per_row * rows)
        forward = FORWARD_FACTOR * (max(self.forward_constant, 0.0) + self.forward_per_row * rows)
        return self.fixed + int(max(own, forward))


def footprint(
    model: nn.Module,
    example: Mapping[str, torch.Tensor],
    options: Mapping[str, Any],
    base: str = "float32",
    recompute: bool = False,
) -> Footprint:
    """The estimate of training ``model`` with ``options`` (generate's trainable-set options:
    ``lora`` + ``trainable``, ``train_last``, ``bias_only``; none: everything trains); ``base``: how the
    frozen matrices are stored (``--base``: int8 1 byte a value, float16 2); ``recompute``: repeated layers
    are recomputed."""
    lora: Lora | None = options.get("lora")
    adapted = add_adapters(model, lora, seed=0)[0] if lora is not None else copy.deepcopy(model)
    names = [n for n, _ in adapted.named_parameters()]
    reachable = reachable_parameters(adapted, example)  # the generator freezes the others
    if lora is not None:
        patterns = [*options.get("trainable", ()), *(n for n in names if n.endswith(("lora_A", "lora_B")))]
        trainable = set(select_trainable(names, trainable=patterns)) & reachable
    else:
        trainable = set(select_trainable(names, trainable=options.get("trainable", ()),
                                         train_last=options.get("train_last"), bias_only=bool(options.get("bias_only")),
                                         reachable=reachable)) & reachable  # fmt: skip
    tables = {f"{m}.weight".lstrip(".") for m, module in adapted.named_modules() if isinstance(module, nn.Embedding)}
    params = dict(adapted.named_parameters())
    frozen = {n: p for n, p in params.items() if n not in trainable and n not in tables}
    narrow = NARROW[base].itemsize if base in NARROW else 4
    frozen_bytes = sum((narrow if p.dim() == 2 else 4) * p.numel() for p in frozen.values())
    trained = sum(params[n].numel() for n in trainable)
    looked_up = sum(params[n].numel() for n in tables & trainable)
    fixed = BASE_BYTES + frozen_bytes + 16 * trained + 4 * looked_up
    one, two = (_saved_bytes(adapted, example, trainable, rows, recompute) for rows in (1, 2))
    whole_one, whole_two = (_saved_bytes(adapted, example, set(names), rows, recompute) for rows in (1, 2))
    return Footprint(fixed, two - one, 2 * one - two, whole_two - whole_one, 2 * whole_one - whole_two, frozen_bytes)


def reachable_parameters(model: nn.Module, example: Mapping[str, torch.Tensor]) -> set[str]:
    """Names of the parameters the outputs depend on (one row of the example through autograd):
    a BERT pooler under mean pooling is not among them."""
    params = dict(model.named_parameters())
    saved = {n: p.requires_grad for n, p in params.items()}
    feeds = [t[:1] if t.dim() else t for t in example.values()]
    try:
        for p in params.values():
            p.requires_grad_(True)
        result = model(*feeds)
        outputs = [o for o in (result if isinstance(result, (tuple, list)) else [result])
                   if isinstance(o, torch.Tensor) and o.requires_grad]  # fmt: skip
        if not outputs:
            return set(params)
        grads = torch.autograd.grad(sum(o.float().sum() for o in outputs), list(params.values()), allow_unused=True)
        return {n for n, g in zip(params, grads) if g is not None}
    finally:
        for n, p in params.items():
            p.requires_grad_(saved[n])


def _saved_bytes(
    model: nn.Module, example: Mapping[str, torch.Tensor], trainable: set[str], rows: int, recompute: bool = False
) -> int:
    """Bytes PyTorch keeps for the backward of one forward over ``rows`` example rows (weights excluded);
    with ``recompute``, one repeated layer's share (the largest) and every such layer's input."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trainable)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, tuple[int, str]] = {}  # storage -> (bytes, the repeated layer that saved it, or "")
    held: list[torch.UntypedStorage] = []
    inputs: dict[str, int] = {}  # repeated layer -> the bytes of its input
    inside: list[str] = []

    def pack(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            known = storages.get(storage.data_ptr(), (0, ""))
            storages[storage.data_ptr()] = (max(known[0], storage.nbytes()), known[1] or "".join(inside[:1]))
            held.append(storage)  # alive until the count is done, as for a backward: no address is reused
        # The graph keeps nothing: a saved output packed as itself holds its own grad_fn, a cycle through C++
        # that Python's collector cannot see, and it kept the model's copy alive (600 MB per SmolLM2 candidate).

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("the memory estimate's forward is only counted: nothing runs its backward")

    hooks = []
    if recompute:
        for path, module in _repeated_layers(model):
            def enter(module: nn.Module, args: Any, path: str = path) -> None:
                inside.append(path)
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                inputs[path] = 0 if first is None else first.untyped_storage().nbytes()

            def leave(*_: Any) -> None:  # returns nothing: a forward hook's result would replace the output
                inside.pop()

            hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    feeds = [t[torch.arange(rows) % t.shape[0]] if t.dim() else t for t in example.values()]
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            model(*feeds)  # only the count is wanted: nothing runs backward
    finally:
        for hook in hooks:
            hook.remove()
    per_layer: dict[str, int] = {}
    for size, layer in storages.values():
        per_layer[layer] = per_layer.get(layer, 0) + size
    outside = per_layer.pop("", 0)
    return outside + max(per_layer.values(), default=0) + sum(inputs.values())


_LAYER = re.compile(LAYER_NAME)


def _repeated_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose path ends in ``name.N`` (``model.layers.3``): what the recompute
    pass (:mod:`artifacts.passes.recompute`) finds in the exported node names."""
    found: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        if _LAYER.fullmatch(".".join(path.split(".")[-2:])) and not any(path.startswith(f + ".") for f, _ in found):
            found.append((path, module))
    return found
