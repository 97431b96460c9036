"""ExecuTorch's training beside the SDK's portable engine and PyTorch eager, on the MLP (784-256-128-10, batch 64).

ExecuTorch (PyPI ``executorch``) is what a PyTorch user would try instead: ``torch.export`` of a module that returns
its loss, ``torch.export.experimental._export_forward_backward`` for the joint forward-backward graph, ``to_edge``
(or ``to_edge_transform_and_lower`` with the XNNPACK partitioner) and ``to_executorch``, then its training module's
``forward_backward`` and its SGD optimizer (the only optimizer its training API offers, so every side here trains
with plain SGD). The four sides start from the same weights and data, and take turns in one process, a block of
steps each (medians of the blocks' per-step times; ratios within a round). Losses of the first steps are compared.

ExecuTorch lives outside the development venv (it would pull pandas, coremltools and more into it): ``--setup``
installs the pinned ``executorch`` and the few modules it imports into ``.executorch-lib`` with ``--no-deps``; the
run puts that directory on the path of a child process of this venv's Python (whose torch 2.13 it runs on).

Run: .venv/bin/python -m benchmarks.executorch [--setup]   (writes benchmarks/results/executorch.*)
"""

from __future__ import annotations

import argparse
import json
import os
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


def mlp():  # type: ignore[no-untyped-def]
    from torch import nn

    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def sides(work: Path) -> dict[str, object]:
    """``name -> one training step`` (returning the loss) for each side, all from the same weights and batch."""
    import torch
    from torch import nn
    from torch.export import export
    from torch.export.experimental import _export_forward_backward

    from artifacts import SGD, generate
    from ondevice import Trainer

    torch.manual_seed(0)
    torch.set_num_threads(2)
    net = mlp()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

    class Train(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x, y):  # type: ignore[no-untyped-def]  # a second, detached output: as its examples do
            out = self.net(x)
            return nn.functional.cross_entropy(out, y), out.detach().argmax(dim=1)

    made: dict[str, object] = {}
    for name, lower in (("ExecuTorch", False), ("ExecuTorch + XNNPACK", True)):
        net.load_state_dict(state)
        made[name] = _executorch_step(_export_forward_backward(export(Train(net), (x, y), strict=True)), lower, x, y)
    eager = mlp()
    eager.load_state_dict(state)
    sgd = torch.optim.SGD(eager.parameters(), lr=LR)

    def torch_step() -> float:
        sgd.zero_grad()
        loss = nn.functional.cross_entropy(eager(x), y)
        loss.backward()
        sgd.step()
        return float(loss.detach())

    made["PyTorch eager"] = torch_step
    net.load_state_dict(state)
    generate(net, {"input": x}, work / "mlp", optimizer=SGD(lr=LR), force=True)
    trainer = Trainer.load(work / "mlp", engine="portable", threads=2, evaluation=False)
    batch = {"input": x.numpy(), "labels": y.numpy()}
    made["SDK portable"] = lambda: float(trainer.train_step(batch).loss)
    return made


def _executorch_step(joint, lower: bool, x, y):  # type: ignore[no-untyped-def]
    from executorch.exir import to_edge, to_edge_transform_and_lower
    from executorch.extension.training import _load_for_executorch_for_training_from_buffer, get_sgd_optimizer

    if lower:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        program = to_edge_transform_and_lower(joint, partitioner=[XnnpackPartitioner()]).to_executorch()
    else:
        program = to_edge(joint).to_executorch()
    buffer = program.buffer  # the module reads it in place: it lives as long as the step (freed, it crashed)
    module = _load_for_executorch_for_training_from_buffer(buffer)
    optimizer = None

    def step() -> float:
        nonlocal optimizer
        assert buffer
        loss = module.forward_backward("forward", (x, y))[0]
        if optimizer is None:  # its parameters can be named only after a first forward_backward
            optimizer = get_sgd_optimizer(module.named_parameters(), LR, 0, 0, 0, False)
        optimizer.step(module.named_gradients())
        return float(loss)

    return step


def measure() -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="odt-et-") as work:
        steps = sides(Path(work))
        losses = {name: [step() for _ in range(STEPS)] for name, step in steps.items()}  # type: ignore[operator]
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(ROUNDS):
            for name, step in steps.items():
                started = time.perf_counter()
                for _ in range(BLOCKS):
                    step()  # type: ignore[operator]
                times[name].append((time.perf_counter() - started) / BLOCKS * 1e3)
    sdk = np.array(times["SDK portable"])
    from importlib.metadata import version

    import torch

    from benchmarks._machine import machine
    from ondevice.session import ORT_VERSION

    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "versions": {"onnxruntime": ORT_VERSION, "torch": torch.__version__,
                     "executorch": version("executorch")},  # fmt: skip
        "losses": losses,
        "ms_per_step": {name: float(np.median(t)) for name, t in times.items()},
        "sdk_speed_vs": {name: float(np.median(np.array(t) / sdk)) for name, t in times.items()},
    }


def table(result: dict) -> str:  # type: ignore[type-arg]
    m = result["machine"]
    v = result["versions"]
    lines = [f"ExecuTorch's training beside the SDK ({result['date']}; {m['cpu']}, {m['cores']} cores, 2 threads where "
             "a side has threads): the MLP 784-256-128-10, batch 64, SGD lr 0.05, the same weights and batch; the "
             f"sides take turns in one process ({ROUNDS} rounds of {BLOCKS} steps; medians). ExecuTorch "
             f"{v['executorch']}, torch {v['torch']}, the SDK's portable engine on onnxruntime {v['onnxruntime']}.",
             "",
             "| side | ms / step | SDK portable's speed against it | losses, first 5 steps |",
             "|---|---:|---:|---|"]  # fmt: skip
    for name, ms in result["ms_per_step"].items():
        losses = ", ".join(f"{v:.4f}" for v in result["losses"][name])
        lines.append(f"| {name} | {ms:.3f} | {result['sdk_speed_vs'][name]:.2f}x | {losses} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help=f"install {', '.join(PINS)} into {LIB.name}")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setup or not LIB.is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(LIB), *PINS],
                       check=True)  # fmt: skip
    if not args.child:  # ExecuTorch's modules on the path of a process of its own
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(LIB)])}
        return subprocess.run([sys.executable, "-m", "benchmarks.executorch", "--child", "--out", str(args.out)],
                              env=env, cwd=ROOT).returncode  # fmt: skip
    result = measure()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "executorch.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "executorch.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
