"""Start Flower's own processes (SuperLink, SuperNodes, `flwr run`) and always stop them by PID."""

from __future__ import annotations

import logging
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Sequence

from .errors import DeployError

__all__ = [
    "RUN_TOKEN", "ProcessGroup", "Terminated", "TreeMemory", "free_port", "flower_env", "wait_healthy", "started_by",
]  # fmt: skip

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


RUN_TOKEN = "ODT_RUN"
"""The environment variable that marks every process of one run (Ray's workers included): the
watcher and the cleanup signal only processes that carry this run's value, never another run's,
even one that shares the FLWR_HOME."""


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower's processes: own FLWR_HOME and run token, no telemetry, update check or
    dependency installation, this venv's executables first."""
    import uuid

    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(flwr_home),
        **{RUN_TOKEN: uuid.uuid4().hex},
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",  # the apps run in this environment, no `uv sync`
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    return env


def wait_healthy(
    port: int, process: subprocess.Popen[bytes], log_path: Path, *, ca: Path | None = None, timeout: float = 30.0
) -> None:
    """Wait until a SuperLink answers on its HTTP(S) port, or fail with its log's last lines."""
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    url = f"{'https' if ca else 'http'}://127.0.0.1:{port}/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DeployError(f"flower-superlink exited with code {process.returncode}: {_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=1, context=context) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise DeployError(f"flower-superlink did not become healthy within {timeout:.0f} s: {_tail(log_path)}")


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived (``timeout``, CI cancellation, a service manager, a closed terminal):
    handled like Ctrl-C, so every process is stopped on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


class ProcessGroup:
    """Processes started in their own sessions; leaving the block (also by error, Ctrl-C, SIGTERM
    or SIGHUP) terminates each whole process group by PID, then kills what is still alive."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.port: int | None = None  # the SuperLink's, once started
        self._logs: list[IO[bytes]] = []
        self._previous: dict[int, object] = {}  # signal handlers replaced while the group runs
        self._reaper: subprocess.Popen[bytes] | None = None

    def start(
        self, name: str, command: Sequence[str], *, extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        handle = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self._logs.append(handle)
        try:
            process = subprocess.Popen(
                list(command),
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**self.env, **(extra_env or {})},
                start_new_session=True,
            )
        except OSError as exc:
            raise DeployError(f"cannot start {command[0]}: {exc.strerror}") from exc
        self.processes[name] = process
        log.debug("started %s (pid %d): %s", name, process.pid, " ".join(command))
        return process

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def kill(self, name: str) -> None:
        """Kill one process group now (fault injection, or a node that must go)."""
        process = self.processes[name]
        _signal_group(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        for process in self.processes.values():  # what is left of each group
            _signal_group(process.pid, signal.SIGKILL)
        # Descendants that started sessions of their own still carry this run's FLWR_HOME and token.
        _kill_started_by(self.env.get("FLWR_HOME", ""), self.env.get(RUN_TOKEN), seconds=10)
        for handle in self._logs:
            handle.close()
        if self._reaper is not None:  # nothing left to reap: it sees its pipe close and exits
            self._reaper.stdin.close()  # type: ignore[union-attr]
            try:
                self._reaper.wait(timeout=40)
            except subprocess.TimeoutExpired:  # it gives up after 30 s itself; never let it outlive us
                self._reaper.kill()
                self._reaper.wait()

    def __enter__(self) -> ProcessGroup:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._previous[sig] = signal.signal(sig, _raise_terminated)
        home = self.env.get("FLWR_HOME", "")
        if home:  # kill -9 of this process runs no handler: a watcher outside it stops the run's processes
            env = {k: v for k, v in os.environ.items() if k not in ("FLWR_HOME", RUN_TOKEN)}
            self._reaper = subprocess.Popen(
                [sys.executable, "-m", "federated.processes", "--reap", home, self.env.get(RUN_TOKEN, "")],
                stdin=subprocess.PIPE, env=env, start_new_session=True,
            )  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def started_by(flwr_home: str, token: str | None = None) -> list[int]:
    """Live (non-zombie) processes whose environment holds ``FLWR_HOME=flwr_home`` (and, given a
    ``token``, this run's :data:`RUN_TOKEN`)."""
    if not flwr_home:
        return []
    needles = {f"FLWR_HOME={flwr_home}".encode(), *([f"{RUN_TOKEN}={token}".encode()] if token else [])}
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if int(proc.name) == os.getpid() or not needles <= set((proc / "environ").read_bytes().split(b"\0")):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


class TreeMemory:
    """The peak memory of a run's whole process tree, sampled every ``every`` seconds in a thread.

    The tree is this process, its descendants and everything with the run's ``FLWR_HOME`` (Ray's
    workers in a simulation are not descendants). Each process counts its proportional set size
    (PSS: a page shared by N processes counts 1/N in each), so the sum is what the tree holds
    together; RSS would count the libraries every Ray worker maps many times over. Linux only
    (``peak`` stays 0 elsewhere). ``/usr/bin/time`` on the command sees only its own process: 149 MB
    in one run and 1.51 GB in an identical one, while the tree held 2.8 GB.
    """

    def __init__(self, flwr_home: str, every: float = 1.0, token: str | None = None) -> None:
        self.flwr_home, self.every, self.token = flwr_home, every, token
        self.peak = 0
        self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="odt-tree-memory", daemon=True)

    def __enter__(self) -> TreeMemory:
        if sys.platform.startswith("linux"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> int:
        """Sum the tree's PSS now; keeps the peak. Returns the sum (bytes)."""
        pids = {os.getpid(), *_descendants(os.getpid()), *started_by(self.flwr_home, self.token)}
        total = sum(_pss(pid) for pid in pids)
        if total > self.peak:
            self.peak, self.peak_processes = total, len(pids)
        return total


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(proc.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _pss(pid: int) -> int:
    """A process's proportional set size in bytes (0 when it is gone or unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _reap(flwr_home: str, token: str | None) -> None:
    """Wait until the process that started a run ends (its pipe closes, however it ended), then kill
    every process left of the run: SuperLink, SuperNodes, `flwr run`, their apps, Ray's workers."""
    sys.stdin.buffer.read()
    _kill_started_by(flwr_home, token, seconds=30)


def _kill_started_by(flwr_home: str, token: str | None, *, seconds: float) -> None:
    """SIGKILL every process of the run (its FLWR_HOME and token) until none is left, for at most ``seconds``,
    then what is left of their process groups: Ray's DashboardAgent and RuntimeEnvAgent run in the simulation
    process's group with an environment of their own (no FLWR_HOME), ignore SIGTERM, and outlived
    ``odt fl simulate`` (about 190 MB) until this."""
    deadline = time.monotonic() + seconds
    groups: set[int] = set()
    while (stray := started_by(flwr_home, token)) and time.monotonic() < deadline:
        for pid in stray:
            try:
                groups.add(os.getpgid(pid))
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
    for group in groups - {0, 1, os.getpgrp()}:  # never this process's own group (a terminal's job)
        _signal_group(group, signal.SIGKILL)


if __name__ == "__main__" and sys.argv[1:2] == ["--reap"]:
    _reap(sys.argv[2], (sys.argv[3:4] or [""])[0] or None)
