"""Verification at kinks: one rounding step at a ReLU input is retried on nearby data, a wrong gradient
still fails."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import artifacts.passes as passes
from artifacts.kinks import Kink, kink_outputs, near_kinks
from ondevice.cli import main

MODEL = str(Path(__file__).with_name("models.py")) + ":mobilenet_v3"


def _generate(out: Path, seed: int, capsys) -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    code = main(["generate", "--model", MODEL, "--input", "x:8x3x64x64:float32", "--out", str(out), "--seed",
                 str(seed), "--json"])  # fmt: skip
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code == 0 else {"error": captured.out + captured.err}


@pytest.mark.parametrize("seed", range(5))
def test_the_mobilenet_v3_style_nchwc_variant_verifies_on_seeds_0_to_4(tmp_path, capsys, seed):
    code, manifest = _generate(tmp_path / "a", seed, capsys)
    assert code == 0, manifest
    assert manifest["variants"] == {"nchwc": "training_model.nchwc.onnx"}
    note = manifest["verification"]["note"]
    if seed == 0:  # on this data one ReLU input of the variant's forward is exactly 0 where PyTorch has ~4e-8
        assert "at input shape 4x3x64x64: retried on nearby data (seed 1), which passes" in note
        assert "Relu '/3/block/block.2/Relu', item 0: input 0 (kink at 0)" in note
    assert manifest["verification"]["passed"]


def _off_by_one_percent(model: onnx.ModelProto, parameter: str) -> None:
    """Make the graph's gradient of ``parameter`` 1 % too large (a wrong kernel, not a kink)."""
    grad = f"{parameter}_grad"
    nodes = list(model.graph.node)
    (producer,) = [n for n in nodes if grad in n.output]
    producer.output[list(producer.output).index(grad)] = f"{grad}/true"
    nodes.insert(nodes.index(producer) + 1, helper.make_node("Mul", [f"{grad}/true", "test.scale"], [grad]))
    model.graph.initializer.append(numpy_helper.from_array(np.array(1.01, np.float32), "test.scale"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def test_a_wrong_gradient_beside_a_kink_still_fails(tmp_path, capsys, monkeypatch):
    def mutated(model, context):  # type: ignore[no-untyped-def]
        changed = passes.convs_to_nchwc(model)
        _off_by_one_percent(model, "0.weight")
        return changed

    registry = [p if p.name != "nchwc-conv" else passes.Pass(p.name, p.stage, mutated, p.fixes, p.exact, p.test)
                for p in passes.REGISTRY]  # fmt: skip
    monkeypatch.setattr(passes, "REGISTRY", tuple(registry))
    code, found = _generate(tmp_path / "a", 0, capsys)
    assert code != 0
    assert "training_model.nchwc.onnx: grad 0.weight" in found["error"]
    assert "Relu '/3/block/block.2/Relu', item 0: input 0 (kink at 0), but it fails on nearby data (seed 1) as well: " \
           "not a kink" in found["error"]  # fmt: skip
    assert not (tmp_path / "a").exists()


def test_near_kinks_finds_values_at_each_kind_of_kink():
    x = np.array([[1.0, -2.0, 3e-8, 5.0], [2.0, -1.0, 0.5, 4.0]], np.float32)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("HardSwish", ["y"], ["h"], name="hardswish"),
         helper.make_node("Clip", ["x", "lo", "hi"], ["c"], name="clip"),
         helper.make_node("MaxPool", ["p"], ["m"], name="pool", kernel_shape=[2, 2], strides=[2, 2])],
        "g", [], [], [numpy_helper.from_array(np.array(-1.0, np.float32), "lo"),
                      numpy_helper.from_array(np.array(6.0, np.float32), "hi")]))  # fmt: skip
    nodes = kink_outputs(model)
    assert [(n.name, points) for n, points in nodes] == [("relu", (0.0,)), ("hardswish", (-3.0, 3.0)),
                                                          ("clip", (-1.0, 6.0)), ("pool", (0.0,))]  # fmt: skip
    y = np.array([[2.9999998, 1.0], [0.0, 1.0]], np.float32)
    pool = np.array([[[[1.0, 0.5], [1.0 + 1e-7, -1.0]]], [[[1.0, 0.0], [0.5, 0.25]]]], np.float32)
    found = near_kinks(nodes, [x, y, x, pool])
    assert found == [
        Kink("relu", "Relu", 0.0, 0, float(np.float32(3e-8))),
        Kink("hardswish", "HardSwish", 3.0, 0, float(np.float32(2.9999998))),
        Kink("clip", "Clip", -1.0, 1, -1.0),
        Kink("pool", "MaxPool", 0.0, 0, float(np.float32(1.0 + 1e-7)) - 1.0),
    ]
    assert near_kinks(nodes, [x + 0.25, y - 1, x + 0.5, pool * [[[[1]]], [[[2]]]] + [[[[0, 0], [0.5, 0]]]]]) == []
