"""Users install the package, not this clone: build the wheel, install it into fresh virtual
environments OUTSIDE the repository, and run the digits flow from an empty directory.

- the device install (``[device]``: stock onnxruntime, the portable engine): torch never needed;
  train/evaluate/export/predict on the artifacts the workstation made, `odt generate` says which
  extra it needs;
- the same environment plus ``[federated]``: a Flower simulation writes its report and plot;
- ``[all]`` (stock onnxruntime: the generator's own gradient builder, the portable engine, no training build):
  generate, train, evaluate, export, predict, fl simulate, keygen, bundle, and
  `bridge serve` answering ``/web/`` with the browser client and the onnxruntime-web files.
Versions come from requirements/lock.txt (as constraints), like `make`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

MODEL = """
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
"""

DATA = """
import numpy as np
from sklearn.datasets import load_digits
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype(np.float32)
order = np.random.default_rng(0).permutation(len(y))
x, y = x[order], y[order]
np.savez("data/train.npz", input=x[:1400], labels=y[:1400])
np.savez("data/test.npz", input=x[1400:], labels=y[1400:])
"""


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _venv(path: Path, wheel: Path, extra: str) -> tuple[Path, dict[str, str]]:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{path / 'bin'}{os.pathsep}{env['PATH']}"
    install = [str(path / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
    _run([*install, "-c", str(ROOT / "requirements" / "lock.txt"), f"{wheel}{extra}"], path, env)
    return path / "bin", env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_extra_runs_the_digits_flow_from_an_empty_directory(wheel, tmp_path):
    bin_dir, env = _venv(tmp_path / "venv", wheel, "[all]")
    odt = str(bin_dir / "odt")
    work = tmp_path / "empty"
    (work / "data").mkdir(parents=True)
    (work / "model.py").write_text(MODEL)
    _run([str(bin_dir / "python"), "-c", DATA], work, env)

    out = _run([odt, "generate", "--model", "model.py:build", "--input", "input:32x64:float32", "--out", "art"],
               work, env)  # fmt: skip
    assert "verification: PASS" in out and "training_model.portable.onnx: grad 3.weight" in out, out
    assert oct((work / "art" / "manifest.json").stat().st_mode & 0o777) == "0o644"
    made = json.loads(_run([odt, "inspect", "art", "--json"], work, env))
    assert made["engines"]["carried"] == ["portable"] and not (work / "art" / "optimizer_model.onnx").exists()
    _run([odt, "train", "art", "--data", "data/train.npz", "--epochs", "3", "--checkpoint", "ck"], work, env)
    metrics = json.loads(_run([odt, "evaluate", "art", "--data", "data/test.npz", "--checkpoint", "ck", "--json"],
                              work, env))  # fmt: skip
    assert metrics["accuracy"] > 0.85
    _run([odt, "export", "art", "--checkpoint", "ck", "--out", "model.onnx"], work, env)
    predicted = json.loads(_run([odt, "predict", "model.onnx", "--artifacts", "art", "--data", "data/test.npz",
                                 "--json"], work, env))  # fmt: skip
    assert len(predicted["output"]) == 397

    report = json.loads(_run([odt, "fl", "simulate", "--clients", "2", "--rounds", "1", "--artifacts", "art",
                              "--data", "data", "--out", "fl", "--json"], work, env))  # fmt: skip
    assert report["rounds"][-1]["central.accuracy"] > 0.3
    assert (work / "fl" / "rounds.png").stat().st_size > 10_000

    _run([odt, "keygen", "--out", "keys/odt"], work, env)
    assert oct((work / "keys" / "odt").stat().st_mode & 0o777) == "0o600"
    _run([odt, "bundle", "art", "--out", "bundle", "--sign-key", "keys/odt"], work, env)
    port = _free_port()
    server = subprocess.Popen([odt, "bridge", "serve", "bundle", "--public-key", "keys/odt.pub", "--port", str(port)],
                              cwd=work, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        page = _get(f"http://127.0.0.1:{port}/web/")
        assert "<html" in page.decode().lower()
        for wasm in ("ort-wasm-simd-threaded.wasm", "ort-training-wasm-simd-threaded.wasm"):  # current, 1.19.2
            assert len(_get(f"http://127.0.0.1:{port}/web/ort/{wasm}")) > 1_000_000
        assert b"export" in _get(f"http://127.0.0.1:{port}/web/odt-web.mjs")
        assert b"OdtClient" in _get(f"http://127.0.0.1:{port}/web/odt-worker.mjs")  # the page trains in it
    finally:
        server.terminate()
        server.wait(timeout=30)

    # the device side alone: stock onnxruntime, no torch, every device command works on the artifacts made above
    device_bin, device_env = _venv(tmp_path / "device", wheel, "[device]")
    device = str(device_bin / "odt")
    code = "import sys, ondevice; ondevice.Trainer; assert 'torch' not in sys.modules and 'flwr' not in sys.modules"
    _run([str(device_bin / "python"), "-c", code], work, device_env)
    engines = json.loads(_run([device, "inspect", "art", "--json"], work, device_env))["engines"]
    assert engines["installed"] == ["portable"] and engines["runs"].startswith("portable (onnxruntime 1.3"), engines
    _run([device, "train", "art", "--data", "data/train.npz", "--epochs", "1", "--checkpoint", "dev"], work,
         device_env)  # fmt: skip
    _run([device, "predict", "art", "--checkpoint", "dev", "--data", "data/test.npz", "--out", "p.npz"], work,
         device_env)  # fmt: skip
    _run([device, "export", "art", "--checkpoint", "dev", "--out", "w.safetensors"], work, device_env)
    from safetensors.numpy import load_file  # every weight by name, written without torch

    from ondevice import Manifest

    manifest = Manifest.load(work / "art")
    assert sorted(load_file(work / "w.safetensors")) == sorted(p.name for p in (*manifest.trainable, *manifest.frozen))
    refused = subprocess.run([device, "generate", "--model", "model.py:build", "--input", "input:4x64:float32",
                              "--out", "x"], cwd=work, env=device_env, capture_output=True, text=True)  # fmt: skip
    assert refused.returncode == 1 and "needs torch" in refused.stderr, refused.stderr

    # add the federated extra: a Flower run that writes its report (matplotlib comes with it)
    _run([str(device_bin / "pip"), "install", "-q", "-c", str(ROOT / "requirements" / "lock.txt"),
          f"{wheel}[federated]"], work, device_env)  # fmt: skip
    _run([device, "fl", "simulate", "--clients", "2", "--rounds", "1", "--artifacts", "art", "--data", "data",
          "--out", "fl2"], work, device_env)  # fmt: skip
    assert (work / "fl2" / "metrics.json").is_file() and (work / "fl2" / "rounds.png").is_file()


def _get(url: str, attempts: int = 100) -> bytes:
    for _ in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read()
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer")


def test_a_wheel_without_the_browser_files_is_refused_with_what_to_do(tmp_path):
    """`pip wheel` of a source tree where npm never ran fails, naming `make wheel` and the opt-out; with the opt-out
    it builds a wheel without them."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    source = tmp_path / "source"
    for name in tracked.split():  # the tracked sources only: no mobile_bridge/web/ort
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((ROOT / name).read_bytes())
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "ODT_WHEEL_WITHOUT_BROWSER"}
    refused = subprocess.run(build, cwd=source, capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and not list(tmp_path.glob("*.whl"))
    said = " ".join((refused.stdout + refused.stderr).split())
    assert "the browser client's onnxruntime-web files are not in mobile_bridge/web/ort" in said, said[-2000:]
    assert "`make wheel`" in said and "ODT_WHEEL_WITHOUT_BROWSER=1" in said
    without = {**env, "ODT_WHEEL_WITHOUT_BROWSER": "1"}
    built = subprocess.run(build, cwd=source, capture_output=True, text=True, env=without)
    assert built.returncode == 0, built.stderr[-2000:]
    assert len(list(tmp_path.glob("ondevice_training-*.whl"))) == 1
