"""The ONNX Runtime side of generation: build the graphs, repair the eval graph, load-check."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Callable

import onnx

from ondevice.engines import open_engine
from ondevice.manifest import Manifest
from ondevice.ort_format import convert_to_ort_format as to_ort_format
from ondevice.ort_format import native_stderr_silenced
from ondevice.session import ort_error_message

from .errors import ArtifactError, ExportError, UnsupportedOperatorError
from .export import dropout_to_inference
from .losses import Loss
from .optimizers import SGD, AdamW
from .passes.batchnorm import strip_batchnorm_training
from .passes.crossentropy import rewrite_cross_entropy
from .passes.portable import lower_operators

log = logging.getLogger(__name__)

__all__ = ["run_ort_generator", "repair_eval_model", "convert_to_ort_format", "frozen_as_inputs_ort", "check_loads"]


def run_ort_generator(
    graph: onnx.ModelProto,
    trainable: list[str],
    frozen: list[str],
    loss: Loss,
    loss_output: str,
    optimizer: AdamW | SGD,
    extra_outputs: list[str],
    work: Path,
    describe: Callable[[str], str] = lambda node: node,
) -> None:
    """Run ORT's ``generate_artifacts`` into ``work``; ``describe`` names the layer of a graph node."""
    from onnxruntime.training import artifacts as ort_artifacts

    # Path mode writes temporary files into the working directory: keep them in `work`.
    with _inside(work), contextlib.redirect_stdout(io.StringIO()), native_stderr_silenced():
        try:
            ort_artifacts.generate_artifacts(
                graph,
                requires_grad=trainable,
                frozen_params=frozen,
                loss=loss.block(),
                optimizer=optimizer.block(),
                artifact_directory=work,
                additional_output_names=extra_outputs or None,
                loss_input_names=[loss_output],
            )
        except ArtifactError:
            raise
        except Exception as exc:
            message = ort_error_message(exc)
            missing = re.search(r"not been registered: (\w+) for node (\S+)", message)
            if missing:
                raise UnsupportedOperatorError(
                    f"layer {describe(missing.group(2))} exports as ONNX {missing.group(1)}, which has no gradient "
                    "in ONNX Runtime 1.19 training. Freeze the parameters before it (--freeze) or replace it."
                ) from exc
            if "gradient_builder" in str(exc) or "Grad" in message and "implementation" in message:
                raise UnsupportedOperatorError(
                    f"ONNX Runtime cannot differentiate this model: {message}. Freeze the layers it names "
                    "(--freeze) or replace them."
                ) from exc
            raise ExportError(f"ONNX Runtime's artifact generation failed: {message}") from exc


@contextlib.contextmanager
def _inside(path: Path):  # type: ignore[no-untyped-def]
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def repair_eval_model(path: Path) -> None:
    model = onnx.load(path)
    strip_batchnorm_training(model)
    dropout_to_inference(model)
    rewrite_cross_entropy(model)  # the training graph's loss, for the same speed (a registry pass there)
    # what stays of it (ignore_index, class weights) as standard operators, as in the portable graphs: the
    # eval graph serves both engines, and stock ORT loads its ORT-format copy only without the function operator
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    lower_operators(model, opset, ("SoftmaxCrossEntropyLoss",))
    onnx.save(model, path)


def convert_to_ort_format(work: Path) -> None:
    """ORT-format copies of ``work``'s graphs (:func:`ondevice.ort_format.convert_to_ort_format`)."""
    try:
        to_ort_format(work)
    except RuntimeError as exc:
        raise ExportError(str(exc)) from exc


def frozen_as_inputs_ort(source: Path, target: Path) -> bool:
    """Write an ORT-format copy of the graph ``source`` whose weights stored in another file (``frozen.bin``)
    are graph inputs, so the copy holds none of them. False (and the reason logged) when ONNX Runtime cannot
    convert it: the ONNX graph serves instead."""
    model = onnx.load(source, load_external_data=False)
    graph = model.graph
    external = [t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external)
    kept = [t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        onnx.save(model, Path(scratch) / source.name)
        try:
            convert_to_ort_format(Path(scratch))
        except ExportError as exc:
            log.warning("no ORT-format copy of %s (the portable engine loads the ONNX graph): %s", source.name, exc)
            return False
        os.replace(Path(scratch) / source.with_suffix(".ort").name, target)
    return True


def check_loads(work: Path, manifest: Manifest) -> None:
    """Create the ORT session once: kernels missing at load time (ConvTransposeGrad) show up here."""
    try:
        session = open_engine(work, manifest, "classic", work / "checkpoint", threads=None, lean_memory=False,
                              with_eval=True)  # fmt: skip
    except Exception as exc:
        message = ort_error_message(exc)
        if "Grad" in message:
            raise UnsupportedOperatorError(
                f"ONNX Runtime has no CPU kernel for a gradient this model needs: {message}. "
                "Freeze that layer (--freeze) or replace it."
            ) from exc
        raise ExportError(f"the generated artifacts do not load in ONNX Runtime: {message}") from exc
    size = session.module.get_parameters_size(True)  # type: ignore[attr-defined]
    if size != manifest.trainable_size:
        raise ExportError(f"ORT's parameter buffer holds {size} values, the manifest {manifest.trainable_size}.")
    feeds = session.input_names(True)  # type: ignore[attr-defined]
    if tuple(feeds) != manifest.feed_names:
        raise ExportError(f"training graph inputs {feeds} differ from the manifest's {list(manifest.feed_names)}.")
