"""The manifest's schema, checked on load before ONNX Runtime sees a file.

Pure functions over the parsed JSON: each problem names where it is (``trainable[3].offset``),
what was expected and what was found.
"""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import ManifestError

__all__ = ["validate_manifest", "REQUIRED_FILES", "DTYPES"]

REQUIRED_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")
"""The files every runtime opens: the file table must cover them (and hash them)."""
DTYPES = ("float32", "float64", "float16", "int64", "int32", "bool")
LOSSES = ("cross_entropy", "mse", "l1", "bce_with_logits", "model", "custom")
OPTIMIZERS = ("adamw", "sgd")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE = re.compile(r"[A-Za-z0-9_.-]+")


def _fail(where: str, expected: str, found: Any) -> None:
    raise ManifestError(
        f"manifest.json: {where} must be {expected}, found {found!r:.80}. Regenerate the artifacts (odt generate)."
    )


def _name(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        _fail(where, "a non-empty string", value)
    return value


def _int(where: str, value: Any, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        _fail(where, f"an integer >= {low}", value)
    return value


def _list(where: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        _fail(where, "a list", value)
    return value


def _tensors(where: str, value: Any, *, batch_first: bool) -> None:
    seen = set()
    for i, spec in enumerate(_list(where, value)):
        at = f"{where}[{i}]"
        if not isinstance(spec, dict):
            _fail(at, "an object", spec)
        name = _name(f"{at}.name", spec.get("name"))
        if name in seen:
            _fail(f"{at}.name", "unique", name)
        seen.add(name)
        if spec.get("dtype") not in DTYPES:
            _fail(f"{at}.dtype", f"one of {list(DTYPES)}", spec.get("dtype"))
        shape = _list(f"{at}.shape", spec.get("shape"))
        if batch_first and (not shape or shape[0] != "batch"):
            _fail(f"{at}.shape", 'a list starting with "batch"', shape)
        for d, dim in enumerate(shape):
            if isinstance(dim, str):
                if not dim.isidentifier() and dim != "?":
                    _fail(f"{at}.shape[{d}]", "a size or an axis name", dim)
            else:
                _int(f"{at}.shape[{d}]", dim, low=0 if not batch_first else 1)


def _params(where: str, value: Any, *, offsets: bool) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    expected_offset = 0
    for i, spec in enumerate(_list(where, value)):
        at = f"{where}[{i}]"
        if not isinstance(spec, dict):
            _fail(at, "an object", spec)
        name = _name(f"{at}.name", spec.get("name"))
        if name in shapes:
            _fail(f"{at}.name", "unique", name)
        shape = tuple(_int(f"{at}.shape[{d}]", n, low=1) for d, n in enumerate(_list(f"{at}.shape", spec.get("shape"))))
        shapes[name] = shape
        if offsets:
            offset = _int(f"{at}.offset", spec.get("offset"))
            if offset != expected_offset:
                _fail(f"{at}.offset", f"{expected_offset} (the parameters tile one buffer in order)", offset)
            expected_offset += math.prod(shape)
    return shapes


def validate_manifest(data: dict[str, Any]) -> None:
    """Raise ManifestError for the first thing in ``data`` that breaks the schema."""
    _name("name", data.get("name"))
    files = data.get("files")
    if not isinstance(files, dict):
        _fail("files", "an object of file name -> sha256", files)
    for name, digest in files.items():
        if not _FILE.fullmatch(name) or name in (".", ".."):
            _fail(f"files[{name!r}]", "a plain file name inside the artifact directory", name)
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            _fail(f"files[{name!r}]", "a sha256 (64 hex digits)", digest)
    missing = [f for f in REQUIRED_FILES if f not in files]
    if missing:
        _fail("files", f"a table that hashes every file the runtime opens (missing {missing})", sorted(files))
    _tensors("inputs", data.get("inputs"), batch_first=True)
    if not data["inputs"]:
        _fail("inputs", "at least one input", [])
    _tensors("targets", data.get("targets"), batch_first=True)
    _tensors("outputs", data.get("outputs"), batch_first=False)
    _name("loss_output", data.get("loss_output"))
    if data.get("loss_input") is not None:
        _name("loss_input", data.get("loss_input"))
    trainable = _params("trainable", data.get("trainable"), offsets=True)
    if not trainable:
        _fail("trainable", "at least one trainable parameter", [])
    frozen = _params("frozen", data.get("frozen"), offsets=False)
    for i, buffer in enumerate(_list("buffers", data.get("buffers"))):
        if not isinstance(buffer, dict) or buffer.get("name") not in frozen:
            _fail(f"buffers[{i}].name", "a frozen parameter", buffer)
        _name(f"buffers[{i}].output", buffer.get("output"))
    loss, optimizer = data.get("loss"), data.get("optimizer")
    if not isinstance(loss, dict) or loss.get("kind") not in LOSSES:
        _fail("loss.kind", f"one of {list(LOSSES)}", loss)
    if not isinstance(loss.get("options", {}), dict):
        _fail("loss.options", "an object", loss.get("options"))
    if not isinstance(optimizer, dict) or optimizer.get("kind") not in OPTIMIZERS:
        _fail("optimizer.kind", f"one of {list(OPTIMIZERS)}", optimizer)
    lr = optimizer.get("lr")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not (lr > 0 and math.isfinite(lr)):
        _fail("optimizer.lr", "a positive finite number", lr)
    if not isinstance(optimizer.get("options", {}), dict):
        _fail("optimizer.options", "an object", optimizer.get("options"))
    if not isinstance(data.get("versions"), dict):
        _fail("versions", "an object", data.get("versions"))
    padding = data.get("padding", {})
    if not isinstance(padding, dict):
        _fail("padding", "an object of weight -> padding row", padding)
    for name, row in padding.items():
        if name not in trainable:
            _fail(f"padding[{name!r}]", "a trainable embedding weight", name)
        if _int(f"padding[{name!r}]", row) >= trainable[name][0]:
            _fail(f"padding[{name!r}]", f"a row below {trainable[name][0]}", row)
    if data.get("finite_check") is not None:
        _name("finite_check", data["finite_check"])
    _adapters(data.get("adapters", []), trainable, frozen)
    labels = _list("labels", data.get("labels", []))
    for i, label in enumerate(labels):
        _name(f"labels[{i}]", label)
    if len(set(labels)) != len(labels):
        _fail("labels", "distinct class names", labels)
    _tokenizer(data.get("tokenizer"), files, data["inputs"])
    limits = data.get("index_limits", {})
    inputs = {spec["name"]: spec["dtype"] for spec in data["inputs"]}
    if not isinstance(limits, dict):
        _fail("index_limits", "an object of input -> table rows", limits)
    for name, rows in limits.items():
        if not inputs.get(name, "").startswith("int"):
            _fail(f"index_limits[{name!r}]", "an integer input", name)
        _int(f"index_limits[{name!r}]", rows, low=1)
    hf = data.get("hf_config")
    if hf is not None and not (
        isinstance(hf, dict) and isinstance(hf.get("prefix"), str) and isinstance(hf.get("config"), dict)
        and isinstance(hf["config"].get("model_type"), str)
    ):  # fmt: skip
        _fail("hf_config", 'null or {"config": a transformers config with model_type, "prefix": a string}', hf)
    _frozen_file(data.get("frozen_file"), files, frozen)
    if data.get("plan") is not None and not isinstance(data["plan"], dict):
        _fail("plan", "an object", data["plan"])


def _adapters(value: Any, trainable: dict[str, tuple[int, ...]], frozen: dict[str, tuple[int, ...]]) -> None:
    shapes = {**frozen, **trainable}
    for i, adapter in enumerate(_list("adapters", value)):
        at = f"adapters[{i}]"
        if not isinstance(adapter, dict):
            _fail(at, "an object", adapter)
        names = [_name(f"{at}.{key}", adapter.get(key)) for key in ("weight", "a", "b")]
        missing = [n for n in names if n not in shapes]
        if missing:
            _fail(at, "names of parameters in trainable or frozen", missing)
        (out, inp), a, b = shapes[names[0]], shapes[names[1]], shapes[names[2]]
        if len(a) != 2 or len(b) != 2 or a[1] != inp or b[0] != out or a[0] != b[1]:
            _fail(at, f"A (rank x {inp}) and B ({out} x rank) for a {out} x {inp} weight", (a, b))
        scale = adapter.get("scale")
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
            _fail(f"{at}.scale", "a finite number", scale)


def _frozen_file(value: Any, files: dict[str, Any], frozen: dict[str, tuple[int, ...]]) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or value.get("file") not in files:
        _fail("frozen_file.file", "a file listed in files", value)
    offsets = value.get("offsets")
    if not isinstance(offsets, dict) or not offsets:
        _fail("frozen_file.offsets", "an object of frozen parameter -> offset", offsets)
    expected = 0
    for name, offset in offsets.items():
        if name not in frozen:
            _fail(f"frozen_file.offsets[{name!r}]", "a frozen parameter", name)
        if _int(f"frozen_file.offsets[{name!r}]", offset) != expected:
            _fail(f"frozen_file.offsets[{name!r}]", f"{expected} (the tensors tile the file in order)", offset)
        expected += math.prod(frozen[name])


def _tokenizer(value: Any, files: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        _fail("tokenizer", "an object", value)
    if value.get("file") not in files:
        _fail("tokenizer.file", "a file listed in files", value.get("file"))
    names = {spec["name"] for spec in inputs}
    if value.get("ids") not in names:
        _fail("tokenizer.ids", f"one of the inputs {sorted(names)}", value.get("ids"))
    if value.get("mask") is not None and value.get("mask") not in names:
        _fail("tokenizer.mask", f"one of the inputs {sorted(names)} or null", value.get("mask"))
    _int("tokenizer.max_length", value.get("max_length"), low=1)
