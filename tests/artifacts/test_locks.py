"""`generate --force` never replaces artifacts a trainer holds, and a trainer never opens artifacts
while they are being replaced: the finished run's checkpoint would match no artifacts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from artifacts import generate
from ondevice import InUseError, Trainer
from ondevice.files import sha256_file
from ondevice.locks import ARTIFACTS_LOCK


def _hold(code: str) -> subprocess.Popen[str]:
    code += "\nprint('holding', flush=True)\nimport time\ntime.sleep(120)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    return holder


def test_generate_force_refuses_artifacts_a_trainer_holds(tmp_path):
    torch.manual_seed(0)
    model, example = torch.nn.Linear(4, 3), {"x": torch.randn(8, 4)}
    out = tmp_path / "a"
    generate(model, example, out, verify=False)
    manifest = sha256_file(out / "manifest.json")
    holder = _hold(f"from ondevice import Trainer\ntrainer = Trainer.load({str(out)!r})")
    try:
        with pytest.raises(InUseError, match=f"artifacts {out} is in use by pid {holder.pid}; a trainer is using"):
            generate(torch.nn.Linear(4, 3), example, out, force=True, verify=False)
        assert sha256_file(out / "manifest.json") == manifest
    finally:
        holder.kill()
        holder.wait()
    generate(torch.nn.Linear(4, 3), example, out, force=True, verify=False)  # the trainer is gone
    assert sha256_file(out / "manifest.json") != manifest


def test_a_trainer_waits_for_no_one_but_refuses_artifacts_being_replaced(tmp_path):
    torch.manual_seed(0)
    out = tmp_path / "a"
    generate(torch.nn.Linear(4, 3), {"x": torch.randn(8, 4)}, out, verify=False)
    holder = _hold("from pathlib import Path\nfrom ondevice.locks import exclusive\n"
                   f"lock = exclusive(Path({str(out / ARTIFACTS_LOCK)!r}), 'x', 'y')\nlock.__enter__()")  # fmt: skip
    try:
        with pytest.raises(InUseError, match=f"artifacts {out} is in use by pid {holder.pid}; odt generate --force"):
            Trainer.load(out)
    finally:
        holder.kill()
        holder.wait()
    first, second = Trainer.load(out), Trainer.load(out)  # readers share the artifacts
    assert first.manifest_sha256 == second.manifest_sha256


def test_a_process_may_replace_artifacts_it_trains_itself(tmp_path):
    """Benchmarks regenerate into one directory while an earlier trainer of theirs is still alive:
    only other processes' holds refuse (Linux names them in /proc/locks)."""
    torch.manual_seed(0)
    out = tmp_path / "a"
    generate(torch.nn.Linear(4, 3), {"x": torch.randn(8, 4)}, out, verify=False)
    trainer = Trainer.load(out)
    generate(torch.nn.Linear(4, 3), {"x": torch.randn(8, 4)}, out, force=True, verify=False)
    assert trainer.manifest_sha256 != Trainer.load(out).manifest_sha256
