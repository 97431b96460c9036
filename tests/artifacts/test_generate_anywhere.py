"""Generate anywhere: the built wheel's [workstation] extra in a fresh environment with stock onnxruntime and no
training build, on CPython 3.12 and 3.13 and on Linux arm64 under emulation, generates and verifies five model
families (the digits MLP, a BERT with LoRA, an LSTM, a CNN with BatchNorm, a grouped-query-attention decoder with
LoRA), and they train like today's pipeline (ORT's own builder, the classic engine, in this environment)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests import emulation
from tests.artifacts import generate_anywhere_models as models  # the file runs alone in the new environment too

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.classic]  # today's pipeline is the training build's


NEWER_TORCH = "torch==2.14.1"
"""torch for CPython 3.12+ here: the classic lock's torch 2.13.0+cpu is a CPython 3.11 file on this machine's disk, and
PyPI's 2.13.0 for the other Pythons needs an NVIDIA library release (cudnn 9.20.0.48) that this machine's index
lacks; 2.14.1 (PyPI's CUDA build, which runs on the CPU) resolves. The [workstation] extra admits both."""
ARM64_TORCH = "torch==2.9.1"
"""torch on Linux aarch64: PyPI's 2.13 and 2.14 there are CUDA builds whose NVIDIA libraries (nvidia-cudnn-cu13)
this machine's index lacks; 2.9.1 is the last CPU build (104 MB). The [workstation] extra admits it there."""

PYTHONS = ("3.12", "3.13")


def _pyenv_python(version: str) -> Path:
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob(f"{version}.*/bin/python"))
    assert found, f"CPython {version} is not installed under {root} (pyenv install {version}); these tests need it"
    return found[-1]


def _constraints(where: Path, torch: str = NEWER_TORCH) -> Path:
    """The device lock, and for everything else (torch, transformers and theirs) the development lock: one pinned
    set with a current onnx and stock onnxruntime, no training build, and ``torch``."""
    device = (ROOT / "requirements" / "device-lock.txt").read_text().splitlines()
    pinned = {line.split("==")[0].lower() for line in device if "==" in line}
    skip = pinned | {"onnxruntime-training", "torch"}
    rest = [line for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
            if "==" in line and line.split("==")[0].lower() not in skip]  # fmt: skip
    path = where / "constraints.txt"
    path.write_text("\n".join([*device, *rest, torch]) + "\n")
    return path


@pytest.fixture(scope="module", params=PYTHONS)
def stock_workstation(request, wheel, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A fresh CPython 3.12 or 3.13 environment with the built wheel's [workstation] extra: stock onnxruntime,
    no training build."""
    where = tmp_path_factory.mktemp(f"workstation-{request.param}", numbered=False)
    subprocess.run([str(_pyenv_python(request.param)), "-m", "venv", str(where / "venv")], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    pip = [str(where / "venv" / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    result = subprocess.run([*pip, "-c", str(_constraints(where)), f"{wheel}[workstation]", "transformers"],
                            capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    yield where / "venv" / "bin" / "python", env
    shutil.rmtree(where / "venv", ignore_errors=True)  # gigabytes of CUDA libraries torch brings: one at a time


@pytest.fixture(scope="module")
def today(tmp_path_factory) -> dict[str, list[float]]:
    """Today's pipeline in this environment (ORT's builder, both engines): the classic engine's 20 losses."""
    where = tmp_path_factory.mktemp("today")
    made = models.generate_all(str(where))
    assert all(made[name]["engines"] == ["classic", "portable"] for name in models.MODELS), made
    return {name: models.losses(str(where), name, "classic") for name in models.MODELS}


def test_the_workstation_generates_without_the_training_build_and_trains_like_today(stock_workstation, today,
                                                                                    tmp_path):  # fmt: skip
    python, env = stock_workstation
    work = tmp_path / "empty"
    work.mkdir()
    script = Path(models.__file__)
    run = subprocess.run([str(python), str(script), str(work / "out")], cwd=work, env=env, capture_output=True,
                         text=True, timeout=1800)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["engines_installed"] == ["portable"] and report["onnxruntime"].startswith("1.3"), report
    assert python.parent.parent.parent.name.endswith(report["python"]) and report["torch"].startswith("2.14.1"), report
    assert report["workstation_admits_torch"], report
    for name, made in report["made"].items():
        assert made == {"engines": ["portable"], "passed": True}, (name, made)
        assert not (work / "out" / name / "optimizer_model.onnx").exists()
    for name in models.MODELS:
        np.testing.assert_allclose(report["losses"][name], today[name], rtol=1e-5, err_msg=name)


def test_the_workstation_generates_on_linux_arm64_under_emulation(wheel, today, tmp_path):
    """The same five families in Debian arm64 under qemu-user, with torch 2.9.1's aarch64 CPU build."""
    root = emulation.arm64_root(tmp_path)
    constraints = _constraints(tmp_path, ARM64_TORCH)
    emulation.host_pip_into(root, "--no-deps", ARM64_TORCH)  # its markers would be evaluated for the host
    emulation.host_pip_into(root, "-c", str(constraints), "transformers", "filelock", "sympy", "networkx", "jinja2",
                            "fsspec")  # fmt: skip
    emulation.install_wheel(root, wheel)
    shutil.copyfile(models.__file__, root / "work" / "models.py")
    found = emulation.in_arm64(root, "cd /work && /opt/venv/bin/python models.py /work/out")
    report = json.loads(found.splitlines()[-1])
    assert report["engines_installed"] == ["portable"] and report["torch"].startswith("2.9.1"), report
    assert report["workstation_admits_torch"], report
    for name, made in report["made"].items():
        assert made == {"engines": ["portable"], "passed": True}, (name, made)
    for name in models.MODELS:
        np.testing.assert_allclose(report["losses"][name], today[name], rtol=1e-5, err_msg=name)
