"""Runtime benchmark on the digits model: trainer overhead over raw ORT calls, cold start, peak RSS.

Run: .venv-classic/bin/python -m benchmarks.runtime [--out benchmarks/results]
Each figure is a median of interleaved repetitions in one run; RSS and cold start come from
separate subprocesses so that neither side pays for the other's imports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from benchmarks._machine import machine  # noqa: E402

BATCH, EPOCHS = 32, 3
MIN_BLOCKS, MAX_BLOCKS = 31, 151
WIDTH = 0.03
"""Blocks are added until the overhead's 95 % interval spans at most 3 points."""

COLD_START = """
import time, sys
t0 = time.perf_counter()
import numpy as np
t1 = time.perf_counter()
from ondevice import Trainer
t2 = time.perf_counter()
trainer = Trainer.load(sys.argv[1])
t3 = time.perf_counter()
batch = {"input": np.zeros((32, 64), np.float32), "labels": np.zeros(32, np.int64)}
trainer.train_step(batch)
t4 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, t4 - t3)
"""
COLD_PARTS = ("import numpy", "import ondevice (with ONNX Runtime)", "Trainer.load", "first step")

RSS_ONDEVICE = """
import sys, numpy as np
from ondevice import Trainer
from ondevice.data import load_npz
trainer = Trainer.load(sys.argv[1])
trainer.fit(load_npz(sys.argv[2]), epochs=3, batch_size=32, progress=False)
print(int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024)
"""

RSS_TORCH = """
import sys, numpy as np, torch
from samples.digits.model import build
data = np.load(sys.argv[2])
x, y = torch.from_numpy(data["input"]), torch.from_numpy(data["labels"])
model = build().train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8, weight_decay=0.0)
for epoch in range(3):
    for start in range(0, len(x), 32):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[start:start + 32]), y[start:start + 32]).backward()
        optimizer.step()
print(int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024)
"""


def _run(code: str, *args: str) -> float:
    return _run_all(code, *args)[0]


def _run_all(code: str, *args: str) -> list[float]:
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                            cwd=ROOT)  # fmt: skip
    return [float(v) for v in result.stdout.strip().splitlines()[-1].split()]


def overhead(artifacts: Path, train: dict) -> dict[str, float]:
    """Per-step time of Trainer.fit, and of Trainer.train_step, against a hand-written loop of
    the bare ORT calls over the same shuffled batches.

    Blocks of EPOCHS epochs per side, interleaved, the order of the sides alternating from block
    to block so that neither always runs first; the overhead is the median of per-block ratios,
    and blocks are added until its 95 % bootstrap interval spans at most WIDTH (or MAX_BLOCKS).
    """
    import numpy as np

    from benchmarks.compare import ratio_interval
    from ondevice import Trainer

    trainer = Trainer.load(artifacts)
    # The raw loop drives the trainer's own ORT objects: one set of threads and one memory arena,
    # so the difference is the trainer's Python alone (two sessions' spinning thread pools on
    # two cores disturbed each other by more than the overhead being measured).
    raw = trainer._engine
    size = len(train["labels"])
    steps = EPOCHS * -(-size // BATCH)
    batch = {k: v[:BATCH] for k, v in train.items()}

    def raw_block() -> float:
        start = time.perf_counter()
        for epoch in range(EPOCHS):
            order = np.random.default_rng(epoch).permutation(size)
            for first in range(0, size, BATCH):
                index = order[first : first + BATCH]
                raw.train_step([train["input"][index], train["labels"][index]])
                raw.optimizer_step()
                raw.reset_grad()
        return (time.perf_counter() - start) / steps

    def fit_block() -> float:
        trainer.epoch = 0
        start = time.perf_counter()
        trainer.fit(train, epochs=EPOCHS, batch_size=BATCH, progress=False)
        return (time.perf_counter() - start) / steps

    def step_block() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(batch)
        return (time.perf_counter() - start) / steps

    sides = {"raw": raw_block, "fit": fit_block, "step": step_block}
    for run in sides.values():
        run()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in sides}
    while True:
        order = list(sides) if len(times["raw"]) % 2 == 0 else list(reversed(sides))
        for name in order:
            times[name].append(sides[name]())
        ratios = {k: [t / r for t, r in zip(times[k], times["raw"])] for k in ("fit", "step")}
        low, high = ratio_interval(ratios["fit"])
        if len(times["raw"]) >= MIN_BLOCKS and (high - low <= WIDTH or len(times["raw"]) >= MAX_BLOCKS):
            break
    ratio = {k: statistics.median(v) for k, v in ratios.items()}
    return {
        "raw_ort_step_ms": 1e3 * statistics.median(times["raw"]),
        "fit_step_ms": 1e3 * statistics.median(times["fit"]),
        "train_step_ms": 1e3 * statistics.median(times["step"]),
        "fit_overhead_pct": 100 * (ratio["fit"] - 1),
        "fit_overhead_interval_pct": [100 * (low - 1), 100 * (high - 1)],
        "overhead_blocks": len(times["raw"]),
        "train_step_overhead_pct": 100 * (ratio["step"] - 1),
    }


def fetch_reading(artifacts: Path, train: dict) -> dict[str, float]:
    """Microseconds to turn one step's fetched outputs into numpy: iterating ORT's OrtValueVector
    (how ORT's own Python API reads them) against indexing it (what ondevice.session does)."""
    import timeit

    from ondevice import Manifest
    from ondevice.engines import open_engine
    from ondevice.session import C

    session = open_engine(artifacts, Manifest.load(artifacts), "classic", artifacts / "checkpoint", threads=None,
                          lean_memory=False, with_eval=False)  # fmt: skip
    fetches = C.OrtValueVector()
    session.module.train_step([train["input"][:BATCH], train["labels"][:BATCH]], fetches)
    ways = {
        "iterating": lambda: [value.numpy() for value in fetches],
        "by_index": lambda: [fetches[i].numpy() for i in range(len(fetches))],
    }
    return {f"fetch_{k}_us": 1e6 * min(timeit.repeat(f, number=2000, repeat=5)) / 2000 for k, f in ways.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    from artifacts import generate
    from ondevice.data import load_npz
    from samples.digits.data import prepare
    from samples.digits.model import build

    work = Path(tempfile.mkdtemp(prefix="odt-bench-"))
    paths = prepare(work / "data")
    artifacts = work / "artifacts"
    generate(build(), {"input": torch.randn(BATCH, 64)}, artifacts, verify=False)
    train = load_npz(str(paths["train"]))
    figures = {**overhead(artifacts, train), **fetch_reading(artifacts, train)}
    cold = [_run_all(COLD_START, str(artifacts)) for _ in range(7)]
    figures["import_load_first_step_s"] = statistics.median(sum(parts) for parts in cold)
    figures["cold_start_parts_ms"] = {k: 1e3 * statistics.median(p[i] for p in cold) for i, k in enumerate(COLD_PARTS)}
    rss_ondevice = [_run(RSS_ONDEVICE, str(artifacts), str(paths["train"])) for _ in range(3)]
    rss_torch = [_run(RSS_TORCH, "", str(paths["train"])) for _ in range(3)]
    figures["peak_rss_ondevice_mib"] = statistics.median(rss_ondevice) / 2**20
    figures["peak_rss_torch_mib"] = statistics.median(rss_torch) / 2**20
    figures["rss_ratio"] = figures["peak_rss_ondevice_mib"] / figures["peak_rss_torch_mib"]
    (out / "runtime.json").write_text(json.dumps({"machine": machine(), "figures": figures}, indent=2))
    f = figures
    rows = [
        ("hand-written loop of raw ORT calls, per step", f"{f['raw_ort_step_ms']:.3f} ms"),
        ("`Trainer.fit`, per step (NaN guard, metrics, seeded dropout)", f"{f['fit_step_ms']:.3f} ms"),
        (
            f"`Trainer.fit` overhead over the raw loop (median of {f['overhead_blocks']} interleaved blocks of "
            f"{EPOCHS} epochs; 95 % interval)",
            f"{f['fit_overhead_pct']:.1f} % ({f['fit_overhead_interval_pct'][0]:.1f} to "
            f"{f['fit_overhead_interval_pct'][1]:.1f} %)",
        ),
        (
            "`Trainer.train_step(batch)`, which also validates every batch",
            f"{f['train_step_ms']:.3f} ms ({f['train_step_overhead_pct']:+.1f} %)",
        ),
        (
            "reading a step's outputs into numpy: iterating ORT's `OrtValueVector` / by index (best of 5)",
            f"{f['fetch_iterating_us']:.1f} / {f['fetch_by_index_us']:.1f} us",
        ),
        ("import + load + first step (median of 7 processes)", f"{f['import_load_first_step_s'] * 1e3:.0f} ms"),
        *((f"- of which {k} (median)", f"{v:.1f} ms") for k, v in f["cold_start_parts_ms"].items()),
        ("peak RSS, training process, ondevice", f"{f['peak_rss_ondevice_mib']:.0f} MiB"),
        ("peak RSS, training process, PyTorch eager", f"{f['peak_rss_torch_mib']:.0f} MiB"),
    ]
    table = "\n".join(
        ["| figure (digits model, batch 32) | value |", "|---|---:|"] + [f"| {a} | {b} |" for a, b in rows]
    )
    (out / "runtime.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
