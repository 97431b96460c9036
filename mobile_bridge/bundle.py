"""Bundles: what a phone or browser runtime needs to train, hashed, optionally signed.

A bundle directory holds the training/eval/optimizer models (ONNX and ORT format), the
checkpoint, ``required_operators.config`` for reduced ORT builds, an updated ``manifest.json``
(so the Python runtime can load it), ``bundle.json`` (file hashes, the input/output spec and the
weight-buffer layout an app needs) and, when signed, ``bundle.sig`` (Ed25519 over ``bundle.json``).

Two sets of graphs: the classic ones for ONNX Runtime 1.19.2's training builds (onnxruntime-web's
``TrainingSession``, ORT Mobile's training packages), and, when the artifacts carry them, the portable
step graphs for any current ONNX Runtime (onnxruntime-web 1.30, ORT Mobile's inference packages) with
``parameters.bin``, the values those graphs take as inputs (the browser's copies of the training and step
graphs read its frozen arrays as initializers, once per session)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from ondevice import ConfigError, Manifest, Schedule, Trainer
from ondevice.engines.contract import PORTABLE_ORT, PORTABLE_STEP
from ondevice.files import output_refusal, publish_dir, sha256_file, staging_dir
from ondevice.frozen import HALF
from ondevice.manifest import MANIFEST_NAME
from ondevice.ort_format import convert_to_ort_format
from ondevice.schema import SCHEMA, SCHEMA_FILE, conforms
from ondevice.session import LOSS_SCALE

from .errors import BundleError, SignatureError
from .signing import sign, verify

__all__ = ["BUNDLE_FORMAT", "make_bundle", "verify_bundle", "load_trainer"]

BUNDLE_FORMAT = 1
BUNDLE_JSON = "bundle.json"
SIGNATURE = "bundle.sig"
PARAMETERS = "parameters.bin"


def make_bundle(
    artifacts: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    sign_key: str | os.PathLike[str] | None = None,
    lr: float | None = None,
    schedule: str = "constant",
    total_steps: int | None = None,
    warmup: int = 0,
    min_lr: float = 0.0,
    force: bool = False,
) -> dict[str, Any]:
    """Build a bundle from an artifact directory; the learning rate (default: the manifest's) and
    its schedule are baked into the optimizer graph. A linear or cosine schedule needs
    ``total_steps``, the optimizer steps it spans (after them the rate stays at ``min_lr``).
    Returns the bundle description.

    Examples
    --------
    >>> make_bundle("out/digits/artifacts", "out/digits/bundle", sign_key="keys/odt")  # doctest: +SKIP
    """
    refusal = output_refusal(out, force=force, marker=BUNDLE_JSON, extra=(MANIFEST_NAME, SIGNATURE))
    if refusal is not None:
        raise BundleError(refusal + ".")
    source, target = Path(artifacts), Path(out).absolute()
    manifest = Manifest.load(source)
    if (manifest.frozen_file or {}).get(HALF):
        raise BundleError(f"{source} stores its frozen base in float16 (odt generate --base float16), which does not "
                          "bundle: the training builds of phones and browsers (onnxruntime-training 1.19.2) cannot "
                          "load float16 tensors from a checkpoint. Generate the artifacts with --base int8 (a quarter "
                          "of float32's bytes) or float32 for a bundle.")  # fmt: skip
    if schedule != "constant" and total_steps is None:
        raise BundleError(
            f"a {schedule} schedule needs --total-steps N (total_steps=N): the optimizer steps it spans on the "
            "device, e.g. epochs x batches per epoch. Without it the rate would reach its end after one step."
        )
    try:
        curve = Schedule(
            schedule,
            manifest.optimizer.lr if lr is None else lr,
            1 if total_steps is None else total_steps,
            warmup,
            min_lr,
        )
    except ConfigError as exc:
        raise BundleError(f"bundle learning rate: {exc}") from exc
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BundleError(f"cannot create {target.parent}: {exc.strerror}. Choose a writable --out.") from None
    try:
        work = staging_dir(target)
    except OSError as exc:
        raise BundleError(f"cannot write in {target.parent} ({exc.strerror}). Choose a writable --out.") from None
    try:
        rate = {
            "kind": curve.kind,
            "base": curve.base,
            "total": curve.total,
            "warmup": curve.warmup,
            "min_lr": curve.min_lr,
        }
        import onnx

        from ondevice.engines.step_graph import fuse_step, unseed

        from .frozen import frozen_arrays, internalize_frozen, read_from_parameters
        from .learning_rate import bake_learning_rate
        from .loss_scale import expose_loss_scale

        # the portable graphs run on current ONNX Runtimes (onnxruntime-web 1.30, ORT Mobile): parameters are inputs
        portable = manifest.portable_files
        classic = "classic" in manifest.engines  # artifacts made without the training build carry no classic graphs
        graphs = (*(("training_model.onnx",) if classic else ()), "eval_model.onnx",
                  *(portable[:1] if portable else ()))
        # reads the checkpoint's tensors and frozen.bin's alike; needed only to write them out again
        trainer = Trainer.load(source, evaluation=False) if portable or manifest.frozen_file else None
        frozen = {} if trainer is None else frozen_arrays(source, manifest, trainer)
        if manifest.frozen_file is None:
            for name in (*graphs, "checkpoint"):
                shutil.copy2(source / name, work / name)
        else:
            internalize_frozen(source, work, manifest, graphs, trainer, frozen)
        if portable:
            shutil.copy2(source / portable[1], work / portable[1])
            training = onnx.load(work / portable[0])
            if unseed(training.graph, [p.name for p in manifest.trainable]):  # phones and browsers bind no gradient
                onnx.save(training, work / portable[0])  # buffers: their graphs make the zeros they scatter into
            step = fuse_step(
                training,
                onnx.load(work / portable[1]),
                [p.name for p in manifest.trainable],
                manifest.finite_check,
            )
            onnx.save(step, work / PORTABLE_STEP)
            layout = _write_parameters(trainer, manifest, frozen, work / PARAMETERS, work / portable[0])
        del trainer, frozen

        if classic:  # onnxruntime-web's and ORT Mobile's training builds (1.19.2)
            training = onnx.load(work / "training_model.onnx")
            expose_loss_scale(training, manifest.loss_output, list(manifest.feed_names))
            onnx.save(training, work / "training_model.onnx")
            optimizer = onnx.load(source / "optimizer_model.onnx")
            onnx.save(bake_learning_rate(optimizer, **rate), work / "optimizer_model.onnx")
        try:
            convert_to_ort_format(work)
        except RuntimeError as exc:
            raise BundleError(f"{exc}; the artifacts' graphs do not convert for phones and browsers") from exc
        # the browser's portable graphs read the frozen arrays from parameters.bin (after the ORT-format copies,
        # which would otherwise hold them)
        sources = {"training": portable[0], "step": PORTABLE_STEP} if portable and layout else {}
        browser = {kind: name.replace(".onnx", ".web.onnx") for kind, name in sources.items()}
        for kind, name in sources.items():
            onnx.save(read_from_parameters(onnx.load(work / name), layout, PARAMETERS), work / browser[kind])
        # the app tokenizes text with the artifacts' tokenizer; a language model's decoder (its weights are
        # the trained ones: it is not an ORT-format graph of its own)
        for extra in (manifest.tokenizer, manifest.decoder):
            if extra is not None:
                shutil.copy2(source / extra.file, work / extra.file)
        (work / SCHEMA_FILE).write_text(json.dumps(SCHEMA, indent=1))  # the browser validates bundle.json with it
        files = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file()}
        # phones and browsers have no NCHWc kernels; the bundle makes its own ORT-format graphs
        dropped = {*manifest.portable_variants, *PORTABLE_ORT.values()}
        kept = None if manifest.portable is None else {k: v for k, v in manifest.portable.items() if k not in dropped}
        bundled = replace(manifest, files=files, name=f"{manifest.name} (bundle)", frozen_file=None, variants={},
                          portable=kept)  # fmt: skip
        bundled.save(work)
        artifacts_sha = sha256_file(source / MANIFEST_NAME)
        description = _describe(bundled, sha256_file(work / MANIFEST_NAME), artifacts_sha, work, rate)
        if portable:
            options = manifest.optimizer.options
            description["portable"] = {
                "training": portable[0],
                "optimizer": portable[1],
                "step": PORTABLE_STEP,
                "eval": "eval_model.onnx",
                "parameters": PARAMETERS,
                "frozen": layout,
                **({"browser": browser} if browser else {}),
                "optimizer_options": {
                    "betas": list(options.get("betas", (0.9, 0.999))),
                    "weight_decay": options.get("weight_decay", 0.0),
                },
            }
        text = json.dumps(description, indent=2, sort_keys=True).encode()
        (work / BUNDLE_JSON).write_bytes(text)
        if sign_key is not None:
            (work / SIGNATURE).write_bytes(sign(text, sign_key))
        publish_dir(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return description


def _write_parameters(
    trainer: Trainer, manifest: Manifest, arrays: dict[str, np.ndarray], path: Path, graph: Path
) -> list[dict[str, Any]]:
    """``parameters.bin``: every trainable parameter in the manifest's order (the flat float32 weight buffer),
    then the frozen arrays ``graph`` reads (of ``arrays``), as the artifacts store them (float32, or an int8 base's int8
    matrices with their float32 scales, a large matrix's row blocks being views of its bytes), little-endian.
    Returns the frozen arrays' places: name, shape, dtype and byte offset (a multiple of 4 for float32)."""
    import onnx

    wanted = {i.name for i in onnx.load(graph, load_external_data=False).graph.input}
    layout: list[dict[str, Any]] = []
    with open(path, "wb") as handle:
        for spec in manifest.trainable:
            handle.write(np.ascontiguousarray(trainer.parameter(spec.name), "<f4").tobytes())
        written: dict[int, int] = {}  # a mapped file's address -> where its bytes start in parameters.bin

        def place(array: np.ndarray) -> int:
            root = array
            while isinstance(root.base, np.ndarray):
                root = root.base
            if root is array or not isinstance(root, np.memmap):  # an array of its own
                handle.write(b"\0" * (-handle.tell() % 4))
                start = handle.tell()
                handle.write(np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes())
                return start
            if root.ctypes.data not in written:  # frozen.bin, once: its tensors are views of it
                handle.write(b"\0" * (-handle.tell() % 4))
                written[root.ctypes.data] = handle.tell()
                handle.write(memoryview(root))
            return written[root.ctypes.data] + array.ctypes.data - root.ctypes.data

        for name, array in arrays.items():
            if name in wanted:
                dtype = np.dtype(array.dtype).name
                layout.append({"name": name, "shape": list(array.shape), "dtype": dtype, "byte_offset": place(array)})
    return layout


def _describe(
    manifest: Manifest, manifest_sha: str, artifacts_sha: str, work: Path, rate: dict[str, Any]
) -> dict[str, Any]:
    def tensor(spec: Any) -> dict[str, Any]:
        return {"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)}

    return {
        "format": BUNDLE_FORMAT,
        "name": manifest.name,
        "manifest_sha256": manifest_sha,
        "artifacts_manifest_sha256": artifacts_sha,
        "files": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(work.iterdir())},
        "inputs": [tensor(t) for t in manifest.inputs],
        "targets": [tensor(t) for t in manifest.targets],
        "outputs": [tensor(t) for t in manifest.outputs],
        "feed_order": [*manifest.feed_names, LOSS_SCALE],  # the training graph's inputs, for positional APIs
        "num_classes": manifest.num_classes,
        "finite_check": manifest.finite_check,
        "loss_scale": LOSS_SCALE,
        "optimizer": manifest.optimizer.kind,
        "micro_batch_size": manifest.plan and manifest.plan.micro_batch_size,
        "loss": asdict(manifest.loss),
        "weights": {
            "dtype": "float32",
            "size": manifest.trainable_size,
            "tensors": [{"name": p.name, "shape": list(p.shape), "offset": p.offset} for p in manifest.trainable],
        },
        "learning_rate": {"baked": True, **rate},
    }


def verify_bundle(
    bundle: str | os.PathLike[str], public_key: str | os.PathLike[str] | None = None, *, skip_signature: bool = False
) -> dict[str, Any]:
    """Check a bundle: its signature and the sha256 of every file. Returns the bundle description.

    With ``public_key`` the bundle must be signed by it. Without one, a signed bundle is refused unless
    ``skip_signature``: its hashes alone prove nothing, since whoever alters a file can re-hash ``bundle.json``.
    """
    bundle = Path(bundle)
    try:
        text = (bundle / BUNDLE_JSON).read_bytes()
    except OSError:
        raise BundleError(f"{bundle} has no {BUNDLE_JSON}: it is not a bundle made by `odt bundle`.") from None
    signature = bundle / SIGNATURE
    if public_key is not None:
        if not signature.is_file():
            raise SignatureError(f"{bundle} is not signed ({SIGNATURE} missing) but a public key was given.")
        verify(text, signature.read_bytes(), public_key)
    elif signature.exists() and not skip_signature:
        raise SignatureError(
            f"{bundle} is signed ({SIGNATURE}) but no public key was given, so its signature was not checked: "
            f"whoever altered a file could have re-hashed {BUNDLE_JSON}. Give the signer's public key "
            "(--public-key KEY.pub), or --skip-signature to check the file hashes only."
        )
    try:
        description = json.loads(text)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested too deeply
        problem = type(exc).__name__
        raise BundleError(f"{BUNDLE_JSON} is not a valid bundle description ({problem}); rebuild it.") from None
    if not isinstance(description, dict) or description.get("format") != BUNDLE_FORMAT:
        found = description.get("format") if isinstance(description, dict) else type(description).__name__
        raise BundleError(f"bundle format {found!r} is not {BUNDLE_FORMAT}; rebuild it.")
    problem = conforms(description, {"$ref": "#/$defs/bundle"})
    if problem is not None:
        raise BundleError(
            f"{BUNDLE_JSON}: {problem.where} must be {problem.expected}, found {problem.found!r:.80}; "
            "rebuild the bundle."
        )
    files = description["files"]
    problems = []
    for name, entry in files.items():
        path = bundle / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != entry.get("sha256"):
            problems.append(f"{name} was altered")
    if problems:
        raise BundleError(f"bundle {bundle}: {'; '.join(problems)}. Download it again.")
    return description


def load_trainer(
    bundle: str | os.PathLike[str],
    public_key: str | os.PathLike[str] | None,
    *,
    threads: int | None = None,
    skip_signature: bool = False,
) -> Trainer:
    """The Python runtime over a bundle, refused before any training if the signature or a hash fails
    (a signed bundle without ``public_key``: unless ``skip_signature``, see :func:`verify_bundle`)."""
    verify_bundle(bundle, public_key, skip_signature=skip_signature)
    return Trainer.load(bundle, threads=threads)
