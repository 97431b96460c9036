"""The device install on real platforms: the built wheel with stock onnxruntime on the other CPython
versions of this machine (pyenv), and on Linux arm64 (Debian under qemu-user), trains the digits
model with the classic engine's losses; no documented install resolves to two ONNX Runtimes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ondevice import Trainer

ROOT = Path(__file__).resolve().parents[1]
DEVICE_LOCK = ROOT / "requirements" / "device-lock.txt"
pytestmark = pytest.mark.slow

STEPS = """
import json, sys
import numpy as np
from ondevice import Trainer
data = np.load(sys.argv[2])
trainer = Trainer.load(sys.argv[1], engine="portable")
losses = [trainer.train_step({"input": data["input"][i:i + 32], "labels": data["labels"][i:i + 32]}).loss
          for i in range(0, len(data["labels"]), 32)]
print(json.dumps({"engine": trainer.engine, "onnxruntime": trainer.ort_version, "losses": losses}))
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
    np.testing.assert_allclose(found["losses"], expected, rtol=1e-5)
    # the command line too, with the engine and runtime in its report
    cli = subprocess.run([str(bin_dir / "odt"), "train", str(artifacts), "--data", str(data), "--epochs", "1",
                          "--checkpoint", "ck", "--json"], cwd=work, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    report = json.loads(cli.stdout)
    assert report["engine"] == "portable" and report["epochs"][0]["epoch"] == 1
    resumed = Trainer.load(artifacts, engine="classic", checkpoint=work / "ck" / "latest.ckpt")  # crosses back
    assert resumed.step == 10


DOCUMENTED = ["[all]", "[device,federated]", "[workstation-classic,federated]"]  # [device], [classic]: installed
# for real by other tests


@pytest.mark.parametrize("extras", DOCUMENTED)
def test_no_documented_install_resolves_to_two_onnx_runtimes(extras, wheel, tmp_path):
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                             "--disable-pip-version-check", "--report", str(report), "-c",
                             str(ROOT / "requirements" / "lock.txt"), f"{wheel}{extras}"],
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    runtimes = names & {"onnxruntime", "onnxruntime-training", "onnxruntime-training-cpu"}
    assert len(runtimes) == 1, (extras, runtimes)
    assert ("onnxruntime" in runtimes) == ("classic" not in extras)  # [all] generates without the training build


# -- Linux arm64: Debian under qemu-user-static (make test sets up the emulation: `make arm64`) ---------

ARM64_ROOT_CACHE = (Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "odt"
                    / f"debian-bookworm-arm64-{hashlib.sha256(DEVICE_LOCK.read_bytes()).hexdigest()[:12]}.tar")
"""A Debian arm64 root with python3 and the device lock's packages in /opt/venv, built once per machine and
device lock (debootstrap took 5.5 min here, the packages 2 min under emulation), outside the clone."""
ARM64_PLATFORMS = ["--platform", "manylinux_2_28_aarch64", "--platform", "manylinux2014_aarch64", "--platform",
                   "manylinux_2_17_aarch64", "--python-version", "3.11", "--implementation", "cp"]  # fmt: skip


def _chroot(root: Path, command: str, timeout: float = 1800) -> str:
    # /proc and /sys stay unmounted: with the host's /sys, `import onnxruntime` segfaults under qemu
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    result = subprocess.run([chroot, str(root), "/bin/sh", "-c", command], capture_output=True, text=True,
                            timeout=timeout, env=env)  # fmt: skip
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _arm64_root(where: Path) -> Path:
    """Unpack the cached arm64 root into ``where`` (building the cache first when it is absent)."""
    root = where / "root"
    if not ARM64_ROOT_CACHE.is_file():
        debootstrap = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
        subprocess.run([debootstrap, "--arch=arm64", "--variant=minbase", "--include=python3,python3-venv", "bookworm",
                        str(root), "http://deb.debian.org/debian"], check=True, capture_output=True, timeout=3600)
        _chroot(root, "python3 -m venv /opt/venv", 1800)
        # the device lock's aarch64 wheels go in from the host's pip (emulated pip took 2 min here, and cannot
        # verify the TLS of this network); the SDK's own wheel is installed by the root's pip in the test
        site = root / "opt" / "venv" / "lib" / "python3.11" / "site-packages"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--only-binary",
                        ":all:", *ARM64_PLATFORMS, "--target", str(site), "--upgrade", "-r", str(DEVICE_LOCK)],
                       check=True, capture_output=True)  # fmt: skip
        ARM64_ROOT_CACHE.parent.mkdir(parents=True, exist_ok=True)
        partial = ARM64_ROOT_CACHE.with_suffix(".partial")
        subprocess.run(["tar", "-cf", str(partial), "-C", str(root), "."], check=True)
        os.replace(partial, ARM64_ROOT_CACHE)
    else:
        root.mkdir()
        subprocess.run(["tar", "-xf", str(ARM64_ROOT_CACHE), "-C", str(root)], check=True)
    return root


def test_the_wheel_trains_digits_on_linux_arm64_under_emulation(wheel, epoch, tmp_path):
    assert Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists(), "arm64 emulation is off: run `make arm64` as root"
    artifacts, data, expected = epoch
    root = _arm64_root(tmp_path)
    work = root / "work"
    shutil.copytree(artifacts, work / "art")
    for source in (wheel, data):
        shutil.copyfile(source, work / source.name)
    (work / "steps.py").write_text(STEPS)
    assert _chroot(root, "uname -m").strip() == "aarch64"
    _chroot(root, f"/opt/venv/bin/pip install -q --disable-pip-version-check --no-index --no-deps /work/{wheel.name}")
    found = json.loads(_chroot(root, f"cd /work && /opt/venv/bin/python steps.py art {data.name}").splitlines()[-1])
    assert found["engine"] == "portable" and found["onnxruntime"] == "1.32.0", found
    np.testing.assert_allclose(found["losses"], expected, rtol=1e-4)
