"""Check data against the manifest before it reaches ORT, and cut it into seeded batches.

Safe casts, applied silently: any integer or bool dtype to int64 and float16/float64/integers to
float32, when every value survives the cast (integers fit, floats stay finite). Everything else
(floats given for integer labels, values that overflow) is refused with a DataError.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, TYPE_CHECKING, Iterator, Mapping

import numpy as np

from .errors import DataError
from .manifest import IGNORE_INDEX, Manifest, TensorSpec

if TYPE_CHECKING:
    import zipfile

__all__ = ["check_data", "batches", "load_npz", "padding_trimmer", "trim_padding", "MAX_DATA_BYTES"]


MAX_DATA_BYTES = 1 << 30
"""Largest decompressed size of an .npz that load_npz reads (1 GiB; ODT_MAX_DATA_BYTES overrides)."""


def load_npz(path: str | os.PathLike[str], *, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """Arrays of an ``.npz`` file, keyed by name; its decompressed size is checked before reading.

    ``max_bytes`` defaults to ``ODT_MAX_DATA_BYTES`` from the environment, else :data:`MAX_DATA_BYTES`.
    """
    limit = max_bytes if max_bytes is not None else int(os.environ.get("ODT_MAX_DATA_BYTES", MAX_DATA_BYTES))
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist.")
    import zipfile  # here, not at the top: only reading data needs it (cold start)

    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise DataError(
            f"data file {path} is not an .npz archive ({exc or type(exc).__name__}). odt reads .npz (named arrays: "
            "numpy.savez(path, input=..., labels=...); a single .npy array has no names), .jsonl of "
            '{"text": ..., "label": ...} lines for artifacts with a tokenizer, and .csv (a header row, then one '
            "example per line); convert other formats to one of them."
        ) from None
    with archive:  # opened once: sizes, headers and arrays (what numpy.load would do, with the checks first)
        members = archive.infolist()
        if not members or not all(m.filename.endswith(".npy") for m in members):
            raise DataError(f"data file {path} holds no .npy arrays: save named arrays with numpy.savez.")
        size = sum(m.file_size for m in members)
        if size > limit:
            raise DataError(
                f"data file {path} decompresses to {size:,} bytes, over the limit of {limit:,} "
                f"({path.stat().st_size:,} bytes on disk). Split the data, or raise ODT_MAX_DATA_BYTES "
                "if it is genuine."
            )
        try:
            arrays = {}
            for member in members:
                with archive.open(member) as handle:
                    _check_header(path, member, handle)
                with archive.open(member) as handle:
                    arrays[member.filename[:-4]] = np.lib.format.read_array(handle, allow_pickle=False)
            return arrays
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
            raise DataError(f"data file {path} is not a readable .npz archive: {exc}") from exc


def _check_header(path: Path, member: zipfile.ZipInfo, handle: IO[bytes]) -> None:
    """An .npy header's shape must fit the bytes the member holds: a header claiming 4 TiB in a small
    file would otherwise make numpy allocate it (MemoryError) before reading anything."""
    major, _ = np.lib.format.read_magic(handle)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(handle)
    needed = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    if needed > member.file_size:
        raise DataError(
            f"data file {path}: array {member.filename[:-4]!r} claims shape {shape} ({needed:,} bytes) "
            f"but holds {member.file_size:,} bytes: the file is damaged or forged."
        )


def check_data(manifest: Manifest, data: Mapping[str, np.ndarray], *, labels: bool = True) -> dict[str, np.ndarray]:
    """Validate and cast ``data`` to the manifest's feeds; returns arrays in feeding order.

    ``labels=False`` checks the model inputs only (prediction).
    """
    specs = list(manifest.inputs) + (list(manifest.targets) if labels else [])
    if not isinstance(data, Mapping):
        raise DataError(f"data must map input names to arrays, got {type(data).__name__}.")
    missing = [s.name for s in specs if s.name not in data]
    if missing:
        raise DataError(
            f"data has no {missing}; expected arrays named {[s.name for s in specs]}, found {sorted(data)}."
        )
    checked = {spec.name: _check_array(spec, data[spec.name]) for spec in specs}
    sizes = {name: len(array) for name, array in checked.items()}
    if len(set(sizes.values())) != 1:
        raise DataError(f"every array needs the same number of examples (dimension 0), found {sizes}.")
    if not next(iter(sizes.values())):
        raise DataError("the dataset is empty: dimension 0 of every array is 0.")
    _check_axes(specs, checked)
    _check_indices(manifest, checked)
    _check_token_labels(manifest, checked, counted=labels)
    if labels:
        _check_labels(manifest, checked)
    return checked


def _check_axes(specs: list[TensorSpec], data: dict[str, np.ndarray]) -> None:
    """A named dynamic axis (e.g. ``seq``) must have one size across all arrays, and not 0."""
    seen: dict[str, tuple[str, int]] = {}
    for spec in specs:
        for axis, dim in enumerate(spec.shape):
            if not axis or not isinstance(dim, str):
                continue
            size = data[spec.name].shape[axis]
            if not size:
                raise DataError(
                    f"{spec.name!r} has shape {data[spec.name].shape}: no values along axis {dim!r}. Every "
                    "example needs at least one (a text at least one token); drop the empty ones."
                )
            first = seen.setdefault(dim, (spec.name, size))
            if first[1] != size:
                raise DataError(
                    f"axis {dim!r} must have one size in every array: {first[0]!r} has {first[1]}, "
                    f"{spec.name!r} has {size}. Pad or truncate them to the same length."
                )


def _check_array(spec: TensorSpec, value: object) -> np.ndarray:
    array = np.asarray(value)
    want = np.dtype(spec.dtype)
    if array.dtype != want:
        array = _cast(spec, array, want)
    if array.ndim != len(spec.shape):
        raise DataError(f"{spec.name!r} needs {len(spec.shape)} dimensions {_shape(spec)}, got shape {array.shape}.")
    for axis, (expected, found) in enumerate(zip(spec.shape, array.shape)):
        if isinstance(expected, int) and expected != found:
            raise DataError(f"{spec.name!r} needs shape {_shape(spec)}, got {array.shape} (dimension {axis}).")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        bad = int(np.count_nonzero(~np.isfinite(array)))
        raise DataError(f"{spec.name!r} holds {bad} NaN/Inf values; clean the data before training.")
    return np.ascontiguousarray(array)


def _cast(spec: TensorSpec, array: np.ndarray, want: np.dtype) -> np.ndarray:
    kind = array.dtype.kind
    if want.kind == "i" and kind in "iub":
        if array.size and (array.min() < np.iinfo(want).min or array.max() > np.iinfo(want).max):
            raise DataError(f"{spec.name!r}: values do not fit {want}.")
        return array.astype(want)
    if want.kind == "f" and kind in "fiub":
        cast = array.astype(want)
        if kind == "f" and np.isfinite(array).all() and not np.isfinite(cast).all():
            raise DataError(f"{spec.name!r}: values overflow {want}.")
        return cast
    raise DataError(
        f"{spec.name!r} must be {want} (or safely castable to it), got {array.dtype}. "
        f"Convert it, e.g. array.astype(np.{want})."
    )


def _check_labels(manifest: Manifest, data: dict[str, np.ndarray]) -> None:
    classes = manifest.num_classes
    if classes is None:
        return
    ignore = manifest.loss.options.get("ignore_index")
    for spec in manifest.targets:
        labels = data[spec.name]
        valid = labels if ignore is None else labels[labels != ignore]
        if valid.size and (valid.min() < 0 or valid.max() >= classes):
            raise DataError(
                f"{spec.name!r} must hold class indices in [0, {classes - 1}], found values "
                f"from {valid.min()} to {valid.max()}."
            )


def _check_token_labels(manifest: Manifest, data: dict[str, np.ndarray], *, counted: bool) -> None:
    """A causal LM's next-token labels: token ids of its vocabulary or IGNORE_INDEX (-100), and (``counted``:
    training or evaluating) at least one token to count, else the mean loss is 0/0."""
    spec = manifest.tokenizer
    if spec is None or spec.labels is None or spec.labels not in data:
        return
    labels, vocab = data[spec.labels], manifest.index_limits.get(spec.ids)
    if vocab is not None and labels.size:
        wrong = ((labels < 0) | (labels >= vocab)) & (labels != IGNORE_INDEX)
        bad = np.flatnonzero(wrong.reshape(len(labels), -1).any(axis=1))
        if bad.size:
            row = int(bad[0])
            raise DataError(
                f"{spec.labels!r} must hold token ids in [0, {vocab - 1}] (the vocabulary) or {IGNORE_INDEX} (not "
                f"counted); example {row} holds {labels[row][wrong[row]].ravel()[0]} ({bad.size} examples are out "
                "of range). Make the labels from the text with the artifacts' tokenizer (a .jsonl file does)."
            )
    if counted and labels.size and not np.any(labels[:, 1:] != IGNORE_INDEX):  # the model predicts token t+1 from t
        raise DataError(
            f"no token to learn from: in {spec.labels!r} every label after each text's first token is "
            f"{IGNORE_INDEX} ({len(labels)} examples), so the loss is 0/0. Give the examples text to learn (a .jsonl "
            "line's \"completion\" or \"text\"), and check that prompts leave room for it within the artifacts' "
            "max length."
        )


def _check_indices(manifest: Manifest, data: dict[str, np.ndarray]) -> None:
    """Ids that index a table must lie in [0, rows): ORT fails on larger ones with its source path
    and reads negative ones from the end of the table."""
    for name, rows in manifest.index_limits.items():
        ids = data.get(name)
        if ids is None or not ids.size:
            continue
        bad = np.flatnonzero(((ids < 0) | (ids >= rows)).any(axis=tuple(range(1, ids.ndim))))
        if bad.size:
            row = int(bad[0])
            found = ids[row][(ids[row] < 0) | (ids[row] >= rows)].ravel()[0] if ids.ndim > 1 else ids[row]
            raise DataError(
                f"{name!r} must hold ids in [0, {rows - 1}] (the rows of the table it indexes); example {row} "
                f"holds {found} ({bad.size} examples are out of range). Tokenize with the artifacts' vocabulary."
            )


def _shape(spec: TensorSpec) -> str:
    return "(" + ", ".join(str(d) for d in spec.shape) + ")"


def batches(
    data: Mapping[str, np.ndarray], batch_size: int, *, shuffle: bool, seed: int, epoch: int
) -> Iterator[dict[str, np.ndarray]]:
    """Batches of ``data`` (the last one may be smaller); the order depends on (seed, epoch) only."""
    size = len(next(iter(data.values())))
    if batch_size < 1:
        raise DataError(f"batch size must be at least 1, got {batch_size}.")
    if batch_size > size:
        raise DataError(f"batch size {batch_size} is larger than the dataset ({size} examples).")
    for index in batch_indices(size, batch_size, shuffle=shuffle, seed=seed, epoch=epoch):
        yield {name: array[index] for name, array in data.items()}


BUCKET_POOL = 50
"""Length buckets sort this many optimizer steps' worth of shuffled examples at a time."""


def batch_indices(
    size: int,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    lengths: np.ndarray | None = None,
    accumulate: int = 1,
) -> list[np.ndarray]:
    """The example indices of each batch of :func:`batches` (the order depends on (seed, epoch) only).

    With ``lengths`` (tokens per example), batches are bucketed by length: the shuffled examples
    are sorted by length within pools of ``BUCKET_POOL`` optimizer steps, cut into steps of
    ``batch_size * accumulate`` examples, and the steps are shuffled (a step's micro-batches stay
    together; a short last step stays last). A batch of texts then pads to its own longest text.
    """
    order = np.random.default_rng([seed, epoch]).permutation(size) if shuffle else np.arange(size)
    if lengths is not None:
        step = batch_size * accumulate
        pool = step * BUCKET_POOL
        steps: list[np.ndarray] = []
        for start in range(0, size, pool):
            chunk = order[start : start + pool]
            chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
            steps += [chunk[i : i + step] for i in range(0, len(chunk), step)]
        tail = [steps.pop()] if len(steps[-1]) < step else []
        if shuffle:
            steps = [steps[i] for i in np.random.default_rng([seed, epoch, 1]).permutation(len(steps))]
        order = np.concatenate(steps + tail)
    return [order[start : start + batch_size] for start in range(0, size, batch_size)]


def padding_trimmer(manifest: Manifest) -> tuple[int, int] | None:
    """Feed positions ``(ids, mask)`` whose trailing all-padding columns a batch may drop, or None.

    A batch of texts is padded to the longest text of the whole data; a shorter batch carries
    columns that every row masks out. Dropping them changes no value the model returns when the
    sequence axis is dynamic and appears in no other input, target or output (a pooled sequence
    classifier): attention gives masked tokens weight 0 and pooling skips them. Only trailing
    columns are dropped, so left-padded data (fixed-length recurrent models) is never touched.
    """
    spec = manifest.tokenizer
    if spec is None or spec.mask is None:
        return None
    tensors = {t.name: t for t in (*manifest.inputs, *manifest.targets)}
    ids, mask = tensors.get(spec.ids), tensors.get(spec.mask)
    if (
        ids is None
        or mask is None
        or len(ids.shape) != 2
        or ids.shape != mask.shape
        or not isinstance(ids.shape[1], str)
    ):
        return None
    others = [
        t for t in (*manifest.inputs, *manifest.targets, *manifest.outputs) if t.name not in (ids.name, mask.name)
    ]
    if any(ids.shape[1] in t.shape for t in others):
        return None
    names = list(manifest.feed_names)
    return names.index(ids.name), names.index(mask.name)


def trim_padding(feeds: list[np.ndarray], positions: tuple[int, int]) -> list[np.ndarray]:
    """``feeds`` without the trailing columns that the mask zeroes in every row (see padding_trimmer)."""
    mask = positions[1]
    used = np.flatnonzero(feeds[mask].any(axis=0))
    width = int(used[-1]) + 1 if len(used) else 1
    if width == feeds[mask].shape[1]:
        return feeds
    trimmed = list(feeds)
    for index in positions:
        trimmed[index] = np.ascontiguousarray(feeds[index][:, :width])
    return trimmed
