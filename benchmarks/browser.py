"""Browser benchmark: ORT web (headless Chromium) against Python ORT on the same bundle.

Figures per model: median training step with 1 and 2 WASM threads on the page's thread (the
page is cross-origin isolated, which threads need) and with 1 thread in a Web Worker
(WorkerClient; its step includes the message round trip), against Python ORT with the same
threads; the page's longest stall while it trains (the longest gap between ticks of a 4 ms
timer); page open to first step; bundle size. Then the kernels' own speed on both sides: a
one-node MatMul model in an inference session (the wide model's layer shape, and a square one),
which says how much of the step's gap is the matrix multiply alone.
Run: .venv/bin/python -m benchmarks.browser
"""

from __future__ import annotations

import functools
import json
import mimetypes
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "mobile_bridge" / "web"
STEPS, BATCH = 60, 32
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
    from ondevice.engines.classic import OrtTraining

    artifacts, site = work / name.replace(" ", "_"), work / "site"
    generate(model, {"input": torch.randn(BATCH, 64)}, artifacts, verify=False)
    _site(site)
    make_bundle(artifacts, site / "bundle")
    for module in ("odt-web.mjs", "odt-worker.mjs"):
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
        session = OrtTraining(site / "bundle", threads=threads)
        times = []
        for _ in range(STEPS):
            t = time.perf_counter()
            session.train_step([x, y.astype(np.int64)])
            session.optimizer_step()
            session.reset_grad()
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
                         capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
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
    rows = [measure(name, model, work) for name, model in models()]
    kernels = measure_kernels(work)
    (out / "browser.json").write_text(json.dumps({"machine": machine(), "rows": rows, "kernels": kernels}, indent=2))
    lines = [
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
