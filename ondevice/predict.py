"""Inference on an exported model through a plain ONNX Runtime InferenceSession."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping

import numpy as np

from .data import check_data
from .errors import OndeviceError
from .manifest import DecoderSpec, Manifest
from .session import ort, ort_error_message, session_options

if TYPE_CHECKING:
    from .decode import TextGenerator

__all__ = ["Predictor", "METADATA_MANIFEST", "METADATA_TOKENIZER", "METADATA_DECODER"]

METADATA_MANIFEST = "odt.manifest"
"""An exported model's metadata key holding the manifest of the artifacts it came from."""
METADATA_TOKENIZER = "odt.tokenizer"
"""... and the ``tokenizer.json`` text, when the artifacts read text."""
METADATA_DECODER = "odt.decoder"
"""... and, for a causal language model's cached decoder, its :class:`~ondevice.manifest.DecoderSpec`."""


class Predictor:
    """Run an exported inference model on data checked against the artifact manifest.

    Without ``manifest``, the one ``odt export`` embedded in the model is used (and its tokenizer,
    as ``tokenizer_json``).

    Examples
    --------
    >>> predictor = Predictor("model.onnx")  # doctest: +SKIP
    >>> predictor.predict({"input": x})["output"].argmax(-1)  # doctest: +SKIP
    """

    def __init__(
        self, path: str | os.PathLike[str], manifest: Manifest | None = None, *, threads: int | None = None
    ) -> None:
        from .model_file import mapped_model

        try:
            # The large weights are the file's pages, fed to every run, not a second copy in ONNX Runtime's memory.
            model, self._weights = mapped_model(path)
            source = os.fspath(path) if model is None else model
            self._session = ort.InferenceSession(source, session_options(threads), providers=["CPUExecutionProvider"])
            del model
        except OSError as exc:
            raise OndeviceError(f"cannot load inference model {path}: {exc.strerror or exc}.") from None
        except Exception as exc:
            said = ort_error_message(exc)
            if "Protobuf parsing failed" in said:  # ORT's words for a file that is no ONNX model, or one cut short
                said = (f"it is not a whole ONNX model ({os.path.getsize(path):,} bytes; cut short, damaged or another "
                        "kind of file). Export it again with `odt export`.")  # fmt: skip
            raise OndeviceError(f"cannot load inference model {path}: {said}") from exc
        metadata = self._session.get_modelmeta().custom_metadata_map
        self.tokenizer_json: str | None = metadata.get(METADATA_TOKENIZER)
        if manifest is None:
            if METADATA_MANIFEST not in metadata:
                raise OndeviceError(
                    f"{path} carries no manifest (it was not exported by this odt): give the artifact directory it "
                    "came from (--artifacts DIR; Predictor(path, Manifest.load(DIR)))."
                )
            manifest = Manifest.from_json(metadata[METADATA_MANIFEST])
        self.manifest = manifest
        self.decoder: DecoderSpec | None = None
        """The cached decoder's layout when the model is a causal LM's (``text_generator``), else None."""
        if METADATA_DECODER in metadata:
            import json

            self.decoder = DecoderSpec.from_dict(json.loads(metadata[METADATA_DECODER]))
        self._guard = None  # the mapped file changed under a run: a typed error, not SIGBUS (ondevice.file_guard)
        if self._weights:
            from .file_guard import FileGuard

            remedy = "Nothing was predicted from the change. Export the model again."
            self._guard = FileGuard(Path(path), os.path.getsize(path), reader="prediction", remedy=remedy)
        self._inputs = [i.name for i in self._session.get_inputs() if i.name not in self._weights]
        self._outputs = [o.name for o in self._session.get_outputs()]

    def predict(
        self, data: Mapping[str, np.ndarray], *, batch_size: int | None = None, progress: bool = False
    ) -> dict[str, np.ndarray]:
        """Every output for every example, computed ``batch_size`` examples at a time (so a large
        file never becomes one huge batch; default: the manifest's ``eval_batch_size``, the memory
        plan's micro-batch, else 256); ``progress`` shows a bar on a terminal."""
        if self.decoder is not None:
            raise OndeviceError("this model is a language model's decoder: complete prompts with "
                                "`odt predict MODEL --prompt TEXT` (Predictor.text_generator()).")  # fmt: skip
        if batch_size is None:
            batch_size = self.manifest.eval_batch_size
        from ._progress import progress_bar

        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise OndeviceError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
        checked = check_data(self.manifest, data, labels=False)
        size = len(next(iter(checked.values())))
        parts: list[list[np.ndarray]] = []
        with progress_bar(total=-(-size // batch_size), disable=not progress) as bar:
            for start in range(0, size, batch_size):
                feeds = {name: checked[name][start : start + batch_size] for name in self._inputs} | self._weights
                with self._reading():
                    parts.append(self._session.run(self._outputs, feeds))
                bar.update(1)
        return {name: np.concatenate([part[i] for part in parts]) for i, name in enumerate(self._outputs)}

    def text_generator(self) -> TextGenerator:
        """Greedy text completion with this model (a causal LM's decoder from ``odt export``)."""
        from .decode import TextGenerator, over_plan

        if self.decoder is None or self.tokenizer_json is None:
            raise OndeviceError(
                "this model is not a language model's decoder with its tokenizer: export causal-lm artifacts "
                "(`odt generate --task causal-lm`) with `odt export` to complete prompts."
            )
        generator = TextGenerator(self._session, self.decoder, self.tokenizer_json, weights=self._weights)
        generator.streamed = over_plan(self.manifest, sum(w.nbytes for w in self._weights.values()))
        if generator.streamed:
            from .frozen import mapped_ranges

            ranges = mapped_ranges(self._weights.values())
            generator.reading = lambda: self._reading(ranges)
        else:
            generator.reading = self._reading
        return generator

    @contextlib.contextmanager
    def _reading(self, streamed_ranges: list[tuple[int, int]] | None = None) -> Iterator[None]:
        """Around a run: the mapped file checked before and after (a change ends it with a typed error); with
        ``streamed_ranges``, those pages unmapped while the run reads them."""
        from .frozen import streamed

        if self._guard is not None:
            self._guard.check()
        with streamed(streamed_ranges) if streamed_ranges else contextlib.nullcontext():
            yield
        if self._guard is not None:
            self._guard.check()
