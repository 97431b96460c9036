"""Browser benchmark: ORT web (headless Chromium) against Python ORT on the same bundle.

First the builds, in one run: digits and MiniLM LoRA r8 + head trained in Chromium on onnxruntime-web
1.19.2's training build (classic graphs), on the current build with WASM and, for digits, with WebGPU
(Chromium's software adapter here; opt-in), beside Python's classic engine (onnxruntime-training 1.19.2)
and portable engine (newest stock onnxruntime). Everything runs one thread. Rounds take turns: each
round runs every variant once, and a ratio is the median over rounds of that round's ratio.

Then, per model on the current build: median training step with 1 and 2 WASM threads on the page's thread (the
page is cross-origin isolated, which threads need) and with 1 thread in a Web Worker
(WorkerClient; its step includes the message round trip), against Python ORT with the same
threads; the page's longest stall while it trains (the longest gap between ticks of a 4 ms
timer); page open to first step; bundle size. Then the kernels' own speed on both sides: a
one-node MatMul model in an inference session (the wide model's layer shape, and a square one),
which says how much of the step's gap is the matrix multiply alone.
Run: .venv-classic/bin/python -m benchmarks.browser
"""

from __future__ import annotations

import functools
import json
import mimetypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "mobile_bridge" / "web"
STEPS, BATCH = 60, 32
BUILD_CASES = {"digits sample": 60, "MiniLM-L6 (LoRA r8 + head)": 6}
"""benchmark models (benchmarks.models) and their steps per browser run"""
ROUNDS = 3
VARIANTS = (("page", 1), ("page", 2), ("Web Worker", 1))
"""(where ORT runs, WASM threads)"""
KERNELS = (("MatMul 32x512 @ 512x512", (32, 512, 512)), ("MatMul 512x512 @ 512x512", (512, 512, 512)))
"""(name, (m, k, n)): both operands are inputs, as the weights are in a training graph"""
KERNEL_RUNS = 60

from benchmarks._machine import machine  # noqa: E402


class _Quiet(SimpleHTTPRequestHandler):
    """Static files with the headers that make a page cross-origin isolated (SharedArrayBuffer)."""

    def end_headers(self) -> None:
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()

    def log_message(self, *args: object) -> None:
        pass


def models():
    import torch

    from samples.digits.model import build

    torch.manual_seed(0)
    wide = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    return [("digits MLP", build()), ("MLP 64-512-512-10", wide)]


def measure(name, model, work: Path) -> dict:
    import torch

    from artifacts import generate
    from mobile_bridge import make_bundle
    from ondevice import Trainer

    artifacts, site = work / name.replace(" ", "_"), work / "site"
    generate(model, {"input": torch.randn(BATCH, 64)}, artifacts, verify=False)
    _site(site)
    make_bundle(artifacts, site / "bundle")
    for module in ("odt-web.mjs", "odt-worker.mjs", "odt-secagg.mjs"):
        shutil.copy(WEB / module, site / module)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 64)).astype(np.float32)
    y = rng.integers(0, 10, BATCH)
    steps = [{"size": BATCH, "input": x.ravel().tolist(), "labels": y.tolist()}] * STEPS
    server = _serve(site)
    browser = {}
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/index.html"
        for where, threads in VARIANTS:
            task = {"steps": steps, "threads": threads, "worker": where == "Web Worker"}
            result = browser[where, threads] = _in_browser(url, task, work)
            if not (result.get("ok") and result["isolated"] and result["threads"] == threads):
                raise RuntimeError(f"{where} with {threads} threads did not run as asked: {result}")
    finally:
        server.shutdown()
        server.server_close()
    python_steps = {}
    for threads in sorted({t for _, t in VARIANTS}):
        trainer = Trainer.load(site / "bundle", engine="portable", threads=threads)  # the graphs the browser runs
        times = []
        for _ in range(STEPS):
            t = time.perf_counter()
            trainer.train_step({"input": x, "labels": y})
            times.append(1e3 * (time.perf_counter() - t))
        python_steps[threads] = statistics.median(times[5:])
    return {
        "model": name,
        "variants": [
            {
                "where": where,
                "threads": threads,
                "browser_step_ms": statistics.median(browser[where, threads]["stepTimes"][5:]),
                "python_step_ms": python_steps[threads],
                "longest_stall_ms": browser[where, threads]["longestStallMs"],
            }
            for where, threads in VARIANTS
        ],
        "open_to_first_step_ms": browser["page", 1]["sinceOpenMs"],
        "bundle_bytes": sum(p.stat().st_size for p in (site / "bundle").iterdir()),
    }


def measure_builds(work: Path) -> list[dict]:
    """Step times of each onnxruntime-web build and of Python's engines on one bundle per model (module docstring)."""
    from artifacts import AdamW, Lora, generate
    from mobile_bridge import make_bundle

    from .compare import _batches
    from .engines import Worker, stock_python
    from .models import cases

    rows = []
    for case in (c for c in cases() if c.name in BUILD_CASES):
        steps = BUILD_CASES[case.name]
        artifacts, site = work / "build-artifacts", _site(work / "build-site")
        generate(case.build(), case.inputs(case.batch), artifacts, trainable=case.trainable, optimizer=AdamW(),
                 lora=Lora(**case.lora) if case.lora else None, force=True, verify=False)  # fmt: skip
        make_bundle(artifacts, site / "bundle")
        for module in ("odt-web.mjs", "odt-worker.mjs", "odt-secagg.mjs"):
            shutil.copy(WEB / module, site / module)
        batches = _batches(case, 4)
        data = work / "build-batches"
        data.mkdir(exist_ok=True)
        for i, batch in enumerate(batches):
            np.savez(data / f"{i}.npz", **batch)
        plain = [{"size": case.batch, **{k: v.ravel().tolist() for k, v in b.items()}} for b in batches]
        browser_steps = [plain[i % len(plain)] for i in range(steps + 2)]  # 2 warm-up steps
        browsers = {"1.19.2 training build": {"build": "training"}, "current, WASM": {}}
        if case.name == "digits sample":  # MiniLM came out wrong on the software adapter (docs): not timed there
            browsers["current, WebGPU"] = {"provider": "webgpu", "webgpu": True}
        common = [str(site / "bundle"), str(data), "1", str(len(batches))]
        pythons = {"Python classic": Worker(Path(sys.executable), "classic", common),
                   "Python portable": Worker(stock_python(), "portable", common)}  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in (*browsers, *pythons)}
        providers = {}
        server = _serve(site)
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/index.html"
            for index in range(ROUNDS):
                for name, extra in browsers.items():
                    result = _in_browser(url, {"steps": browser_steps, "threads": 1, **extra}, work)
                    if not result.get("ok"):
                        raise RuntimeError(f"{case.name} on {name}: {result}")
                    providers[name] = result["provider"]
                    times[name].append(statistics.median(result["stepTimes"][2:]))
                for name, worker in pythons.items():
                    times[name].append(1e3 * worker.block(steps, index * steps))
        finally:
            server.shutdown()
            server.server_close()
            for worker in pythons.values():
                worker.finish()
        classic = times["1.19.2 training build"]
        for name in (*browsers, *pythons):
            rows.append({
                "model": case.name, "batch": case.batch, "runtime": name, "provider": providers.get(name, "CPU"),
                "step_ms": statistics.median(times[name]),
                "vs_training_build": statistics.median(c / t for c, t in zip(classic, times[name])),
                "vs_python_portable": statistics.median(
                    t / p for t, p in zip(times[name], times["Python portable"])),
            })  # fmt: skip
    return rows


def _builds_markdown(rows: list[dict]) -> list[str]:
    lines = [
        f"Builds (one thread everywhere; medians of {ROUNDS} rounds that take turns):",
        "",
        "| model | batch | runs on | step | steps/s | speed vs 1.19.2 training build | time vs Python portable |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['runtime']} ({r['provider']}) | {r['step_ms']:.2f} ms | "
            f"{1e3 / r['step_ms']:.1f} | {r['vs_training_build']:.2f}x | {r['vs_python_portable']:.2f}x |"
        )
    return lines


def _site(site: Path) -> Path:
    """An empty page at ``site`` with onnxruntime-web's files at /ort/."""
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir()
    (site / "index.html").write_text("<!doctype html><title>bench</title>")
    os.symlink(WEB / "ort", site / "ort")
    return site


def _serve(site: Path) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _in_browser(url: str, task: dict, work: Path) -> dict:
    (work / "task.json").write_text(json.dumps(task))
    out = subprocess.run(["node", str(WEB / "tools" / "run-in-browser.mjs"), url, str(work / "task.json")],
                         capture_output=True, text=True, timeout=1200)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"the browser run failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def _matmul_model(m: int, k: int, n: int) -> bytes:
    from onnx import TensorProto, helper

    shapes = {"a": [m, k], "b": [k, n]}
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, dims) for name, dims in shapes.items()]
    output = helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "matmul", inputs, [output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def _python_runs(session, feeds: dict) -> list[float]:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(KERNEL_RUNS):
        t = time.perf_counter()
        session.run(None, feeds)
        times.append(1e3 * (time.perf_counter() - t))
    return times[5:]


def measure_kernels(work: Path) -> list[dict]:
    """Median run time of one MatMul in the browser and in Python ORT, per shape and thread count."""
    import onnxruntime as ort

    site = _site(work / "kernel-site")
    rows = []
    server = _serve(site)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/index.html"
        for name, (m, k, n) in KERNELS:
            (site / "matmul.onnx").write_bytes(_matmul_model(m, k, n))
            rng = np.random.default_rng(0)
            feeds = {key: rng.standard_normal(dims, dtype=np.float32) for key, dims in (("a", (m, k)), ("b", (k, n)))}
            kernel = {"url": "/matmul.onnx", "inputs": {"a": [m, k], "b": [k, n]}, "runs": KERNEL_RUNS}
            for threads in sorted({t for _, t in VARIANTS}):
                options = ort.SessionOptions()
                options.intra_op_num_threads, options.log_severity_level = threads, 3
                session = ort.InferenceSession(str(site / "matmul.onnx"), options, providers=["CPUExecutionProvider"])
                before = _python_runs(session, feeds)  # Python on both sides of the browser's runs: the machine drifts
                result = _in_browser(url, {"threads": threads, "kernel": kernel}, work)
                if not (result.get("ok") and result["isolated"] and result["threads"] == threads):
                    raise RuntimeError(f"{name} with {threads} threads did not run as asked: {result}")
                python_ms = statistics.median(before + _python_runs(session, feeds))
                browser_ms = statistics.median(result["times"][5:])
                gflop = 2 * m * k * n / 1e9
                rows.append({"kernel": name, "threads": threads, "browser_ms": browser_ms, "python_ms": python_ms,
                             "browser_gflops": 1e3 * gflop / browser_ms,
                             "python_gflops": 1e3 * gflop / python_ms})  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    return rows


def main() -> int:
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    mimetypes.add_type("text/javascript", ".mjs")
    mimetypes.add_type("application/wasm", ".wasm")
    work = Path(tempfile.mkdtemp(prefix="odt-browser-bench-"))
    builds = measure_builds(work)
    rows = [measure(name, model, work) for name, model in models()]
    kernels = measure_kernels(work)
    (out / "browser.json").write_text(
        json.dumps({"machine": machine(), "builds": builds, "rows": rows, "kernels": kernels}, indent=2)
    )
    cpu, versions = machine(), json.loads((WEB / "ort" / "onnxruntime-web.package.json").read_text())["version"]
    lines = [
        f"Machine: {cpu['cpu']} ({cpu['cores']} cores); headless Chromium; onnxruntime-web {versions} and 1.19.2.",
        "",
        *_builds_markdown(builds),
        "",
        "The current build (WASM) on the page and in a Web Worker, against Python ORT on the same portable graphs:",
        "",
        f"| model (batch {BATCH}) | ORT runs on | threads | browser step | Python ORT step | browser / Python "
        f"| page's longest stall in {STEPS} steps | page open to first step | bundle size |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for v in r["variants"]:
            lines.append(
                f"| {r['model']} | {v['where']} | {v['threads']} | {v['browser_step_ms']:.2f} ms | "
                f"{v['python_step_ms']:.2f} ms | {v['browser_step_ms'] / v['python_step_ms']:.1f}x | "
                f"{v['longest_stall_ms']:.0f} ms | {r['open_to_first_step_ms']:.0f} ms | "
                f"{r['bundle_bytes'] / 1024:.0f} KiB |"
            )
    lines += [
        "",
        "The matrix multiply alone (one MatMul in an inference session, both operands inputs; "
        f"medians of {KERNEL_RUNS - 5} runs):",
        "",
        "| kernel | threads | browser | Python ORT | browser GFLOP/s | Python GFLOP/s | browser / Python |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for k in kernels:
        lines.append(
            f"| {k['kernel']} | {k['threads']} | {k['browser_ms']:.3f} ms | {k['python_ms']:.3f} ms | "
            f"{k['browser_gflops']:.1f} | {k['python_gflops']:.1f} | {k['browser_ms'] / k['python_ms']:.1f}x |"
        )
    (out / "browser.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
