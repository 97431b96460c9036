"""The memory planner's estimate of a training step's peak RSS, before anything is built.

peak = BASE_BYTES                           Python, numpy, ONNX Runtime, a session's fixed cost
     + 4 bytes x frozen weights read whole   (frozen embedding tables are paged in by the row: ~0)
     + 16 bytes x trainable weights           weight, gradient, AdamW's two moments
     + 4 bytes x trainable embedding tables   the dense gradient of a lookup
     + ACTIVATION_FACTOR x what PyTorch saves for the backward at that micro-batch

The saved tensors are counted, not guessed: one forward of the candidate in PyTorch (its
trainable set, its LoRA adapters) under ``saved_tensors_hooks``, at 1 and 2 rows, gives a line
in the micro-batch. ORT's step holds more than PyTorch saves (the activation gradients of the
backward, its arena's chunks); the two constants were chosen against ``ondevice.measure`` on MiniLM
and the benchmark models (``python -m benchmarks.planner``, docs/performance.md): within 25 % of
the measured peaks on 17 of the 18 rows; the last 8 modules of MiniLM at 8 rows measured 26 %
above their estimate in this evening's three runs (21 % in one before).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from torch import nn

from .lora import Lora, add_adapters
from .selection import select_trainable

__all__ = ["BASE_BYTES", "ACTIVATION_FACTOR", "Footprint", "footprint"]

BASE_BYTES = 70_000_000
ACTIVATION_FACTOR = 1.5


class Footprint:
    """One candidate's estimate as a function of the micro-batch size."""

    def __init__(self, fixed: int, per_row: float, constant_saved: float) -> None:
        self.fixed, self.per_row, self.constant_saved = fixed, per_row, constant_saved

    @property
    def floor(self) -> int:
        """What no micro-batch size takes away (the estimate at zero rows)."""
        return self.fixed + int(ACTIVATION_FACTOR * max(self.constant_saved, 0.0))

    def at(self, rows: int) -> int:
        return self.floor + int(ACTIVATION_FACTOR * self.per_row * rows)


def footprint(model: nn.Module, example: Mapping[str, torch.Tensor], options: Mapping[str, Any]) -> Footprint:
    """The estimate of training ``model`` with ``options`` (generate's trainable-set options:
    ``lora`` + ``trainable``, ``train_last``, ``bias_only``; none: everything trains)."""
    lora: Lora | None = options.get("lora")
    adapted = add_adapters(model, lora, seed=0)[0] if lora is not None else copy.deepcopy(model)
    names = [n for n, _ in adapted.named_parameters()]
    if lora is not None:
        patterns = [*options.get("trainable", ()), *(n for n in names if n.endswith(("lora_A", "lora_B")))]
        trainable = set(select_trainable(names, trainable=patterns))
    else:
        trainable = set(select_trainable(names, trainable=options.get("trainable", ()),
                                         train_last=options.get("train_last"),
                                         bias_only=bool(options.get("bias_only"))))  # fmt: skip
    tables = {f"{m}.weight".lstrip(".") for m, module in adapted.named_modules() if isinstance(module, nn.Embedding)}
    params = dict(adapted.named_parameters())
    frozen = sum(p.numel() for n, p in params.items() if n not in trainable and n not in tables)
    trained = sum(params[n].numel() for n in trainable)
    looked_up = sum(params[n].numel() for n in tables & trainable)
    fixed = BASE_BYTES + 4 * frozen + 16 * trained + 4 * looked_up
    one, two = (_saved_bytes(adapted, example, trainable, rows) for rows in (1, 2))
    return Footprint(fixed, per_row=two - one, constant_saved=2 * one - two)


def _saved_bytes(model: nn.Module, example: Mapping[str, torch.Tensor], trainable: set[str], rows: int) -> int:
    """Bytes PyTorch keeps for the backward of one forward over ``rows`` example rows (weights excluded)."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trainable)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    feeds = [t[torch.arange(rows) % t.shape[0]] if t.dim() else t for t in example.values()]
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(*feeds)  # only the count is wanted: nothing runs backward
    return sum(storages.values())
