"""Shared fixtures: artifacts generated once per test session (generation needs torch; tests may)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads: Hugging Face models come from local files only


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    from ondevice.data import load_npz
    from samples.digits.data import prepare

    paths = prepare(tmp_path_factory.mktemp("digits-data"))
    return {split: load_npz(str(path)) for split, path in paths.items()}


@pytest.fixture(scope="session")
def data_dir(digits_data, tmp_path_factory) -> Path:
    """train/val/test .npz files of the digits sample in one directory."""
    directory = tmp_path_factory.mktemp("digits-npz")
    for split, arrays in digits_data.items():
        np.savez(directory / f"{split}.npz", **arrays)
    return directory


def _generate(tmp_path_factory, name: str, dropout: bool = True, **options):  # type: ignore[no-untyped-def]
    import torch

    from artifacts import generate
    from samples.digits.model import build

    model = build()
    if not dropout:
        model[2].p = 0.0
    out = tmp_path_factory.mktemp(name) / "artifacts"
    generate(model, {"input": torch.randn(32, 64)}, out, **options)
    return out, model


@pytest.fixture(scope="session")
def digits_artifacts(tmp_path_factory) -> Path:
    """The digits sample model as shipped (with dropout)."""
    return _generate(tmp_path_factory, "digits")[0]


@pytest.fixture(scope="session")
def digits_no_dropout(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The digits model with dropout 0, and its torch twin, for step-by-step comparison."""
    return _generate(tmp_path_factory, "digits-nodrop", dropout=False)


@pytest.fixture(scope="session")
def digits_sgd(tmp_path_factory) -> Path:
    from artifacts import SGD

    return _generate(tmp_path_factory, "digits-sgd", dropout=False, optimizer=SGD(lr=0.05))[0]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a clean copy of the tracked sources (plus the vendored web files)."""
    import shutil
    import subprocess
    import sys

    source = tmp_path_factory.mktemp("source")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in [*tracked.split(), *(str(p.relative_to(ROOT)) for p in (ROOT / "mobile_bridge/web/ort").iterdir())]:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", ".", "-w",
                    str(out)], cwd=source, check=True, capture_output=True)  # fmt: skip
    (found,) = out.glob("ondevice_training-*.whl")
    return found


@pytest.fixture(scope="session")
def stock_python(tmp_path_factory) -> list[str]:
    """A command prefix running Python with stock onnxruntime (the device lock and the text extra, no torch)
    and this clone's ``ondevice`` on the path: what the portable engine meets on a device, whose graph
    optimizer differs from the training build's."""
    import subprocess
    import sys

    where = tmp_path_factory.mktemp("stock-venv")
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    python = str(where / "bin" / "python")
    import tomllib

    text = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["text"]
    lock = str(ROOT / "requirements" / "device-lock.txt")
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", lock, *text],
                   check=True, capture_output=True)  # fmt: skip
    return ["env", f"PYTHONPATH={ROOT}", python]


# -- Tests of the classic engine (ONNX Runtime's training build: CPython 3.11 on Linux x86_64) ----------------------
# They carry @pytest.mark.classic. `make test` runs them in .venv-classic, the rest in .venv (the newest Python, stock
# onnxruntime); where the training build is not installed they are left out, and the summary says so in one line.
CLASSIC_NOT_RUN = pytest.StashKey[int]()


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    from ondevice.engines import installed_engines

    if "classic" in installed_engines():
        return
    classic = [item for item in items if item.get_closest_marker("classic")]
    if classic:
        config.hook.pytest_deselected(items=classic)
        items[:] = [item for item in items if not item.get_closest_marker("classic")]
        config.stash[CLASSIC_NOT_RUN] = len(classic)


def pytest_terminal_summary(terminalreporter, config):  # type: ignore[no-untyped-def]
    if count := config.stash.get(CLASSIC_NOT_RUN, 0):
        terminalreporter.write_line(f"{count} tests of the classic engine not run here: ONNX Runtime's training build "
                                    "is not installed (make test runs them in .venv-classic where CPython 3.11 exists)")
