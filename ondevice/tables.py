"""``.csv`` data: a header row, then one example per line.

For artifacts with a tokenizer the columns are ``text`` and ``label`` (like ``.jsonl``); for a
model with one float input they are its features, in order, and an optional ``label`` column.
Labels may be class names or numbers. Every problem is a DataError naming the line and column.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import numpy as np

from .errors import DataError
from .manifest import Manifest
from .text import MAX_LINES, TextEncoder, _check_size, _label

__all__ = ["load_csv"]


def load_csv(
    path: str | os.PathLike[str], directory: str | os.PathLike[str] | None, *, labels: bool = True,
    encoder: TextEncoder | None = None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """The artifacts' arrays from a ``.csv`` file (see the module's docstring)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist.")
    _check_size(path)
    # The trainer checks the artifacts' files; reading data needs only the manifest (see TextEncoder).
    manifest = encoder.manifest if encoder is not None else Manifest.load(directory, check_files=False)  # type: ignore[arg-type]
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:  # a byte-order mark (Excel) is not a header
            reader = csv.DictReader(handle)
            header = list(reader.fieldnames or [])
            rows = []
            for row in reader:
                if len(rows) == MAX_LINES:
                    raise DataError(f"{path} has more than {MAX_LINES:,} lines: split it.")
                rows.append(row)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text (byte {exc.start}): save the file as UTF-8.") from None
    except csv.Error as exc:
        raise DataError(f"{path} is not valid CSV ({exc}).") from None
    if not rows:
        raise DataError(f"{path} holds no examples (a header row, then one example per line).")
    wants_labels = labels and bool(manifest.targets)
    if wants_labels and "label" not in header:
        raise DataError(f'{path}: expected a "label" column, found columns {header}. Rename the column holding '
                        "the classes to label (or give data without labels to `odt predict`).")  # fmt: skip
    if manifest.tokenizer is not None:
        data = _texts(path, header, rows, encoder or TextEncoder(directory))
    else:
        data = _features(path, header, rows, manifest)
    if wants_labels:
        targets = [_label(_number(row["label"]), manifest, f"{path}:{i}") for i, row in enumerate(rows, 2)]
        data[manifest.targets[0].name] = np.array(targets, dtype=np.int64)
    return data


def _texts(path: Path, header: list[str], rows: list[dict[str, str]], encoder: TextEncoder) -> dict[str, np.ndarray]:
    if "text" not in header:
        raise DataError(f'{path}: these artifacts read text: expected a "text" column, found columns {header}.')
    return encoder([row["text"] or "" for row in rows])


def _features(path: Path, header: list[str], rows: list[dict[str, str]], manifest: Manifest) -> dict[str, np.ndarray]:
    spec = manifest.inputs[0]
    shape = spec.shape[1:]
    if len(manifest.inputs) != 1 or not spec.dtype.startswith("float") or not all(isinstance(d, int) for d in shape):
        raise DataError(f"{path}: .csv holds one float input of fixed shape; these artifacts take "
                        f"{[(t.name, t.dtype, list(t.shape)) for t in manifest.inputs]}. Use .npz.")  # fmt: skip
    columns = [c for c in header if c != "label"]
    size = math.prod(shape)  # type: ignore[arg-type]
    if len(columns) != size:
        raise DataError(f"{path}: input {spec.name!r} takes {size} features per example {tuple(shape)}, the file "
                        f"has {len(columns)} feature columns (every column but label).")  # fmt: skip
    values = np.empty((len(rows), size), np.float32)
    for i, row in enumerate(rows):
        for j, column in enumerate(columns):
            try:
                values[i, j] = float(row[column])
            except (TypeError, ValueError):
                raise DataError(f"{path}:{i + 2}: column {column!r} holds {row[column]!r}, not a number.") from None
    return {spec.name: values.reshape(len(rows), *shape)}  # type: ignore[misc]


def _number(value: str) -> str | int:
    """A label cell as the class number it spells, else as the class name."""
    text = (value or "").strip()
    return int(text) if text.lstrip("-").isdigit() else text
