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
    p.add_argument("--only", default="", help="only the models whose name contains one of these comma-separated words")
    p.add_argument("--name", default="bench", help="file name of the results (default bench: bench.json, bench.md)")
    return _run(p.parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    from .compare import run

    result = run(Path(args.out), quick=args.quick, threads=args.threads, only=args.only, name=args.name)
    print((Path(args.out) / f"{args.name}.md").read_text(), end="")
    del result
    return 0
