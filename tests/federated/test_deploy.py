"""Real Flower processes on 127.0.0.1: simulation, deployment (plain, faulty, TLS), interruption.

Every test checks that no process it started is still alive afterwards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from federated.processes import ProcessGroup, flower_env, free_port, started_by
from federated.runner import APP_DIR, deploy, simulate, supernode_command
from federated.tls import make_node_keys

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[2]


def _config(artifacts: Path, data: Path, out: Path, **extra) -> dict:
    return {"artifacts": str(artifacts), "data": str(data), "output": str(out), "num-server-rounds": 2, **extra}


def _alive_with_home(flwr_home: Path) -> list[int]:
    return started_by(str(flwr_home))


def _accuracies(report: dict) -> list[float]:
    return [row["central.accuracy"] for row in report["rounds"]]


def test_a_seeded_run_samples_the_same_clients_and_ends_with_the_same_weights(digits_artifacts, data_dir, tmp_path):
    """Flower gives simulated nodes new random ids each run; the server orders them by partition id
    and seeds each round's sample, so two runs with one seed sample alike and end alike (and
    another seed samples other clients)."""
    runs = {}
    for name, seed in (("first", 3), ("again", 3), ("other", 4)):
        config = _config(digits_artifacts, data_dir, tmp_path / name, **{"num-server-rounds": 3, "seed": seed})
        report = simulate(6, {**config, "fraction-train": 0.5, "min-nodes": 3}, work=tmp_path / f"{name}-work")
        runs[name] = (
            [sorted(row["clients"]) for row in report["rounds"][1:]],  # the partitions sampled to evaluate
            np.load(tmp_path / name / "global_weights.npz"),
        )
    (sampled, weights), (sampled_again, weights_again), (sampled_other, _) = runs.values()
    assert all(len(s) == 3 for s in sampled) and sampled_again == sampled and sampled_other != sampled
    for name in weights.files:
        np.testing.assert_allclose(weights_again[name], weights[name], atol=1e-6, err_msg=name)


def test_simulation_accuracy_rises(digits_artifacts, data_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative work directory, as `make demo` passes (flwr runs in the app folder)
    start = time.monotonic()
    report = simulate(
        4, _config(digits_artifacts, data_dir, tmp_path / "out", **{"num-server-rounds": 3}), work=Path("w")
    )
    wall = time.monotonic() - start
    seconds = [row["seconds"] for row in report["rounds"][1:]]  # each round's wall time, from the server
    assert all(s > 0 for s in seconds) and sum(seconds) < wall
    accuracy = _accuracies(report)
    assert len(accuracy) == 4 and accuracy[-1] > accuracy[0] + 0.3
    assert all(row["bytes_up"] > 0 for row in report["rounds"][1:])
    assert (tmp_path / "out" / "rounds.png").stat().st_size > 10_000
    # the final global model, by the PyTorch model's names: the same weights as global_weights.npz
    from safetensors.numpy import load_file

    final = load_file(tmp_path / "out" / "global_model.safetensors")
    npz = np.load(tmp_path / "out" / "global_weights.npz")
    assert sorted(final) == sorted(n for n in npz.files if not n.startswith("__"))
    for name in final:
        np.testing.assert_array_equal(final[name], npz[name], err_msg=name)
    assert _alive_with_home(tmp_path / "w" / "flwr-home") == []


def test_deployment_survives_a_foreign_node(digits_artifacts, digits_sgd, data_dir, tmp_path):
    nodes = 3

    def node_config(i: int) -> str:
        extra = f' artifacts="{digits_sgd}"' if i == 2 else ""
        return f"partition-id={i} num-partitions={nodes}{extra}"

    config = _config(digits_artifacts, data_dir, tmp_path / "out", **{"round-timeout": 60.0})
    report = deploy(nodes, config, work=tmp_path / "w", node_config=node_config)
    first = report["rounds"][1]
    assert len(first["excluded"]) == 1
    (reason,) = first["excluded"].values()
    assert "differ from the server's" in reason
    assert len(first["bytes_up_per_client"]) == 2
    accuracy = _accuracies(report)
    assert accuracy[-1] > accuracy[0] + 0.3
    assert _alive_with_home(tmp_path / "w" / "flwr-home") == []


def test_deployment_finishes_when_a_node_is_killed_mid_round(digits_artifacts, data_dir, tmp_path):
    groups: list[ProcessGroup] = []
    killed: list[float] = []

    def kill_when_round_starts(line: str) -> None:
        if line.startswith("round 0:") and not killed:  # initial evaluation done: round 1 is being sent
            groups[0].kill("supernode-2")
            killed.append(time.monotonic())

    config = _config(digits_artifacts, data_dir, tmp_path / "out", **{"round-timeout": 20.0})
    report = deploy(3, config, work=tmp_path / "w", after_start=groups.append, on_line=kill_when_round_starts)
    assert killed, "the node was never killed"
    assert len(report["rounds"]) == 3
    assert all(1 <= len(row["bytes_up_per_client"]) <= 2 for row in report["rounds"][1:])
    assert _accuracies(report)[-1] > _accuracies(report)[0] + 0.2
    assert _alive_with_home(tmp_path / "w" / "flwr-home") == []


def test_tls_deployment_refuses_an_unregistered_node(digits_artifacts, data_dir, tmp_path):
    intruder: dict[str, Path] = {}

    def start_intruder(group: ProcessGroup) -> None:
        ca = tmp_path / "w" / "tls" / "ca.crt"
        key = make_node_keys(tmp_path / "intruder", "intruder")  # never registered
        command = supernode_command(
            group.port, "partition-id=0 num-partitions=2", ca=ca, key=key, retries=3, max_wait=5
        )
        group.start("intruder", command)
        intruder["log"] = group.log_path("intruder")

    config = _config(digits_artifacts, data_dir, tmp_path / "out", **{"num-server-rounds": 1})
    report = deploy(2, config, tls=True, work=tmp_path / "w", after_start=start_intruder)
    assert len(report["rounds"][1]["bytes_up_per_client"]) == 2  # only the two registered nodes trained
    text = intruder["log"].read_text(errors="replace")
    # Same CA, valid TLS, but its key was never registered: the SuperLink refuses to activate it.
    assert "Failed to activate SuperNode" in text, text[-2000:]
    assert _alive_with_home(tmp_path / "w" / "flwr-home") == []


def test_unreachable_superlink_gives_up_with_a_message(tmp_path):
    command = supernode_command(free_port(), "partition-id=0 num-partitions=1", retries=2, max_wait=3)
    start = time.monotonic()
    with ProcessGroup(tmp_path, flower_env(tmp_path / "home")) as group:
        assert group.start("node", command).wait(timeout=60) != 0
    assert time.monotonic() - start < 60
    assert "could not establish a connection to the SuperLink" in group.log_path("node").read_text(errors="replace")
    assert _alive_with_home(tmp_path / "home") == []


def _wait_none_alive(flwr_home: Path, seconds: float = 60) -> list[int]:
    """Processes still alive with this FLWR_HOME once they are all gone, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (alive := _alive_with_home(flwr_home)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def _interrupted(command: list[str], sig: signal.Signals, flwr_home: Path) -> tuple[int, set[int]]:
    """Run ``odt COMMAND`` as a terminal starts it, send ``sig`` once round 1 is reported: (its exit status, the
    process groups of the run's processes seen at that moment)."""
    # Started the way a terminal starts it: default signal handling and no blocked signals (a
    # child inherits both from this pytest process, which holds ORT's and torch's threads).
    terminal = (
        "import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, []); "
        "signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    launch = [sys.executable, "-c", terminal, str(Path(sys.executable).parent / "odt"), *command]
    process = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("round 1:"):
            break
    groups = set()
    for pid in _alive_with_home(flwr_home):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    process.send_signal(sig)
    try:
        return process.wait(timeout=60), groups
    except subprocess.TimeoutExpired:
        status = Path(f"/proc/{process.pid}/status").read_text()
        process.kill()
        raise AssertionError(f"no exit 60 s after {sig!r}: " + " ".join(re.findall(r"Sig\w+:\s+\w+", status))) from None


def _in_groups(groups: set[int]) -> list[int]:
    """Live processes whose process group is one of ``groups``."""
    alive = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[0] != "Z" and int(stat[2]) in groups:
            alive.append(int(proc.name))
    return alive


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=["ctrl-c", "sigterm", "sighup", "kill-9"]
)
def test_interrupted_deploy_leaves_no_process(digits_artifacts, data_dir, tmp_path, sig):
    """Ctrl-C, `timeout`/CI cancellation (SIGTERM), a closed terminal (SIGHUP) and kill -9 (no handler runs:
    a watcher process outside odt stops the run's Flower processes) all clean up."""
    out = tmp_path / "out"
    # 100 rounds: the run is still going when the signal lands, so a signal that is not acted on
    # shows as no exit (with 5 rounds it showed as the run's normal exit 0).
    command = ["fl", "deploy", "--nodes", "2", "--rounds", "100", "--artifacts", str(digits_artifacts),
               "--data", str(data_dir), "--out", str(out)]  # fmt: skip
    code, _ = _interrupted(command, sig, out / "logs" / "flwr-home")
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig)
    assert _wait_none_alive(out / "logs" / "flwr-home") == []
    assert os.path.exists(out / "logs" / "superlink.log")


def test_a_terminated_simulation_leaves_no_process_of_ray(digits_artifacts, data_dir, tmp_path):
    """SIGTERM ends `odt fl simulate` and everything in its processes' groups: Ray's DashboardAgent and
    RuntimeEnvAgent carry no FLWR_HOME, ignore SIGTERM, and stayed alive (about 190 MB) before."""
    out = tmp_path / "out"
    command = ["fl", "simulate", "--clients", "2", "--rounds", "100", "--artifacts", str(digits_artifacts),
               "--data", str(data_dir), "--out", str(out)]  # fmt: skip
    code, groups = _interrupted(command, signal.SIGTERM, out / "logs" / "flwr-home")
    assert code == 128 + signal.SIGTERM
    assert groups, "no process of the run was seen"
    deadline = time.monotonic() + 60
    while (left := _in_groups(groups)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in left if Path(f"/proc/{pid}").exists()]


def test_a_run_where_every_client_fails_exits_1_with_the_cause_and_no_old_report(digits_artifacts, data_dir,
                                                                                  tmp_path, capsys):  # fmt: skip
    """A garbage train.npz: every client fails in round 1. Before, odt printed an unchanged accuracy and
    exited 0 (and with an old metrics.json in --out, reported that); now the run stops with the
    first client's error and the path of Flower's log, and the old report stays as it was."""
    from federated.report import write_report
    from ondevice.cli import main

    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    (data / "train.npz").write_bytes(b"not an archive")
    (data / "test.npz").write_bytes((data_dir / "test.npz").read_bytes())
    write_report([{"round": 0, "central.accuracy": 0.99}], out, {"run_id": "an-earlier-run"})
    old = (out / "metrics.json").read_bytes()
    argv = ["fl", "simulate", "--clients", "2", "--rounds", "2", "--artifacts", str(digits_artifacts),
            "--data", str(data), "--out", str(out), "--round-timeout", "120"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "round 1: every one of the 2 clients failed or was excluded" in err, err
    assert "train.npz is not an .npz archive" in err and "RayTaskError" not in err and not err.endswith("'>\n")
    assert str(out / "logs" / "flwr-run.log") in err and err.count("\n") == 1
    assert (out / "metrics.json").read_bytes() == old
    assert _wait_none_alive(out / "logs" / "flwr-home") == []


@pytest.fixture(autouse=True)
def _flower_on_path(monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def test_flwr_run_runs_the_app_folder(digits_artifacts, data_dir, tmp_path):
    """Flower's own runner on the app folder: `flwr run federated/app --stream` with its managed SuperLink.

    What Flower packages is the app folder alone: its pyproject.toml and licence.
    """
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk  # what `flwr run` packages and ships to every node

    fab = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(APP_DIR)))
    assert sorted(fab.namelist()) == [".info/CONTENT", "LICENSE", "pyproject.toml"]
    home = tmp_path / "flwr-home"
    env = flower_env(home)
    config = _config(digits_artifacts, data_dir, tmp_path / "out")
    overrides = " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in config.items())
    command = ["flwr", "run", str(APP_DIR), "--stream", "--federation-config", "num-supernodes=3",
               "--run-config", overrides]  # fmt: skip
    try:
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    finally:
        for pid in started_by(str(home)):  # Flower leaves its managed SuperLink running: stop it
            os.kill(pid, signal.SIGKILL)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "round 2: global accuracy" in result.stdout
    report = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert _accuracies(report)[-1] > _accuracies(report)[0] + 0.3
    time.sleep(0.5)
    assert _alive_with_home(home) == []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _saved_round(path: Path) -> int:
    try:
        with np.load(path) as state:
            return int(json.loads(state["__meta__"].tobytes().decode())["round"])
    except Exception:  # not there yet, or being replaced
        return -1


def test_a_run_whose_server_is_killed_resumes_after_its_last_round(digits_artifacts, data_dir, tmp_path):
    """kill -9 the server (the simulation process that runs the ServerApp) once round 2 is saved;
    `--resume` runs the remaining rounds and ends where an uninterrupted run ends (same seeds, same
    client data, stateless FedAvg: the same weights)."""
    rounds = 8
    base = [str(Path(sys.executable).parent / "odt"), "fl", "simulate", "--clients", "3", "--rounds", str(rounds),
            "--artifacts", str(digits_artifacts), "--data", str(data_dir)]  # fmt: skip
    subprocess.run([*base, "--out", str(tmp_path / "straight")], check=True, capture_output=True, timeout=300)

    out = tmp_path / "killed"
    run = subprocess.Popen([*base, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while _saved_round(out / "run-state.npz") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    servers = [p for p in started_by(str(out / "logs" / "flwr-home")) if "flwr-simulation" in _cmdline(p)]
    for pid in servers:
        os.kill(pid, signal.SIGKILL)
    killed_after = _saved_round(out / "run-state.npz")
    assert servers and 2 <= killed_after < rounds, killed_after
    assert run.wait(timeout=120) != 0 and not (out / "metrics.json").exists()  # the run failed

    failed_log = (out / "logs" / "flwr-run.log").read_bytes()
    # --resume DIR alone: the run's settings come from DIR/run-config.json
    resumed = subprocess.run([*base[:3], "--resume", str(out)], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"resuming after round {killed_after} of {rounds}" in resumed.stdout
    assert (out / "logs" / "flwr-run.attempt-1.log").read_bytes() == failed_log  # the failed attempt's log is kept
    assert not (out / "run-failed.json").exists()
    report = json.loads((out / "metrics.json").read_text())
    assert [r["round"] for r in report["rounds"]] == list(range(rounds + 1))
    straight = np.load(tmp_path / "straight" / "global_weights.npz")
    final = np.load(out / "global_weights.npz")
    for name in straight.files:  # replies are summed in content order, not arrival order
        np.testing.assert_allclose(final[name], straight[name], atol=1e-4, err_msg=name)
    accuracy = json.loads((tmp_path / "straight" / "metrics.json").read_text())["rounds"][-1]
    assert abs(report["rounds"][-1]["central.accuracy"] - accuracy["central.accuracy"]) <= 0.004  # one test example
    assert _alive_with_home(out / "logs" / "flwr-home") == []


def test_secure_aggregation_ends_like_plain_fedavg(digits_no_dropout, data_dir, tmp_path):
    """SecAgg+ in Flower's simulation runtime: a round with and without it ends with the same global
    weights up to the quantization, and the report counts every node's bytes. (One round: AdamW's
    first steps turn differences of 1e-6 into visible ones, so later rounds are compared in the
    benchmark by accuracy.)"""
    reports, weights = {}, {}
    for name, extra in (("plain", {}), ("secure", {"secure-aggregation": True})):
        config = _config(digits_no_dropout[0], data_dir, tmp_path / name, **{"num-server-rounds": 1, **extra})
        reports[name] = simulate(4, config, work=tmp_path / f"{name}-work")
        weights[name] = np.load(tmp_path / name / "global_weights.npz")
    counts = 4 * 200  # at least 200 examples per client here; max-examples (100,000) scales the weights
    bound = 4 * (2 * 4.0 / 2**29) * 100_000 / counts + 1e-6  # a level per node / the summed weights + float32
    for tensor in weights["plain"].files:
        np.testing.assert_allclose(weights["secure"][tensor], weights["plain"][tensor], atol=bound, err_msg=tensor)
    assert _accuracies(reports["secure"]) == pytest.approx(_accuracies(reports["plain"]), abs=0.005)
    (row,) = reports["secure"]["rounds"][1:]
    assert len(row["bytes_up_per_client"]) == 4 and not row["excluded"]


def test_tls_deployment_with_secure_aggregation(digits_artifacts, data_dir, tmp_path):
    """Real SuperLink and SuperNodes over TLS, every round aggregated with SecAgg+, and DP composed
    with it: each node clips its update inside the protocol, the server adds noise to the sum and
    reports the privacy spent so far."""
    from federated.privacy import gaussian_epsilon

    dp = {"dp-noise": 0.001, "dp-clip": 10.0, "dp-mode": "client"}  # little noise: the run must still learn
    config = _config(digits_artifacts, data_dir, tmp_path / "out", **{"secure-aggregation": True, **dp})
    report = deploy(3, config, tls=True, work=tmp_path / "w")
    assert all(len(row["bytes_up_per_client"]) == 3 for row in report["rounds"][1:])
    assert _accuracies(report)[-1] > _accuracies(report)[0] + 0.3
    for row in report["rounds"][1:]:
        assert row["dp_sampled_clients"] == 3 and row["dp_noise_std"] == pytest.approx(0.001 * 10.0 / 3)
        assert row["dp_epsilon"] == pytest.approx(gaussian_epsilon(0.001, row["round"], 1e-5))
    assert report["settings"]["secure_aggregation"] is True
    assert _alive_with_home(tmp_path / "w" / "flwr-home") == []


@pytest.mark.classic
def test_a_round_with_a_classic_and_a_portable_node_averages_like_numpy(digits_no_dropout, data_dir, tmp_path):
    """Real SuperNodes, one training on the classic engine and one on the portable engine (node config
    ``engine``): the round's global weights are numpy's example-weighted average of what each engine
    trains from the same start on that node's data."""
    from federated.config import Settings
    from federated.task import local_epochs, node_data
    from ondevice import Trainer

    artifacts = digits_no_dropout[0]
    engines = ("classic", "portable")
    config = _config(artifacts, data_dir, tmp_path / "out", **{"num-server-rounds": 1})
    describe = lambda i: f'partition-id={i} num-partitions=2 engine="{engines[i]}"'  # noqa: E731
    report = deploy(2, config, work=tmp_path / "work", node_config=describe, on_line=lambda line: None)
    assert report["rounds"][-1]["round"] == 1 and not report["rounds"][-1]["excluded"], report["rounds"][-1]

    settings = Settings.from_config(config)
    updates, counts = [], []
    for pid, engine in enumerate(engines):
        train, _ = node_data(settings, {"partition-id": pid, "num-partitions": 2}, str(artifacts))
        trainer = Trainer.load(artifacts, engine=engine, evaluation=False)
        trainer.set_lr(settings.lr)
        size = len(train["labels"])
        epochs = local_epochs(settings.local_epochs, settings.local_steps, size, settings.batch_size)
        trainer.fit(train, epochs=epochs, batch_size=min(settings.batch_size, size), seed=settings.seed * 100_003 + 1,
                    progress=False)  # fmt: skip
        updates.append(trainer.get_weights())
        counts.append(size)
    final = np.load(tmp_path / "out" / "global_weights.npz")
    for name in updates[0]:
        expected = np.average([u[name] for u in updates], axis=0, weights=counts)
        np.testing.assert_allclose(final[name], expected, atol=2e-6, err_msg=name)
    assert _alive_with_home(tmp_path / "work" / "flwr-home") == []
