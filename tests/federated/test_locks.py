"""Runs lock what they use: one federated run per --out, cleanup that signals only its own run's
processes, and node counts a machine can start."""

from __future__ import annotations

import subprocess
import sys
import time

from federated.processes import ProcessGroup, flower_env
from ondevice.cli import main


def _hold(code: str) -> subprocess.Popen[str]:
    """A process that runs ``code`` (which prints "holding" once it holds what it holds), then waits."""
    code += "\nprint('holding', flush=True)\nimport time\ntime.sleep(120)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    return holder


def test_a_second_run_with_the_same_out_is_refused_naming_the_first(digits_artifacts, data_dir, tmp_path, capsys):
    out = tmp_path / "out"
    holder = _hold(f"from federated.cli import run_lock\nfrom pathlib import Path\n"
                   f"lock = run_lock(Path({str(out)!r}))\nlock.__enter__()")  # fmt: skip
    try:
        (out / "run-config.json").write_text("the first run's")
        code = main(["fl", "simulate", "--artifacts", str(digits_artifacts), "--data", str(data_dir),
                     "--out", str(out), "--clients", "2"])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 1 and f"--out {out} is in use by pid {holder.pid}; another odt run writes there" in err, err
        assert (out / "run-config.json").read_text() == "the first run's"  # nothing of the second run was written
        assert sorted(p.name for p in out.iterdir()) == [".odt-run.lock", "run-config.json"]
    finally:
        holder.kill()
        holder.wait()


def test_cleanup_signals_only_its_own_runs_processes(tmp_path):
    """Two runs that share a FLWR_HOME (before the --out lock, two runs with one --out did): the
    first to end used to SIGKILL the other's processes, which carried the same FLWR_HOME."""
    home = tmp_path / "flwr-home"
    first = ProcessGroup(tmp_path, flower_env(home))
    first.__enter__()
    try:
        survivor = first.start("sleeper", ["sleep", "120"])
        with ProcessGroup(tmp_path, flower_env(home)) as second:
            victim = second.start("sleeper-2", ["sleep", "120"])
        assert victim.poll() is not None  # the second run's own process was stopped
        time.sleep(0.5)
        assert survivor.poll() is None, "the second run's cleanup killed the first run's process"
    finally:
        first.__exit__(None, None, None)
    assert survivor.poll() is not None


def test_deploy_refuses_more_supernodes_than_the_machine_can_start(digits_artifacts, data_dir, tmp_path, capsys):
    code = main(["fl", "deploy", "--artifacts", str(digits_artifacts), "--data", str(data_dir),
                 "--out", str(tmp_path / "out"), "--nodes", "100000"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--nodes 100000 would start 100000 SuperNode processes" in err, err
    assert not (tmp_path / "out").exists()
    code = main(["fl", "deploy", "--artifacts", str(digits_artifacts), "--data", str(data_dir), "--out", "/proc/x"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: cannot create --out /proc/x") and err.count("\n") == 1, err
