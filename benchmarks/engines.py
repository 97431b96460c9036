"""`python -m benchmarks.engines`: the portable engine on the newest stock onnxruntime beside the classic
engine (onnxruntime-training 1.19.2), PyTorch eager and ExecuTorch, on every benchmark model.

The two ONNX Runtimes cannot share a process (or an environment): each side is a worker process, the
portable one in its own virtual environment (``.venv-stock``, made from requirements/device-lock.txt
on first use). ExecuTorch's worker runs on this venv's torch with ExecuTorch's own directory on its path
(``benchmarks.executorch``; installed there on first use): it exports the row, checks its first gradients
against PyTorch's and trains with AdamW, or says why it cannot. The workers take turns: one block of steps
each, in rotation, so all see the same phases of the machine; a row's speed is the median over blocks of
the per-block ratio. Each worker then reports its load time and its peak RSS (VmHWM: load, warm-up and
every step). Writes benchmarks/results/engines.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ._machine import machine
from .compare import _batches
from .executorch import LIB, Refused, last_exception, runtime_check
from .executorch import setup as executorch_setup
from .models import cases

ROOT = Path(__file__).resolve().parents[1]
STOCK = ROOT / ".venv-stock"
RESULTS = ROOT / "benchmarks" / "results"
MIN_BLOCK_S = 0.25
"""Each timed block runs at least this long on the fastest side."""

WORKER = r"""
import json, sys, time
import numpy as np
kind, directory, data, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
batches = [dict(np.load(f"{data}/{i}.npz")) for i in range(int(sys.argv[5]))]
start, note = time.perf_counter(), None
if kind == "torch":
    import torch
    from benchmarks.compare import HFAdamW
    from benchmarks.models import cases
    torch.set_num_threads(threads)
    case = next(c for c in cases() if c.name == sys.argv[6])
    model = case.torch_model().train()
    trainable = set(json.loads(sys.argv[7]))
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    optimizer = HFAdamW([p for p in model.parameters() if p.requires_grad])
    batches = [([torch.from_numpy(v) for k, v in b.items() if k != "labels"], torch.from_numpy(b["labels"]))
               for b in batches]
    def step(batch):
        loss = torch.nn.functional.cross_entropy(model(*batch[0]), batch[1])
        loss.backward(); optimizer.step(); optimizer.zero_grad()
elif kind == "executorch":
    import torch
    from benchmarks.executorch import Refused, engine_step
    from benchmarks.models import cases
    torch.set_num_threads(threads)
    case = next(c for c in cases() if c.name == sys.argv[6])
    try:
        step, note = engine_step(case, set(json.loads(sys.argv[7])), batches)
    except Refused as refused:
        print("refused", json.dumps(str(refused)), flush=True)
        sys.exit(0)
else:
    from ondevice import Trainer
    trainer = Trainer.load(directory, engine=kind, threads=threads)
    step = trainer.train_step
load_s = time.perf_counter() - start
for i in range(3):
    step(batches[i % len(batches)])
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "quit":
        break
    n, offset = map(int, line.split())
    t = time.perf_counter()
    for i in range(n):
        step(batches[(offset + i) % len(batches)])
    print((time.perf_counter() - t) / n, flush=True)
rss = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
print(json.dumps({"load_s": load_s, "peak_rss": rss, "note": note}), flush=True)
"""


def stock_python(behind: str | None = None) -> Path:
    """The Python of ``.venv-stock`` (stock onnxruntime from the device lock), made on first use. With ``behind``
    (a site-packages directory: the workstation's torch, transformers, peft), a venv of its own whose ``.pth``
    file puts that directory after its own site-packages, so stock onnxruntime is the one imported."""
    where = STOCK if behind is None else STOCK.with_name(STOCK.name + "-workstation")
    python = where / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        lock = ROOT / "requirements" / "device-lock.txt"
        packages = [line.split("==")[0] for line in lock.read_text().splitlines() if "==" in line]
        subprocess.run([str(where / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "-c", str(lock),
                        *packages], check=True)  # fmt: skip
    if behind is not None:
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        (Path(site) / "odt-workstation.pth").write_text(behind + "\n")
    return python


class Worker:
    def __init__(self, python: Path, kind: str, args: list[str], path: tuple[Path, ...] = (), log: Path | None = None):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (ROOT, *path)))}
        stderr = open(log, "w") if log else None  # None: inherited (the ONNX Runtime sides are quiet)
        try:
            self.process = subprocess.Popen([str(python), "-c", WORKER, kind, *args], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=ROOT)
        finally:
            if stderr:
                stderr.close()
        first = self._line()
        if first.startswith("refused "):
            self.process.wait(timeout=120)
            why, check = json.loads(first.removeprefix("refused ")), runtime_check(log.read_text()) if log else None
            raise Refused(why + (f"; its runtime logged: {check}" if check else ""))
        if first != "ready":
            code = self.process.wait(timeout=120)
            died = f"crashed ({signal.Signals(-code).name})" if code < 0 else f"exited with {code}"
            raise Refused(f"{died} before its first steps" + (f": {last_exception(log.read_text())}" if log else ""))

    def _line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def block(self, steps: int, offset: int) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{steps} {offset}\n")
        self.process.stdin.flush()
        return float(self._line())

    def finish(self) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write("quit\n")
        self.process.stdin.flush()
        report = json.loads(self._line())
        self.process.wait(timeout=120)
        return report


def measure(case: Any, work: Path, threads: int, blocks: int) -> dict[str, Any]:
    from artifacts import AdamW, Lora, generate

    directory = work / "artifacts"
    lora = Lora(**case.lora) if case.lora else None
    manifest = generate(case.build(), case.inputs(case.batch), directory, trainable=case.trainable,
                        optimizer=AdamW(), lora=lora, force=True, verify=False)  # fmt: skip
    data = work / "batches"
    data.mkdir(exist_ok=True)
    batches = _batches(case, 4)
    for i, batch in enumerate(batches):
        np.savez(data / f"{i}.npz", **batch)
    common = [str(directory), str(data), str(threads), str(len(batches))]
    trainable = json.dumps([p.name for p in manifest.trainable])
    workers = {
        "torch": Worker(Path(sys.executable), "torch", [*common, case.name, trainable]),
        "classic": Worker(Path(sys.executable), "classic", common),
        "portable": Worker(stock_python(), "portable", common),
    }
    refused = None
    try:  # ExecuTorch runs on this venv's torch, from its own directory (benchmarks.executorch)
        workers["executorch"] = Worker(Path(sys.executable), "executorch", [*common, case.name, trainable], (LIB,),
                                       work / "executorch.log")  # fmt: skip
    except Refused as why:
        refused = str(why)
    # an untimed block each; then blocks of at least MIN_BLOCK_S on the fastest side (20 steps of digits were
    # 10 ms: a thread's wake-up or a neighbour's burst moved the ratio by 0.2); ExecuTorch, tens of times slower
    # on some rows, takes fewer steps, as many as fill MIN_BLOCK_S (at least one)
    first = {name: worker.block(1 if name == "executorch" else case.steps, 0) for name, worker in workers.items()}
    steps = max(case.steps, math.ceil(MIN_BLOCK_S / min(first.values())))
    count = {name: steps for name in workers}
    if "executorch" in workers:
        count["executorch"] = min(steps, math.ceil(MIN_BLOCK_S / first["executorch"]))
    times: dict[str, list[float]] = {name: [] for name in workers}
    order = list(workers)
    for index in range(blocks):
        for name in order[index % len(order) :] + order[: index % len(order)]:  # rotate who goes first
            times[name].append(workers[name].block(count[name], index * steps))
    reports = {name: worker.finish() for name, worker in workers.items()}
    median = {name: statistics.median(values) for name, values in times.items()}

    def speed(a: str, b: str) -> float | None:
        """Median over blocks of ``b``'s step time over ``a``'s (>1: ``a`` is faster)."""
        return statistics.median(y / x for x, y in zip(times[a], times[b])) if b in times else None

    return {
        "model": case.name,
        "batch": case.batch,
        "blocks": blocks,
        "steps_per_block": count,
        "step_ms": {name: 1e3 * value for name, value in median.items()},
        "portable_vs_classic": speed("portable", "classic"),
        "portable_vs_torch": speed("portable", "torch"),
        "classic_vs_torch": speed("classic", "torch"),
        "portable_vs_executorch": speed("portable", "executorch"),
        "executorch_refused": refused,
        "executorch_kernels": reports["executorch"]["note"] if "executorch" in reports else None,
        "load_s": {name: r["load_s"] for name, r in reports.items()},
        "peak_rss_mib": {name: r["peak_rss"] / 2**20 for name, r in reports.items()},
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Engines: portable (stock onnxruntime) beside classic (onnxruntime-training), PyTorch and ExecuTorch",
        "",
        f"Machine: {result['machine']['cpu']} ({result['machine']['cores']} cores). Threads: {result['threads']}. "
        f"Portable engine on onnxruntime {result['versions']['portable']}; classic on onnxruntime-training "
        f"{result['versions']['classic']}; torch {result['versions']['torch']}; ExecuTorch "
        f"{result['versions'].get('executorch', '-')} (lowered to XNNPACK, AdamW applied by torch to the tensors it "
        "shares: its training API has SGD only).",
        "Speed columns are medians of per-block ratios (>1: the first is faster), the workers "
        f"taking turns block by block (blocks of at least {MIN_BLOCK_S} s on the fastest side, after an untimed "
        "one; ExecuTorch's of as many steps as fill that time). Peak RSS is each worker process's VmHWM (not given for "
        "ExecuTorch: its worker exports the model with torch in the same process).",
        "",
        "| model | batch | portable ms | classic ms | PyTorch ms | ExecuTorch ms | portable vs classic "
        "| portable vs PyTorch | portable vs ExecuTorch | classic vs PyTorch "
        "| peak RSS MiB portable / classic / PyTorch | load s portable / classic |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    refusals, unlowered = [], []
    for row in result["rows"]:
        ms, rss, load = row["step_ms"], row["peak_rss_mib"], row["load_s"]
        executorch = row.get("portable_vs_executorch")
        if row.get("executorch_refused"):
            refusals.append(f"- {row['model']}: {row['executorch_refused']}")
        if (row.get("executorch_kernels") or "XNNPACK") != "XNNPACK":
            unlowered.append(f"- {row['model']}: {row['executorch_kernels']}")
        lines.append(
            f"| {row['model']} | {row['batch']} | {ms['portable']:.2f} | {ms['classic']:.2f} | {ms['torch']:.2f} "
            f"| {_or_dash(ms.get('executorch'), '{:.2f}')} | {row['portable_vs_classic']:.2f}x "
            f"| {row['portable_vs_torch']:.2f}x | {_or_dash(executorch, '{:.2f}x')} | {row['classic_vs_torch']:.2f}x "
            f"| {rss['portable']:.0f} / {rss['classic']:.0f} / {rss['torch']:.0f} "
            f"| {load['portable']:.2f} / {load['classic']:.2f} |"
        )
    if unlowered:
        lines += ["", "Rows ExecuTorch runs without XNNPACK:", "", *unlowered]
    if refusals:
        lines += ["", "Rows ExecuTorch does not train (its first step's gradients are checked against PyTorch's):", "",
                  *refusals]  # fmt: skip
    return "\n".join(lines) + "\n"


def _executorch_version() -> str:
    """The version of the ExecuTorch in :data:`LIB` (its dist-info's name: LIB is on the workers' path only)."""
    return next(p.name.removesuffix(".dist-info").split("-")[1] for p in LIB.glob("executorch-*.dist-info"))


def _or_dash(value: float | None, form: str) -> str:
    return "-" if value is None else form.format(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated substrings of model names (default: all)")
    parser.add_argument("--blocks", type=int, default=7, help="blocks per worker (default 7)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS), help="directory for engines.json/.md")
    args = parser.parse_args(argv)
    if not LIB.is_dir():
        executorch_setup()
    import tempfile

    import onnxruntime
    import torch

    wanted = [w for w in args.only.split(",") if w]
    rows = []
    portable_version = subprocess.run([str(stock_python()), "-c", "import onnxruntime; print(onnxruntime.__version__)"],
                                      capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    for case in cases():
        if wanted and not any(w in case.name for w in wanted):
            continue
        with tempfile.TemporaryDirectory(prefix="odt-engines-") as tmp:
            started = time.perf_counter()
            rows.append(measure(case, Path(tmp), args.threads, args.blocks))
            print(f"{case.name}: portable vs classic {rows[-1]['portable_vs_classic']:.2f}x "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    result = {
        "machine": machine(),
        "threads": args.threads,
        "versions": {"portable": portable_version, "classic": onnxruntime.__version__, "torch": torch.__version__,
                     "executorch": _executorch_version()},
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engines.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "engines.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
