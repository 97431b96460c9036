"""`python -m benchmarks`: the SDK's trainer against PyTorch eager, side by side in one run, per model.

Same initial weights, batches and thread count; PyTorch uses a foreach AdamW with ORT's
(Hugging Face) semantics. Blocks of steps alternate between the two sides; figures are medians.
Peak RSS, import time and load + first step come from separate subprocesses per side.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from artifacts import AdamW, Lora, generate

from ._machine import machine
from .models import Case, cases

ROOT = Path(__file__).resolve().parents[1]


class HFAdamW:
    """torch foreach twin of ORT's AdamWOptimizer (adam_mode=1), for a fair eager baseline."""

    def __init__(self, params: list[nn.Parameter], lr: float = 1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.0) -> None:
        self.params, self.lr, self.betas, self.eps, self.wd, self.t = params, lr, betas, eps, wd, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = self.betas
        grads = [p.grad for p in self.params]
        torch._foreach_lerp_(self.m, grads, 1 - b1)
        torch._foreach_mul_(self.v, b2)
        torch._foreach_addcmul_(self.v, grads, grads, value=1 - b2)
        lr_t = self.lr * (1 - b2**self.t) ** 0.5 / (1 - b1**self.t)
        denom = torch._foreach_add(torch._foreach_sqrt(self.v), self.eps)
        torch._foreach_addcdiv_(self.params, self.m, denom, value=-lr_t)
        if self.wd:
            torch._foreach_mul_(self.params, 1 - self.lr * self.wd)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def matmul_gflops(threads: int, size: int = 1024, repeat: int = 20) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


def _batches(case: Case, count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(count):
        if case.random_batch is not None:
            out.append({**case.random_batch(rng, case.batch), "labels": rng.integers(0, case.classes, case.batch)})
            continue
        inputs = {k: v.numpy() for k, v in case.inputs(case.batch).items()}
        if case.vocab:
            inputs = {k: rng.integers(0, case.vocab, v.shape).astype(np.int64) for k, v in inputs.items()}
        else:
            inputs = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in inputs.items()}
        out.append({**inputs, "labels": rng.integers(0, case.classes, case.batch).astype(np.int64)})
    return out


def _train_flops(model: nn.Module, batch: dict[str, np.ndarray], trainable: set[str]) -> float:
    """FLOPs of one training step (forward + backward) with only ``trainable`` requiring grad."""
    from torch.utils.flop_counter import FlopCounterMode

    model = model.train()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trainable)
    inputs = [torch.from_numpy(v) for k, v in batch.items() if k != "labels"]
    with FlopCounterMode(display=False) as counter:
        loss = nn.functional.cross_entropy(model(*inputs), torch.from_numpy(batch["labels"]))
        loss.backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


WIDTH = 0.10
"""Blocks repeat until the speed-up's 95 % interval spans at most this share of its median."""


def ratio_interval(ratios: list[float], *, level: float = 0.95, draws: int = 4000) -> tuple[float, float]:
    """A seeded bootstrap interval of the median of paired per-block ratios (PyTorch / SDK).

    Each block of the SDK runs next to a block of PyTorch, so a ratio per pair cancels the
    machine's slow drifts; the interval says how far the median of those ratios can be trusted.
    """
    samples = np.random.default_rng(0).choice(np.asarray(ratios), size=(draws, len(ratios)), replace=True)
    low, high = np.quantile(np.median(samples, axis=1), [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def measure(case: Case, work: Path, *, threads: int, blocks: int, steps: int, max_blocks: int) -> dict[str, Any]:
    from ondevice import Trainer

    model = case.build()
    example = {k: v for k, v in case.inputs(case.batch).items()}
    directory = work / case.name.replace(" ", "_").replace("(", "").replace(")", "")
    start = time.perf_counter()
    lora = Lora(**case.lora) if case.lora else None
    manifest = generate(model, example, directory, trainable=case.trainable, optimizer=AdamW(), lora=lora, force=True)
    generation_s = time.perf_counter() - start
    batches = _batches(case, 8)

    trainer = Trainer.load(directory, threads=threads)
    torch.set_num_threads(threads)
    twin = case.torch_model().train()
    trained = [p for n, p in twin.named_parameters() if n in {t.name for t in manifest.trainable}]
    for p in twin.parameters():
        p.requires_grad_(p in set(trained))
    optimizer = HFAdamW(trained)
    torch_batches = [
        ({k: torch.from_numpy(v) for k, v in b.items() if k != "labels"}, torch.from_numpy(b["labels"]))
        for b in batches
    ]

    ort_losses: list[float] = []
    torch_losses: list[float] = []

    def ort_block(n: int, offset: int) -> float:
        t = time.perf_counter()
        for i in range(n):
            ort_losses.append(trainer.train_step(batches[(offset + i) % len(batches)]).loss)
        return (time.perf_counter() - t) / n

    def torch_block(n: int, offset: int) -> float:
        t = time.perf_counter()
        for i in range(n):
            inputs, labels = torch_batches[(offset + i) % len(torch_batches)]
            loss = nn.functional.cross_entropy(twin(*inputs.values()), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch_losses.append(float(loss.detach()))
        return (time.perf_counter() - t) / n

    ort_block(3, 0), torch_block(3, 0)  # warm-up
    ort_times: list[float] = []
    torch_times: list[float] = []
    while True:  # `blocks` pairs, then 3 more at a time while the interval is wide
        for _ in range(blocks if not ort_times else 3):
            offset = len(ort_times) * steps
            ort_times.append(ort_block(steps, offset))
            torch_times.append(torch_block(steps, offset))
        ratios = [t / o for t, o in zip(torch_times, ort_times)]
        low, high = ratio_interval(ratios)
        if high - low <= WIDTH * statistics.median(ratios) or len(ort_times) >= max_blocks:
            break
    ort_step, torch_step = statistics.median(ort_times), statistics.median(torch_times)
    flops = _train_flops(case.torch_model(), batches[0], {t.name for t in manifest.trainable})
    return {
        "model": case.name,
        "batch": case.batch,
        "trainable_parameters": manifest.trainable_size,
        "trainable_names": [t.name for t in manifest.trainable],
        "steps_per_block": steps,
        "ort_step_ms": 1e3 * ort_step,
        "torch_step_ms": 1e3 * torch_step,
        "ort_spread_ms": [1e3 * min(ort_times), 1e3 * max(ort_times)],
        "torch_spread_ms": [1e3 * min(torch_times), 1e3 * max(torch_times)],
        "speedup": statistics.median(ratios),
        "speedup_interval": [low, high],
        "noisy": high - low > WIDTH * statistics.median(ratios),
        "blocks": len(ort_times),
        "train_gflop_per_step": flops / 1e9,
        "ort_gflops": flops / ort_step / 1e9,
        "generation_s": generation_s,
        "artifact_bytes": sum((directory / f).stat().st_size for f in manifest.files),
        "ort_losses": ort_losses[3:],
        "torch_losses": torch_losses[3:],
        "directory": str(directory),
    }


RSS_ORT = """
import sys, numpy as np
from ondevice import Trainer
from ondevice.data import load_npz
t = Trainer.load(sys.argv[1], threads=int(sys.argv[3]))
batch = load_npz(sys.argv[2])
for _ in range(20):
    t.train_step(batch)
print(int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024)
"""

RSS_TORCH = """
import json, sys, torch, numpy as np
from benchmarks.models import cases
from benchmarks.compare import HFAdamW
torch.set_num_threads(int(sys.argv[3]))
case = next(c for c in cases() if c.name == sys.argv[1])
model = case.torch_model().train()
trainable = set(json.load(open(sys.argv[4])))  # what the SDK trains: the same set needs grads and moments here
for name, p in model.named_parameters():
    p.requires_grad_(name in trainable)
data = np.load(sys.argv[2])
inputs = [torch.from_numpy(data[k]) for k in data.files if k != "labels"]
labels = torch.from_numpy(data["labels"])
opt = HFAdamW([p for p in model.parameters() if p.requires_grad])
for _ in range(20):
    torch.nn.functional.cross_entropy(model(*inputs), labels).backward()
    opt.step(); opt.zero_grad()
print(int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024)
"""

COLD_ORT = """
import time, sys
t0 = time.perf_counter()
from ondevice import Trainer
from ondevice.data import load_npz
t1 = time.perf_counter()
t = Trainer.load(sys.argv[1])
t.train_step(load_npz(sys.argv[2]))
print(t1 - t0, time.perf_counter() - t1)
"""

COLD_TORCH = """
import json, time, sys
t0 = time.perf_counter()
import torch, numpy as np
t1 = time.perf_counter()
from benchmarks.models import cases
from benchmarks.compare import HFAdamW
case = next(c for c in cases() if c.name == sys.argv[1])
model = case.torch_model().train()
trainable = set(json.load(open(sys.argv[3])))
for name, p in model.named_parameters():
    p.requires_grad_(name in trainable)
data = np.load(sys.argv[2])
opt = HFAdamW([p for p in model.parameters() if p.requires_grad])
torch.nn.functional.cross_entropy(model(*[torch.from_numpy(data[k]) for k in data.files if k != "labels"]),
                                  torch.from_numpy(data["labels"])).backward()
opt.step()
print(t1 - t0, time.perf_counter() - t1)
"""


def _python(code: str, *args: str) -> list[float]:
    # In the repository's root: the child imports `benchmarks` and `samples` as packages.
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True, cwd=ROOT)
    return [float(v) for v in out.stdout.split()]


def process_figures(case: Case, row: dict[str, Any], work: Path, threads: int, repeat: int) -> None:
    batch_file, names_file = work / "batch.npz", work / "trainable.json"
    np.savez(batch_file, **_batches(case, 1)[0])
    names_file.write_text(json.dumps(row["trainable_names"]))
    rss_ort = statistics.median(
        _python(RSS_ORT, row["directory"], str(batch_file), str(threads))[0] for _ in range(repeat)
    )
    torch_args = (case.name, str(batch_file), str(threads), str(names_file))
    rss_torch = statistics.median(_python(RSS_TORCH, *torch_args)[0] for _ in range(repeat))
    cold_ort = [_python(COLD_ORT, row["directory"], str(batch_file)) for _ in range(repeat)]
    cold_torch = [_python(COLD_TORCH, case.name, str(batch_file), str(names_file)) for _ in range(repeat)]
    row.update(
        rss_ort_mib=rss_ort / 2**20,
        rss_torch_mib=rss_torch / 2**20,
        import_ort_s=statistics.median(c[0] for c in cold_ort),
        import_torch_s=statistics.median(c[0] for c in cold_torch),
        load_first_step_ort_s=statistics.median(c[1] for c in cold_ort),
        load_first_step_torch_s=statistics.median(c[1] for c in cold_torch),
    )


def run(out: Path, *, quick: bool = False, threads: int = 2, only: str = "", name: str = "bench") -> dict[str, Any]:
    """Measure the cases (``only``: those whose name contains one of these comma-separated words) and
    write ``NAME.json``/``NAME.md`` (and the charts for the full run) to ``out``."""
    work = Path(tempfile.mkdtemp(prefix="odt-bench-"))
    try:
        chosen = [c for c in cases() if not quick or c.name in ("digits sample", "MLP 784-256-128-10")]
        words = [w.strip() for w in only.split(",") if w.strip()]
        chosen = [c for c in chosen if not words or any(w in c.name for w in words)]
        blocks, max_blocks, steps, repeat = (3, 3, 5, 1) if quick else (9, 18, 20, 3)
        peak = matmul_gflops(threads)
        rows = []
        for case in chosen:
            print(f"bench: {case.name}", file=sys.stderr, flush=True)
            row = measure(
                case, work, threads=threads, blocks=blocks, steps=min(steps, case.steps), max_blocks=max_blocks
            )
            process_figures(case, row, work, threads, repeat)
            row["matmul_gflops"] = matmul_gflops(threads)  # the rate now, next to this row's steps
            row["matmul_share"] = row["ort_gflops"] / row["matmul_gflops"]
            rows.append(row)
        result = {"machine": machine(), "threads": threads, "matmul_gflops": peak, "quick": quick, "rows": rows}
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(result, indent=2))
        (out / f"{name}.md").write_text(markdown(result))
        if name == "bench":
            charts(result, out)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def markdown(result: dict[str, Any]) -> str:
    rates = [r.get("matmul_gflops", result["matmul_gflops"]) for r in result["rows"]]
    lines = [
        f"Threads: {result['threads']} on both sides; machine matmul rate {result['matmul_gflops']:.1f} GFLOP/s "
        f"(float32 1024x1024, torch) at the start, {min(rates):.1f} to {max(rates):.1f} measured after each row "
        "(a row's share is of the rate after it). Speed-up: the median of per-block ratios (PyTorch / SDK, blocks "
        f"interleaved), with its 95 % bootstrap interval; blocks repeat until the interval spans at most "
        f'{WIDTH:.0%} of the median ("noisy" when it still did not).',
        "",
        "| model | batch | SDK step | PyTorch step | speedup (95 % interval, blocks) "
        "| SDK GFLOP/s (share of matmul rate) | peak RSS SDK / PyTorch | import SDK / PyTorch "
        "| load + first step SDK / PyTorch | generation | artifacts |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['ort_step_ms']:.2f} ms | {r['torch_step_ms']:.2f} ms | "
            f"{r['speedup']:.2f}x ({r['speedup_interval'][0]:.2f}-{r['speedup_interval'][1]:.2f}, {r['blocks']}"
            f"{', noisy' if r['noisy'] else ''}) | {r['ort_gflops']:.1f} ({100 * r['matmul_share']:.0f} %) | "
            f"{r['rss_ort_mib']:.0f} / {r['rss_torch_mib']:.0f} MiB | "
            f"{r['import_ort_s']:.2f} / {r['import_torch_s']:.2f} s | "
            f"{1e3 * r['load_first_step_ort_s']:.0f} / {1e3 * r['load_first_step_torch_s']:.0f} ms | "
            f"{r['generation_s']:.1f} s | {r['artifact_bytes'] / 2**20:.2f} MiB |"
        )
    return "\n".join(lines) + "\n"


def charts(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axis = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.5))
    y = np.arange(len(rows))
    axis.barh(y - 0.2, [r["ort_step_ms"] for r in rows], 0.4, label="SDK (ONNX Runtime)")
    axis.barh(y + 0.2, [r["torch_step_ms"] for r in rows], 0.4, label="PyTorch eager")
    axis.set_yticks(y, [f"{r['model']} ({r['speedup']:.2f}x)" for r in rows])
    axis.set_xscale("log")
    axis.set_xlabel("training step, ms (median, log scale)")
    axis.legend()
    fig.tight_layout()
    fig.savefig(out / "bench_steps.png", dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 2.8), squeeze=False)
    for axis, r in zip(axes[0], rows):
        axis.plot(r["ort_losses"], label="SDK")
        axis.plot(r["torch_losses"], label="PyTorch", linestyle="--")
        axis.set_title(r["model"], fontsize=8)
        axis.set_xlabel("step")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out / "bench_losses.png", dpi=100)
    plt.close(fig)
