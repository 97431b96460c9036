"""ExecuTorch's training beside the SDK's portable engine and PyTorch eager: the MLP, the CNN and the small encoder.

ExecuTorch (PyPI ``executorch``) is what a PyTorch user would try instead: ``torch.export`` of a module that returns
its loss, decomposed (``run_decompositions``: without it attention's backward is not core ATen),
``torch.export.experimental._export_forward_backward`` for the joint forward-backward graph, ``to_edge``
(or ``to_edge_transform_and_lower`` with the XNNPACK partitioner) and ``to_executorch``, then its training module's
``forward_backward`` and its SGD optimizer (the only optimizer its training API offers, so every side here trains
with plain SGD). The four sides start from the same weights and data (dropout 0, so that all compute the same),
and take turns in one process, a block of steps each (medians of the blocks' per-step times; ratios within a
round). Losses of the first steps are compared. (:func:`engine_step` is the same export for ``benchmarks.engines``'
ExecuTorch column, with AdamW.)

ExecuTorch lives outside the development venv (it would pull pandas, coremltools and more into it): ``--setup``
installs the pinned ``executorch`` and the few modules it imports into ``.executorch-lib`` with ``--no-deps``; the
runs put that directory on the path of child processes of this venv's Python (whose torch 2.13 they run on): each
ExecuTorch side is first tried alone for a few steps (it may crash, or train wrongly), then the sides that train
the row take turns.

Run: .venv-classic/bin/python -m benchmarks.executorch [--setup]   (writes benchmarks/results/executorch.*)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / ".executorch-lib"
PINS = ["executorch==1.5.1", "torchao==0.18.0", "ruamel.yaml==0.19.1", "tabulate==0.10.0"]
LR, STEPS, BLOCKS, ROUNDS = 0.05, 5, 50, 7


ROWS = ("MLP 784-256-128-10", "CNN", "encoder (all trainable)")
"""The rows of ``benchmarks.models`` measured here (dropout set to 0 on every side, so all compute the same)."""


SIDES = ("ExecuTorch", "ExecuTorch + XNNPACK", "PyTorch eager", "SDK portable")


def sides(case, work: Path, wanted: tuple[str, ...] = SIDES) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """``name -> one training step`` (returning the loss) for each ``wanted`` side, from the same weights and batch."""
    import torch
    from torch import nn

    from artifacts import SGD, generate
    from ondevice import Trainer

    torch.set_num_threads(2)
    net = _without_dropout(case.build())
    state = {k: v.clone() for k, v in net.state_dict().items()}
    inputs = case.inputs(case.batch)
    torch.manual_seed(1)
    y = torch.randint(0, case.classes, (case.batch,))

    made: dict[str, object] = {}
    example = (*inputs.values(), y)
    for name, lower in (("ExecuTorch", False), ("ExecuTorch + XNNPACK", True)):
        if name not in wanted:
            continue
        net.load_state_dict(state)
        made[name] = _sgd_step(*_training_module(net, example, lower), example)
    eager = _without_dropout(case.build())
    eager.load_state_dict(state)
    sgd = torch.optim.SGD(eager.parameters(), lr=LR)

    def torch_step() -> float:
        sgd.zero_grad()
        loss = nn.functional.cross_entropy(eager(*inputs.values()), y)
        loss.backward()
        sgd.step()
        return float(loss.detach())

    made["PyTorch eager"] = torch_step
    if "SDK portable" not in wanted:
        return {name: step for name, step in made.items() if name in wanted}
    net.load_state_dict(state)
    out = work / "artifacts"
    generate(net, dict(inputs), out, optimizer=SGD(lr=LR), force=True)
    trainer = Trainer.load(out, engine="portable", threads=2, evaluation=False)
    batch = {**{n: v.numpy() for n, v in inputs.items()}, "labels": y.numpy()}
    made["SDK portable"] = lambda: float(trainer.train_step(batch).loss)
    return {name: step for name, step in made.items() if name in wanted}


def _without_dropout(model):  # type: ignore[no-untyped-def]
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        elif isinstance(module, nn.MultiheadAttention):  # its attention dropout is a float, not a module
            module.dropout = 0.0
    return model


def _sgd_step(module, buffer: bytes, example):  # type: ignore[no-untyped-def]
    from executorch.extension.training import get_sgd_optimizer

    optimizer = None

    def step() -> float:
        nonlocal optimizer
        assert buffer
        loss = module.forward_backward("forward", example)[0]
        if optimizer is None:  # its parameters can be named only after a first forward_backward
            optimizer = get_sgd_optimizer(module.named_parameters(), LR, 0, 0, 0, False)
        optimizer.step(module.named_gradients())
        return float(loss)

    return step


def engine_step(case, trainable: set[str], batches: list[dict[str, np.ndarray]]):  # type: ignore[no-untyped-def]
    """``(step, how)``: ``step(batch)`` is one AdamW step of ``case`` on ExecuTorch, for ``benchmarks.engines``'
    column; ``how`` says which kernels run it (XNNPACK where its lowering and first step work, else ExecuTorch's
    portable kernels, with XNNPACK's error).

    Its training API offers SGD only, so the update is the eager side's (``HFAdamW``: ORT's AdamW formula in
    torch's foreach kernels) applied in place to the tensors ``named_parameters`` shares with the program. The
    export decomposes first (``run_decompositions``): without it attention's backward is not core ATen. Dropout is
    0, so that one export serves both the timing and the check of its first gradients against PyTorch's (dropout's
    cost, left out, counts in ExecuTorch's favour); :class:`Refused` says which gradient is wrong, or what failed.
    """
    import torch
    from torch import nn

    from benchmarks.compare import HFAdamW

    model = _without_dropout(case.torch_model().train())
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trainable)

    def example(batch: dict[str, np.ndarray]) -> tuple:  # type: ignore[type-arg]  # views of the arrays, no copy
        return (*(torch.from_numpy(v) for k, v in batch.items() if k != "labels"), torch.from_numpy(batch["labels"]))

    first = example(batches[0])
    reference = copy.deepcopy(model)
    nn.functional.cross_entropy(reference(*first[:-1]), first[-1]).backward()
    expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    failed = {}
    for lower in (True, False):
        try:
            module, buffer = _training_module(model, first, lower)
            module.forward_backward("forward", first)  # parameters can be named only after a first step
            break
        except Exception as error:  # export, lowering and the runtime raise many types; the table shows the message
            failed[lower] = f"{type(error).__name__}: {_first_line(error)}"
    else:
        raise Refused(f"failed: {failed[False]}" + ("" if failed[True] == failed[False] else
                                                     f" (with XNNPACK: {failed[True]})"))  # fmt: skip
    _check_gradients(module.named_gradients(), expected)
    named = module.named_parameters()
    params = list(named.values())
    optimizer = HFAdamW(params)

    def step(batch: dict[str, np.ndarray]) -> None:
        assert buffer
        module.forward_backward("forward", example(batch))
        gradients = module.named_gradients()
        for name, parameter in zip(named, params):
            parameter.grad = gradients[name]
        optimizer.step()

    return step, "XNNPACK" if not failed else f"portable kernels (XNNPACK failed: {failed[True]})"


class Refused(Exception):
    """A side cannot train the row (the message says why): ExecuTorch's export, lowering or gradients failed, or
    a ``benchmarks.engines`` worker did not start."""


def _training_module(model, example, lower: bool = True):  # type: ignore[no-untyped-def]
    """``(module, buffer)``: ``model``'s loss as an ExecuTorch training module, lowered to XNNPACK or not. The module
    reads the program's buffer in place: keep the buffer as long as the module (freed, it crashed)."""
    from executorch.exir import to_edge, to_edge_transform_and_lower
    from executorch.extension.training import _load_for_executorch_for_training_from_buffer
    from torch import nn
    from torch.export import export
    from torch.export.experimental import _export_forward_backward

    class Train(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, *args):  # type: ignore[no-untyped-def]
            out = self.net(*args[:-1])
            return nn.functional.cross_entropy(out, args[-1]), out.detach().argmax(dim=1)

    # decomposed before the joint graph is made: otherwise attention's backward is not core ATen
    joint = _export_forward_backward(export(Train(model), example, strict=True).run_decompositions())
    if lower:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        program = to_edge_transform_and_lower(joint, partitioner=[XnnpackPartitioner()]).to_executorch()
    else:
        program = to_edge(joint).to_executorch()
    buffer = program.buffer
    return _load_for_executorch_for_training_from_buffer(buffer), buffer


def _check_gradients(got: dict, expected: dict) -> None:  # type: ignore[type-arg]
    """Raise :class:`Refused` naming the first parameter whose gradient is not PyTorch's (or is missing): within
    1e-3 of its largest value, plus 1e-6 (a gradient that is zero in exact arithmetic, such as attention's key
    bias, is rounding noise of 1e-10 on both sides)."""
    names = {name.removeprefix("net."): value for name, value in got.items()}
    if set(names) != set(expected):
        raise Refused(f"trains other parameters: {len(names)} gradients where PyTorch has {len(expected)}")
    for name, value in expected.items():
        scale = float(value.abs().max())
        error = float((names[name] - value).abs().max())
        if error > 1e-3 * scale + 1e-6:
            raise Refused(f"trains wrongly: the gradient of {name} is off by up to {error:.3g} where its largest "
                          f"value is {scale:.3g}")  # fmt: skip


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:200]


def _case(name: str):  # type: ignore[no-untyped-def]
    from benchmarks.models import cases

    return next(c for c in cases() if c.name == name)


def probe(row: str, side: str) -> list[float]:
    """The first :data:`STEPS` losses of one side on one row (in a process of its own: ExecuTorch may crash)."""
    with tempfile.TemporaryDirectory(prefix="odt-et-") as work:
        step = sides(_case(row), Path(work), (side,))[side]
        return [step() for _ in range(STEPS)]  # type: ignore[operator]


def timed(row: str, wanted: tuple[str, ...]) -> dict[str, object]:
    """The sides of one row taking turns, a block of steps each, :data:`ROUNDS` times."""
    case = _case(row)
    with tempfile.TemporaryDirectory(prefix="odt-et-") as work:
        steps = sides(case, Path(work), wanted)
        losses = {name: [step() for _ in range(STEPS)] for name, step in steps.items()}  # type: ignore[operator]
        block = BLOCKS if case.name.startswith("MLP") else max(2, BLOCKS // 10)
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(ROUNDS):
            for name, step in steps.items():
                started = time.perf_counter()
                for _ in range(block):
                    step()  # type: ignore[operator]
                times[name].append((time.perf_counter() - started) / block * 1e3)
    sdk = np.array(times["SDK portable"])
    speed = {name: float(np.median(np.array(t) / sdk)) for name, t in times.items()}
    return {"model": case.name, "batch": case.batch, "steps_per_block": block, "losses": losses,
            "ms_per_step": {name: float(np.median(t)) for name, t in times.items()}, "sdk_speed_vs": speed}  # fmt: skip


def measure(env: dict[str, str]) -> dict[str, object]:
    """Every row: each ExecuTorch side first probed alone (a crash or losses unlike PyTorch's keep it out of the
    timing, with the reason), then the sides that train it taking turns."""
    from benchmarks._machine import machine

    def child(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "benchmarks.executorch", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=3600)  # fmt: skip

    def result(run: subprocess.CompletedProcess[str]):  # type: ignore[no-untyped-def]
        if run.returncode != 0:
            raise RuntimeError(run.stderr[-3000:])
        return json.loads(run.stdout.strip().splitlines()[-1])

    rows = []
    for row in ROWS:
        reference = result(child("--probe", row, "PyTorch eager"))
        refused: dict[str, str] = {}
        for side in SIDES[:2]:
            run = child("--probe", row, side)
            if run.returncode < 0:
                refused[side] = f"crashed ({signal.Signals(-run.returncode).name}) in its first {STEPS} steps"
            elif run.returncode != 0:
                refused[side] = "failed: " + last_exception(run.stderr)
            elif not np.allclose(losses := result(run), reference, rtol=1e-3):
                said, expected = (", ".join(f"{x:.4g}" for x in values) for values in (losses, reference))
                refused[side] = f"trains wrongly: losses {said} where PyTorch's are {expected}"
        wanted = [s for s in SIDES if s not in refused]
        rows.append({**result(child("--time", row, ",".join(wanted))), "refused": refused})
        print(f"{row}: done", flush=True)
    versions = [row.pop("versions") for row in rows][-1]  # what the timing processes ran on
    return {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "versions": versions, "rows": rows}


def last_exception(stderr: str) -> str:
    """The last exception's line of a traceback, with the line after it (where torch puts the message)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    raised = [i for i, line in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    at = raised[-1] if raised else len(lines) - 1
    return " ".join(lines[at : at + 2])[:240]


def runtime_check(stderr: str) -> str | None:
    """The first failed check ExecuTorch's runtime logged (its exceptions say only ``error: 0x12``)."""
    return next((line.strip() for line in stderr.splitlines() if "Check failed" in line), None)


def setup() -> None:
    """Install :data:`PINS` into :data:`LIB` (ExecuTorch and what it imports, without their dependencies)."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(LIB), *PINS], check=True)


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import torch

    from ondevice.session import ORT_VERSION

    return {"onnxruntime": ORT_VERSION, "torch": torch.__version__, "executorch": version("executorch")}


def table(result: dict) -> str:  # type: ignore[type-arg]
    m, v = result["machine"], result["versions"]
    lines = [f"ExecuTorch's training beside the SDK ({result['date']}; {m['cpu']}, {m['cores']} cores, 2 threads where "
             "a side has threads): SGD lr 0.05, dropout 0, the same weights and batch on every side; the sides take "
             f"turns in one process ({ROUNDS} rounds of a block of steps each; medians). ExecuTorch {v['executorch']}, "
             f"torch {v['torch']}, the SDK's portable engine on onnxruntime {v['onnxruntime']}.", "",
             "| model | batch | side | ms / step | SDK portable's speed against it | losses, first 5 steps |",
             "|---|---:|---|---:|---:|---|"]  # fmt: skip
    for row in result["rows"]:
        for name, ms in row["ms_per_step"].items():
            losses = ", ".join(f"{x:.4f}" for x in row["losses"][name])
            lines.append(f"| {row['model']} | {row['batch']} | {name} | {ms:.3f} | {row['sdk_speed_vs'][name]:.2f}x "
                         f"| {losses} |")  # fmt: skip
        for name, why in row["refused"].items():
            lines.append(f"| {row['model']} | {row['batch']} | {name} | - | - | not timed: {why} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help=f"install {', '.join(PINS)} into {LIB.name}")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)  # the children, ExecuTorch on their path
    parser.add_argument("--time", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(*args.probe)))
        return 0
    if args.time:
        print(json.dumps({**timed(args.time[0], tuple(args.time[1].split(","))), "versions": versions()}))
        return 0
    if args.setup or not LIB.is_dir():
        setup()
    result = measure({**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(LIB)])})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "executorch.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "executorch.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
