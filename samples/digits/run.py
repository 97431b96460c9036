"""The digits sample end to end: data, artifacts (verified against PyTorch), on-device training.

Run by `make demo`. Everything it writes goes under --out (default out/digits).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from data import prepare  # noqa: E402
from model import build  # noqa: E402

from artifacts import generate  # noqa: E402
from artifacts.verify import format_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="out/digits", help="output directory (default out/digits)")
    args = parser.parse_args(argv)
    out = Path(args.out)

    print("1. data: scikit-learn digits -> .npz")
    paths = prepare(out / "data")
    print(f"   {', '.join(str(p) for p in paths.values())}")

    print("2. artifacts: PyTorch model -> ONNX Runtime training artifacts, verified against PyTorch")
    manifest = generate(build(), {"input": torch.randn(32, 64)}, out / "artifacts", force=True, ort_format=True)
    print(format_table(manifest.verification))
    print(f"   {manifest.trainable_size:,} trainable parameters -> {out / 'artifacts'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
