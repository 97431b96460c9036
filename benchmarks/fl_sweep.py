"""How the federated defaults were chosen: FedAvg in one process, over settings and seeds.

The digits sample's partitions (Dirichlet 0.5), each node's local training and FedAvg's weighting
by examples, as in the Flower runs of `benchmarks/federation.py` (the same `federated.task`
functions pick a node's data and its local epochs), but without Flower: one process, no
messages, so that many settings x seeds fit in minutes. Per local setting (epochs, lr, minimum
local steps): 10 clients x 20 rounds, and 100 clients x 30 rounds with 10 sampled per round
(seeded), each for three seeds (partitions, data order, sampling); the final accuracy on the
central test set per seed, their mean, and the round at which 90 % is first reached.
Run: .venv-classic/bin/python -m benchmarks.fl_sweep
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from benchmarks._machine import machine  # noqa: E402
from benchmarks.federation import TARGET, prepare  # noqa: E402

SEEDS = (0, 1, 2)
SETTINGS = (
    {"local-epochs": 1, "lr": 0.003, "local-steps": 0},
    {"local-epochs": 2, "lr": 0.003, "local-steps": 0},
    {"local-epochs": 2, "lr": 0.01, "local-steps": 0},
    {"local-epochs": 1, "lr": 0.01, "local-steps": 20},
    {"local-epochs": 1, "lr": 0.01, "local-steps": 40},
)
SETUPS = (("10 clients, 20 rounds", 10, 10, 20), ("100 clients, 10 per round, 30 rounds", 100, 10, 30))
"""(name, clients, clients per round, rounds)"""


def fedavg(
    artifacts: Path, data: Path, setting: dict, clients: int, per_round: int, rounds: int, seed: int
) -> list[float]:
    """Central test accuracy after each round of in-process FedAvg (Flower's weighted mean)."""
    from flwr.server.strategy.aggregate import aggregate

    from federated.task import Settings, local_epochs, node_data
    from ondevice import Trainer
    from ondevice.data import load_npz

    config = {**setting, "artifacts": str(artifacts), "data": str(data), "partitioning": "dirichlet",
              "dirichlet-alpha": 0.5, "seed": seed}  # fmt: skip
    settings = Settings.from_config(config)
    nodes = [
        node_data(settings, {"partition-id": i, "num-partitions": clients}, str(artifacts))[0] for i in range(clients)
    ]
    central = Trainer.load(artifacts)
    if central.get_buffers():
        raise SystemExit("fl_sweep averages weights only; this model has buffers")
    test = load_npz(str(data / "test.npz"))
    weights = central.get_weights()
    rng = np.random.default_rng(seed)
    accuracy = []
    for server_round in range(1, rounds + 1):
        chosen = sorted(rng.choice(clients, per_round, replace=False)) if per_round < clients else range(clients)
        updates = []
        for node in chosen:
            train, size = nodes[node], len(nodes[node]["labels"])
            trainer = Trainer.load(artifacts)  # fresh optimizer moments each round, as the ClientApp
            trainer.set_weights(weights)
            trainer.set_lr(settings.lr)
            epochs = local_epochs(settings.local_epochs, settings.local_steps, size, settings.batch_size)
            trainer.fit(train, epochs=epochs, batch_size=min(settings.batch_size, size),
                        seed=settings.seed * 100_003 + server_round, progress=False)  # fmt: skip
            updates.append((size, trainer.get_weights()))
        names = list(weights)
        weights = dict(zip(names, aggregate([([w[n] for n in names], size) for size, w in updates])))
        central.set_weights(weights)
        accuracy.append(central.evaluate(test)["accuracy"])
    return accuracy


def label(setting: dict) -> str:
    steps = f"at least {setting['local-steps']} steps" if setting["local-steps"] else "no minimum steps"
    return f"{setting['local-epochs']} local epoch{'s' * (setting['local-epochs'] > 1)}, lr {setting['lr']}, {steps}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="odt-fl-sweep-"))
    artifacts, data, central = prepare(work)
    centralized = max(central.values())
    rows = []
    for name, clients, per_round, rounds in SETUPS:
        for setting in SETTINGS:
            curves = [fedavg(artifacts, data, setting, clients, per_round, rounds, seed) for seed in SEEDS]
            rows.append({"setup": name, "setting": setting, "accuracy_per_round": curves})
            print(name, label(setting), [round(c[-1], 4) for c in curves], flush=True)
    (out / "fl_sweep.json").write_text(
        json.dumps({"machine": machine(), "seeds": SEEDS, "centralized_accuracy": central, "rows": rows}, indent=2)
    )
    lines = [
        f"Centralized: {centralized:.4f} (the better of lr {', '.join(map(str, central))}). FedAvg in one process, "
        f"seeds {', '.join(map(str, SEEDS))} (partitions, data order, sampling); final accuracy per seed and their "
        "mean.",
        "",
        "| clients | local setting | final accuracy per seed | mean | mean vs centralized "
        f"| rounds to {TARGET:.0%} per seed |",
        "|---|---|---|---:|---:|---|",
    ]
    for r in rows:
        finals = [c[-1] for c in r["accuracy_per_round"]]
        mean = statistics.mean(finals)
        reached = [next((i + 1 for i, a in enumerate(c) if a >= TARGET), None) for c in r["accuracy_per_round"]]
        lines.append(
            f"| {r['setup']} | {label(r['setting'])} | {', '.join(f'{a:.4f}' for a in finals)} | {mean:.4f} | "
            f"{100 * (mean - centralized):+.1f} pts | {', '.join('-' if n is None else str(n) for n in reached)} |"
        )
    (out / "fl_sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
