"""Generate anywhere: the built wheel's [workstation] extra in a fresh environment with stock onnxruntime and no
training build generates and verifies five model families (the digits MLP, a BERT with LoRA, an LSTM, a CNN with
BatchNorm, a grouped-query-attention decoder with LoRA), and they train like today's pipeline (ORT's own
builder, the classic engine, in this environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.artifacts import generate_anywhere_models as models  # the file runs alone in the new environment too

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _constraints(where: Path) -> Path:
    """The device lock, and for everything else (torch, transformers and theirs) the development lock: one pinned
    set with a current onnx and stock onnxruntime, no training build."""
    device = (ROOT / "requirements" / "device-lock.txt").read_text().splitlines()
    pinned = {line.split("==")[0].lower() for line in device if "==" in line}
    rest = [line for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
            if "==" in line and line.split("==")[0].lower() not in pinned | {"onnxruntime-training"}]  # fmt: skip
    path = where / "constraints.txt"
    path.write_text("\n".join([*device, *rest]) + "\n")
    return path


@pytest.fixture(scope="module")
def stock_workstation(wheel, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    where = tmp_path_factory.mktemp("workstation")
    subprocess.run([sys.executable, "-m", "venv", str(where / "venv")], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    pip = [str(where / "venv" / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    result = subprocess.run([*pip, "-c", str(_constraints(where)), f"{wheel}[workstation]", "transformers"],
                            capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return where / "venv" / "bin" / "python", env


def test_the_workstation_generates_without_the_training_build_and_trains_like_today(stock_workstation, tmp_path):
    python, env = stock_workstation
    work = tmp_path / "empty"
    work.mkdir()
    script = Path(models.__file__)
    run = subprocess.run([str(python), str(script), str(work / "out")], cwd=work, env=env, capture_output=True,
                         text=True, timeout=1800)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["engines_installed"] == ["portable"] and report["onnxruntime"].startswith("1.3"), report
    for name, made in report["made"].items():
        assert made == {"engines": ["portable"], "passed": True}, (name, made)
        assert not (work / "out" / name / "optimizer_model.onnx").exists()

    today = models.generate_all(str(tmp_path / "today"))  # ORT's builder, both engines
    for name in models.MODELS:
        assert today[name]["engines"] == ["classic", "portable"]
        expected = models.losses(str(tmp_path / "today"), name, "classic")
        np.testing.assert_allclose(report["losses"][name], expected, rtol=1e-5, err_msg=name)
