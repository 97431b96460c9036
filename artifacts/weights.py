"""Device-trained weights back into the PyTorch model the artifacts were generated from."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .errors import ModelLoadError

__all__ = ["load_into"]


def load_into(
    model: nn.Module,
    source: str | os.PathLike[str],
    *,
    artifacts: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Load trained weights into ``model``; returns the ``state_dict`` keys the source did not hold.

    ``source`` is a ``.safetensors`` file from ``odt export``, or a checkpoint (``latest.ckpt``)
    of the artifact directory ``artifacts`` (LoRA adapters folded in). Every tensor must match a
    key and shape of ``model``; keys the graph never read (an unused pooler) are returned and
    keep their values.

    Examples
    --------
    >>> model = build()  # the model given to generate()  # doctest: +SKIP
    >>> load_into(model, "ckpt/latest.ckpt", artifacts="out/mlp")  # doctest: +SKIP
    []
    """
    source = Path(source)
    if not source.is_file():
        raise ModelLoadError(f"weights {source} do not exist.")
    if source.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            tensors = load_file(source)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"{source} is not a readable .safetensors file ({exc}).") from None
    else:
        if artifacts is None:
            raise ModelLoadError(f"{source} is a checkpoint: give artifacts=DIR, the artifact directory it belongs to.")
        from ondevice import Trainer
        from ondevice.formats import model_weights

        weights = model_weights(Trainer.load(artifacts, checkpoint=source, evaluation=False))
        tensors = {name: torch.from_numpy(value) for name, value in weights.items()}
    state = model.state_dict()
    unknown = sorted(set(tensors) - set(state))
    wrong = [f"{n}: {tuple(t.shape)} here, {tuple(state[n].shape)} in the model" for n, t in tensors.items()
             if n in state and tuple(t.shape) != tuple(state[n].shape)]  # fmt: skip
    if unknown or wrong:
        raise ModelLoadError(
            f"{source} does not fit this model: {len(unknown)} unknown keys {unknown[:5]}, wrong shapes {wrong[:5]}. "
            "Load it into the model the artifacts were generated from."
        )
    model.load_state_dict(tensors, strict=False)
    return sorted(set(state) - set(tensors))
