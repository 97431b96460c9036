"""Losses the generator can attach, each with its ORT block and its PyTorch reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ondevice.manifest import TensorSpec

from .errors import OptionError

__all__ = ["Loss", "CrossEntropy", "MSE", "L1", "BCEWithLogits", "ModelLoss", "CustomLoss", "loss_from_name"]

_REDUCTIONS = ("mean", "sum")


class Loss:
    """Base of the losses: ``block()`` builds the ORT graph, ``reference()`` computes it in torch."""

    kind: str = ""
    target_name: str | None = "target"

    def options(self) -> dict[str, Any]:
        return {}

    def block(self) -> Any:
        raise NotImplementedError

    def target_spec(self, output: TensorSpec) -> TensorSpec | None:
        """The extra graph input the loss compares against (None when the model takes it)."""
        assert self.target_name is not None
        return TensorSpec(self.target_name, "float32", output.shape)

    def reference(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


def _check_reduction(kind: str, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise OptionError(
            f"{kind} loss: reduction must be one of {_REDUCTIONS} (training needs a scalar loss), got {reduction!r}."
        )


def _vector(name: str, values: Sequence[float] | None) -> np.ndarray | None:
    if values is None:
        return None
    array = np.asarray(values, dtype=np.float32)
    if array.ndim != 1 or array.size == 0 or not np.all(np.isfinite(array)):
        raise OptionError(f"{name} must be a non-empty list of finite numbers, got {values!r}.")
    return array


def _json(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else [float(v) for v in values]


class _Truthy(np.ndarray):
    # ORT 1.19's CrossEntropyLoss block tests `if self._weight:`, which raises for arrays with
    # more than one element; this view answers True so the class weights reach the graph.
    def __bool__(self) -> bool:
        return True


@dataclass(frozen=True)
class CrossEntropy(Loss):
    """Softmax cross-entropy over the last dimension; labels are int64 class indices."""

    reduction: str = "mean"
    weight: tuple[float, ...] | None = None
    ignore_index: int | None = None
    label_smoothing: float = 0.0
    kind = "cross_entropy"
    target_name = "labels"

    def __post_init__(self) -> None:
        _check_reduction(self.kind, self.reduction)
        _vector("cross_entropy weight", self.weight)
        if self.label_smoothing:
            raise OptionError(
                "cross_entropy: label_smoothing is not supported by ONNX Runtime's SoftmaxCrossEntropyLoss. "
                "Leave it at 0 or pass a CustomLoss."
            )

    def options(self) -> dict[str, Any]:
        return {"reduction": self.reduction, "weight": _json(self.weight), "ignore_index": self.ignore_index}

    def block(self) -> Any:
        from onnxruntime.training.onnxblock import loss

        weight = _vector("weight", self.weight)
        return loss.CrossEntropyLoss(
            weight=None if weight is None else weight.view(_Truthy),
            reduction=self.reduction,
            ignore_index=self.ignore_index,
        )

    def target_spec(self, output: TensorSpec) -> TensorSpec:
        classes = output.shape[-1] if output.shape else None
        if self.weight is not None and isinstance(classes, int) and len(self.weight) != classes:
            raise OptionError(
                f"cross_entropy: {len(self.weight)} class weights given, but the output {output.name!r} has "
                f"{classes} classes. Give one weight per class (--class-weights w0,w1,...)."
            )
        return TensorSpec(self.target_name, "int64", output.shape[:-1])

    def reference(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        assert target is not None
        weight = None if self.weight is None else torch.tensor(self.weight, dtype=output.dtype)
        flat = output.reshape(-1, output.shape[-1])
        return F.cross_entropy(
            flat,
            target.reshape(-1),
            weight=weight,
            reduction=self.reduction,
            ignore_index=-100 if self.ignore_index is None else self.ignore_index,
        )


@dataclass(frozen=True)
class MSE(Loss):
    reduction: str = "mean"
    kind = "mse"

    def __post_init__(self) -> None:
        _check_reduction(self.kind, self.reduction)

    def options(self) -> dict[str, Any]:
        return {"reduction": self.reduction}

    def block(self) -> Any:
        from onnxruntime.training.onnxblock import loss

        return loss.MSELoss(reduction=self.reduction)

    def reference(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        return F.mse_loss(output, target, reduction=self.reduction)


@dataclass(frozen=True)
class L1(Loss):
    reduction: str = "mean"
    kind = "l1"

    def __post_init__(self) -> None:
        _check_reduction(self.kind, self.reduction)

    def options(self) -> dict[str, Any]:
        return {"reduction": self.reduction}

    def block(self) -> Any:
        from onnxruntime.training.onnxblock import loss

        return loss.L1Loss(reduction=self.reduction)

    def reference(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        return F.l1_loss(output, target, reduction=self.reduction)


@dataclass(frozen=True)
class BCEWithLogits(Loss):
    """Binary cross-entropy on logits (multi-label); targets are float 0/1 of the output's shape."""

    reduction: str = "mean"
    weight: tuple[float, ...] | None = None
    pos_weight: tuple[float, ...] | None = None
    kind = "bce_with_logits"

    def __post_init__(self) -> None:
        _check_reduction(self.kind, self.reduction)
        _vector("bce_with_logits weight", self.weight)
        _vector("bce_with_logits pos_weight", self.pos_weight)

    def options(self) -> dict[str, Any]:
        return {"reduction": self.reduction, "weight": _json(self.weight), "pos_weight": _json(self.pos_weight)}

    def block(self) -> Any:
        from onnxruntime.training.onnxblock import loss

        return loss.BCEWithLogitsLoss(
            weight=_vector("weight", self.weight),
            reduction=self.reduction,
            pos_weight=_vector("pos_weight", self.pos_weight),
        )

    def reference(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        def opt(values: tuple[float, ...] | None) -> torch.Tensor | None:
            return None if values is None else torch.tensor(values, dtype=output.dtype)

        return F.binary_cross_entropy_with_logits(
            output, target, weight=opt(self.weight), pos_weight=opt(self.pos_weight), reduction=self.reduction
        )


@dataclass(frozen=True)
class ModelLoss(Loss):
    """The model computes its own loss: its loss output is used as is (targets are model inputs)."""

    kind = "model"
    target_name = None

    def block(self) -> Any:
        from onnxruntime.training.onnxblock import blocks

        return blocks.PassThrough()

    def target_spec(self, output: TensorSpec) -> None:
        return None

    def reference(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        return output


@dataclass(frozen=True)
class CustomLoss(Loss):
    """Any ORT ``onnxblock.Block`` loss, with the torch function verification compares it to.

    ``make_block`` returns a fresh block whose ``build(output_name, target_name)`` adds the loss;
    ``reference(output, target)`` computes the same loss in torch; ``target`` describes the target
    input (the block must create a graph input of that name when it does not exist).
    """

    make_block: Callable[[], Any] = field(compare=False, default=None)  # type: ignore[assignment]
    reference_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(compare=False, default=None)  # type: ignore[assignment]
    target: TensorSpec | None = None
    name: str = "custom"
    kind = "custom"

    def __post_init__(self) -> None:
        if not callable(self.make_block) or not callable(self.reference_fn):
            raise OptionError("CustomLoss needs make_block (returns an onnxblock.Block) and reference_fn (torch).")

    def options(self) -> dict[str, Any]:
        return {"name": self.name}

    def block(self) -> Any:
        return self.make_block()

    def target_spec(self, output: TensorSpec) -> TensorSpec | None:
        return self.target

    def reference(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        return self.reference_fn(output, target)


_BY_NAME: dict[str, type[Loss]] = {cls.kind: cls for cls in (CrossEntropy, MSE, L1, BCEWithLogits, ModelLoss)}
"""The losses a name selects (`odt generate --loss`); CustomLoss needs Python. The manifest schema lists the kinds."""


def loss_from_name(name: str, **options: Any) -> Loss:
    """Build a loss from its CLI name and options; unknown names and options raise OptionError."""
    if name not in _BY_NAME:
        raise OptionError(f"unknown loss {name!r}; choose one of {sorted(_BY_NAME)}.")
    try:
        return _BY_NAME[name](**options)
    except TypeError as exc:
        raise OptionError(f"loss {name!r} does not take these options {sorted(options)}: {exc}") from exc
