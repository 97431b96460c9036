"""Adapters in are checked like everything else in: `generate(lora_from=...)` refuses a damaged or
partial PEFT folder with a typed one-line error, trains the modules the adapter saved (as PEFT
does), and a memory plan with an adapter describes what trains."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from artifacts import generate
from artifacts.errors import SelectionError
from ondevice.cli import main
from tests.ondevice.test_formats import lora_trained  # noqa: F401  (module fixture: LoRA r4 on query/value + head)

ADAPTER, CONFIG = "adapter_model.safetensors", "adapter_config.json"


@pytest.fixture(scope="module")
def adapter(lora_trained, tmp_path_factory) -> Path:  # noqa: F811
    root, _, _ = lora_trained
    out = tmp_path_factory.mktemp("peft") / "adapter"
    assert main(["export", str(root / "a"), "--checkpoint", str(root / "ckpt"), "--format", "peft",
                 "--out", str(out)]) == 0  # fmt: skip
    return out


def _config(**changes):
    def damage(folder: Path) -> None:
        config = json.loads((folder / CONFIG).read_text())
        config.update(changes)
        (folder / CONFIG).write_text(json.dumps(config))

    return damage


def _tensors(change):
    def damage(folder: Path) -> None:
        save_file(change(load_file(folder / ADAPTER)), folder / ADAPTER)

    return damage


def _write(name: str, data: bytes):
    return lambda folder: (folder / name).write_bytes(data)


def _scaled(value: float):
    return _tensors(lambda t: {k: (v * 0 + value).astype(v.dtype) if "lora_B" in k else v for k, v in t.items()})


DAMAGED = [
    # (what is wrong, how, what the error says)
    ("an empty weights file", _write(ADAPTER, b""), "adapter_model.safetensors cannot be read"),
    ("garbage weights", _write(ADAPTER, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}garbage"), "cannot be read"),
    ("no tensors at all", _tensors(lambda t: {}), "lacks 4 of the 4 tensors its config implies"),
    ("no lora_B", _tensors(lambda t: {k: v for k, v in t.items() if "lora_B" not in k}), "lacks 2 of the 4"),
    ("a fractional rank", _config(r=4.7), "rank must be an integer >= 1, got 4.7"),
    ("a rank as text", _config(r="4"), "rank must be an integer >= 1, got '4'"),
    ("a rank of 10^9", _config(r=10**9), "rank 1000000000 is larger than layer"),
    ("no alpha", _config(lora_alpha=None), "alpha must be a positive number"),
    ("no targets", _config(target_modules=[]), "targets must be a non-empty list"),
    ("a config that is not JSON", _write(CONFIG, b"{r: 4"), "adapter_config.json:"),
    ("a config that is a list", _write(CONFIG, b"[4]"), "holds list, not an object"),
    ("NaN weights", _scaled(float("nan")), "is not finite numbers"),
    ("huge weights", _scaled(1e20), "values up to 1e+20"),
    ("no folder", lambda folder: shutil.rmtree(folder), "adapter_config.json: No such file"),
    # PEFT variants whose forward differs from plain LoRA's: loaded as LoRA they computed something else, silently
    ("a DoRA adapter", _config(use_dora=True), "sets use_dora=True: DoRA scales each adapted weight's columns"),
    ("an rsLoRA adapter", _config(use_rslora=True), "rsLoRA scales the adapters by alpha / sqrt(rank)"),
    ("a bias on lora_B", _config(lora_bias=True), "a bias on lora_B adds a term"),
    ("some layers only", _config(layers_to_transform=[0]), "adapters on some layers only"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "damage", "said"), DAMAGED, ids=[d[0] for d in DAMAGED])
def test_a_damaged_or_partial_adapter_is_refused(lora_trained, adapter, tmp_path, what, damage, said):  # noqa: F811
    _, base, _ = lora_trained
    folder = tmp_path / "adapter"
    shutil.copytree(adapter, folder)
    damage(folder)
    with pytest.raises(SelectionError, match=None) as caught:
        generate(base, {"x": torch.randn(8, 8)}, tmp_path / "b", lora_from=folder, verify=False)
    assert said in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    assert not (tmp_path / "b").exists()


def test_the_modules_an_adapter_saved_train_as_in_peft(lora_trained, adapter, tmp_path):  # noqa: F811
    """The adapter saved the head (modules_to_save): PEFT trains it, and so do these artifacts,
    without naming it again."""
    _, base, trainer = lora_trained
    assert json.loads((adapter / CONFIG).read_text())["modules_to_save"] == ["head"]
    manifest = generate(base, {"x": torch.randn(8, 8)}, tmp_path / "b", lora_from=adapter)
    assert {p.name for p in manifest.trainable} == {p.name for p in trainer.manifest.trainable}
    assert {"head.weight", "head.bias"} <= {p.name for p in manifest.trainable}


def test_a_memory_plan_with_an_adapter_plans_that_adapter(lora_trained, adapter, tmp_path):  # noqa: F811
    """The adapter fixes what trains; the plan measures it (micro-batches only) and says so."""
    _, base, trainer = lora_trained
    manifest = generate(base, {"x": torch.randn(8, 8)}, tmp_path / "b", lora_from=adapter, memory_budget="2GB",
                        batch_size=16)  # fmt: skip
    plan = manifest.plan
    assert plan is not None and [r["candidate"] for r in plan.rows] == ["LoRA rank 4 + head (from the adapter)"]
    assert plan.chosen == "LoRA rank 4 + head (from the adapter)"
    assert {p.name for p in manifest.trainable} == {p.name for p in trainer.manifest.trainable}
    started = {p.name: p for p in manifest.trainable}
    assert started["query.lora_A"].shape == (4, 8)
    np.testing.assert_array_equal(  # the adapters start where the adapter ended, as without a plan
        __import__("ondevice").Trainer.load(tmp_path / "b").get_weights()["query.lora_B"],
        trainer.get_weights()["query.lora_B"],
    )
