"""Federated benchmark on the digits sample (Flower simulation runtime, real SuperLink).

10 clients with Dirichlet(0.5) label skew for 20 rounds with the run config's defaults (client lr
0.01, 1 local epoch, at least 40 local steps): FedAvg, FedProx, FedAvgM (server momentum) and
FedAvg with fp16 and int8 update codecs, and FedAvg with the settings before those defaults (2
local epochs, lr 0.003, no minimum steps), against centralized training at both rates; then 100
clients x 30 rounds (10 sampled per round): rounds to 90 % test accuracy, the wall time of a round
once running (from the run's report) and of start-up, and what a client task's SDK work costs
(artifacts, data) the first time and from the process's caches.
Run: .venv-classic/bin/python -m benchmarks.federation [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from benchmarks._machine import machine  # noqa: E402
from federated.config import Settings  # noqa: E402

DEFAULTS = Settings()

TARGET = 0.90


CENTRAL_LRS = (0.003, 0.01)
BEFORE = {"local-epochs": 2, "lr": 0.003, "local-steps": 0}
"""The settings of this benchmark's earlier runs, before the defaults were chosen by it."""


def prepare(work: Path) -> tuple[Path, Path, dict[float, float]]:
    import torch

    from artifacts import generate
    from ondevice import Trainer
    from ondevice.data import load_npz
    from samples.digits.data import prepare as prepare_data
    from samples.digits.model import build

    paths = prepare_data(work / "data")
    artifacts = work / "artifacts"
    generate(build(), {"input": torch.randn(32, 64)}, artifacts, verify=False)
    accuracy = {}
    for lr in CENTRAL_LRS:
        central = Trainer.load(artifacts)
        central.set_lr(lr)
        central.fit(load_npz(str(paths["train"])), epochs=20, batch_size=32, progress=False)
        accuracy[lr] = central.evaluate(load_npz(str(paths["test"])))["accuracy"]
    return artifacts, work / "data", accuracy


def run(name: str, clients: int, config: dict, work: Path) -> dict:
    from federated.runner import simulate

    start = time.perf_counter()
    report = simulate(
        clients, {**config, "output": str(work / name)}, work=work / name / "logs", on_line=lambda _: None
    )
    wall = time.perf_counter() - start
    rounds = report["rounds"][1:]
    return {
        "name": name,
        "clients": clients,
        "rounds": len(rounds),
        "final_accuracy": report["rounds"][-1]["central.accuracy"],
        "accuracy_per_round": [r["central.accuracy"] for r in report["rounds"]],
        "bytes_up_per_round": statistics.median(r["bytes_up"] for r in rounds),
        "bytes_down_per_round": statistics.median(r["bytes_down"] for r in rounds),
        "wall_s": wall,
        "round_s": statistics.median(r["seconds"] for r in rounds[1:]) if len(rounds) > 1 else rounds[0]["seconds"],
        "first_round_s": rounds[0]["seconds"],
        "startup_s": wall - sum(r["seconds"] for r in rounds),
        "rounds_to_target": next((i for i, r in enumerate(report["rounds"]) if r["central.accuracy"] >= TARGET), None),
    }


def local_fit_ms(artifacts: Path, data: Path, config: dict) -> float:
    """Median wall time of one client's local training in the 100-client setting."""
    from federated.task import Settings, local_epochs, node_data
    from ondevice import Trainer

    settings = Settings.from_config({**config, "artifacts": str(artifacts), "data": str(data)})
    train, _ = node_data(settings, {"partition-id": 0, "num-partitions": 100}, str(artifacts))
    size = len(train["labels"])
    epochs = local_epochs(settings.local_epochs, settings.local_steps, size, settings.batch_size)
    times = []
    for _ in range(20):
        trainer = Trainer.load(artifacts)
        start = time.perf_counter()
        trainer.fit(train, epochs=epochs, batch_size=min(settings.batch_size, size), progress=False)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def sdk_task_ms(artifacts: Path, data: Path, config: dict) -> dict[str, float]:
    """Milliseconds of a client task's SDK work in the 100-client setting (medians of 20): a fresh
    trainer (each train task: new optimizer moments; without the eval graph, and with it as every
    task loaded it before, in alternating runs; loaded and freed, as a task does), the evaluation
    trainer and the node's data, loaded cold (a new process's first task) and from the process's
    caches (every later task)."""
    from federated import task

    settings = task.Settings.from_config({**config, "artifacts": str(artifacts), "data": str(data)})
    sha = task.manifest_sha256(artifacts)
    node = {"partition-id": 0, "num-partitions": 100}

    def median_ms(*works, clear=None) -> list[float]:  # type: ignore[no-untyped-def]
        times: list[list[float]] = [[] for _ in works]
        for i in range(20):
            for j in range(len(works))[:: 1 if i % 2 else -1]:  # side by side, alternating who goes first
                if clear:
                    clear()
                start = time.perf_counter()
                works[j]()
                times[j].append(1e3 * (time.perf_counter() - start))
        return [statistics.median(t) for t in times]

    train, train_before = median_ms(
        lambda: task.node_trainer(str(artifacts), sha), lambda: task.Trainer.load(str(artifacts))
    )
    return {
        "train trainer (fresh each task, no eval graph)": train,
        "train trainer with the eval graph (before)": train_before,
        "evaluation trainer, cold": median_ms(
            lambda: task.node_trainer(str(artifacts), sha, for_evaluation=True),
            clear=task._evaluation_trainer.cache_clear,
        )[0],
        "evaluation trainer, cached": median_ms(lambda: task.node_trainer(str(artifacts), sha, for_evaluation=True))[0],
        "node data, cold": median_ms(
            lambda: task.node_data(settings, node, str(artifacts)), clear=task._partitions.cache_clear
        )[0],
        "node data, cached": median_ms(lambda: task.node_data(settings, node, str(artifacts)))[0],
    }


def round_sdk_ms(task_ms: dict[str, float], sampled: int = 10) -> tuple[float, float]:
    """The SDK's work in a round of ``sampled`` train and evaluate tasks: as before (every task
    loads a trainer with the eval graph and the node's data) and now (a training-only trainer per
    train task; the evaluation trainer and the data from the process's caches)."""
    data_cold, data_cached = task_ms["node data, cold"], task_ms["node data, cached"]
    before = sampled * (task_ms["train trainer with the eval graph (before)"] + data_cold) + sampled * (
        task_ms["evaluation trainer, cold"] + data_cold
    )
    now = sampled * (task_ms["train trainer (fresh each task, no eval graph)"] + data_cached) + sampled * (
        task_ms["evaluation trainer, cached"] + data_cached
    )
    return before, now


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 20/30")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="odt-fl-bench-"))
    artifacts, data, central = prepare(work)
    centralized = max(central.values())  # the rows compare with the better of the two rates
    rounds = 3 if args.quick else 20
    base = {
        "artifacts": str(artifacts), "data": str(data), "num-server-rounds": rounds, "partitioning": "dirichlet",
        "dirichlet-alpha": 0.5, "min-nodes": 10,
    }  # fmt: skip
    scale = {**base, "num-server-rounds": 3 if args.quick else 30, "fraction-train": 0.1, "min-nodes": 10}
    local_ms = local_fit_ms(artifacts, data, scale)  # first: a failure here should not cost the runs
    task_ms = sdk_task_ms(artifacts, data, scale)
    sdk_before, sdk_now = round_sdk_ms(task_ms)
    before = "2 local epochs, lr 0.003, no minimum steps (before)"
    rows = [
        run("FedAvg", 10, base, work),
        run(f"FedAvg, {before}", 10, {**base, **BEFORE}, work),
        run("FedProx (mu 0.01)", 10, {**base, "strategy": "fedprox", "proximal-mu": 0.01}, work),
        run("FedAvgM (server momentum 0.9)", 10, {**base, "strategy": "fedavgm"}, work),
        run("FedAvg + fp16 deltas", 10, {**base, "codec": "fp16"}, work),
        run("FedAvg + int8 deltas", 10, {**base, "codec": "int8"}, work),
    ]
    many = [
        ("FedAvg, 100 clients, 10 per round", scale),
        ("FedAvgM, 100 clients, 10 per round", {**scale, "strategy": "fedavgm"}),
        (f"FedAvg, 100 clients, 10 per round, {before}", {**scale, **BEFORE}),
    ]
    rows += [run(name, 100, config, work) for name, config in many]
    (out / "federated.json").write_text(
        json.dumps(
            {
                "machine": machine(),
                "centralized_accuracy": {str(lr): a for lr, a in central.items()},
                "local_fit_ms": local_ms,
                "sdk_task_ms": task_ms,
                "sdk_round_ms": {"before": sdk_before, "now": sdk_now},
                "rows": rows,
            },
            indent=2,
        )  # fmt: skip
    )
    lines = [
        "Centralized (20 epochs on all training data): test accuracy "
        + ", ".join(f"{a:.4f} at lr {lr}" for lr, a in central.items())
        + f"; the rows compare with the better, {centralized:.4f}. Rows without a note use the run config's "
        f"defaults (lr {DEFAULTS.lr}, {DEFAULTS.local_epochs} local epoch, "
        f"at least {DEFAULTS.local_steps} local steps).",
        "",
        f"| run | clients | rounds | final accuracy | vs centralized | rounds to {TARGET:.0%} | bytes up / round "
        "| bytes down / round | wall time | a round (median, from round 2) | first round | start-up |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        reached = "not reached" if r["rounds_to_target"] is None else str(r["rounds_to_target"])
        lines.append(
            f"| {r['name']} | {r['clients']} | {r['rounds']} | {r['final_accuracy']:.4f} | "
            f"{100 * (r['final_accuracy'] - centralized):+.1f} pts | {reached} | "
            f"{r['bytes_up_per_round'] / 1024:.0f} KiB | {r['bytes_down_per_round'] / 1024:.0f} KiB | "
            f"{r['wall_s']:.0f} s | {r['round_s']:.2f} s | {r['first_round_s']:.1f} s | {r['startup_s']:.1f} s |"
        )
    big = rows[-len(many)]
    lines += [
        "",
        f"100 clients: a round takes {big['round_s']:.2f} s once running (10 train and 10 evaluate tasks, "
        f"aggregation, central evaluation), against {local_ms:.1f} ms for one client's local training "
        f"(median of 20); the run's {big['wall_s']:.0f} s are mostly start-up ({big['startup_s']:.1f} s: SuperLink, "
        "`flwr run`, the simulation runtime, and the server's query of every node's partition id for seeded "
        f"sampling, in which Ray's actors start and import the ClientApp; the first round then takes "
        f"{big['first_round_s']:.1f} s). Without sampling (10 clients), the actors start in the first round instead.",
        "",
        "A client task's SDK work (ms, median of 20, in one process; a train task's trainer is loaded and freed, "
        "as in a task, and the two train rows ran alternately):",
        "",
        "| work | ms |",
        "|---|---:|",
        *(f"| {name} | {ms:.2f} |" for name, ms in task_ms.items()),
        "",
        f"The SDK's work in a round of 10 train and 10 evaluate tasks: {sdk_before:.0f} ms when every task loads a "
        f"trainer with the eval graph and the node's data, {sdk_now:.0f} ms now ({sdk_now / sdk_before:.2f} of it).",
    ]
    (out / "federated.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
