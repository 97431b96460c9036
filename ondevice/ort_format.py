"""ORT-format graphs, written by ONNX Runtime's own converter (the generator's and the bundle's)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

from .session import ort_error_message

__all__ = ["convert_to_ort_format", "native_stderr_silenced"]


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Drop what native code writes to fd 2 (ORT's gradient builder and converter log at INFO regardless of
    the default logger severity). Python exceptions still carry the error."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def convert_to_ort_format(directory: Path) -> None:
    """Write an ORT-format copy (``.ort``) beside every ``.onnx`` graph in ``directory``, with the fixed
    optimizations a reduced (phone) build loads. A failure raises RuntimeError with ONNX Runtime's message,
    without its C++ source location."""
    from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort

    logging.getLogger("ort_format_model.utils").setLevel(logging.WARNING)
    with contextlib.redirect_stdout(io.StringIO()), native_stderr_silenced():
        try:
            convert_onnx_models_to_ort(directory, output_dir=directory, optimization_styles=[OptimizationStyle.Fixed])
        except Exception as exc:
            raise RuntimeError(f"conversion to ORT format failed: {ort_error_message(exc)}") from exc
