"""The device install on real platforms: the built wheel with stock onnxruntime on the other CPython
versions of this machine (pyenv), and on Linux arm64 (Debian under qemu-user), trains the digits
model with the classic engine's losses, its update in the native kernel; no documented install resolves to
two ONNX Runtimes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ondevice import Trainer
from tests import emulation

ROOT = Path(__file__).resolve().parents[1]
DEVICE_LOCK = ROOT / "requirements" / "device-lock.txt"
pytestmark = pytest.mark.slow

STEPS = """
import json, sys
import numpy as np
from ondevice import Trainer
from ondevice.engines.update_kernel import status
data = np.load(sys.argv[2])
trainer = Trainer.load(sys.argv[1], engine="portable")
losses = [trainer.train_step({"input": data["input"][i:i + 32], "labels": data["labels"][i:i + 32]}).loss
          for i in range(0, len(data["labels"]), 32)]
print(json.dumps({"engine": trainer.engine, "onnxruntime": trainer.ort_version, "losses": losses,
                  "update": status()}))
"""


def _pyenv_python(version: str) -> Path:
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob(f"{version}.*/bin/python"))
    assert found, f"CPython {version} is not installed under {root} (pyenv install {version}); these tests need it"
    return found[-1]


def classic_losses(artifacts: Path, data: dict[str, np.ndarray]) -> list[float]:
    trainer = Trainer.load(artifacts, engine="classic")
    starts = range(0, len(data["labels"]), 32)
    return [trainer.train_step({k: v[i : i + 32] for k, v in data.items()}).loss for i in starts]


@pytest.fixture(scope="module")
def epoch(digits_no_dropout, digits_data, tmp_path_factory):
    """The digits artifacts (no dropout), one epoch of 320 examples as .npz, and the classic engine's losses."""
    artifacts, _ = digits_no_dropout
    data = {k: v[:320] for k, v in digits_data["train"].items()}
    path = tmp_path_factory.mktemp("epoch") / "train.npz"
    np.savez(path, **data)
    return artifacts, path, classic_losses(artifacts, data)


def _device_venv(python: Path, wheel: Path, where: Path) -> tuple[Path, dict[str, str]]:
    subprocess.run([str(python), "-m", "venv", str(where)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{where / 'bin'}{os.pathsep}{env['PATH']}"
    pip = [str(where / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "-c", str(DEVICE_LOCK)]
    result = subprocess.run([*pip, f"{wheel}[device]"], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return where / "bin", env


@pytest.mark.classic
@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_the_wheel_trains_digits_on_other_pythons_like_the_classic_engine(version, wheel, epoch, tmp_path):
    artifacts, data, expected = epoch
    bin_dir, env = _device_venv(_pyenv_python(version), wheel, tmp_path / "venv")
    work = tmp_path / "empty"
    work.mkdir()
    run = subprocess.run([str(bin_dir / "python"), "-c", STEPS, str(artifacts), str(data)], cwd=work, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout)
    assert found["engine"] == "portable" and found["onnxruntime"] == "1.32.0", found
    assert found["update"].startswith("native update kernel"), found  # loaded and passed its self-check
    np.testing.assert_allclose(found["losses"], expected, rtol=1e-5)
    # the command line too, with the engine and runtime in its report
    cli = subprocess.run([str(bin_dir / "odt"), "train", str(artifacts), "--data", str(data), "--epochs", "1",
                          "--checkpoint", "ck", "--json"], cwd=work, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    report = json.loads(cli.stdout)
    assert report["engine"] == "portable" and report["update"] == "kernel" and report["epochs"][0]["epoch"] == 1
    resumed = Trainer.load(artifacts, engine="classic", checkpoint=work / "ck" / "latest.ckpt")  # crosses back
    assert resumed.step == 10


def test_the_wheel_carries_the_update_kernel_for_each_linux_platform(wheel):
    """Built by the wheel's build backend (ziglang), one library per platform, with its source."""
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"ondevice/kernels/update.c", "ondevice/kernels/linux-x86_64/libodt_update.so",
            "ondevice/kernels/linux-aarch64/libodt_update.so"} <= names  # fmt: skip
    assert wheel.name.endswith("-py3-none-any.whl")  # loaded with ctypes: one wheel for every Python


DOCUMENTED = ["[all]", "[device,federated]", pytest.param("[workstation-classic,federated]", marks=pytest.mark.classic)]
# [device], [classic]: installed for real by other tests; the training build's extras resolve on CPython 3.11 only


@pytest.mark.parametrize("extras", DOCUMENTED)
def test_no_documented_install_resolves_to_two_onnx_runtimes(extras, wheel, tmp_path):
    report = tmp_path / "report.json"
    lock = ROOT / "requirements" / ("classic-lock.txt" if "classic" in extras else "lock.txt")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                             "--disable-pip-version-check", "--report", str(report), "-c", str(lock),
                             f"{wheel}{extras}"],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    runtimes = names & {"onnxruntime", "onnxruntime-training", "onnxruntime-training-cpu"}
    assert len(runtimes) == 1, (extras, runtimes)
    assert ("onnxruntime" in runtimes) == ("classic" not in extras)  # [all] generates without the training build


# -- Linux arm64: Debian under qemu-user-static (make test sets up the emulation: `make arm64`) ---------


@pytest.mark.classic
def test_the_wheel_trains_digits_on_linux_arm64_under_emulation(wheel, epoch, tmp_path):
    artifacts, data, expected = epoch
    root = emulation.arm64_root(tmp_path)
    emulation.install_wheel(root, wheel)
    work = root / "work"
    shutil.copytree(artifacts, work / "art")
    shutil.copyfile(data, work / data.name)
    (work / "steps.py").write_text(STEPS)
    found = json.loads(emulation.in_arm64(root, f"cd /work && /opt/venv/bin/python steps.py art {data.name}")
                       .splitlines()[-1])
    assert found["engine"] == "portable" and found["onnxruntime"] == "1.32.0", found
    assert found["update"] == "native update kernel (baseline)", found  # NEON: loaded, its self-check passed
    np.testing.assert_allclose(found["losses"], expected, rtol=1e-4)
