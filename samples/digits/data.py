"""Prepare scikit-learn's bundled 8x8 digits (no download) as .npz files keyed by input name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def prepare(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write train/val/test .npz files (``input``: float32 pixels in [0, 1], ``labels``: int64).

    A stratified, seeded 70/15/15 split of the 1,797 images.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_rest, y_train, y_rest = train_test_split(x, y, test_size=0.3, stratify=y, random_state=seed)
    x_val, x_test, y_val, y_test = train_test_split(x_rest, y_rest, test_size=0.5, stratify=y_rest, random_state=seed)
    paths = {}
    for split, (xs, ys) in {"train": (x_train, y_train), "val": (x_val, y_val), "test": (x_test, y_test)}.items():
        paths[split] = out / f"{split}.npz"
        np.savez(paths[split], input=xs, labels=ys)
    return paths
