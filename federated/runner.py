"""`odt fl simulate` and `odt fl deploy`: Flower's real SuperLink/SuperNodes on 127.0.0.1, run to the end."""

from __future__ import annotations

import logging
import secrets
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from .errors import DeployError, RunFailedError
from .processes import RUN_TOKEN, ProcessGroup, TreeMemory, flower_env, free_port, wait_healthy
from .report import REPORT, read_outcome
from .tls import make_node_keys, make_tls

__all__ = ["simulate", "deploy", "supernode_command", "register_node", "APP_DIR"]

log = logging.getLogger(__name__)

APP_DIR = Path(__file__).resolve().parent / "app"
"""The Flower app: a folder with only its pyproject.toml ([tool.flwr.app]) and licence, shipped
inside the package; the components it names are this installed package."""


def _run_config(values: Mapping[str, Any]) -> str:
    def text(value: Any) -> str:
        return f'"{value}"' if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)

    return " ".join(f"{key}={text(value)}" for key, value in values.items())


def _write_connection(flwr_home: Path, port: int, ca: Path | None) -> None:
    lines = ["[superlink]", 'default = "odt"', "", "[superlink.odt]", f'address = "127.0.0.1:{port}"']
    lines += [f'root-certificates = "{ca}"'] if ca else ["insecure = true"]
    flwr_home.mkdir(parents=True, exist_ok=True)
    (flwr_home / "config.toml").write_text("\n".join(lines) + "\n")


def _superlink(group: ProcessGroup, port: int, *, simulation: bool, tls: dict[str, Path] | None, auth: bool) -> None:
    command = [
        "flower-superlink", "--host", "127.0.0.1", "--port", str(port),
        "--database", str(group.log_dir / "state.db"), "--disable-runtime-dependency-installation",
        "--isolation", "subprocess",
    ]  # fmt: skip
    command += ["--simulation"] if simulation else []
    if tls:
        command += [
            "--ssl-ca-certfile",
            str(tls["ca"]),
            "--ssl-certfile",
            str(tls["cert"]),
            "--ssl-keyfile",
            str(tls["key"]),
        ]
    else:
        command += ["--insecure"]
    command += ["--enable-supernode-auth"] if auth else []
    process = group.start("superlink", command)
    group.port = port
    wait_healthy(port, process, group.log_path("superlink"), ca=tls["ca"] if tls else None)


def _flwr_run(
    group: ProcessGroup, config: Mapping[str, Any], federation: str | None, on_line: Callable[[str], None]
) -> int:
    command = ["flwr", "run", str(APP_DIR), "odt", "--stream", "--run-config", _run_config(config)]
    command += ["--federation-config", federation] if federation else []
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=group.env, text=True, cwd=group.log_dir,
        start_new_session=True,
    )  # fmt: skip
    group.processes["flwr-run"] = process  # type: ignore[assignment]
    assert process.stdout is not None
    with open(group.log_path("flwr-run"), "w") as transcript:
        for line in process.stdout:
            transcript.write(line)
            on_line(line.rstrip("\n"))
    return process.wait()


def _with_run_id(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with a fresh run id: only a report written under it counts as this run's."""
    return {**config, "run-id": secrets.token_hex(8)}


def _report(config: Mapping[str, Any], group: ProcessGroup, code: int) -> dict[str, Any]:
    """This run's report, or a RunFailedError with the ServerApp's own reason."""
    out = Path(config["output"])
    report, failure = read_outcome(out, config["run-id"])
    if failure is not None:
        raise RunFailedError(f"the federated run failed: {failure} (Flower's log: {group.log_path('flwr-run')})")
    if code != 0:
        raise RunFailedError(f"`flwr run` failed (exit {code}); see {group.log_path('flwr-run')}.")
    if report is None:
        raise RunFailedError(
            f"the run ended without writing its report to {out / REPORT}; see {group.log_path('flwr-run')} "
            f"and the other logs in {group.log_dir}."
        )
    return report


def _memory(group: ProcessGroup) -> TreeMemory:
    return TreeMemory(group.env["FLWR_HOME"], token=group.env[RUN_TOKEN])


def _with_memory(report: dict[str, Any], config: Mapping[str, Any], memory: TreeMemory) -> dict[str, Any]:
    """The report with the peak memory of the run's process tree, also written into OUTPUT/metrics.json."""
    import json

    from ondevice.files import atomic_write_bytes

    memory.sample()  # a run shorter than one sampling interval still gets a figure
    report = {**report, "process_tree": {"peak_pss_bytes": memory.peak, "processes": memory.peak_processes}}
    atomic_write_bytes(Path(config["output"]) / REPORT, json.dumps(report, indent=2).encode())
    return report


def simulate(
    clients: int, config: Mapping[str, Any], *, work: Path | None = None, on_line: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the app with Flower's simulation runtime (a real `flower-superlink --simulation`)."""
    work = Path(work or tempfile.mkdtemp(prefix="odt-fl-")).resolve()  # flwr run works in the app folder
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    _write_connection(work / "flwr-home", port, None)
    with ProcessGroup(work, flower_env(work / "flwr-home")) as group, _memory(group) as memory:
        on_line(f"odt: starting Flower's SuperLink (simulation runtime) on 127.0.0.1:{port}")
        _superlink(group, port, simulation=True, tls=None, auth=False)
        on_line(f"odt: SuperLink up; running the app with {clients} virtual clients (round 0 is the initial model)")
        config = _with_run_id(config)
        code = _flwr_run(group, config, f"num-supernodes={clients}", on_line)
        return _with_memory(_report(config, group, code), config, memory)


def deploy(
    nodes: int,
    config: Mapping[str, Any],
    *,
    tls: bool = False,
    work: Path | None = None,
    node_config: Callable[[int], str] | None = None,
    on_line: Callable[[str], None] = print,
    after_start: Callable[[ProcessGroup], None] | None = None,
) -> dict[str, Any]:
    """A real deployment on 127.0.0.1: one SuperLink, ``nodes`` SuperNodes, then `flwr run`.

    With ``tls`` a throwaway CA signs the SuperLink's certificate and SuperNode authentication
    is on: each node's public key is registered before the run.
    """
    work = Path(work or tempfile.mkdtemp(prefix="odt-fl-")).resolve()  # flwr run works in the app folder
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    certs = make_tls(work / "tls") if tls else None
    _write_connection(work / "flwr-home", port, certs["ca"] if certs else None)
    describe = node_config or (lambda i: f"partition-id={i} num-partitions={nodes}")
    with ProcessGroup(work, flower_env(work / "flwr-home")) as group, _memory(group) as memory:
        on_line(f"odt: starting Flower's SuperLink on 127.0.0.1:{port}" + (" with TLS" if tls else ""))
        _superlink(group, port, simulation=False, tls=certs, auth=tls)
        on_line(f"odt: SuperLink up; starting {nodes} SuperNodes")
        for i in range(nodes):
            key = None
            if certs:
                key = make_node_keys(work / "tls", f"node{i}")
                register_node(group, key["public"])
            command = supernode_command(port, describe(i), ca=certs["ca"] if certs else None, key=key)
            group.start(f"supernode-{i}", command)
        if after_start:
            after_start(group)
        on_line("odt: running the app (round 0 is the initial model)")
        config = _with_run_id(config)
        code = _flwr_run(group, config, None, on_line)
        return _with_memory(_report(config, group, code), config, memory)


def supernode_command(
    port: int,
    node_config: str,
    *,
    ca: Path | None = None,
    key: dict[str, Path] | None = None,
    retries: int = 20,
    max_wait: float = 60.0,
) -> list[str]:
    """A `flower-supernode` for the SuperLink on 127.0.0.1:``port``; it retries with Flower's
    bounded back-off (``retries`` attempts, ``max_wait`` seconds) and then exits with a message."""
    command = [
        "flower-supernode", "--superlink", f"127.0.0.1:{port}", "--host", "127.0.0.1", "--port", str(free_port()),
        "--node-config", node_config, "--isolation", "subprocess",
        "--max-retries", str(retries), "--max-wait-time", str(max_wait),
    ]  # fmt: skip
    command += ["--root-certificates", str(ca)] if ca else ["--insecure"]
    command += ["--auth-supernode-private-key", str(key["private"])] if key else []
    return command


def register_node(group: ProcessGroup, public_key: Path) -> None:
    """`flwr supernode register KEY.pub` against this deployment's SuperLink."""
    result = subprocess.run(
        ["flwr", "supernode", "register", str(public_key), "odt"],
        env=group.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if result.returncode != 0:
        raise DeployError(f"registering {public_key.name} failed: {(result.stdout + result.stderr).strip()[-300:]}")
