"""Greedy text generation with a causal language model's cached decoder on any ONNX Runtime.

``odt export`` writes the decoder (``decoder.onnx`` of the artifacts) with the trained weights;
:class:`TextGenerator` feeds it a left-padded batch of prompts once, then one token per row per
step, the keys and values of earlier tokens coming back as the cache (never recomputed).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from .errors import DataError, OndeviceError
from .manifest import DecoderSpec, Manifest

__all__ = ["Completion", "TextGenerator", "decoder_model", "decoder_parts", "greedy", "over_plan", "positions_of",
           "DECODE_MARGIN", "MAX_NEW_TOKENS"]

MAX_NEW_TOKENS = 4096
"""The most tokens one call may ask for: beyond, a typo (1e9) would run for days."""


@dataclass(frozen=True)
class Completion:
    """One prompt's greedy continuation: its text, token ids and why it stopped (``"eos"``: the model
    ended it; ``"length"``: ``max_new_tokens`` were made; ``"context"``: the model's positions ran out)."""

    prompt: str
    text: str
    tokens: tuple[int, ...]
    stopped: str


def positions_of(mask: np.ndarray) -> np.ndarray:
    """Position ids of left-padded rows, as ``transformers``' ``generate`` makes them."""
    positions = np.cumsum(mask, axis=1) - 1
    return np.where(mask == 0, 1, positions).astype(np.int64)


def greedy(
    step: Callable[[dict[str, Any]], list[Any]],
    rows: Sequence[Sequence[int]],
    spec: DecoderSpec,
    max_new_tokens: int,
) -> list[tuple[list[int], str]]:
    """``(new tokens, why it stopped)`` per row of prompt token ids: the prompts run once, left-padded,
    then one token per row per ``step`` (a session's run: feeds -> [logits, *present])."""
    width = max(len(r) for r in rows)
    pad = spec.eos[0] if spec.eos else 0
    ids = np.array([[pad] * (width - len(r)) + list(r) for r in rows], np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], np.int64)
    past = [np.zeros((len(rows), spec.kv_heads, 0, spec.head_dim), np.float32)] * (2 * spec.layers)
    made: list[list[int]] = [[] for _ in rows]
    stopped: list[str | None] = [None] * len(rows)
    new = ids
    while True:
        if mask.shape[1] > spec.max_positions:
            stopped = [s or "context" for s in stopped]
            break
        positions = positions_of(mask)[:, -new.shape[1] :]
        out = step({"ids": new, "mask": mask, "positions": positions, **dict(zip(spec.past_names(), past))})
        logits, past = out[0], out[1:]
        chosen = np.asarray(logits).argmax(-1)
        for row, token in enumerate(chosen.tolist()):
            if stopped[row] is None:
                if token in spec.eos:
                    stopped[row] = "eos"
                else:
                    made[row].append(token)
                    if len(made[row]) == max_new_tokens:
                        stopped[row] = "length"
        if all(stopped):
            break
        new = np.where([s is None for s in stopped], chosen, pad).astype(np.int64)[:, None]
        mask = np.concatenate([mask, np.ones((len(rows), 1), np.int64)], 1)
    return [(tokens, str(why)) for tokens, why in zip(made, stopped)]


class TextGenerator:
    """Greedy completions of prompts with an exported decoder (``odt export`` of causal-LM artifacts).

    Examples
    --------
    >>> generator = Predictor("assistant.onnx").text_generator()  # doctest: +SKIP
    >>> generator(["Turn on the kitchen lights ->"], max_new_tokens=24)[0].text  # doctest: +SKIP
    """

    def __init__(
        self, session: Any, spec: DecoderSpec, tokenizer_json: str,
        weights: Mapping[str, np.ndarray] | None = None,
    ) -> None:  # fmt: skip
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise OndeviceError("a language model reads text with the `tokenizers` library: "
                                "pip install 'ondevice-training[text]'.") from None  # fmt: skip

        self._session, self.spec = session, spec
        self._weights = dict(weights or {})  # fed every run, mapped from a file (an exported model, frozen.bin)
        self.reading: Callable[[], AbstractContextManager[None]] = nullcontext
        """Entered around each run: a trainer's reading of ``frozen.bin`` (its pages checked and, when streamed,
        unmapped while the run reads them), or the streaming of an exported file's mapped weights."""
        self.streamed = False
        """Whether the mapped weights' pages leave RSS while tokens are made (the plan streams, or decoding would
        pass its budget otherwise)."""
        self._tokenizer = Tokenizer.from_str(tokenizer_json)
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self._outputs = ["logits", *spec.present_names()]
        self.tokens_per_second = 0.0
        """Generated tokens per second of the last call (all rows, prompt processing included)."""

    def __call__(
        self, prompts: Sequence[str], *, max_new_tokens: int = 32, batch_size: int = 8, progress: bool = False
    ) -> list[Completion]:
        """The greedy completion of every prompt, ``batch_size`` prompts at a time (left-padded)."""
        from ._progress import progress_bar

        if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise DataError(f"prompts must be a non-empty list of non-empty strings, got {prompts!r:.80}.")
        for index, prompt in enumerate(prompts):
            check_prompt(index, prompt)
        for name, value, top in (("max_new_tokens", max_new_tokens, MAX_NEW_TOKENS), ("batch_size", batch_size, 4096)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise DataError(f"{name} must be an integer from 1 to {top}, got {value!r}.")
        rows = self.encode(prompts)
        for prompt, ids in zip(prompts, rows):
            if not ids:
                raise DataError(f"the prompt {prompt[:40]!r} has no tokens for this model's tokenizer. Give it text.")
            if len(ids) >= self.spec.max_positions:
                raise DataError(f"the prompt {prompt[:40]!r} is {len(ids)} tokens: the model reads at most "
                                f"{self.spec.max_positions - 1} before its answer. Shorten it.")  # fmt: skip
        completions: list[Completion] = []
        start, made = time.perf_counter(), 0
        with progress_bar(total=-(-len(rows) // batch_size), disable=not progress) as bar:
            for first in range(0, len(rows), batch_size):
                chunk = rows[first : first + batch_size]
                for prompt, (tokens, why) in zip(prompts[first:], greedy(self.step, chunk, self.spec, max_new_tokens)):
                    text = self._tokenizer.decode(tokens, skip_special_tokens=True)
                    completions.append(Completion(prompt, text, tuple(tokens), why))
                    made += len(tokens)
                bar.update(1)
        self.tokens_per_second = made / max(time.perf_counter() - start, 1e-9)
        return completions

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        """Each prompt's token ids, as the decoder reads them (special tokens included, no padding)."""
        return [e.ids for e in self._tokenizer.encode_batch(list(prompts))]

    def step(self, feeds: Mapping[str, Any]) -> list[Any]:
        """One run of the decoder: ``[logits, *present]`` for ``feeds`` (what :func:`greedy` calls)."""
        from .session import ort_error_message

        try:
            with self.reading():
                return self._session.run(self._outputs, {**feeds, **self._weights})
        except Exception as exc:
            raise OndeviceError(f"the decoder failed: {ort_error_message(exc)}") from exc


DECODE_MARGIN = 32 << 20
"""Bytes a decoder's run may add to a process beside the weights it reads (cache, logits, ORT's buffers). SmolLM2
on an int8 base, two prompts of 24 tokens: RSS rose 120 MiB over the session's while the run read frozen.bin's
129 MiB, ORT's buffers coming out of memory the process had freed before (one-off)."""


def over_plan(manifest: Manifest, mapped: int) -> bool:
    """Whether decoding would pass the memory plan's budget with ``mapped`` bytes of mapped weights in RSS (those of
    ``frozen.bin``, or of an exported model's file): then their pages are streamed, unmapped while tokens are made
    (:func:`ondevice.frozen.streamed`), as the plan streams a step's."""
    from .session import process_status

    now = process_status("VmRSS")
    return bool(manifest.plan and now is not None and now + mapped + DECODE_MARGIN > manifest.plan.budget)


def check_prompt(index: int, prompt: str) -> None:
    """A prompt the decoder can read: text that is not only whitespace, valid UTF-8 (a command line's invalid
    bytes reach Python as lone surrogates)."""
    if not prompt.strip():
        raise DataError(f"prompt {index + 1} is only whitespace ({prompt!r:.40}): give the text to complete.")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"prompt {index + 1} is not valid UTF-8 text ({prompt!r:.60}); pass it as UTF-8.") from None


def decoder_model(model: Any, weights: Mapping[str, np.ndarray], fed: Collection[str] = ()):  # type: ignore[no-untyped-def]
    """The decoder graph ``model`` (the artifacts' ``decoder.onnx``, loaded) with ``weights`` (by name, e.g. the
    trained and folded ones) put into the initializers the generator left empty, except those named in ``fed``:
    they become graph inputs, which every run feeds (:class:`TextGenerator`'s ``weights``, e.g. the trainer's
    mapping of ``frozen.bin``: read in place, where a session's initializers would be copies of it)."""
    from onnx import helper

    for tensor in [t for t in model.graph.initializer if t.name in fed]:
        model.graph.initializer.remove(tensor)
        model.graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    model, tensors = decoder_parts(model, weights)
    model.graph.initializer.extend(tensors)
    return model


def decoder_parts(
    model: Any, weights: Mapping[str, np.ndarray], files: Mapping[str, tuple[Path, int, int]] | None = None
):  # type: ignore[no-untyped-def]
    """``(graph without the empty initializers, a generator of them filled from weights)``: what
    :func:`decoder_model` joins, for a writer that puts one weight at a time in a file. A weight named in
    ``files`` comes as ``(its TensorProto without data, (file, offset, length))``: the writer copies its bytes
    from that file (``frozen.bin``) without mapping them into the process."""
    import onnx
    from onnx import numpy_helper

    files = files or {}
    empty = [t for t in model.graph.initializer
             if not (t.HasField("raw_data") or _has_values(t))]  # fmt: skip
    for tensor in empty:
        if tensor.name not in weights:
            raise OndeviceError(f"the decoder needs weight {tensor.name!r}, which these artifacts do not hold. "
                                "Regenerate them with `odt generate`.")  # fmt: skip
    for tensor in empty:
        model.graph.initializer.remove(tensor)

    def filled():  # type: ignore[no-untyped-def]
        for tensor in empty:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            value = weights[tensor.name]
            if tensor.name in files and value.dtype == dtype and value.shape == tuple(tensor.dims):
                header = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
                yield header, files[tensor.name]
                continue
            value = np.asarray(value).astype(dtype, copy=False)
            if value.shape != tuple(tensor.dims):
                raise OndeviceError(f"weight {tensor.name!r} is {value.shape}, the decoder expects "
                                    f"{tuple(tensor.dims)}. Regenerate the artifacts.")  # fmt: skip
            yield numpy_helper.from_array(value, tensor.name)

    return model, filled()


def _has_values(initializer: Any) -> bool:
    return any(len(getattr(initializer, f)) for f in ("float_data", "int32_data", "int64_data", "double_data")) or (
        not initializer.dims or 0 in initializer.dims
    )
