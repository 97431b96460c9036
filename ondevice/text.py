"""Text on the device: the artifacts' ``tokenizer.json`` turns sentences into the model's inputs.

Tokenization uses Hugging Face's Rust ``tokenizers`` library (no torch; ``pip install
'ondevice-training[text]'``). A ``.jsonl`` dataset holds one ``{"text": ..., "label": ...}`` object
per line; labels are class names from the manifest (or class numbers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import DataError, ManifestError
from .manifest import IGNORE_INDEX, Manifest

__all__ = ["TextEncoder", "load_jsonl"]

MAX_LINES = 1_000_000
MAX_LINE_BYTES = 1 << 20
"""Longest ``.jsonl`` line read (1 MiB); the whole file is bounded by ODT_MAX_DATA_BYTES like an ``.npz``."""
CHARS_PER_TOKEN = 64
"""Texts are cut to ``max_length * CHARS_PER_TOKEN`` characters before tokenizing: the tokenizer
would otherwise hold every token of a huge text (100 MB of text took 5.9 GB) only to keep ``max_length``."""


class TextEncoder:
    """Encode texts as the manifest's token-id (and attention-mask) inputs.

    Texts are cut to the manifest's ``max_length`` tokens and padded to the longest one given.

    Examples
    --------
    >>> encoder = TextEncoder("out/intents/artifacts")  # doctest: +SKIP
    >>> encoder(["turn on the kitchen lights"])["ids"].shape  # doctest: +SKIP
    (1, 8)
    """

    def __init__(
        self, directory: str | os.PathLike[str] | None, manifest: Manifest | None = None, *,
        tokenizer_json: str | None = None,
    ) -> None:  # fmt: skip
        """``directory`` holds the manifest and its tokenizer; an exported model gives both instead
        (``manifest`` and ``tokenizer_json``, from :class:`~ondevice.Predictor`)."""
        directory = Path(directory or ".")
        # Only the tokenizer's file is hashed here: re-reading every file (frozen.bin) after a trainer has
        # mapped it fills the page cache in large folios again, and each embedding row a step reads then
        # maps a whole folio (MiniLM, odt train: 25 MiB more at the first step).
        self.manifest = manifest if manifest is not None else Manifest.load(directory, check_files=False)
        spec = self.manifest.tokenizer
        if spec is None:
            raise ManifestError(
                f"artifacts {directory} carry no tokenizer: give .npz data with the inputs "
                f"{[t.name for t in self.manifest.inputs]}, or regenerate with `odt generate --tokenizer FILE`."
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ManifestError(
                "these artifacts read text with the `tokenizers` library: pip install 'ondevice-training[text]'."
            ) from None
        if tokenizer_json is None:
            try:
                tokenizer_json = (directory / spec.file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ManifestError(f"cannot read the tokenizer {directory / spec.file}: {exc}") from None
            self.manifest.check_files(directory, names=(spec.file,))
        try:
            self._tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:
            raise ManifestError(f"cannot read the tokenizer {directory / spec.file}: {exc}") from None
        # The tokenizer's own pad token, side and fixed length if it has one (a recurrent model reads
        # a fixed length, left-padded); else pad to the longest text given. Cut at max_length tokens.
        padding = self._tokenizer.padding or {}
        fixed = padding.get("length")  # MiniLM's file says 128: only a length within max_length is kept
        self._tokenizer.enable_padding(
            pad_id=padding.get("pad_id", 0), pad_token=padding.get("pad_token", "[PAD]"),
            direction=padding.get("direction", "right"), length=fixed if fixed and fixed <= spec.max_length else None,
        )  # fmt: skip
        truncation = self._tokenizer.truncation or {}
        self._tokenizer.enable_truncation(spec.max_length, direction=truncation.get("direction", "right"))
        self.spec = spec
        self._pad = (padding.get("pad_id", 0), padding.get("direction", "right"))

    def decode(self, ids: np.ndarray) -> list[str]:
        """The texts rows of token ids spell (special tokens and padding dropped)."""
        return self._tokenizer.decode_batch(np.asarray(ids).tolist(), skip_special_tokens=True)

    def __call__(self, texts: Sequence[str], prompts: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """The inputs for ``texts``; for a causal language model (the tokenizer spec names ``labels``)
        also the labels: each text's token ids and its end token, :data:`IGNORE_INDEX` at padding and
        at the tokens of its first ``prompts[i]`` characters (the prompt, which the loss does not count)."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise DataError("texts must be a list of strings.")
        for index, text in enumerate(texts):
            _check_characters(text, f"text {index}")
        if not texts:
            raise DataError("no texts given.")
        limit = max(4096, self.spec.max_length * CHARS_PER_TOKEN)
        prompts = list(prompts) if prompts is not None else [0] * len(texts)
        parts = []
        for start in range(0, len(texts), ENCODE_CHUNK):  # a chunk's Encoding objects are dropped before the next
            encoded = self._tokenizer.encode_batch([t[:limit] for t in texts[start : start + ENCODE_CHUNK]])
            if self.spec.labels is not None:
                parts.append(self._causal(encoded, prompts[start : start + ENCODE_CHUNK]))
                continue
            ids = np.array([e.ids for e in encoded], np.int64)
            mask = np.array([e.attention_mask for e in encoded], np.int64)
            parts.append((ids, mask, None))
        width = max(ids.shape[1] for ids, _, _ in parts)  # each chunk padded to its longest: pad all to the longest
        pad_id, side = self._pad
        out = {self.spec.ids: np.concatenate([_pad(i, width, pad_id, side) for i, _, _ in parts])}
        if self.spec.mask is not None:
            out[self.spec.mask] = np.concatenate([_pad(m, width, 0, side) for _, m, _ in parts])
        if self.spec.labels is not None:
            out[self.spec.labels] = np.concatenate([_pad(lab, width, IGNORE_INDEX, side) for _, _, lab in parts])
        return out


    def _causal(self, encoded: list[Any], prompts: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A causal LM's rows: each text's tokens, then its end token unless the text was cut or ends with it
        (so the model learns to stop, as Hugging Face's TRL trains); labels count the tokens that end after
        the prompt."""
        eos = self.manifest.decoder.eos[0] if self.manifest.decoder is not None and self.manifest.decoder.eos else None
        rows = []
        for encoding, cut in zip(encoded, prompts):
            kept = [i for i, m in enumerate(encoding.attention_mask) if m]
            ids = [encoding.ids[i] for i in kept]
            labels = [t if encoding.offsets[i][1] > cut else IGNORE_INDEX for t, i in zip(ids, kept)]
            if eos is not None and ids[-1:] != [eos] and not encoding.overflowing and len(ids) < self.spec.max_length:
                ids, labels = [*ids, eos], [*labels, eos]
            rows.append((ids, labels))
        width = max(len(ids) for ids, _ in rows)
        pad_id, side = self._pad

        def padded(values: list[list[int]], fill: int) -> np.ndarray:
            return np.concatenate([_pad(np.array([v], np.int64).reshape(1, -1), width, fill, side) for v in values])

        return (padded([i for i, _ in rows], pad_id), padded([[1] * len(i) for i, _ in rows], 0),
                padded([lab for _, lab in rows], IGNORE_INDEX))  # fmt: skip


ENCODE_CHUNK = 256
"""Texts tokenized at a time: ``tokenizers`` keeps offsets and token strings per text; the intents
sample's 2,913 Spanish training lines encoded at once raised the process's peak by 9.6 MB more
than in chunks (one-off, VmHWM after loading the data)."""


def _pad(array: np.ndarray, width: int, value: int, side: str) -> np.ndarray:
    extra = width - array.shape[1]
    if not extra:
        return array
    return np.pad(array, ((0, 0), (extra, 0) if side == "left" else (0, extra)), constant_values=value)


def load_jsonl(
    path: str | os.PathLike[str], directory: str | os.PathLike[str] | None, *, labels: bool = True,
    encoder: TextEncoder | None = None,
) -> dict[str, np.ndarray]:  # fmt: skip
    """A ``.jsonl`` file of ``{"text", "label"}`` lines as the artifacts' arrays (tokenized by
    ``encoder``, default: the tokenizer of the artifacts in ``directory``)."""
    path = Path(path)
    encoder = encoder if encoder is not None else TextEncoder(directory)
    manifest = encoder.manifest
    if not path.is_file():
        raise DataError(f"data file {path} does not exist.")
    _check_size(path)
    texts, targets, prompts = [], [], []
    with path.open("rb") as lines:
        for number, raw in enumerate(iter(lambda: lines.readline(MAX_LINE_BYTES + 1), b""), 1):
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # the byte-order mark Notepad and Excel write
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{path}:{number} is longer than {MAX_LINE_BYTES:,} bytes: one short text per line.")
            if not raw.strip():
                continue
            if number > MAX_LINES:
                raise DataError(f"{path} has more than {MAX_LINES:,} lines: split it.")
            row = _row(raw, f"{path}:{number}", completions=encoder.spec.labels is not None)
            if "prompt" in row:  # a causal LM's pair: the loss counts the completion only
                prompts.append(len(row["prompt"]))
                texts.append(row["prompt"] + row["completion"])
                continue
            prompts.append(0)
            texts.append(row["text"])
            if labels and manifest.targets:
                if "label" not in row:
                    others = sorted(k for k in row if k != "text")
                    raise DataError(f'{path}:{number}: expected a "label" key beside "text", found keys {others}. '
                                    'Rename it to "label" (or give data without labels to `odt predict`).')  # fmt: skip
                targets.append(_label(row["label"], manifest, f"{path}:{number}"))
    if not texts:
        raise DataError(f"{path} holds no examples.")
    data = encoder(texts, prompts)
    if encoder.spec.labels is not None:  # a pair whose prompt fills max_length teaches nothing: its loss is 0
        counted = (data[encoder.spec.labels] != IGNORE_INDEX).any(axis=1)
        empty = [i for i, (n, c) in enumerate(zip(prompts, counted)) if n and not c]
        if empty:
            raise DataError(
                f"{path}: the prompt of {len(empty)} example(s) (the first: number {empty[0] + 1}, "
                f"{texts[empty[0]][:40]!r}...) fills all {encoder.spec.max_length} tokens the artifacts read, so "
                "nothing of its completion is left to learn. Shorten those prompts, or regenerate the artifacts "
                "with a larger --max-length."
            )
    if labels and manifest.targets:
        data[manifest.targets[0].name] = np.array(targets, dtype=np.int64)
    return data


def _check_size(path: Path) -> None:
    from .data import MAX_DATA_BYTES

    limit = int(os.environ.get("ODT_MAX_DATA_BYTES", MAX_DATA_BYTES))
    size = path.stat().st_size
    if size > limit:
        raise DataError(
            f"data file {path} is {size:,} bytes, over the limit of {limit:,}. Split the data, or raise "
            "ODT_MAX_DATA_BYTES if it is genuine."
        )


def _row(raw: bytes, where: str, *, completions: bool = False) -> dict:
    """One ``{"text", "label"}`` object (with ``completions``, a causal LM's ``{"text"}`` or
    ``{"prompt", "completion"}``); invalid UTF-8, JSON or nesting are DataErrors naming the line."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(f"{where} is not UTF-8 text (byte {exc.start}): save the file as UTF-8.") from None
    except json.JSONDecodeError as exc:
        raise DataError(f"{where} is not JSON ({exc.msg}): write one object per line.") from None
    except RecursionError:
        raise DataError(f'{where} nests too deeply: write flat {{"text": "...", "label": ...}} objects.') from None
    pair = completions and isinstance(row, dict) and "text" not in row
    keys = ("prompt", "completion") if pair else ("text",)
    if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in keys):
        shown = raw.decode("utf-8", "replace").strip()[:80]
        wanted = '{"text": "..."} or {"prompt": "...", "completion": "..."}' if completions else \
            '{"text": "...", "label": ...}'  # fmt: skip
        raise DataError(f"{where}: expected {wanted}, found {shown!r}.")
    for key in keys:
        _check_characters(row[key], f"{where}: the {key}")
    return row


def _check_characters(text: str, what: str) -> None:
    """A DataError when ``text`` holds a lone surrogate (JSON's "\\ud800" escape: half of a UTF-16 pair,
    no character at all), which the tokenizer took untyped."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(f"{what} holds a lone surrogate ({text[exc.start]!r} at character {exc.start}), which is "
                        "no character: give UTF-8 text.") from None


def _label(value: object, manifest: Manifest, where: str) -> int:
    names = manifest.labels
    if isinstance(value, str) and value in names:
        return names.index(value)
    classes = manifest.num_classes
    if isinstance(value, int) and not isinstance(value, bool) and classes is not None and 0 <= value < classes:
        return value
    if not names:
        raise DataError(f"{where}: label {value!r} is not a class number below {classes}.")
    import difflib

    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    shown = ", ".join(names[:40]) + (f", ... ({len(names)} in all)" if len(names) > 40 else "")
    raise DataError(f"{where}: label {value!r} is not one of the {len(names)} classes.{hint} Classes: {shown}.")
