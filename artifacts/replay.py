"""PyTorch's dropout with ONNX Runtime's masks: the reference side of verification with dropout on.

While :func:`replayed_dropout` is active, every dropout PyTorch applies in training takes the
next mask ORT's Dropout nodes drew, in the order the exporter wrote the nodes (the order the
forward ran them): ``F.dropout`` (``nn.Dropout`` and every functional call, Hugging Face's
attention rates included) and the dropout inside ``F.scaled_dot_product_attention``, which runs
as the exporter writes it (scaled query and key, softmax, Dropout, the product with the values).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .errors import VerificationError

__all__ = ["Replay", "replayed_dropout", "piecewise_inputs"]


class Replay:
    """Hands out ORT's masks to PyTorch's dropout calls, one per call, in order."""

    def __init__(self, masks: Sequence[np.ndarray] | None, names: Sequence[str]) -> None:
        self.off = masks is None
        self.masks = list(masks or ())
        self.names = list(names)
        self.used = 0

    def dropout(
        self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if not training or self.off:
            return input
        if p == 0:  # the exporter writes a Dropout node for some calls of rate 0 and not for others (nn.Dropout(0))
            if not self._next_is_identity(input):
                return input  # no node: leave the next mask to the dropout it belongs to
        return input * self._next(input, p)

    def _next_is_identity(self, input: torch.Tensor) -> bool:
        """Whether the next mask is a rate-0 node's (input's shape, every value kept): a mask of a real rate keeps
        them all with odds of (1 - p) ** size, nil for any tensor dropout is used on."""
        if self.used == len(self.masks):
            return False
        mask = self.masks[self.used]
        return tuple(mask.shape) == tuple(input.shape) and bool(mask.all())

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if not dropout_p or self.off:
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)  # fmt: skip
        if enable_gqa:
            repeat = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
        root = math.sqrt(1.0 / math.sqrt(query.size(-1)) if scale is None else scale)
        scores = (query * root) @ (key.transpose(-2, -1) * root)
        if is_causal:
            causal = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, -math.inf)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            weights = torch.softmax(scores.masked_fill(~attn_mask, -math.inf), -1)
            weights = torch.where(torch.isnan(weights), torch.zeros_like(weights), weights)
        else:
            weights = torch.softmax(scores if attn_mask is None else scores + attn_mask, -1)
        return (weights * self._next(weights, dropout_p)) @ value

    def _next(self, input: torch.Tensor, p: float) -> torch.Tensor:
        if self.used == len(self.masks):
            raise VerificationError(
                f"PyTorch's forward applies more dropouts than the training graph has Dropout nodes "
                f"({len(self.masks)}): a dropout the exporter did not write (a Dropout2d/AlphaDropout variant, "
                "or dropout in code that tracing does not see)."
            )
        mask, name = self.masks[self.used], self.names[self.used]
        self.used += 1
        if tuple(mask.shape) != tuple(input.shape):
            raise VerificationError(
                f"dropout {self.used} of PyTorch's forward has shape {tuple(input.shape)}, but the training graph's "
                f"Dropout {name!r} drew a mask of shape {tuple(mask.shape)}: the graph's Dropout nodes are not in "
                "the order PyTorch runs them."
            )
        # ORT's kernel: Y = X * mask * (1 / (1 - ratio)), the scale in float32.
        scale = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
        return torch.from_numpy(mask).to(input.dtype) * float(scale)


_SDPA = F.scaled_dot_product_attention


@contextmanager
def replayed_dropout(masks: Sequence[np.ndarray] | None, names: Sequence[str]) -> Iterator[Replay]:
    """Patch PyTorch's dropout to replay ``masks`` (one per Dropout node, in graph order), or with
    ``None`` to switch every dropout off (as the graph's twin with Dropout ratios 0 computes).

    Raises :class:`VerificationError` when the forward applied fewer dropouts than there are masks.
    """
    replay = Replay(masks, names)
    saved = F.dropout, F.scaled_dot_product_attention
    F.dropout, F.scaled_dot_product_attention = replay.dropout, replay.attention
    try:
        yield replay
    finally:
        F.dropout, F.scaled_dot_product_attention = saved
    if not replay.off and replay.used != len(replay.masks):
        raise VerificationError(
            f"the training graph has {len(replay.masks)} Dropout nodes but PyTorch's forward applied "
            f"{replay.used} dropouts; the first one it did not reach is {replay.names[replay.used]!r}."
        )


_PIECEWISE = ("relu", "leaky_relu", "hardtanh", "hardswish", "hardsigmoid")
"""PyTorch's piecewise activations (``nn.ReLU``, ``ReLU6``, ``Hardswish``... call these; ``torch.relu``
is recorded too), whose inputs verification compares with ORT's at a kink."""


@contextmanager
def piecewise_inputs() -> Iterator[list[np.ndarray]]:
    """Record the input of every piecewise activation PyTorch's forward runs (a copy, before an
    in-place one changes it)."""
    seen: list[np.ndarray] = []
    saved = {name: getattr(F, name) for name in _PIECEWISE}

    def recording(function):  # type: ignore[no-untyped-def]
        def record(input: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(input.detach().numpy().copy())
            return function(input, *args, **kwargs)

        return record

    relu = torch.relu
    for name, function in saved.items():
        setattr(F, name, recording(function))
    torch.relu = recording(relu)  # type: ignore[assignment]
    try:
        yield seen
    finally:
        for name, function in saved.items():
            setattr(F, name, function)
        torch.relu = relu  # type: ignore[assignment]
