"""Optimizers ORT training can run, their ORT blocks, and PyTorch references with ORT's semantics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .errors import OptionError

__all__ = ["AdamW", "SGD", "optimizer_from_name", "ReferenceOptimizer"]


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0 and value < float("inf")):
        raise OptionError(f"{name} must be a positive finite number, got {value!r}.")


@dataclass(frozen=True)
class AdamW:
    """AdamW as ORT's AdamWOptimizer runs it (adam_mode=1, the Hugging Face form).

    The bias correction is folded into the learning rate and weight decay is applied after the
    Adam update: ``w -= lr_t * m / (sqrt(v) + eps); w -= lr * weight_decay * w`` with
    ``lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)``. ``max_grad_norm`` clips the global L2
    norm of all gradients first, like ``torch.nn.utils.clip_grad_norm_``.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = None
    kind = "adamw"

    def __post_init__(self) -> None:
        _positive("adamw lr", self.lr)
        _positive("adamw eps", self.eps)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise OptionError(f"adamw betas must be two numbers in [0, 1), got {self.betas!r}.")
        if self.weight_decay < 0:
            raise OptionError(f"adamw weight_decay must be >= 0, got {self.weight_decay!r}.")
        if self.max_grad_norm is not None:
            _positive("adamw max_grad_norm", self.max_grad_norm)

    def options(self) -> dict[str, Any]:
        return {
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "max_grad_norm": self.max_grad_norm,
        }

    def block(self) -> Any:
        from onnxruntime.training.onnxblock import optim

        clip = None if self.max_grad_norm is None else optim.ClipGradNorm(self.max_grad_norm)
        return optim.AdamW(betas=tuple(self.betas), eps=self.eps, weight_decay=self.weight_decay, clip_grad=clip)


@dataclass(frozen=True)
class SGD:
    """Plain SGD, ``w -= lr * g`` (ORT has no momentum, dampening, nesterov or weight decay)."""

    lr: float = 1e-2
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    max_grad_norm: float | None = None
    kind = "sgd"

    def __post_init__(self) -> None:
        _positive("sgd lr", self.lr)
        unsupported = {
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "nesterov": self.nesterov,
        }
        given = [name for name, value in unsupported.items() if value]
        if given:
            raise OptionError(
                f"sgd: ONNX Runtime's SGD has no {', '.join(given)}; it only computes w -= lr * g. "
                "Use AdamW (which has weight_decay) or leave these at 0."
            )
        if self.max_grad_norm is not None:
            _positive("sgd max_grad_norm", self.max_grad_norm)

    def options(self) -> dict[str, Any]:
        return {"max_grad_norm": self.max_grad_norm}

    def block(self) -> Any:
        from onnxruntime.training.onnxblock import optim

        clip = None if self.max_grad_norm is None else optim.ClipGradNorm(self.max_grad_norm)
        return optim.SGD(clip_grad=clip)


def optimizer_from_name(name: str, **options: Any) -> AdamW | SGD:
    """Build an optimizer from its CLI name; options ORT cannot run raise OptionError."""
    kinds: dict[str, type[AdamW] | type[SGD]] = {cls.kind: cls for cls in (AdamW, SGD)}
    if name not in kinds:
        raise OptionError(f"unknown optimizer {name!r}; ONNX Runtime training offers {sorted(kinds)}.")
    try:
        return kinds[name](**options)
    except TypeError as exc:
        raise OptionError(f"optimizer {name!r} does not take these options {sorted(options)}: {exc}") from exc


class ReferenceOptimizer:
    """The torch twin of an ORT optimizer graph: same update, same float32 order of operations."""

    def __init__(self, spec: AdamW | SGD, params: Iterable[torch.Tensor]) -> None:
        self.spec = spec
        self.params = list(params)
        self.t = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self, lr: float | None = None) -> None:
        spec = self.spec
        lr = spec.lr if lr is None else lr
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, spec.max_grad_norm)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.t += 1
        if isinstance(spec, SGD):
            for p, g in zip(self.params, grads):
                p.sub_(lr * g)
            return
        b1, b2 = spec.betas
        # ORT folds the bias corrections into the rate, in float32.
        c1 = 1.0 - torch.tensor(b1, dtype=torch.float32) ** self.t
        c2 = 1.0 - torch.tensor(b2, dtype=torch.float32) ** self.t
        lr_t = torch.tensor(lr, dtype=torch.float32) * torch.sqrt(c2) / c1
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            m.mul_(b1).add_(g, alpha=1.0 - b1)
            v.mul_(b2).add_(g * g, alpha=1.0 - b2)
            p.sub_(lr_t * m / (v.sqrt() + spec.eps))
            p.sub_(lr * spec.weight_decay * p)
