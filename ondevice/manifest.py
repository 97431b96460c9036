"""The manifest: the one contract between the artifact generator and every runtime.

It lives here, in the torch-free runtime, so a device can read it with the standard library;
the generator imports it from here, never the reverse.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import ArtifactIntegrityError, ManifestError, SchemaVersionError
from .files import atomic_write_bytes, sha256_file
from .schema import validate_manifest

PORTABLE_VARIANTS = ("nchwc",)
"""The kinds of variant training graph the manifest's ``portable`` entry may name beside its two graphs."""

CLASSIC_OPTIMIZER = "optimizer_model.onnx"
"""The classic engine's optimizer graph, which only ONNX Runtime's training build can write."""

__all__ = [
    "SCHEMA_VERSION",
    "MANIFEST_NAME",
    "IGNORE_INDEX",
    "TensorSpec",
    "ParamSpec",
    "BufferUpdate",
    "Adapter",
    "TokenizerSpec",
    "DecoderSpec",
    "LossSpec",
    "OptimizerSpec",
    "VerificationRow",
    "Verification",
    "Plan",
    "Manifest",
]

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
BATCH = "batch"
"""Name of the dynamic batch dimension in every input and output shape."""


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: name, numpy dtype name and shape (``"batch"`` is dynamic)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class ParamSpec:
    """A parameter: its shape and, for trainable ones, its offset in the flat float32 buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BufferUpdate:
    """A frozen parameter the train step recomputes (BatchNorm running statistics).

    The training graph returns the new value as output ``output``; the runtime writes it back.
    """

    name: str
    output: str


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter: the layer's ``weight`` W acts as ``W + scale * B @ A`` (``a``: rank x in, ``b``: out x rank).

    ``odt export`` folds the product into W, so the exported model is a plain one.
    """

    weight: str
    a: str
    b: str
    scale: float


IGNORE_INDEX = -100
"""The label of a token the loss does not count (PyTorch's and Hugging Face's convention)."""


@dataclass(frozen=True)
class DecoderSpec:
    """A causal language model's inference graph with a key/value cache (``odt export`` fills in the
    trained weights; ``odt predict --prompt`` decodes with it).

    The graph takes ``ids`` [batch, new], ``mask`` [batch, past + new] (0 for left padding),
    ``positions`` [batch, new] and ``past.{layer}.key`` / ``past.{layer}.value`` [batch, kv_heads,
    past, head_dim]; it returns ``logits`` [batch, vocabulary] of the last position and the
    ``present.{layer}.key`` / ``.value`` caches, past + new long.
    """

    file: str
    layers: int
    kv_heads: int
    head_dim: int
    eos: tuple[int, ...]
    """Token ids that end a completion."""
    max_positions: int
    """The longest prompt + completion the model's positions cover."""
    attention: str
    """How attention was exported: ``"sdpa"``, ``"sdpa-repeated-kv"`` (grouped-query attention as
    key/value heads repeated to the query heads, exactly) or ``"eager"``."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DecoderSpec:
        return cls(**{**data, "eos": tuple(int(t) for t in data["eos"])})

    def past_names(self) -> list[str]:
        return [f"past.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")]

    def present_names(self) -> list[str]:
        return [f"present.{i}.{kind}" for i in range(self.layers) for kind in ("key", "value")]


@dataclass(frozen=True)
class TokenizerSpec:
    """A Hugging Face ``tokenizer.json`` in the artifact directory that turns text into the inputs.

    ``ids`` (and ``mask``, when the model takes an attention mask) name the inputs it fills;
    texts are padded or cut to ``max_length`` tokens. ``labels`` names the input that takes each
    text's own token ids as next-token labels (a causal language model's), with :data:`IGNORE_INDEX`
    at prompt and padding positions; None for every other model.
    """

    file: str
    ids: str
    mask: str | None
    max_length: int
    labels: str | None = None


@dataclass(frozen=True)
class LossSpec:
    kind: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OptimizerSpec:
    kind: str
    lr: float
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class VerificationRow:
    """One compared quantity: the largest absolute and relative difference, and its tolerance."""

    item: str
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    passed: bool


@dataclass(frozen=True)
class Verification:
    passed: bool
    rows: tuple[VerificationRow, ...]
    note: str = ""


@dataclass(frozen=True)
class Plan:
    """The memory planner's choice (``odt generate --memory-budget``) and every candidate's figures: how
    the runtime loads and batches the chosen set so that training stays within the budget it was measured in."""

    budget: int
    """Bytes of peak RSS the chosen set was measured to fit."""
    batch_size: int
    """Examples per optimizer step the plan was measured at: ``odt train``'s default batch."""
    chosen: str | None = None
    rows: tuple[Mapping[str, Any], ...] = ()
    """One row per candidate, in the order tried: its name, size, estimate and (when measured) peak."""
    lean_memory: bool = False
    """The choice fits only with ORT's memory arena off: the runtime then loads it that way."""
    stream_weights: bool = False
    """The choice fits only with its frozen weights streamed: the runtime then streams them."""
    engine: str | None = None
    """The engine the choice was measured on when that matters (streamed weights: portable); the runtime's
    ``engine="auto"`` then takes it."""
    micro_batch_size: int | None = None
    """The chosen micro-batch: ``Trainer.fit`` accumulates ``batch_size / micro_batch_size`` of them per
    optimizer step unless told otherwise (None: the whole batch fits)."""

    @property
    def chosen_row(self) -> Mapping[str, Any] | None:
        """The chosen candidate's row (its measured peak, micro-batch and options), None when none fit."""
        return next((row for row in self.rows if row.get("candidate") == self.chosen), None)

    @property
    def eval_batch_size(self) -> int:
        """Rows per eval or predict step within the plan: its micro-batch, else its batch."""
        return self.micro_batch_size or self.batch_size

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """The plan a manifest holds (its schema checked the types); keys a newer generator adds are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{key: tuple(value) if key == "rows" else value for key, value in data.items() if key in known})


@dataclass(frozen=True)
class Manifest:
    """What an artifact directory holds and how to feed it.

    ``inputs`` are the model's inputs in ``forward`` order; ``targets`` are the extra inputs the
    loss needs (labels); ``loss_input`` is the model output the loss reads (None when the model
    returns its own loss) and ``loss_output`` the graphs' loss output. The training and eval
    graphs take ``inputs + targets`` in that order and return the loss followed by ``outputs``
    (the training graph then the new values of ``buffers`` and ``finite_check``). ``trainable``
    is in the order of ONNX Runtime's contiguous parameter buffer, with offsets into it.
    """

    name: str
    files: Mapping[str, str]
    inputs: tuple[TensorSpec, ...]
    targets: tuple[TensorSpec, ...]
    loss_output: str
    loss_input: str | None
    outputs: tuple[TensorSpec, ...]
    trainable: tuple[ParamSpec, ...]
    frozen: tuple[ParamSpec, ...]
    buffers: tuple[BufferUpdate, ...]
    loss: LossSpec
    optimizer: OptimizerSpec
    versions: Mapping[str, Any]
    verification: Verification | None = None
    schema_version: int = SCHEMA_VERSION
    padding: Mapping[str, int] = field(default_factory=dict)
    """Embedding weights whose padding row (value) gets no gradient, as with PyTorch's ``padding_idx``."""
    finite_check: str | None = None
    """The training graph's last output: the L2 norm of the loss and every accumulated gradient,
    finite exactly when the step may be applied (None in artifacts made before it; the runtime
    then checks the gradients itself)."""
    adapters: tuple[Adapter, ...] = ()
    labels: tuple[str, ...] = ()
    """Class names, in the order of the classifier's outputs (empty: classes are numbers)."""
    tokenizer: TokenizerSpec | None = None
    plan: Plan | None = None
    """The memory planner's choice and its measurements, when ``--memory-budget`` picked the trainable set."""
    hf_config: Mapping[str, Any] | None = None
    """``{"config": config.json, "prefix": "model."}`` when the model is (or wraps, under ``prefix``)
    a ``transformers`` model, so that ``odt export --format hf`` writes a folder ``from_pretrained`` loads."""
    frozen_file: Mapping[str, Any] | None = None
    """``{"file": "frozen.bin", "offsets": {name: offset}}``: frozen weights kept out of the checkpoint,
    as float32 tensors tiling that file (offsets in elements) which ONNX Runtime memory-maps; frozen
    parameters not named there (BatchNorm statistics, other types) are in the checkpoint. Optional
    ``"lookups": [name]``: the tables a step reads a row at a time (embeddings), which the runtime
    pages in by the row (:mod:`ondevice.frozen`)."""
    variants: Mapping[str, str] = field(default_factory=dict)
    """Training graphs for runtimes with faster kernels, by kind: ``{"nchwc": "training_model.nchwc.onnx"}``
    when depthwise convolutions can run on ORT's x86 NCHWc kernels. Same inputs, outputs, parameters and
    values as ``training_model.onnx``; the runtime loads one (:func:`ondevice.session.training_graph`)."""
    portable: Mapping[str, str] | None = None
    """The portable engine's graphs, ``{"training": file, "optimizer": file}`` (with ``eval_model.onnx``; for a
    small model also ``"step"``: the two fused, see :attr:`portable_step`), or
    ``{"unsupported": why}`` naming the operator and layer that did not lower; None in artifacts made
    before the portable engine (:mod:`ondevice.engines`)."""
    index_limits: Mapping[str, int] = field(default_factory=dict)
    """Integer inputs that index a table (token ids into an embedding): input -> rows. The runtime
    refuses ids outside [0, rows) before ORT sees them (ORT reads -1 as the last row)."""
    decoder: DecoderSpec | None = None
    """A causal language model's cached inference graph (:class:`DecoderSpec`), or None."""

    @property
    def trainable_size(self) -> int:
        """Number of float32 values in the trainable parameter buffer."""
        return sum(p.size for p in self.trainable)

    @property
    def portable_files(self) -> tuple[str, str] | None:
        """``(training graph, optimizer graph)`` of the portable engine, or None when the artifacts lack them."""
        files = self.portable or {}
        return (files["training"], files["optimizer"]) if "training" in files else None

    @property
    def portable_step(self) -> str | None:
        """The portable training and optimizer graphs fused into one (a whole step per run), when the
        artifacts carry it: the generator writes it for small models, where a run's fixed cost counts."""
        return (self.portable or {}).get("step") if self.portable_files else None

    @property
    def portable_ort(self) -> dict[str, str]:
        """The ORT-format copies of the portable engine's graphs by graph (``{"training": file, "step": file,
        "eval": file}``), which read the frozen weights as inputs; empty for artifacts without ``frozen.bin``."""
        from .engines.contract import PORTABLE_ORT

        files = self.portable or {}
        return {graph: files[key] for graph, key in PORTABLE_ORT.items() if key in files}

    @property
    def portable_variants(self) -> dict[str, str]:
        """The portable training graph's variants by kind (``{"nchwc": file}`` where the model has
        convolutions ORT's NCHWc kernels run), like :attr:`variants` for the classic engine."""
        return {kind: name for kind, name in (self.portable or {}).items() if kind in PORTABLE_VARIANTS}

    @property
    def train_batch_size(self) -> int:
        """Examples per optimizer step by default (``odt train``): the batch the memory plan was
        measured at, else 32."""
        return 32 if self.plan is None else self.plan.batch_size

    @property
    def eval_batch_size(self) -> int:
        """Rows per eval or predict step by default: the memory plan's micro-batch (or its batch), so
        that evaluating and predicting stay within the budget the plan measured training in; 256
        without a plan."""
        return 256 if self.plan is None else self.plan.eval_batch_size

    @property
    def engines(self) -> tuple[str, ...]:
        """The engines these artifacts carry graphs for: the classic one where ORT's training build wrote its
        optimizer graph (artifacts generated without it carry the portable graphs only)."""
        classic = ("classic",) if CLASSIC_OPTIMIZER in self.files or not self.files else ()
        return (*classic, "portable") if self.portable_files else classic

    @property
    def frozen_size(self) -> int:
        return sum(p.size for p in self.frozen)

    @property
    def feed_names(self) -> tuple[str, ...]:
        """Names of the training/eval graph inputs, in feeding order."""
        return tuple(t.name for t in (*self.inputs, *self.targets))

    @property
    def num_classes(self) -> int | None:
        """Classes of a cross-entropy model (last dim of the output the loss reads), else None."""
        scores = [o for o in self.outputs if o.name == self.loss_input]
        if self.loss.kind != "cross_entropy" or not scores:
            return None
        last = scores[0].shape[-1]
        return last if isinstance(last, int) else None

    def to_json(self) -> str:
        """The JSON form, sealed: ``contract_sha256`` hashes what the graphs were built for (see
        :func:`contract_digest`), so a hand edit of it is refused on load."""
        data = asdict(self)
        if data["tokenizer"] is not None and data["tokenizer"]["labels"] is None:
            del data["tokenizer"]["labels"]  # only a causal LM's tokenizer fills labels: others read as before
        data["contract_sha256"] = contract_digest(data)
        return json.dumps(data, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{MANIFEST_NAME} is not valid JSON ({exc}). Regenerate the artifacts.") from None
        except RecursionError:
            raise ManifestError(f"{MANIFEST_NAME} nests too deeply for a manifest. Regenerate the artifacts.") from None
        return _from_dict(data)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``manifest.json`` into ``directory`` atomically."""
        path = Path(directory) / MANIFEST_NAME
        atomic_write_bytes(path, self.to_json().encode())
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, check_files: bool = True) -> Manifest:
        """Read the manifest of an artifact directory and, by default, check every file's sha256.

        Examples
        --------
        >>> manifest = Manifest.load("out/digits/artifacts")  # doctest: +SKIP
        >>> manifest.feed_names  # doctest: +SKIP
        ('input', 'labels')
        """
        directory = Path(directory)
        path = directory / MANIFEST_NAME
        if not directory.is_dir():
            raise ManifestError(f"artifact directory {directory} does not exist. Run `odt generate` first.")
        if not path.is_file():
            raise ManifestError(
                f"{directory} has no {MANIFEST_NAME}: it is not an artifact directory made by `odt generate`."
            )
        if path.stat().st_size > 1 << 26:
            raise ManifestError(f"{path} is over 64 MiB: not a manifest. Regenerate the artifacts.")
        manifest = cls.from_json(path.read_bytes())
        if check_files:
            manifest.check_files(directory)
        return manifest

    def check_files(self, directory: str | os.PathLike[str], names: Sequence[str] | None = None) -> None:
        """Raise ArtifactIntegrityError for every file (of ``names``, default all) that is missing or whose
        bytes changed."""
        problems = []
        for name, expected in self.files.items():
            if names is not None and name not in names:
                continue
            path = Path(directory) / name
            if not path.is_file():
                problems.append(f"{name} is missing")
            elif sha256_file(path) != expected:
                problems.append(f"{name} was altered (sha256 differs from the manifest)")
        if problems:
            raise ArtifactIntegrityError(
                f"artifact directory {directory}: {'; '.join(problems)}. "
                "Copy the directory again from the workstation or regenerate it."
            )


SEALED = ("inputs", "targets", "loss_output", "loss_input", "outputs", "trainable", "frozen", "buffers", "loss",
          "padding", "finite_check", "adapters", "labels", "tokenizer", "index_limits")  # fmt: skip
"""What the graphs were built for: the feeds, the loss and its classes, the parameter buffer's layout."""


def contract_digest(data: Mapping[str, Any]) -> str:
    """sha256 of the manifest's sealed entries (not its name, file table, versions, optimizer defaults,
    verification or plan, which tools may rewrite: a bundle renames and re-hashes its files)."""
    sealed = {key: data.get(key) for key in SEALED}
    return hashlib.sha256(json.dumps(sealed, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_seal(data: dict[str, Any]) -> None:
    seal = data.get("contract_sha256")
    if seal is not None and seal != contract_digest(data):
        raise ArtifactIntegrityError(
            f"{MANIFEST_NAME} was edited after generation: its inputs, outputs, loss, classes, labels or "
            "trainable layout no longer match the graphs it was written for (contract_sha256 differs). "
            "Regenerate the artifacts (odt generate) instead of editing the manifest."
        )


def _from_dict(data: Any) -> Manifest:
    if not isinstance(data, dict):
        raise ManifestError(f"{MANIFEST_NAME} must hold a JSON object, found {type(data).__name__}.")
    version = data.get("schema_version")
    if not isinstance(version, int):
        raise ManifestError(f"{MANIFEST_NAME} has no integer schema_version (found {version!r}).")
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{MANIFEST_NAME} uses schema version {version}, this runtime reads up to {SCHEMA_VERSION}. "
            "Upgrade the runtime or regenerate the artifacts with a matching generator."
        )
    validate_manifest(data)
    _check_seal(data)
    try:
        verification = data.get("verification")
        return Manifest(
            schema_version=version,
            name=str(data["name"]),
            files=dict(data["files"]),
            inputs=tuple(_tensor(t) for t in data["inputs"]),
            targets=tuple(_tensor(t) for t in data["targets"]),
            loss_output=str(data["loss_output"]),
            loss_input=data["loss_input"],
            outputs=tuple(_tensor(t) for t in data["outputs"]),
            trainable=tuple(_param(p) for p in data["trainable"]),
            frozen=tuple(_param(p) for p in data["frozen"]),
            buffers=tuple(BufferUpdate(**b) for b in data["buffers"]),
            loss=LossSpec(**data["loss"]),
            optimizer=OptimizerSpec(**data["optimizer"]),
            versions=dict(data["versions"]),
            verification=None if verification is None else _verification(verification),
            padding={str(k): int(v) for k, v in data.get("padding", {}).items()},
            finite_check=data.get("finite_check"),
            adapters=tuple(Adapter(**a) for a in data.get("adapters", [])),
            labels=tuple(data.get("labels", [])),
            tokenizer=None if data.get("tokenizer") is None else TokenizerSpec(**data["tokenizer"]),
            plan=None if data.get("plan") is None else Plan.from_dict(data["plan"]),
            index_limits={str(k): int(v) for k, v in data.get("index_limits", {}).items()},
            decoder=None if data.get("decoder") is None else DecoderSpec.from_dict(data["decoder"]),
            hf_config=data.get("hf_config"),
            frozen_file=data.get("frozen_file"),
            variants={str(k): str(v) for k, v in data.get("variants", {}).items()},
            portable=None if data.get("portable") is None else {str(k): str(v) for k, v in data["portable"].items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(
            f"{MANIFEST_NAME} does not match schema version {version}: {exc!r}. Regenerate the artifacts."
        ) from exc


def _tensor(data: dict[str, Any]) -> TensorSpec:
    return TensorSpec(name=data["name"], dtype=data["dtype"], shape=tuple(data["shape"]))


def _param(data: dict[str, Any]) -> ParamSpec:
    return ParamSpec(name=data["name"], shape=tuple(data["shape"]), offset=data.get("offset"))


def _verification(data: dict[str, Any]) -> Verification:
    rows = tuple(VerificationRow(**row) for row in data["rows"])
    return Verification(passed=bool(data["passed"]), rows=rows, note=data.get("note", ""))

