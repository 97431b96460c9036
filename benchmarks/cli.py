"""`odt bench`: the side-by-side benchmark against PyTorch (benchmarks.compare)."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register"]


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="SDK trainer vs PyTorch eager on the benchmark models")
    p.add_argument("--quick", action="store_true", help="two small models and few steps (a smoke pass)")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides (default 2)")
    p.add_argument("--out", default="benchmarks/results", help="where bench.json/.md/.png go")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from .compare import run

    result = run(Path(args.out), quick=args.quick, threads=args.threads)
    print((Path(args.out) / "bench.md").read_text(), end="")
    del result
    return 0
