"""CNN benchmark: where the benchmark CNN's training step goes, and what the rewrites buy.

ORT's profiler over the step (milliseconds per op type) of the graph as generated (max pooling
moved before ReLU, ReLU's gradient rewritten), of its NCHWc variant (what an x86 device loads:
the convolutions on ORT's blocked kernels), without the pooling swap, and without either ReLU
rewrite (ORT's own ReluGrad); the step time of each, and of the generated graph with thread
spinning off, in interleaved blocks on the same batch (batch 64, 2 threads).
Run: .venv-classic/bin/python -m benchmarks.cnn [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from benchmarks._machine import machine  # noqa: E402

BATCH, THREADS, STEPS, BLOCKS, PROFILED = 64, 2, 5, 21, 12


GENERATED, NCHWC, NO_SWAP, NO_REWRITES = (
    "generated",
    "NCHWc variant",
    "without the pooling swap",
    "no rewrites (ORT's ReluGrad)",
)


def build(work: Path) -> dict[str, Path]:
    """Training graphs: the benchmark CNN as generated, its NCHWc variant, without the pooling swap,
    and without either ReLU rewrite."""
    from artifacts import generate, passes
    from benchmarks.models import cases
    from ondevice.session import TRAINING_GRAPH

    case = next(c for c in cases() if c.name == "CNN")
    dirs = {GENERATED: work / "generated", NO_SWAP: work / "no-swap", NO_REWRITES: work / "no-rewrites"}
    manifest = generate(case.build(), case.inputs(BATCH), dirs[GENERATED], verify=False)
    with mock.patch.object(passes, "REGISTRY", passes.without("pool-before-relu")):
        generate(case.build(), case.inputs(BATCH), dirs[NO_SWAP], verify=False)
    with mock.patch.object(passes, "REGISTRY", passes.without("pool-before-relu", "relu-grad")):
        generate(case.build(), case.inputs(BATCH), dirs[NO_REWRITES], verify=False)
    paths = {name: directory / TRAINING_GRAPH for name, directory in dirs.items()}
    paths[NCHWC] = dirs[GENERATED] / manifest.variants["nchwc"]
    return {name: paths[name] for name in (GENERATED, NCHWC, NO_SWAP, NO_REWRITES)}


def _objects(graph: Path, *, spinning: bool = True, profile: str | None = None):  # type: ignore[no-untyped-def]
    """ORT's module and optimizer over the training graph file ``graph`` (its directory's checkpoint)."""
    from ondevice.engines.classic import _CPU
    from ondevice.session import C, session_options

    options = session_options(THREADS)
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = profile
    directory = graph.parent
    state = C.load_checkpoint(str(directory / "checkpoint"))
    module = C.Module(str(graph), state, str(directory / "eval_model.onnx"), _CPU, options)
    optimizer = C.Optimizer(str(directory / "optimizer_model.onnx"), state, _CPU, session_options(THREADS))
    return module, optimizer, state  # the state must outlive the module


def _step(objects, batch) -> None:  # type: ignore[no-untyped-def]
    from ondevice.session import C

    module, optimizer, _ = objects
    module.train_step(batch, C.OrtValueVector())
    optimizer.optimizer_step()
    module.lazy_reset_grad()


def profile(graph: Path, batch: list[np.ndarray], work: Path) -> dict[str, float]:
    """Milliseconds per step by op type, from ORT's profiler over PROFILED steps of ``graph`` (a
    training graph file, or an artifact directory for its portable graph)."""
    graph = graph / "training_model.onnx" if graph.is_dir() else graph
    tag = f"{graph.parent.name}-{graph.stem}"
    objects = _objects(graph, profile=str(work / f"profile-{tag}"))
    for _ in range(PROFILED):
        _step(objects, batch)
    del objects  # ORT writes the trace when the session goes
    trace = max(work.glob(f"profile-{tag}*.json"), key=lambda p: p.stat().st_mtime)
    per_op: collections.Counter[str] = collections.Counter()
    for event in json.loads(trace.read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op[event["args"]["op_name"]] += event["dur"] / 1e3 / PROFILED
    return dict(per_op.most_common())


def profile_table(profiles: dict[str, dict[str, float]], shown: int, *, shares: bool = False) -> list[str]:
    """Markdown rows of ``profile`` results side by side: the ``shown`` costliest ops (ms per step,
    and with ``shares`` each op's share of all kernels, which also orders them), then the total."""
    totals = {name: sum(p.values()) for name, p in profiles.items()}

    def weight(op: str, name: str) -> float:
        return profiles[name].get(op, 0.0) / (totals[name] if shares else 1.0)

    def cell(op: str, name: str) -> str:
        ms = profiles[name].get(op, 0.0)
        return f"{ms:.2f} ({100 * ms / totals[name]:.0f} %)" if shares else f"{ms:.2f}"

    ops = sorted(set().union(*profiles.values()), key=lambda op: -max(weight(op, n) for n in profiles))
    return [
        "| op | " + " | ".join(profiles) + " |",
        "|---|" + "---:|" * len(profiles),
        *(f"| {op} | " + " | ".join(cell(op, name) for name in profiles) + " |" for op in ops[:shown]),
        "| all kernels | " + " | ".join(f"{t:.2f}" for t in totals.values()) + " |",
    ]


def step_times(paths: dict[str, Path], batch: list[np.ndarray]) -> dict[str, dict[str, float]]:
    """Median step of each variant and its median ratio to the generated graph (interleaved blocks,
    the order reversed every other block)."""
    variants = {name: _objects(path) for name, path in paths.items()}
    variants[f"{GENERATED}, spinning off"] = _objects(paths[GENERATED], spinning=False)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for objects in variants.values():
        _step(objects, batch)  # warm-up
    for block in range(BLOCKS):
        for name in list(variants) if block % 2 == 0 else reversed(list(variants)):
            start = time.perf_counter()
            for _ in range(STEPS):
                _step(variants[name], batch)
            times[name].append(1e3 * (time.perf_counter() - start) / STEPS)
    base = times[GENERATED]
    return {
        name: {"step_ms": statistics.median(t), "ratio": statistics.median(a / b for a, b in zip(t, base))}
        for name, t in times.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="odt-cnn-bench-"))
    paths = build(work)
    rng = np.random.default_rng(0)
    batch = [rng.standard_normal((BATCH, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, BATCH)]
    profiles = {name: profile(path, batch, work) for name, path in paths.items()}
    steps = step_times(paths, batch)
    (out / "cnn.json").write_text(json.dumps({"machine": machine(), "profiles": profiles, "steps": steps}, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"ORT's profile of the benchmark CNN's training step (batch {BATCH}, {THREADS} threads, ms per step, "
        f"mean of {PROFILED} steps):",
        "",
        *profile_table(profiles, 12),
        "",
        f"Step time ({BLOCKS} interleaved blocks of {STEPS} steps, medians; ratio to the generated graph):",
        "",
        "| variant | step | ratio |",
        "|---|---:|---:|",
        *(f"| {name} | {s['step_ms']:.2f} ms | {s['ratio']:.3f} |" for name, s in steps.items()),
    ]
    (out / "cnn.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
