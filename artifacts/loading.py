"""Load the user's model (factory + optional weights) and parse example input specs."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

from ondevice.manifest import BATCH, TensorSpec

from .errors import InputSpecError, ModelLoadError

__all__ = ["load_factory", "load_weights", "parse_input", "dynamic_axes_of"]

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


def load_factory(spec: str) -> nn.Module:
    """Call ``FILE.py:FACTORY`` or ``package.module:FACTORY`` and return the model it builds."""
    if ":" not in spec:
        raise ModelLoadError(f"--model must be FILE.py:FACTORY or package.module:FACTORY, got {spec!r}.")
    where, _, attr = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ModelLoadError(f"model file {path} does not exist.")
        name = f"_odt_model_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except SystemExit as exc:
            code = exc.code
            raise ModelLoadError(f"importing {path} called sys.exit({code!r}); a model file must not exit.") from None
        except Exception as exc:
            raise ModelLoadError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise ModelLoadError(f"cannot import module {where!r}: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attr, None)
    if factory is None:
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:10]
        raise ModelLoadError(f"{where} has no {attr!r}. It defines: {', '.join(public)}.")
    if not callable(factory):
        raise ModelLoadError(f"{where}:{attr} is a {type(factory).__name__}, not a callable that builds a model.")
    try:
        model = factory()
    except SystemExit as exc:
        raise ModelLoadError(f"{where}:{attr}() called sys.exit({exc.code!r}) instead of returning a model.") from None
    except Exception as exc:
        raise ModelLoadError(f"{where}:{attr}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"{where}:{attr}() returned a {type(model).__name__}, expected a torch.nn.Module.")
    return model


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load a ``state_dict`` file into ``model``; every missing, extra or misshapen key is an error."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"weights file {path} does not exist.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelLoadError(f"weights file {path} is not a torch state_dict: {exc}") from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ModelLoadError(f"weights file {path} holds a {type(state).__name__}, expected a state_dict.")
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    shapes = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing {missing[:5]}")
    if extra:
        problems.append(f"unexpected {extra[:5]}")
    if shapes:
        problems.append(f"wrong shape {shapes[:5]}")
    if problems:
        raise ModelLoadError(f"weights file {path} does not fit the model: {'; '.join(problems)}.")
    model.load_state_dict(state)


def parse_input(spec: str) -> tuple[TensorSpec, tuple[int, ...]]:
    """Parse ``NAME:SHAPE:DTYPE``, e.g. ``input:32x64:float32`` or ``ids:32xseq=20:int64``.

    A dimension is a size, or ``AXIS=SIZE`` for a named dynamic axis with that example size.
    The first dimension is the batch and always dynamic (named ``batch``). Returns the manifest
    spec (dynamic dimensions by name) and the example shape.
    """
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0]:
        raise InputSpecError(
            f"--input must look like NAME:SHAPE:DTYPE (e.g. input:32x64:float32 or ids:32xseq=20:int64), got {spec!r}."
        )
    name, shape_text, dtype = parts
    dims: list[int | str] = []
    shape: list[int] = []
    for text in shape_text.lower().split("x"):
        axis, _, size = text.rpartition("=")
        try:
            shape.append(int(size))
        except ValueError:
            raise InputSpecError(
                f"--input {spec!r}: each dimension is a size or AXIS=SIZE joined by 'x' (e.g. 32x64, 32xseq=20)."
            ) from None
        if axis and not axis.isidentifier():
            raise InputSpecError(f"--input {spec!r}: axis name {axis!r} must be a plain identifier such as seq.")
        dims.append(axis or shape[-1])
    if any(d < 1 for d in shape):
        raise InputSpecError(f"--input {spec!r}: every dimension must be >= 1, the first is the batch.")
    if BATCH in dims[1:]:
        raise InputSpecError(f"--input {spec!r}: {BATCH!r} names the first dimension only; name this axis otherwise.")
    if dtype not in DTYPES:
        raise InputSpecError(f"--input {spec!r}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
    return TensorSpec(name, dtype, (BATCH, *dims[1:])), tuple(shape)


def dynamic_axes_of(specs: list[TensorSpec]) -> dict[str, dict[int, str]]:
    """``{input: {axis: name}}`` of the named dynamic axes beyond the batch."""
    axes = {s.name: {i: d for i, d in enumerate(s.shape) if i and isinstance(d, str)} for s in specs}
    return {name: found for name, found in axes.items() if found}
