"""`python -m benchmarks.gradient_builder [--smollm2]`: the generator's own gradient builder against ONNX
Runtime's (the training build's ``generate_artifacts``), side by side in one run.

Per benchmark model: time and peak RSS of ``generate`` with each builder (fresh processes, alternating, verification
on: both prove the portable graphs, ORT's also the classic ones), and the portable engine's losses over 20 steps
from the same weights and batches (the largest relative difference). ``--smollm2`` adds SmolLM2-135M with LoRA
(``--task causal-lm --base int8 --recompute``), the workstation's largest job. Writes
``benchmarks/results/gradient_builder.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ._machine import machine

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STEPS = 20

def _generate(builder: str, model: str, out: Path) -> dict[str, float]:
    run = subprocess.run([sys.executable, "-m", "benchmarks._generate_one", builder, model, str(out)], cwd=ROOT,
                         capture_output=True, text=True, check=False)  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"{builder} {model}: {run.stderr[-2000:]}")
    return json.loads(run.stdout.splitlines()[-1])


def _losses(artifacts: Path, case) -> list[float]:  # type: ignore[no-untyped-def]
    import torch

    from ondevice import Trainer

    trainer = Trainer.load(artifacts, engine="portable")
    rng = np.random.default_rng(0)
    found = []
    for step in range(STEPS):
        if case.random_batch is not None:
            feeds = case.random_batch(rng, case.batch)
        else:
            torch.manual_seed(step)
            feeds = {k: v.numpy() for k, v in case.inputs(case.batch).items()}
        feeds["labels"] = rng.integers(0, case.classes, size=case.batch).astype(np.int64)
        found.append(trainer.train_step(feeds).loss)
    del trainer
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M with LoRA (minutes, ~8 GB)")
    parser.add_argument("--only", default="", help="comma-separated name prefixes of the models to run")
    args = parser.parse_args(argv)
    from .models import cases

    chosen = [c for c in cases() if not args.only or any(c.name.startswith(p) for p in args.only.split(","))]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, case in enumerate(chosen):
            made, losses = {}, {}
            for builder in ("ort", "own"):  # alternating per model
                out = Path(scratch) / f"{index}-{builder}"  # a trainer of the losses holds its artifacts
                made[builder] = _generate(builder, case.name, out)
                losses[builder] = np.array(_losses(out, case))
            rel = float(np.max(np.abs(losses["own"] - losses["ort"]) / np.abs(losses["ort"])))
            rows.append((case.name, made, rel))
            print(f"{case.name}: {made} max rel loss difference {rel:.2e}", flush=True)
        if args.smollm2:
            made = {b: _generate(b, "smollm2", Path(scratch) / f"lm-{b}") for b in ("ort", "own")}
            rows.append(("SmolLM2-135M LoRA (causal-lm, int8 base, recompute)", made, None))
            print(f"SmolLM2: {made}", flush=True)
    lines = [f"# The generator's own gradient builder against ORT's ({time.strftime('%Y-%m-%d')})", "",
             "Machine: {cpu}, {cores} cores, Python {python}".format(**machine()), "",
             "`generate` with verification on (seconds: the call; peak: the process's VmHWM), fresh processes (ORT's "
             f"builder, then the own one, per model); losses of the portable engine over {STEPS} steps from the same "
             "weights and batches.", "",
             "| model | ORT's builder s | own s | ORT's peak MiB | own peak MiB | max rel loss difference |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, made, rel in rows:
        ort, own = made["ort"], made["own"]
        lines.append(f"| {name} | {ort['seconds']:.1f} | {own['seconds']:.1f} | {ort['peak_mib']:.0f} | "
                     f"{own['peak_mib']:.0f} | {'-' if rel is None else f'{rel:.1e}'} |")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gradient_builder.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
