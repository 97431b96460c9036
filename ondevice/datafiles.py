"""Any data file the runtime reads, by its suffix: ``.npz`` arrays, ``.jsonl`` text, ``.csv`` tables.

The one reader above :mod:`ondevice.data`, :mod:`ondevice.text` and :mod:`ondevice.tables`, so none of
them imports another's reader back.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .data import load_npz
from .tables import load_csv
from .text import TextEncoder, load_jsonl

__all__ = ["load_data", "DATA_FORMATS"]

DATA_FORMATS = (".npz", ".jsonl", ".csv")
"""The data files :func:`load_data` reads (anything else is read as ``.npz``)."""


def load_data(
    path: str | os.PathLike[str], directory: str | os.PathLike[str] | None, *, labels: bool = True,
    encoder: TextEncoder | None = None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """The arrays of an ``.npz`` file, of a ``.jsonl`` text file tokenized for the artifacts in
    ``directory`` (or by ``encoder``), or of a ``.csv`` file (see :mod:`ondevice.tables`)."""
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        return load_jsonl(path, directory, labels=labels, encoder=encoder)
    if suffix == ".csv":
        return load_csv(path, directory, labels=labels, encoder=encoder)
    return load_npz(path)
