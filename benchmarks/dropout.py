"""Training with dropout on, before and after the attention-dropout fix (the dropout-training-mode pass).

Before the fix, the attention-probability Dropout of every BERT-family layer never dropped in the
training graph while ORT's gradient through it was scaled by 1 / (1 - p) = 1.11 (p = 0.1). This
trains the intents sample's configuration (MiniLM, LoRA r8 on query/value + head, lr 2e-3) and the
fine-tuning benchmark's full fine-tuning (lr 1e-4) on the sample's homes, with dropout on as
shipped, from artifacts generated without and with the pass: the same epochs and schedule, three
seeds (data order and dropout masks) each, accuracy on the unseen homes.

Run: .venv-classic/bin/python -m benchmarks.dropout [--quick]   (writes benchmarks/results/dropout.*)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._machine import machine
from benchmarks.finetune import CONFIGS, THREADS, generate_config

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"LoRA r8 (query, value) + head": 2e-3, "full fine-tuning": 1e-4}
SEEDS = (0, 1, 2)


def artifacts(name: str, fixed: bool, labels: list[str], out: Path) -> Path:
    """The configuration's artifacts with the pass (``fixed``) or as main generated them before it."""
    import artifacts.passes as passes

    registry = passes.REGISTRY
    if not fixed:
        passes.REGISTRY = tuple(p for p in registry if p.name != "dropout-training-mode")
    try:
        return generate_config(CONFIGS[name], len(labels), labels, out, RUNS[name])
    finally:
        passes.REGISTRY = registry


def train(directory: Path, data: dict[str, Path], lr: float, seed: int, epochs: int) -> dict[str, float]:
    from ondevice import Schedule, Trainer
    from ondevice.text import load_jsonl

    train_set, test = load_jsonl(data["train"], directory), load_jsonl(data["test"], directory)
    trainer = Trainer.load(directory, threads=THREADS)
    steps = epochs * -(-len(train_set["labels"]) // 32)
    trainer.fit(train_set, epochs=epochs, batch_size=32, progress=False, seed=seed,
                schedule=Schedule("cosine", lr, total=steps, warmup=steps // 10))  # fmt: skip
    return trainer.evaluate(test)


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"Dropout on, before and after the attention-dropout fix ({result['date']}; {m['cpu']}, {THREADS} threads; "
        f"{result['epochs']} epochs, batch 32, cosine schedule; test = the sample's unseen homes)",
        "",
        "| configuration | graph | accuracy per seed (0, 1, 2) | mean | test loss (mean) |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        accuracies = ", ".join(f"{a:.4f}" for a in row["accuracy"])
        lines.append(f"| {row['config']} (lr {row['lr']:g}) | {row['graph']} | {accuracies} | "
                     f"{statistics.mean(row['accuracy']):.4f} | {statistics.mean(row['loss']):.4f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 epoch, LoRA only (smoke run)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import transformers

    from samples.intents.data import prepare

    transformers.logging.set_verbosity_error()
    epochs = 1 if args.quick else 2
    work = Path(tempfile.mkdtemp(prefix="odt-dropout-"))
    data = prepare(work / "data")
    labels = json.loads(data["labels"].read_text())
    result: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "epochs": epochs, "rows": []}
    for name, lr in list(RUNS.items())[: 1 if args.quick else None]:
        for fixed in (False, True):
            graph = "fixed: attention dropout drops" if fixed else "before: attention dropout never drops, 1.11x grad"
            directory = artifacts(name, fixed, labels, work / f"{name.split()[0]}-{fixed}")
            runs = [train(directory, data, lr, seed, epochs) for seed in SEEDS]
            row = {"config": name, "lr": lr, "graph": graph, "accuracy": [r["accuracy"] for r in runs],
                   "loss": [r["loss"] for r in runs]}  # fmt: skip
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dropout.json").write_text(json.dumps(result, indent=2))
    (args.out / "dropout.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
