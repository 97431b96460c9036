"""Early stopping: the run ends `patience` epochs after the best validation loss and keeps that epoch's weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ondevice import ConfigError, Trainer
from ondevice.cli import main
from ondevice.stopping import EarlyStopping, improves


def _split(digits_data):
    train = {k: v[:640] for k, v in digits_data["train"].items()}
    rng = np.random.default_rng(0)  # validation whose labels are noise: its loss rises as the model fits train
    val = {"input": digits_data["val"]["input"][:200], "labels": rng.integers(0, 10, 200).astype(np.int64)}
    return train, val


def test_improves_follows_the_metric_direction():
    assert improves(0.5, None, "val_loss") and improves(0.4, 0.5, "val_loss") and not improves(0.5, 0.5, "val_loss")
    assert improves(0.9, 0.8, "val_accuracy") and not improves(0.7, 0.8, "val_accuracy")
    assert not improves(0.45, 0.5, "val_loss", min_delta=0.1) and not improves(float("nan"), None, "val_loss")


def test_fit_stops_after_patience_and_restores_the_best_epoch(digits_no_dropout, digits_data, tmp_path):
    artifacts, _ = digits_no_dropout
    train, val = _split(digits_data)
    trainer = Trainer.load(artifacts)
    seen: dict[int, np.ndarray] = {}

    def keep(row: dict) -> None:
        seen[row["epoch"]] = trainer.get_flat_weights().copy()

    history = trainer.fit(train, epochs=30, batch_size=32, val_data=val, progress=False, on_epoch=keep,
                          early_stopping=EarlyStopping(patience=2), checkpoint=tmp_path / "latest.ckpt")  # fmt: skip
    losses = [row["val_loss"] for row in history.epochs]
    best = int(np.argmin(losses)) + 1
    assert history.stopped_early and history.best_epoch == best and len(losses) == best + 2 < 30, losses
    assert sorted(seen) == [row["epoch"] for row in history.epochs]
    np.testing.assert_array_equal(trainer.get_flat_weights(), seen[best])  # the best epoch's weights, exactly
    assert trainer.evaluate(val)["loss"] == pytest.approx(losses[best - 1], rel=1e-5)
    saved = Trainer.load(artifacts, checkpoint=tmp_path / "latest.ckpt")  # the checkpoint saved last holds them too
    np.testing.assert_array_equal(saved.get_flat_weights(), seen[best])


def test_without_early_stopping_every_epoch_runs(digits_no_dropout, digits_data):
    artifacts, _ = digits_no_dropout
    train, val = _split(digits_data)
    history = Trainer.load(artifacts).fit(train, epochs=4, batch_size=32, val_data=val, progress=False)
    assert len(history.epochs) == 4 and history.best_epoch is None and not history.stopped_early


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"patience": 0}, "patience must be an integer >= 1"),
        ({"monitor": "loss"}, "monitors a validation metric"),
        ({"min_delta": -1.0}, "min_delta must be a finite number >= 0"),
    ],
)
def test_bad_rules_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        EarlyStopping(**options)


def test_fit_refuses_early_stopping_without_validation_or_an_unmeasured_metric(digits_no_dropout, digits_data):
    artifacts, _ = digits_no_dropout
    train, val = _split(digits_data)
    trainer = Trainer.load(artifacts)
    with pytest.raises(ConfigError, match="early stopping watches validation: give val_data"):
        trainer.fit(train, epochs=2, batch_size=32, early_stopping=EarlyStopping(), progress=False)
    with pytest.raises(ConfigError, match=r"monitors 'val_perplexity', but validation measures \['val_accuracy'"):
        trainer.fit(train, epochs=2, batch_size=32, val_data=val, progress=False,
                    early_stopping=EarlyStopping(monitor="val_perplexity"))  # fmt: skip


def test_odt_train_with_val_stops_by_default_and_prints_each_epoch_as_it_ends(digits_no_dropout, digits_data,
                                                                             tmp_path, capsys):  # fmt: skip
    artifacts, _ = digits_no_dropout
    train, val = _split(digits_data)
    np.savez(tmp_path / "train.npz", **train)
    np.savez(tmp_path / "val.npz", **val)
    command = ["train", str(artifacts), "--data", str(tmp_path / "train.npz"), "--val", str(tmp_path / "val.npz"),
               "--checkpoint", str(tmp_path / "ck")]  # fmt: skip
    assert main([*command, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    losses = [row["val_loss"] for row in report["epochs"]]
    assert report["stopped_early"] and report["best_epoch"] == int(np.argmin(losses)) + 1
    assert len(losses) == report["best_epoch"] + 3 < 30  # the default patience; at most 30 epochs
    assert main([*command, "--patience", "0", "--epochs", "2", "--checkpoint", str(tmp_path / "ck2")]) == 0
    out = capsys.readouterr().out
    assert "up to" not in out and [line.split()[:2] for line in out.splitlines() if line.startswith("epoch")] == [
        ["epoch", "1"], ["epoch", "2"]]  # fmt: skip
    assert main(command[:4] + ["--patience", "2"]) == 2  # --patience without --val
    assert "--patience needs --val" in capsys.readouterr().err
