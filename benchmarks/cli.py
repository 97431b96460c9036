"""`python -m benchmarks` (`make bench`): the side-by-side benchmark against PyTorch (benchmarks.compare).

Benchmarks live in the repository, not in the wheel: they need the test models and the samples.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description="SDK trainer vs PyTorch eager")
    p.add_argument("--quick", action="store_true", help="two small models and few steps (a smoke pass)")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    p.add_argument("--out", default="benchmarks/results", help="where bench.json/.md/.png go")
    return _run(p.parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    from .compare import run

    result = run(Path(args.out), quick=args.quick, threads=args.threads)
    print((Path(args.out) / "bench.md").read_text(), end="")
    del result
    return 0
