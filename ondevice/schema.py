"""The manifest's schema, checked on load before ONNX Runtime sees a file.

``manifest.schema.json`` (shipped in this package, and in every bundle for the browser client)
is the one description of the manifest's shape; :func:`conforms` checks a value against it. What
JSON Schema cannot say (names that refer to each other, offsets that tile a buffer) is checked
beside it here. Each problem names where it is (``trainable[3].offset``), what was expected and
what was found.

Why a small interpreter instead of the ``jsonschema`` package: the device side installs numpy and
ONNX Runtime only, and ``jsonschema`` brings four packages, one of them compiled (rpds-py). The
keywords used here are few; a test checks that this interpreter and ``jsonschema`` agree on the
schema and on damaged manifests, and the browser client runs the same rules in JavaScript.
"""

from __future__ import annotations

import json
import math
import re
from importlib import resources
from typing import Any

from .errors import ManifestError

__all__ = [
    "validate_manifest",
    "conforms",
    "Problem",
    "SCHEMA",
    "SCHEMA_FILE",
    "DTYPES",
    "LOSSES",
    "OPTIMIZERS",
]

SCHEMA_FILE = "manifest.schema.json"
SCHEMA: dict[str, Any] = json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text())
_DEFS = SCHEMA["$defs"]
DTYPES = tuple(_DEFS["dtype"]["enum"])
LOSSES = tuple(_DEFS["loss_kind"]["enum"])
OPTIMIZERS = tuple(_DEFS["optimizer_kind"]["enum"])

_TYPES = {"object": "an object", "array": "a list", "string": "a string", "integer": "an integer",
          "number": "a number", "boolean": "true or false", "null": "null"}  # fmt: skip


class Problem(Exception):
    def __init__(self, where: str, expected: str, found: Any) -> None:
        super().__init__(where, expected, found)
        self.where, self.expected, self.found = where or "the document", expected, found


def conforms(value: Any, schema: dict[str, Any] | None = None) -> Problem | None:
    """The first place where ``value`` breaks ``schema`` (default: the manifest's), or None."""
    try:
        _check(value, SCHEMA if schema is None else schema, "")
    except Problem as problem:
        return problem
    return None


def _phrase(node: dict[str, Any]) -> str:
    """What a schema node expects, in words (its title, else from its keywords)."""
    if "title" in node:
        return node["title"]
    if "$ref" in node:
        return _phrase(_resolve(node["$ref"]))
    if "enum" in node:
        return f"one of {node['enum']}"
    if "const" in node:
        return json.dumps(node["const"])
    if "anyOf" in node:
        return " or ".join(_phrase(branch) for branch in node["anyOf"])
    words = _TYPES.get(node.get("type", ""), "a valid value")
    if "minimum" in node:
        words += f" >= {node['minimum']}"
    if "exclusiveMinimum" in node:
        words += f" > {node['exclusiveMinimum']}"
    return words


def _resolve(ref: str) -> dict[str, Any]:
    return _DEFS[ref.removeprefix("#/$defs/")]


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":  # JSON has no NaN or Infinity (Python's json reads them): neither is a number here
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}[kind])


def _admits(node: dict[str, Any], value: Any) -> bool:
    """Whether ``node`` is of ``value``'s JSON type (or says no type)."""
    node = _resolve(node["$ref"]) if "$ref" in node and "type" not in node else node
    return "type" not in node or _is(value, node["type"])


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _check(value: Any, node: dict[str, Any], where: str) -> None:
    def fail(expected: str | None = None) -> None:
        raise Problem(where, node.get("title") or expected or _phrase(node), value)

    if "$ref" in node:
        _check(value, _resolve(node["$ref"]), where)
    if "anyOf" in node and all(conforms(value, b) is not None for b in node["anyOf"]):
        typed = [b for b in node["anyOf"] if _admits(b, value)]
        if len(typed) == 1:  # null or an object, and it is an object: say what is wrong inside it
            _check(value, typed[0], where)
        fail()
    if "type" in node and not _is(value, node["type"]):
        fail()
    if "const" in node and (value != node["const"] or type(value) is not type(node["const"])):
        fail()
    if "enum" in node and value not in node["enum"]:
        fail()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < node.get("minimum", -math.inf) or value <= node.get("exclusiveMinimum", -math.inf):
            fail()
    if isinstance(value, str):
        if len(value) < node.get("minLength", 0) or ("pattern" in node and not re.search(node["pattern"], value)):
            fail()
    if isinstance(value, dict):
        _check_object(value, node, where, fail)
    if isinstance(value, list):
        if len(value) < node.get("minItems", 0):
            fail()
        if node.get("uniqueItems") and len({json.dumps(v, sort_keys=True) for v in value}) != len(value):
            fail()
        prefix = node.get("prefixItems", [])
        for i, item in enumerate(value):
            child = prefix[i] if i < len(prefix) else node.get("items")
            if child is not None:
                _check(item, child, f"{where}[{i}]")


def _check_object(value: dict[str, Any], node: dict[str, Any], where: str, fail: Any) -> None:
    properties = node.get("properties", {})
    for key in node.get("required", []):
        if key not in value:
            if key in properties:
                raise Problem(_join(where, key), _phrase(properties[key]), "nothing")
            fail(f"an object with {key!r}")
    if len(value) < node.get("minProperties", 0):
        fail()
    for key, item in value.items():
        if "propertyNames" in node:
            _check(key, node["propertyNames"], f"{where}[{key!r}]")
        if key in properties:
            _check(item, properties[key], _join(where, key))
        elif "additionalProperties" in node:
            _check(item, node["additionalProperties"], f"{where}[{key!r}]")


def _fail(where: str, expected: str, found: Any) -> None:
    raise ManifestError(
        f"manifest.json: {where} must be {expected}, found {found!r:.80}. Regenerate the artifacts (odt generate)."
    )


def validate_manifest(data: dict[str, Any]) -> None:
    """Raise ManifestError for the first thing in ``data`` that breaks the schema or its relations."""
    problem = conforms(data)
    if problem is not None:
        _fail(problem.where, problem.expected, problem.found)
    files, inputs = data["files"], data["inputs"]
    for where in ("inputs", "targets", "outputs"):
        _unique(where, data[where])
    trainable = _params("trainable", data["trainable"], offsets=True)
    frozen = _params("frozen", data["frozen"], offsets=False)
    for i, buffer in enumerate(data["buffers"]):
        if buffer["name"] not in frozen:
            _fail(f"buffers[{i}].name", "a frozen parameter", buffer["name"])
    for name, row in data.get("padding", {}).items():
        if name not in trainable:
            _fail(f"padding[{name!r}]", "a trainable embedding weight", name)
        if row >= trainable[name][0]:
            _fail(f"padding[{name!r}]", f"a row below {trainable[name][0]}", row)
    _adapters(data.get("adapters", []), trainable, frozen)
    _tokenizer(data.get("tokenizer"), files, inputs)
    dtypes = {spec["name"]: spec["dtype"] for spec in inputs}
    for name in data.get("index_limits", {}):
        if not dtypes.get(name, "").startswith("int"):
            _fail(f"index_limits[{name!r}]", "an integer input", name)
    _frozen_file(data.get("frozen_file"), files, frozen)
    for kind, name in data.get("variants", {}).items():
        if name not in files:
            _fail(f"variants[{kind!r}]", "a file listed in files", name)
    for kind, name in (data.get("portable") or {}).items():  # the schema allows graph files and "unsupported"
        if kind != "unsupported" and name not in files:
            _fail(f"portable.{kind}", "a file listed in files", name)
    classic = {"training_model.onnx", "optimizer_model.onnx"} <= set(files)
    if not classic and "training" not in (data.get("portable") or {}):
        _fail("files", "training_model.onnx and optimizer_model.onnx (the classic engine's graphs) or portable "
              "graphs (artifacts generated without the training build)", sorted(files))
    decoder = data.get("decoder")
    if decoder is not None and decoder["file"] not in files:
        _fail("decoder.file", "a file listed in files", decoder["file"])


def _unique(where: str, specs: list[dict[str, Any]]) -> None:
    seen = set()
    for i, spec in enumerate(specs):
        if spec["name"] in seen:
            _fail(f"{where}[{i}].name", "unique", spec["name"])
        seen.add(spec["name"])


def _params(where: str, specs: list[dict[str, Any]], *, offsets: bool) -> dict[str, tuple[int, ...]]:
    _unique(where, specs)
    shapes: dict[str, tuple[int, ...]] = {}
    expected_offset = 0
    for i, spec in enumerate(specs):
        shapes[spec["name"]] = shape = tuple(spec["shape"])
        if offsets:
            if spec["offset"] != expected_offset:
                _fail(f"{where}[{i}].offset", f"{expected_offset} (the parameters tile one buffer in order)",
                      spec["offset"])  # fmt: skip
            expected_offset += math.prod(shape)
    return shapes


def _adapters(value: Any, trainable: dict[str, tuple[int, ...]], frozen: dict[str, tuple[int, ...]]) -> None:
    shapes = {**frozen, **trainable}
    for i, adapter in enumerate(value):
        at = f"adapters[{i}]"
        names = [adapter[key] for key in ("weight", "a", "b")]
        missing = [n for n in names if n not in shapes]
        if missing:
            _fail(at, "names of parameters in trainable or frozen", missing)
        (out, inp), a, b = shapes[names[0]], shapes[names[1]], shapes[names[2]]
        if len(a) != 2 or len(b) != 2 or a[1] != inp or b[0] != out or a[0] != b[1]:
            _fail(at, f"A (rank x {inp}) and B ({out} x rank) for a {out} x {inp} weight", (a, b))


def _frozen_file(value: Any, files: dict[str, Any], frozen: dict[str, tuple[int, ...]]) -> None:
    if value is None:
        return
    if value["file"] not in files:
        _fail("frozen_file.file", "a file listed in files", value["file"])
    offsets, int8, half = value["offsets"], value.get("int8", {}), value.get("float16", [])
    if not set(int8) <= set(offsets):
        _fail("frozen_file.int8", "tensors in frozen_file.offsets", sorted(set(int8) - set(offsets)))
    if not isinstance(half, list) or not set(half) <= set(offsets) - set(int8):
        _fail("frozen_file.float16", "a list of tensors in frozen_file.offsets, none of them int8", half)
    expected = 0  # in 4-byte words: a float32 tensor, float16 or int8 rows padded to whole words (int8: then scales)
    for name, offset in offsets.items():
        if name not in frozen:
            _fail(f"frozen_file.offsets[{name!r}]", "a frozen parameter", name)
        if offset != expected:
            _fail(f"frozen_file.offsets[{name!r}]", f"{expected} (the tensors tile the file in order)", offset)
        expected += math.prod(frozen[name])
        if name in half:
            if len(frozen[name]) != 2:
                _fail(f"frozen_file.float16[{name!r}]", "a matrix (float16 rows)", frozen[name])
            expected = offset + -(-math.prod(frozen[name]) // 2)
        if name in int8:
            if len(frozen[name]) != 2:
                _fail(f"frozen_file.int8[{name!r}]", "a matrix (int8 rows)", frozen[name])
            expected = offset + -(-math.prod(frozen[name]) // 4)
            if int8[name] != expected:
                _fail(f"frozen_file.int8[{name!r}]", f"{expected} (the scales follow the rows)", int8[name])
            expected += frozen[name][0]
    lookups = value.get("lookups", [])
    if not isinstance(lookups, list) or not all(name in offsets for name in lookups):
        _fail("frozen_file.lookups", "a list of tensors in frozen_file.offsets", lookups)


def _tokenizer(value: Any, files: dict[str, Any], inputs: list[dict[str, Any]]) -> None:
    if value is None:
        return
    if value["file"] not in files:
        _fail("tokenizer.file", "a file listed in files", value.get("file"))
    names = {spec["name"] for spec in inputs}
    if value.get("ids") not in names:
        _fail("tokenizer.ids", f"one of the inputs {sorted(names)}", value.get("ids"))
    if value.get("mask") is not None and value.get("mask") not in names:
        _fail("tokenizer.mask", f"one of the inputs {sorted(names)} or null", value.get("mask"))
