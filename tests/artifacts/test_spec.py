"""One generation spec: keywords and Spec build the same artifacts, the CLI maps flags onto it once."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from artifacts import MSE, SGD, AdamW, InputSpecError, Lora, Spec, generate
from artifacts.cli import _spec, register
from artifacts.from_onnx import generate_from_onnx
from artifacts.verify import Tolerances
from ondevice import Trainer
from tests.artifacts import models


def test_keywords_are_shorthand_for_the_spec(tmp_path):
    """The same generation given as a Spec and as keywords: the same contract, the same trained weights."""
    spec = Spec(input_names=["x"], optimizer=SGD(lr=0.1), trainable=["2.*"], labels=["a", "b", "c", "d"])
    by_spec = generate(_model(), torch.randn(8, 16), tmp_path / "spec", spec=spec)
    by_keywords = generate(_model(), torch.randn(8, 16), tmp_path / "kw", input_names=["x"], optimizer=SGD(lr=0.1),
                           trainable=["2.*"], labels=["a", "b", "c", "d"])  # fmt: skip
    same = ("inputs", "targets", "outputs", "trainable", "frozen", "loss", "optimizer", "labels", "padding")
    assert {k: getattr(by_spec, k) for k in same} == {k: getattr(by_keywords, k) for k in same}
    assert [p.name for p in by_spec.trainable] == ["2.weight", "2.bias"]
    assert by_spec.optimizer.lr == 0.1 and by_spec.labels == ("a", "b", "c", "d")
    x, y = np.random.default_rng(0).standard_normal((8, 16), dtype=np.float32), np.arange(8) % 4
    weights = []
    for directory in ("spec", "kw"):
        trainer = Trainer.load(tmp_path / directory)
        trainer.fit({"x": x, "labels": y}, epochs=1, batch_size=8)
        weights.append(trainer.parameter("2.weight"))
    np.testing.assert_array_equal(*weights)


def test_keywords_override_the_spec(tmp_path):
    spec = Spec(optimizer=AdamW(lr=1e-3), trainable=["0.*"])
    manifest = generate(_model(), torch.randn(8, 16), tmp_path / "out", spec=spec, trainable=["2.*"], verify=False)
    assert [p.name for p in manifest.trainable] == ["2.weight", "2.bias"]
    assert manifest.optimizer.lr == 1e-3


def test_unknown_option_names_the_fields(tmp_path):
    with pytest.raises(InputSpecError, match=r"unknown generation option 'trainables'.*trainable"):
        generate(_model(), torch.randn(8, 16), tmp_path / "out", trainables=["2.*"])
    assert not (tmp_path / "out").exists()


def test_a_string_where_names_belong_is_refused():
    """`trainable="head"` would otherwise become the globs h, e, a, d."""
    with pytest.raises(InputSpecError, match="list of names"):
        Spec(trainable="head")


def test_spec_is_a_value():
    spec = Spec(trainable=["a"], lora=Lora(4))
    assert spec.trainable == ("a",) and spec == Spec(trainable=("a",), lora=Lora(4))
    assert spec.but(trainable=["b"]).trainable == ("b",) and spec.trainable == ("a",)
    with pytest.raises(AttributeError):
        spec.seed = 1  # type: ignore[misc]


def test_onnx_start_refuses_what_shapes_a_torch_export(tmp_path):
    path = tmp_path / "m.onnx"
    torch.onnx.export(_model(), (torch.randn(2, 16),), path, input_names=["x"], dynamo=False)
    with pytest.raises(InputSpecError, match="lora, memory_budget shape a PyTorch model's export"):
        generate_from_onnx(path, tmp_path / "out", spec=Spec(lora=Lora(4), memory_budget="100MB"))
    assert not (tmp_path / "out").exists()


def test_cli_flags_map_onto_the_spec():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--model", "m.py:f", "--out", "o", "--loss", "mse", "--optimizer", "sgd",
                              "--lr", "0.5", "--trainable", "head.*", "--lora", "4", "--lora-targets", "q,v",
                              "--labels", "a, b", "--atol", "1e-4", "--fd-rtol", "0.1", "--seed", "3",
                              "--memory-budget", "200MB", "--batch-size", "8", "--no-verify"])  # fmt: skip
    spec = _spec(args)
    assert spec == Spec(
        loss=MSE(),
        optimizer=SGD(lr=0.5),
        trainable=("head.*",),
        lora=Lora(rank=4, alpha=8.0, targets=("q", "v")),
        memory_budget="200MB",
        batch_size=8,
        labels=("a", "b"),
        verify=False,
        tolerances=Tolerances(atol=1e-4, rtol=1e-3),
        fd_tolerances=Tolerances(atol=1e-3, rtol=0.1),
        seed=3,
    )


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.mlp()


def test_the_docs_list_every_field():
    import re
    from dataclasses import fields
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "workstation.md").read_text()
    table = page[page.index("| group | fields |") :].split("\n\n")[0]
    rows = table.splitlines()[2:]
    listed = [name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[2])]
    assert sorted(listed) == sorted(f.name for f in fields(Spec))


@pytest.mark.parametrize(
    ("flags", "lr", "adapter_lr"),
    [
        ([], 2e-3, 2e-3),  # LoRA r8 + head by default
        (["--memory-budget", "200MB"], 1e-4, 2e-3),  # the plan decides: adapters get 2e-3, the model 1e-4
        (["--train-last", "2"], 1e-4, 2e-3),
        (["--memory-budget", "200MB", "--lr", "5e-4"], 5e-4, None),  # a given rate is the rate
    ],
)
def test_a_pretrained_model_gets_the_rate_of_what_trains(monkeypatch, tmp_path, flags, lr, adapter_lr):
    import types

    import artifacts.build
    import artifacts.hf
    from artifacts.cli import _from_hf

    made = types.SimpleNamespace(model=None, example={}, dynamic_axes={}, tokenizer=None)
    monkeypatch.setattr(artifacts.hf, "hf_model", lambda *args, **kwargs: made)
    monkeypatch.setattr(artifacts.build, "generate", lambda model, example, out, spec, force: spec)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    spec = _from_hf(parser.parse_args(["generate", "--model", "hf:x", "--out", str(tmp_path / "o"), *flags]), [])
    assert (spec.optimizer.lr, spec.adapter_lr) == (lr, adapter_lr)


def test_adapter_lr_must_be_a_rate():
    with pytest.raises(InputSpecError, match="adapter_lr must be a positive finite rate or None, got -1"):
        Spec(adapter_lr=-1)


@pytest.mark.parametrize("labels, message", [(["a", "a"], "'a' appears more than once"), (["on", " "], "one is empty")])
def test_labels_the_device_would_refuse_are_refused_when_generating(labels, message):
    """`--labels a,a` used to generate artifacts whose manifest every device then refused."""
    from artifacts import Spec
    from artifacts.errors import InputSpecError

    with pytest.raises(InputSpecError, match=f"labels must be distinct, non-empty class names .*{message}"):
        Spec(labels=labels)
