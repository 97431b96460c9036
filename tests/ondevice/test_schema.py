"""One manifest schema: a JSON Schema file is the source; the runtime's interpreter agrees with `jsonschema`."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from dataclasses import fields

import jsonschema
import pytest

from ondevice.errors import ManifestError
from ondevice.manifest import Manifest, TensorSpec
from ondevice.schema import DTYPES, LOSSES, OPTIMIZERS, SCHEMA, conforms

VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def test_the_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.fixture(scope="module")
def manifest(digits_artifacts) -> dict:
    return json.loads((digits_artifacts / "manifest.json").read_text())


def test_a_generated_manifest_is_valid(manifest):
    assert conforms(manifest) is None
    VALIDATOR.validate(manifest)


def test_the_dataclasses_write_what_the_schema_names(manifest):
    """Every field the Manifest dataclass writes is a property of the schema, and the reverse."""
    written = {f.name for f in fields(Manifest)} | {"contract_sha256"}
    assert written == set(SCHEMA["properties"])
    assert set(manifest) <= set(SCHEMA["properties"])


# Values of every JSON kind a hand edit or a corruption can leave behind.
REPLACEMENTS = [None, True, 0, -1, 1, 2.5, "", "x", "batch", "?", [], [0], ["batch"], {}, {"name": "x"}]


def _paths(value, path=()):
    """Every place in a JSON document (as key paths)."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value[:2]):
            yield from _paths(item, (*path, i))


def _damaged(manifest):
    skip = ("versions", "verification", "loss", "optimizer")  # free-form options; covered by kind/lr below
    for path in _paths(manifest):
        if not path or (path[0] in skip and path[-1] not in ("kind", "lr")):
            continue
        if path[:2] == ("plan", "rows") and len(path) > 3:  # a candidate's figures: free-form
            continue
        for value in REPLACEMENTS:
            data = copy.deepcopy(manifest)
            parent = data
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = value
            yield path, data
        data = copy.deepcopy(manifest)
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict):
            del parent[path[-1]]
            yield (*path, "deleted"), data


DECODER = {"file": "decoder.onnx", "layers": 2, "kv_heads": 2, "head_dim": 8, "eos": [2], "max_positions": 64,
           "attention": "sdpa-repeated-kv"}  # fmt: skip
"""A causal language model's cached decoder (absent from the digits manifest)."""

PLAN = {"budget": 200_000_000, "batch_size": 32, "chosen": "everything", "lean_memory": True, "stream_weights": False,
        "engine": None, "micro_batch_size": 8,
        "rows": [{"candidate": "everything", "trainable": 100, "peak_rss": 150_000_000, "fits": True}]}  # fmt: skip
"""A memory plan (absent from the digits manifest)."""


@pytest.mark.parametrize("extra", ["digits", "decoder", "plan"])
def test_the_interpreter_agrees_with_jsonschema_on_damaged_manifests(manifest, extra):
    """Hundreds of single edits: `conforms` and the reference validator accept and refuse the same ones."""
    if extra == "decoder":
        manifest = {**manifest, "files": {**manifest["files"], "decoder.onnx": "0" * 64}, "decoder": DECODER}
    if extra == "plan":
        manifest = {**manifest, "plan": PLAN}
    assert conforms(manifest) is None
    checked = refused = 0
    for path, data in _damaged(manifest):
        ours = conforms(data)
        theirs = VALIDATOR.is_valid(data)
        assert (ours is None) == theirs, (path, ours and (ours.where, ours.expected), list(VALIDATOR.iter_errors(data)))
        checked += 1
        refused += ours is not None
    assert checked > 500 and refused > checked // 2


def test_a_bundle_description_follows_the_same_schema(digits_artifacts, tmp_path):
    from mobile_bridge import make_bundle

    description = make_bundle(digits_artifacts, tmp_path / "bundle")
    schema = {"$ref": "#/$defs/bundle", "$defs": SCHEMA["$defs"]}
    assert conforms(description, schema) is None
    jsonschema.Draft202012Validator(schema).validate(description)
    assert json.loads((tmp_path / "bundle" / "manifest.schema.json").read_text()) == SCHEMA


def test_kinds_and_dtypes_are_listed_once():
    """The generator's losses and optimizers, and the runtime's dtypes, are the schema's lists."""
    from artifacts import CustomLoss, losses, optimizers
    from artifacts.cli import register

    assert [*losses._BY_NAME, CustomLoss.kind] == list(LOSSES)
    assert [optimizers.AdamW.kind, optimizers.SGD.kind] == list(OPTIMIZERS)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    generate = parser._subparsers._group_actions[0].choices["generate"]
    choices = {a.dest: a.choices for a in generate._actions if a.choices}
    assert choices["loss"] == list(losses._BY_NAME) and list(choices["optimizer"]) == list(OPTIMIZERS)
    for dtype in DTYPES:
        TensorSpec("x", dtype, ("batch",))


@pytest.mark.parametrize(
    ("edit", "where", "expected"),
    [
        (lambda d: d["inputs"][0].update(dtype="float99"), "inputs[0].dtype", "one of ['float32'"),
        (lambda d: d.update(trainable=None), "trainable", "a list of at least one trainable parameter"),
        (lambda d: d["trainable"][0].pop("offset"), "trainable[0].offset", "an integer >= 0"),
        (lambda d: d["files"].update({"..": "0" * 64}), "files['..']", "a plain file name"),
        (lambda d: d["optimizer"].update(lr=float("inf")), "optimizer.lr", "a positive finite number"),
    ],
)
def test_problems_say_where_and_what(manifest, edit, where, expected):
    data = copy.deepcopy(manifest)
    edit(data)
    problem = conforms(data)
    assert problem is not None and problem.where == where and problem.expected.startswith(expected), problem


def test_the_plan_is_read_as_a_typed_plan(digits_artifacts, tmp_path):
    """The manifest's plan comes back as :class:`Plan` with the runtime's defaults derived from it; a plan with a
    wrong type is refused by the schema, naming the field."""
    import shutil

    from ondevice.manifest import Plan

    directory = tmp_path / "planned"
    shutil.copytree(digits_artifacts, directory)
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "plan": PLAN}))
    loaded = Manifest.load(directory)
    assert isinstance(loaded.plan, Plan) and loaded.plan.chosen_row == PLAN["rows"][0]
    assert (loaded.train_batch_size, loaded.eval_batch_size) == (32, 8)
    assert json.loads(json.dumps(dataclasses.asdict(loaded)))["plan"] == PLAN  # written back as it was read
    path.write_text(json.dumps({**data, "plan": {**PLAN, "micro_batch_size": "8"}}))
    with pytest.raises(ManifestError, match=r"plan\.micro_batch_size"):
        Manifest.load(directory)
