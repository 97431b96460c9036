"""Inference on an exported model through a plain ONNX Runtime InferenceSession."""

from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from .data import check_data
from .errors import OndeviceError
from .manifest import Manifest
from .session import ort, ort_error_message, session_options

__all__ = ["Predictor", "METADATA_MANIFEST", "METADATA_TOKENIZER"]

METADATA_MANIFEST = "odt.manifest"
"""An exported model's metadata key holding the manifest of the artifacts it came from."""
METADATA_TOKENIZER = "odt.tokenizer"
"""... and the ``tokenizer.json`` text, when the artifacts read text."""


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
        try:
            self._session = ort.InferenceSession(
                os.fspath(path), session_options(threads), providers=["CPUExecutionProvider"]
            )
        except Exception as exc:
            raise OndeviceError(f"cannot load inference model {path}: {ort_error_message(exc)}") from exc
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
        self._inputs = [i.name for i in self._session.get_inputs()]
        self._outputs = [o.name for o in self._session.get_outputs()]

    def predict(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        checked = check_data(self.manifest, data, labels=False)
        feeds = {name: checked[name] for name in self._inputs}
        return dict(zip(self._outputs, self._session.run(self._outputs, feeds)))
