"""Federated benchmark on the digits sample (Flower simulation runtime, real SuperLink).

10 clients with Dirichlet(0.5) label skew for 20 rounds: FedAvg, FedProx, FedAvgM (server
momentum) and FedAvg with fp16 and int8 update codecs, against centralized training; then 100
clients x 30 rounds (10 sampled per round): rounds to 90 % test accuracy by strategy and local
epochs, and the wall time per round. Run: .venv/bin/python benchmarks/federation.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "samples" / "digits")]

from benchmarks._machine import machine  # noqa: E402

TARGET = 0.90


def prepare(work: Path) -> tuple[Path, Path, float]:
    import torch
    from data import prepare as prepare_data
    from model import build

    from artifacts import generate
    from ondevice import Trainer
    from ondevice.data import load_npz

    paths = prepare_data(work / "data")
    artifacts = work / "artifacts"
    generate(build(), {"input": torch.randn(32, 64)}, artifacts, verify=False)
    central = Trainer.load(artifacts)
    central.set_lr(0.003)
    central.fit(load_npz(str(paths["train"])), epochs=20, batch_size=32, progress=False)
    return artifacts, work / "data", central.evaluate(load_npz(str(paths["test"])))["accuracy"]


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
        "rounds_to_target": next((i for i, r in enumerate(report["rounds"]) if r["central.accuracy"] >= TARGET), None),
    }


def local_fit_ms(artifacts: Path, data: Path, config: dict) -> float:
    """Median wall time of one client's local training in the 100-client setting."""
    from federated.task import Settings, node_data
    from ondevice import Trainer

    settings = Settings.from_config({**config, "artifacts": str(artifacts), "data": str(data)})
    train, _ = node_data(settings, {"partition-id": 0, "num-partitions": 100}, str(artifacts))
    times = []
    for _ in range(20):
        trainer = Trainer.load(artifacts)
        start = time.perf_counter()
        trainer.fit(train, epochs=settings.local_epochs, batch_size=min(32, len(train["labels"])), progress=False)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 20/30")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="odt-fl-bench-"))
    artifacts, data, centralized = prepare(work)
    rounds = 3 if args.quick else 20
    base = {
        "artifacts": str(artifacts), "data": str(data), "num-server-rounds": rounds, "partitioning": "dirichlet",
        "dirichlet-alpha": 0.5, "local-epochs": 2, "min-nodes": 10, "lr": 0.003,
    }  # fmt: skip
    scale = {**base, "num-server-rounds": 3 if args.quick else 30, "fraction-train": 0.1, "min-nodes": 10}
    local_ms = local_fit_ms(artifacts, data, scale)  # first: a failure here should not cost the runs
    rows = [
        run("FedAvg", 10, base, work),
        run("FedProx (mu 0.01)", 10, {**base, "strategy": "fedprox", "proximal-mu": 0.01}, work),
        run("FedAvgM (server momentum 0.9)", 10, {**base, "strategy": "fedavgm"}, work),
        run("FedAvg + fp16 deltas", 10, {**base, "codec": "fp16"}, work),
        run("FedAvg + int8 deltas", 10, {**base, "codec": "int8"}, work),
    ]
    many = [
        ("FedAvg, 100 clients, 10 per round", scale),
        ("FedAvgM, 100 clients, 10 per round", {**scale, "strategy": "fedavgm"}),
        ("FedAvg, 100 clients, 10 per round, 10 local epochs", {**scale, "local-epochs": 10}),
        ("FedAvgM, 100 clients, 10 per round, 10 local epochs", {**scale, "strategy": "fedavgm", "local-epochs": 10}),
    ]
    rows += [run(name, 100, config, work) for name, config in many]
    (out / "federated.json").write_text(
        json.dumps({"machine": machine(), "centralized_accuracy": centralized, "rows": rows}, indent=2)
    )
    lines = [
        f"Centralized (20 epochs on all training data): test accuracy {centralized:.4f}",
        "",
        f"| run | clients | rounds | final accuracy | vs centralized | rounds to {TARGET:.0%} | bytes up / round "
        "| bytes down / round | wall time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        reached = "not reached" if r["rounds_to_target"] is None else str(r["rounds_to_target"])
        lines.append(
            f"| {r['name']} | {r['clients']} | {r['rounds']} | {r['final_accuracy']:.4f} | "
            f"{100 * (r['final_accuracy'] - centralized):+.1f} pts | {reached} | "
            f"{r['bytes_up_per_round'] / 1024:.0f} KiB | {r['bytes_down_per_round'] / 1024:.0f} KiB | "
            f"{r['wall_s']:.0f} s |"
        )
    big = rows[-len(many)]
    per_round = big["wall_s"] / big["rounds"]
    lines += [
        "",
        f"100 clients: {big['wall_s']:.0f} s for {big['rounds']} rounds = {per_round:.2f} s per round; one client's "
        f"local training (median of 20) takes {local_ms:.1f} ms, so {per_round - local_ms / 1e3:.2f} s per round is "
        "Flower's orchestration (a ClientApp process per message, polling) and central evaluation.",
    ]
    (out / "federated.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
