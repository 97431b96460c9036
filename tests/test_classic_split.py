"""The suite's two environments: tests marked `classic` need ONNX Runtime's training build. Where it is not
installed (the default .venv: the newest Python, stock onnxruntime) they are left out and the summary says so in one
line; where it is (.venv-classic), they run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ondevice.engines import installed_engines

ROOT = Path(__file__).resolve().parents[1]

TESTS = """
import pytest


@pytest.mark.classic
def test_needs_the_training_build():
    from ondevice.engines import installed_engines

    assert "classic" in installed_engines()


def test_runs_anywhere():
    pass
"""


def test_classic_tests_run_only_where_the_training_build_is_and_are_counted_elsewhere(tmp_path):
    (tmp_path / "test_split.py").write_text(TESTS)
    shutil.copyfile(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "markers=classic", str(tmp_path)]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:]
    if "classic" in installed_engines():
        assert "2 passed" in run.stdout and "not run here" not in run.stdout, run.stdout
    else:
        assert "1 passed, 1 deselected" in run.stdout, run.stdout
        (line,) = [line for line in run.stdout.splitlines() if "not run here" in line]
        assert line.startswith("1 tests of the classic engine not run here: ONNX Runtime's training build"), line
