"""Checkpoints that nothing corrupts silently: checksums, the previous one kept, stale temps, one writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ondevice import CheckpointCorruptError, CheckpointError, Trainer
from ondevice.cli import main


def _data(digits_data, n: int = 64) -> dict[str, np.ndarray]:
    return {k: v[:n] for k, v in digits_data["train"].items()}


@pytest.fixture()
def saved(digits_artifacts, digits_data, tmp_path) -> Path:
    trainer = Trainer.load(digits_artifacts)
    trainer.fit(_data(digits_data), epochs=1, batch_size=16, progress=False, checkpoint=tmp_path / "c.ckpt")
    return tmp_path / "c.ckpt"


def test_no_single_bit_flip_is_accepted(digits_artifacts, saved, tmp_path):
    """48 single-bit flips spread over the file (header and ORT's bytes): every one refused, typed."""
    original = saved.read_bytes()
    positions = np.linspace(0, len(original) - 1, 48).astype(int)
    accepted = []
    for index, position in enumerate(positions):
        flipped = bytearray(original)
        flipped[position] ^= 1 << (index % 8)
        damaged = tmp_path / f"flip{index}.ckpt"
        damaged.write_bytes(bytes(flipped))
        try:
            Trainer.load(digits_artifacts, checkpoint=damaged)
            accepted.append(int(position))
        except CheckpointError as exc:  # never an ORT error, never a crash
            assert "ONNX Runtime" not in str(exc) and "/onnxruntime_src" not in str(exc), exc
    assert accepted == []
    assert Trainer.load(digits_artifacts, checkpoint=saved).epoch == 1


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[: len(b) // 2], "truncated"),  # a save cut short
        (lambda b: b + b"\0" * 10, "truncated or padded"),
        (lambda b: b"", "no header"),  # a zero-byte file
        (lambda b: b"GARBAGE!" + b[8:], "no header"),  # not ours
    ],
)
def test_damaged_checkpoints_are_refused(digits_artifacts, saved, damage, message):
    saved.write_bytes(damage(saved.read_bytes()))
    with pytest.raises(CheckpointCorruptError, match=message):
        Trainer.load(digits_artifacts, checkpoint=saved)


def test_the_previous_checkpoint_is_kept_and_resume_falls_back_to_it(digits_artifacts, digits_data, tmp_path, capsys):
    np.savez(tmp_path / "t.npz", **_data(digits_data))
    train = ["train", str(digits_artifacts), "--data", str(tmp_path / "t.npz"), "--checkpoint", str(tmp_path),
             "--batch-size", "16"]  # fmt: skip
    assert main([*train, "--epochs", "2"]) == 0
    latest, previous = tmp_path / "latest.ckpt", tmp_path / "latest.ckpt.previous"
    assert Trainer.load(digits_artifacts, checkpoint=previous).epoch == 1
    latest.write_bytes(latest.read_bytes()[:-100])  # the newest checkpoint is damaged
    capsys.readouterr()
    assert main([*train, "--epochs", "3", "--resume"]) == 0
    assert f"Using {previous}" in capsys.readouterr().err
    resumed = Trainer.load(digits_artifacts, checkpoint=latest)
    assert resumed.epoch == 3 and Trainer.load(digits_artifacts, checkpoint=previous).epoch == 2
    straight = Trainer.load(digits_artifacts)  # what 3 epochs give without any damage
    straight.fit(_data(digits_data), epochs=3, batch_size=16, progress=False)
    np.testing.assert_array_equal(resumed.get_flat_weights(), straight.get_flat_weights())


def test_a_checkpoint_replaced_by_a_directory_falls_back_to_the_previous(digits_artifacts, digits_data, tmp_path,
                                                                         capsys):  # fmt: skip
    trainer = Trainer.load(digits_artifacts)
    latest = tmp_path / "latest.ckpt"
    trainer.save(latest)
    trainer.fit(_data(digits_data), epochs=1, batch_size=16, progress=False)
    trainer.save(latest)  # the first save is now latest.ckpt.previous
    latest.unlink()
    latest.mkdir()
    assert main(["evaluate", str(digits_artifacts), "--data", str(_npz(digits_data, tmp_path)),
                 "--checkpoint", str(tmp_path)]) == 0  # fmt: skip
    assert f"warning: {latest} is not a file; using {tmp_path / 'latest.ckpt.previous'}" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="is not a file"):
        Trainer.load(digits_artifacts, checkpoint=latest)


def test_a_directory_in_the_previous_checkpoints_place_is_left_alone(digits_artifacts, tmp_path):
    trainer = Trainer.load(digits_artifacts)
    latest = tmp_path / "latest.ckpt"
    trainer.save(latest)
    (tmp_path / "latest.ckpt.previous").mkdir()
    (tmp_path / "latest.ckpt.previous" / "mine.txt").write_text("a user's file")
    trainer.epoch = 4
    trainer.save(latest)  # saved; the directory is not replaced, and no hidden link stays behind
    assert Trainer.load(digits_artifacts, checkpoint=latest).epoch == 4
    assert (tmp_path / "latest.ckpt.previous" / "mine.txt").read_text() == "a user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".latest.ckpt.lock", "latest.ckpt", "latest.ckpt.previous"]


def test_a_lock_that_cannot_be_opened_is_a_checkpoint_error(digits_artifacts, tmp_path):
    (tmp_path / ".c.ckpt.lock").mkdir()  # as a read-only folder or another user's lock file would
    with pytest.raises(CheckpointError, match=r"cannot lock checkpoint .*c.ckpt .*Is a directory"):
        Trainer.load(digits_artifacts).save(tmp_path / "c.ckpt")


def _npz(digits_data, tmp_path: Path) -> Path:
    np.savez(tmp_path / "d.npz", **_data(digits_data))
    return tmp_path / "d.npz"


def test_a_second_writer_is_refused_with_the_holder(digits_artifacts, digits_data, tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", f"""
import time
from ondevice._checkpoint import writer_lock
from pathlib import Path
with writer_lock(Path({str(tmp_path / "c.ckpt")!r})):
    print("holding", flush=True)
    time.sleep(60)
"""],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "holding"
        trainer = Trainer.load(digits_artifacts)
        with pytest.raises(CheckpointError, match=f"checkpoint .* is in use by pid {holder.pid}; wait for that run"):
            trainer.fit(_data(digits_data), epochs=1, batch_size=16, progress=False, checkpoint=tmp_path / "c.ckpt")
        assert trainer.step == 0  # refused before training
    finally:
        holder.kill()
        holder.wait()
    Trainer.load(digits_artifacts).save(tmp_path / "c.ckpt")  # the lock died with its holder


def _saver(digits_artifacts, path) -> subprocess.Popen:
    """A process that saves ``path`` in a loop; it has saved once when this returns (no timer race)."""
    code = f"""
from ondevice import Trainer
t = Trainer.load({str(digits_artifacts)!r})
while True:
    t.epoch += 1
    t.save({str(path)!r})
    print("saved", flush=True)
"""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "saved"
    return process


def test_kills_during_saves_leave_no_orphan_and_no_corrupt_checkpoint(digits_artifacts, tmp_path):
    """kill -9 a process that saves in a loop, 5 times at different moments: the checkpoint's own name
    always holds a whole checkpoint (the old one is kept by a hard link, never moved away), and the
    next save cleans up the killed saves' temporary files."""
    for kill in range(5):
        process = _saver(digits_artifacts, tmp_path / "c.ckpt")
        time.sleep(0.011 * kill)  # any moment after the first save: the assertions hold at every one
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        assert (tmp_path / "c.ckpt").is_file(), "a kill must never leave the checkpoint's name missing"
        for path in (tmp_path / "c.ckpt", tmp_path / "c.ckpt.previous"):
            if path.exists():
                Trainer.load(digits_artifacts, checkpoint=path)  # whole and verified, never half-written
    Trainer.load(digits_artifacts).save(tmp_path / "c.ckpt")
    assert sorted(p.name for p in tmp_path.glob(".c.ckpt.*.tmp")) == []


def test_readers_always_find_the_checkpoint_while_it_is_being_saved(digits_artifacts, tmp_path):
    """At least 30 loads while another process saves in a loop, until three different saves were read:
    every load finds a whole, verified checkpoint (before, the save moved the old file away first and
    9 of 30 reads found none)."""
    saver = _saver(digits_artifacts, tmp_path / "c.ckpt")
    epochs: list[int] = []
    try:
        while (len(epochs) < 30 or len(set(epochs)) < 3) and len(epochs) < 5000:
            epochs.append(Trainer.load(digits_artifacts, checkpoint=tmp_path / "c.ckpt").epoch)
    finally:
        saver.kill()
        saver.wait()
    assert epochs == sorted(epochs) and len(set(epochs)) >= 3  # it was saving all along
