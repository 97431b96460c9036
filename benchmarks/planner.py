"""The memory planner's estimates against fresh measurements (issue 23: within 25 %).

For each model and trainable set below, at several micro-batch sizes: the estimate
(``artifacts.estimate.footprint``, made before anything is built) and the peak RSS that
``python -m ondevice.measure`` reads from the kernel in a fresh process training the generated
artifacts. ``--fit`` also prints the least-squares BASE_BYTES and ACTIVATION_FACTOR for these
rows, to compare with the constants in ``artifacts/estimate.py``.

Run: .venv-classic/bin/python -m benchmarks.planner [--fit]   (writes benchmarks/results/planner.*)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._machine import machine
from benchmarks.models import MINILM_LORA, cases

ROOT = Path(__file__).resolve().parents[1]
ROWS: list[tuple[str, str, dict[str, Any], tuple[int, ...]]] = [
    # (benchmark case, trainable set in words, generate options, micro-batch sizes)
    ("MLP 784-256-128-10", "everything", {}, (64,)),
    ("CNN + BatchNorm", "everything", {}, (8, 64)),
    ("encoder (all trainable)", "everything", {}, (4, 16)),
    ("BERT-shaped encoder", "everything", {}, (2, 8)),
    ("LSTM next-word (seq 20, hidden 256, vocab 5k)", "everything", {}, (32,)),
    ("MobileNet-style (depthwise, BatchNorm, Hardswish)", "everything", {}, (8, 32)),
    ("MiniLM-L6 (LoRA r8 + head)", "LoRA r8 + head", {"lora": MINILM_LORA, "trainable": ["head"]}, (1, 2, 4, 16)),
    ("MiniLM-L6 (LoRA r8 + head)", "last 8 modules", {"train_last": 8}, (2, 8)),
    ("MiniLM-L6 (LoRA r8 + head)", "last 2 layers + head",
     {"trainable": ["encoder.encoder.layer.4", "encoder.encoder.layer.5", "head"]}, (4,)),
    ("MiniLM-L6 (LoRA r8 + head)", "everything", {}, (4,)),
]  # fmt: skip


def run(work: Path) -> list[dict[str, Any]]:
    from artifacts import Lora, generate
    from artifacts.estimate import footprint
    from artifacts.planner import _batch, measure

    by_name = {case.name: case for case in cases()}
    rows = []
    for number, (case_name, trainable, options, micros) in enumerate(ROWS):
        case = by_name[case_name]
        example = case.inputs(case.batch)
        options = {**options, "lora": Lora(**options["lora"])} if "lora" in options else options
        estimate = footprint(case.build(), example, options)
        directory = work / f"a{number}"
        manifest = generate(case.build(), example, directory, verify=False, force=True, **options)
        for micro in micros:
            measured = measure(directory, _batch(manifest, example, micro, work / "batch.npz"))
            rows.append({"model": case_name.split(" (")[0] if "MiniLM" in case_name else case_name,
                         "trainable": trainable, "micro_batch": micro, "fixed": estimate.fixed,
                         "saved_per_row": estimate.per_row, "saved_constant": estimate.constant_saved,
                         "forward_per_row": estimate.forward_per_row, "forward_constant": estimate.forward_constant,
                         "estimate": estimate.at(micro), "peak_rss": measured["peak_rss"]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _saved(row: dict[str, Any], kind: str = "saved") -> float:
    """Bytes PyTorch saves at the row's micro-batch: for the candidate's backward (``saved``, what
    ACTIVATION_FACTOR multiplies) or with every weight training (``forward``, FORWARD_FACTOR's)."""
    return max(row[f"{kind}_constant"], 0) + row[f"{kind}_per_row"] * row["micro_batch"]


def fit(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """Least squares: peak - weights = BASE + FACTOR x saved bytes."""
    from artifacts.estimate import BASE_BYTES

    weights = np.array([r["fixed"] - BASE_BYTES for r in rows], float)
    saved = np.array([_saved(r) for r in rows], float)
    peak = np.array([r["peak_rss"] for r in rows], float)
    (base, factor), *_ = np.linalg.lstsq(np.stack([np.ones_like(saved), saved], 1), peak - weights, rcond=None)
    return float(base), float(factor)


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    errors = [abs(r["estimate"] / r["peak_rss"] - 1) for r in rows]
    lines = [f"Memory planner estimates, {result['date']}, {result['machine']['cpu']}: the estimate before anything "
             "is built against the peak RSS of a fresh process training the generated artifacts (`ondevice.measure`, "
             "4 steps). The estimate adds to the weights the larger of 1.5x what PyTorch saves for the candidate's "
             "backward and 0.7x what it saves when every weight trains (the whole forward).", "",
             "| model | trainable set | micro-batch | weights and runtime | saved for backward | whole forward "
             "| estimate | measured | estimate / measured |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        saved = _saved(r)
        forward = _saved(r, "forward")
        lines.append(f"| {r['model']} | {r['trainable']} | {r['micro_batch']} | {r['fixed'] / 1e6:.0f} MB | "
                     f"{saved / 1e6:.1f} MB | {forward / 1e6:.1f} MB | {r['estimate'] / 1e6:.0f} MB | "
                     f"{r['peak_rss'] / 1e6:.0f} MB | {r['estimate'] / r['peak_rss']:.2f} |")  # fmt: skip
    lines += ["", f"Largest deviation {100 * max(errors):.0f} %, median {100 * float(np.median(errors)):.0f} % "
              f"over {len(rows)} rows (target: within 25 %)."]  # fmt: skip
    if "fit" in result:
        lines.append(f"Least-squares constants for these rows: base {result['fit'][0] / 2**20:.0f} MiB, "
                     f"activation factor {result['fit'][1]:.2f}.")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help="also print the least-squares constants")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="odt-planner-") as work:
        result: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "rows": run(Path(work))}
    if args.fit:
        result["fit"] = fit(result["rows"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "planner.json").write_text(json.dumps(result, indent=2))
    (args.out / "planner.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
