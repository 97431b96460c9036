"""The on-device trainer: train, evaluate, checkpoint, resume and export over one artifact directory."""

from __future__ import annotations

import json
import math
import os
from collections import ChainMap
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from ._metrics import Meter, flatten_weights
from .data import batch_indices, batches, check_data, padding_trimmer, trim_padding
from .engines import Engine, open_engine, resolve
from .errors import (
    CheckpointError,
    ConfigError,
    DataError,
    ManifestError,
    OndeviceError,
    VersionMismatchError,
    WeightsError,
)
from .files import sha256_file
from .frozen import SCALE_SUFFIX, FrozenWeights, dequantize_rows, narrow_matrices, stored_arrays, widened
from .locks import ARTIFACTS_LOCK, shared
from .manifest import MANIFEST_NAME, Manifest
from .schedules import Schedule
from .session import ORT_VERSION, ort_error_message, set_seed
from .stopping import EarlyStopping, improves

if TYPE_CHECKING:
    from .decode import TextGenerator

__all__ = ["Trainer", "StepResult", "History"]


@dataclass(frozen=True)
class StepResult:
    """One step: the loss, the extra outputs (e.g. logits) and whether the update was applied."""

    loss: float
    outputs: dict[str, np.ndarray]
    applied: bool = True


@dataclass
class History:
    """Per-epoch metrics of :meth:`Trainer.fit` (loss, accuracy, val_*, lr, skipped steps)."""

    epochs: list[dict[str, float]] = field(default_factory=list)
    best_epoch: int | None = None
    """With early stopping: the epoch whose weights the trainer ended with (the best ``monitor``)."""
    stopped_early: bool = False
    """Whether early stopping ended the run before ``epochs``."""

    def last(self) -> dict[str, float]:
        return self.epochs[-1] if self.epochs else {}


class Trainer:
    """Train an artifact directory with ONNX Runtime, in torch's vocabulary.

    Examples
    --------
    >>> trainer = Trainer.load("out/digits/artifacts")  # doctest: +SKIP
    >>> history = trainer.fit(train, epochs=20, batch_size=32, val_data=val)  # doctest: +SKIP
    >>> trainer.evaluate(test)["accuracy"]  # doctest: +SKIP
    0.97
    """

    def __init__(self, directory: Path, manifest: Manifest, engine: Engine, manifest_sha: str) -> None:
        self.directory = directory
        self.manifest = manifest
        self._engine = engine
        self._manifest_sha = manifest_sha
        self.epoch = 0
        self.step = 0
        self.seed = 0
        self.skipped_steps = 0
        self.schedule: Schedule | None = None
        self._lr = manifest.optimizer.lr
        engine.set_learning_rate(self._lr)
        self._train_names = [o.name for o in manifest.outputs]
        self._buffers = [b.name for b in manifest.buffers]
        self._trim = padding_trimmer(manifest)  # texts: a batch drops the padding columns all its rows share
        self._grad_views: dict[int, np.ndarray] | None = None
        self._proximal: tuple[float, list[np.ndarray]] | None = None
        self._frozen: FrozenWeights | None = None  # Trainer.load's shared mapping of frozen.bin
        self._in_use: IO[str] | None = None  # Trainer.load's shared lock on the artifacts (ondevice.locks)

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        *,
        checkpoint: str | os.PathLike[str] | None = None,
        threads: int | None = None,
        lean_memory: bool | None = None,
        evaluation: bool = True,
        engine: str = "auto",
        stream_weights: bool | None = None,
    ) -> Trainer:
        """Open an artifact directory (manifest, hashes and ORT version checked), optionally resuming.

        ``engine`` picks what trains (:mod:`ondevice.engines`): ``"classic"`` is ONNX Runtime's
        training build, ``"portable"`` any stock ONNX Runtime running the artifacts' portable graphs;
        ``"auto"`` takes the classic engine where the training build is installed, else the portable
        one. Checkpoints of either load in the other.

        ``lean_memory`` trades some speed for a lower peak (ORT's memory arena off; see
        :func:`ondevice.session.session_options` for what it measured); by default it follows
        the memory planner's choice recorded in the manifest (off without a plan).
        ``stream_weights`` keeps the frozen weights (``frozen.bin``) out of RSS while steps run: their
        pages are unmapped every 10 ms and mapped again from the page cache when read (Linux, portable
        engine; on the classic one they leave between steps only: see :mod:`ondevice.frozen`). By
        default it follows the memory plan, as ``engine="auto"`` takes the engine the plan measured.
        ``evaluation=False`` skips the eval graph's session (on the digits model 15 to 28 % of a
        load in one-offs, and most of the time it takes to free a trainer) for training-only work
        such as a federated train task; such a trainer refuses :meth:`evaluate`,
        :meth:`eval_step` and ``fit(val_data=...)``.
        """
        if not isinstance(evaluation, bool):
            raise ConfigError(f"evaluation must be True or False, got {evaluation!r}.")
        directory = Path(directory)
        manifest = Manifest.load(directory)
        in_use = shared(directory / ARTIFACTS_LOCK, f"artifacts {directory}",
                        "odt generate --force is replacing them: wait for it to finish")  # fmt: skip
        planned = manifest.plan and manifest.plan.engine
        if engine == "auto" and planned is not None:  # the engine the memory plan was measured on (schema-checked)
            engine = planned
        engine = resolve(engine, manifest)
        made_with = str(manifest.versions.get("onnxruntime", ""))
        if engine == "classic" and made_with.split(".")[:2] != ORT_VERSION.split(".")[:2]:
            raise VersionMismatchError(
                f"artifacts were made for ONNX Runtime {made_with}, this device runs {ORT_VERSION}. "
                f"Install onnxruntime-training=={made_with} or regenerate the artifacts."
            )
        sha = sha256_file(directory / MANIFEST_NAME)
        if lean_memory is None:
            lean_memory = bool(manifest.plan and manifest.plan.lean_memory)
        if stream_weights is None:
            stream_weights = bool(manifest.plan and manifest.plan.stream_weights)
        if not isinstance(stream_weights, bool):
            raise ConfigError(f"stream_weights must be True, False or None, got {stream_weights!r}.")
        options = {"threads": threads, "lean_memory": lean_memory, "with_eval": evaluation}
        frozen = FrozenWeights(directory, manifest, stream=stream_weights)  # one mapping of frozen.bin, every session
        options["frozen"] = frozen.values
        try:
            if checkpoint is None:
                opened = open_engine(directory, manifest, engine, directory / "checkpoint", **options)
            else:
                from ._checkpoint import unpacked

                with unpacked(Path(checkpoint), sha) as (raw, _):  # size, sha256 and manifest checked first
                    opened = open_engine(directory, manifest, engine, raw, **options)
        except OndeviceError:
            raise
        except Exception as exc:
            what = f"checkpoint {checkpoint}" if checkpoint else f"artifacts in {directory}"
            raise (CheckpointError if checkpoint else OndeviceError)(
                f"ONNX Runtime cannot load the {what}: {ort_error_message(exc)}"
            ) from exc
        trainer = cls(directory, manifest, opened, sha)
        trainer._frozen = frozen
        trainer._in_use = in_use  # held while the trainer lives: generate --force refuses to replace these artifacts
        if checkpoint is not None:
            trainer._restore_progress()
        return trainer

    @property
    def engine(self) -> str:
        """The engine that trains: ``"classic"`` or ``"portable"``."""
        return self._engine.name

    @property
    def ort_version(self) -> str:
        """The ONNX Runtime version the engine runs on."""
        return self._engine.ort_version

    @property
    def update(self) -> str:
        """How the optimizer update runs: ``"kernel"`` (the portable engine's native pass), ``"graph"`` (its update
        graph, where no kernel loads: see ``ondevice.engines.update_kernel.status()``) or ``"training build"``."""
        return self._engine.update

    @property
    def manifest_sha256(self) -> str:
        """sha256 of the artifact directory's manifest.json: the identity federated peers compare."""
        return self._manifest_sha

    # -- learning rate -------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return self._lr

    def set_lr(self, lr: float) -> None:
        if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
            raise ConfigError(f"learning rate must be positive and finite, got {lr!r}.")
        if lr != self._lr:
            self._engine.set_learning_rate(lr)
            self._lr = lr

    # -- steps ---------------------------------------------------------------------------------
    def train_step(self, batch: Mapping[str, np.ndarray]) -> StepResult:
        """Forward, backward and one optimizer step on ``batch``; skipped if not finite."""
        feeds = list(check_data(self.manifest, batch).values())
        loss, fetched, applied = self._micro_step(feeds, micro=0, whole=self._whole_steps(1))
        self._finish(bad=not applied, micro_steps=1)
        return StepResult(loss, dict(zip(self._train_names, fetched[1 : 1 + len(self._train_names)])), applied)

    def eval_step(self, batch: Mapping[str, np.ndarray]) -> StepResult:
        """Loss and outputs of the eval graph (dropout off, running statistics) on ``batch``."""
        self._check_evaluation("eval_step")
        feeds = list(check_data(self.manifest, batch).values())
        with self._reading():
            fetched = self._engine.eval_step(self._trimmed(feeds))
        return StepResult(float(fetched[0]), dict(zip(self._train_names, fetched[1:])))

    def _whole_steps(self, accumulate: int) -> bool:
        """Whether each micro-batch is a whole optimizer step whose gradients only the update reads (no
        accumulation, no proximal term, the finite check in the graph): the engine may fuse the two."""
        return accumulate == 1 and self._proximal is None and self.manifest.finite_check is not None

    def _micro_step(
        self, feeds: list[np.ndarray], micro: int, whole: bool = False
    ) -> tuple[float, list[np.ndarray], bool]:
        """Forward and backward: the loss, ORT's fetches (loss, outputs, buffers, finite flag) and
        whether loss and gradients are finite. Lean on purpose: it is the loop's per-step Python."""
        # ORT's Dropout draws from a process-wide generator: seed it from (seed, step, micro) so
        # masks, and so a resumed run, are reproducible.
        set_seed((self.seed * 1_000_003 + self.step * 1_009 + micro) % 2**31)
        with self._reading():
            fetched = self._engine.train_step(self._trimmed(feeds), whole=whole)
        loss = float(fetched[0])
        if self.manifest.finite_check is not None:
            finite = math.isfinite(fetched[-1])
        else:
            finite = math.isfinite(loss) and self._gradients_finite()
        if finite and self._buffers:
            for name, value in zip(self._buffers, fetched[1 + len(self._train_names) :]):
                self._engine.set_parameter(name, value)
        return loss, fetched, finite

    def _reading(self) -> AbstractContextManager[None]:
        """Around a session's run: the frozen pages it reads leave RSS (``FrozenWeights.reading``)."""
        return self._frozen.reading() if self._frozen is not None else nullcontext()

    def _trimmed(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        return feeds if self._trim is None else trim_padding(feeds, self._trim)

    def _fetch_index(self, output: str | None) -> int | None:
        """Where ``output`` sits in a step's fetches (the loss comes first), or None."""
        return None if output not in self._train_names else 1 + self._train_names.index(output)

    def _gradients(self) -> dict[int, np.ndarray]:
        """Index in ``manifest.trainable`` -> the accumulated gradient (those ORT has allocated).

        ORT 1.19 allocates each gradient buffer once and zeroes it in place on reset, so views
        taken after the first backward stay valid for the session (a test holds it to that).
        """
        if self._grad_views is not None:
            return self._grad_views
        views = {i: self._engine.gradient_view(p.name) for i, p in enumerate(self.manifest.trainable)}
        present = {i: v for i, v in views.items() if v is not None}
        if len(present) == len(views):
            self._grad_views = present
        return present

    def _gradients_finite(self) -> bool:
        # Artifacts without the in-graph check (manifest.finite_check): a sum is NaN/Inf when any
        # element is (or when it overflows float32, as good a reason to skip), with no temporary.
        return all(math.isfinite(grad.sum()) for grad in self._gradients().values())

    # -- loops ---------------------------------------------------------------------------------
    def fit(
        self,
        data: Mapping[str, np.ndarray],
        *,
        epochs: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int | None = None,
        val_data: Mapping[str, np.ndarray] | None = None,
        schedule: Schedule | None = None,
        accumulate: int | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
        progress: bool = True,
        bucket: bool = False,
        early_stopping: EarlyStopping | None = None,
        on_epoch: Callable[[dict[str, float]], None] | None = None,
    ) -> History:
        """Train until ``epochs`` epochs are complete (a resumed trainer continues where it stopped).

        Each optimizer step averages ``accumulate`` micro-batches of ``batch_size``. Without
        ``accumulate``, each step takes ``batch_size`` examples, in the micro-batches of the memory
        plan when the artifacts have one (see :meth:`micro_batches`); the learning
        rate follows ``schedule`` by optimizer step (default: the schedule of the checkpoint this
        trainer resumed from, else the current constant rate). A schedule that ends before the
        run does is refused up front. ``seed`` sets the data order and dropout (default: the
        checkpoint's, else 0). With ``checkpoint``, a checkpoint is saved atomically after every
        epoch; it holds the seed and the schedule, so a resumed run continues exactly. ``bucket``
        groups texts of similar length into the same optimizer steps (artifacts whose batches drop
        shared padding: a pooled text classifier), so each batch pads to its own longest text.
        ``early_stopping`` (needs ``val_data``) ends the run once validation stops improving and, by default,
        goes back to the best epoch's weights (:class:`ondevice.stopping.EarlyStopping`); ``epochs`` is
        then the most it trains, and the checkpoint saved last holds the best weights. ``on_epoch`` is called
        with each epoch's metrics as it ends (``odt train`` prints them).
        """
        from ._progress import progress_bar

        steps = 1 if accumulate is None else accumulate
        for name, value in (("epochs", epochs), ("batch_size", batch_size), ("accumulate", steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}.")
        if accumulate is None:
            batch_size, accumulate = self.micro_batches(batch_size)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32):
            raise ConfigError(f"seed must be an integer in [0, 2**32), got {seed!r}.")
        if val_data is not None:
            self._check_evaluation("fit(val_data=...)")
        if early_stopping is not None and not isinstance(early_stopping, EarlyStopping):
            raise ConfigError(f"early_stopping must be an EarlyStopping, got {type(early_stopping).__name__}.")
        if early_stopping is not None and val_data is None:
            raise ConfigError("early stopping watches validation: give val_data (odt train --val FILE).")
        train = check_data(self.manifest, data)
        val = None if val_data is None else check_data(self.manifest, val_data)
        size = len(next(iter(train.values())))
        if batch_size > size:
            raise DataError(f"batch size {batch_size} is larger than the dataset ({size} examples).")
        per_epoch = math.ceil(size / batch_size)
        schedule = schedule if schedule is not None else self.schedule
        last = self.step + max(epochs - self.epoch, 0) * math.ceil(per_epoch / accumulate)
        if schedule is not None and not schedule.covers(last):
            raise ConfigError(
                f"the {schedule.kind} schedule spans {schedule.total} optimizer steps, but training to epoch "
                f"{epochs} takes {last}. Give the schedule total={last} (or more), or train fewer epochs."
            )
        self.schedule = schedule
        if seed is not None:
            self.seed = seed
        history = History()
        best = _Best(early_stopping) if early_stopping is not None else None
        from ._checkpoint import writer_lock

        lock = nullcontext() if checkpoint is None else writer_lock(Path(checkpoint))
        with lock, progress_bar(total=(epochs - self.epoch) * per_epoch, disable=not progress) as bar:
            while self.epoch < epochs:
                metrics = self._epoch(train, batch_size, shuffle, accumulate, schedule, bar, bucket)
                self.epoch += 1
                if val is not None:
                    metrics.update({f"val_{k}": v for k, v in self.evaluate(val).items()})
                metrics = {"epoch": self.epoch, **metrics, "lr": self._lr, "skipped": self.skipped_steps}
                history.epochs.append(metrics)
                bar.set_postfix({k: round(v, 4) for k, v in metrics.items() if k in ("loss", "val_accuracy")})
                if on_epoch is not None:
                    on_epoch(metrics)
                stop = best is not None and best.update(self, metrics)
                if stop or (best is not None and self.epoch >= epochs):
                    history.best_epoch, history.stopped_early = best.restore(self), stop
                if checkpoint is not None:
                    self._save(Path(checkpoint))
                if stop:
                    break
        return history

    @property
    def streams_weights(self) -> bool:
        """Whether steps stream ``frozen.bin`` (``stream_weights``, and the artifacts keep one)."""
        return self._frozen is not None and self._frozen.streams

    def micro_batches(self, batch_size: int) -> tuple[int, int]:
        """``(micro-batch, accumulate)`` for optimizer steps of ``batch_size`` examples.

        The memory plan (``odt generate --memory-budget``) records the micro-batch it measured
        within budget; a batch is split into the largest micro-batches up to that size that
        tile it (the step is the same, up to float rounding: gradients are averaged). Without a
        plan, or when the batch fits whole: ``(batch_size, 1)``.
        """
        planned = self.manifest.plan and self.manifest.plan.micro_batch_size
        if not isinstance(planned, int) or planned >= batch_size:
            return batch_size, 1
        micro = max(d for d in range(1, planned + 1) if batch_size % d == 0)
        return micro, batch_size // micro

    def _epoch(
        self,
        data: dict[str, np.ndarray],
        batch_size: int,
        shuffle: bool,
        accumulate: int,
        schedule: Schedule | None,
        bar: Any,
        bucket: bool = False,
    ) -> dict[str, float]:
        meter = Meter(self.manifest)
        arrays = list(data.values())  # feeding order (check_data ordered them)
        labels = list(data).index(meter.labels) if meter.labels in data else None
        scores = self._fetch_index(meter.scores) if labels is not None else None
        pending, bad = 0, False
        lengths = None if not bucket or self._trim is None else arrays[self._trim[1]].sum(axis=1)
        order = batch_indices(len(arrays[0]), batch_size, shuffle=shuffle, seed=self.seed, epoch=self.epoch,
                              lengths=lengths, accumulate=accumulate)  # fmt: skip
        whole = self._whole_steps(accumulate)
        for index in order:
            if pending == 0 and schedule is not None:
                self.set_lr(schedule(self.step))
            feeds = [array[index] for array in arrays]
            loss, fetched, applied = self._micro_step(feeds, micro=pending, whole=whole)
            bad |= not applied
            held = None if scores is None else fetched[scores]
            weight = len(index) if meter.tokens is None else meter.weight(dict(zip(data, feeds)), len(index))
            meter.add(loss, weight, held, None if labels is None else feeds[labels])
            pending += 1
            bar.update(1)
            if pending == accumulate:
                self._finish(bad, pending)
                pending, bad = 0, False
        if pending:
            self._finish(bad, pending)
        return meter.result()

    def _finish(self, bad: bool, micro_steps: int) -> None:
        """Apply the accumulated gradients (or skip them), then clear them.

        ORT sums gradients over micro-batches; for a mean loss they are divided by the count in
        place first, so accumulation equals one large batch for any optimizer.
        """
        if bad:
            self.skipped_steps += 1
            import logging  # here: importing it costs a cold start ~6 ms

            logging.getLogger(__name__).warning(
                "step %d skipped: loss or gradients not finite (%d skipped so far)", self.step, self.skipped_steps
            )
        else:
            if micro_steps > 1 and self.manifest.loss.options.get("reduction", "mean") == "mean":
                for grad in self._gradients().values():
                    grad *= np.float32(1.0 / micro_steps)
            if self._proximal is not None:
                mu, anchors = self._proximal
                for index, grad in self._gradients().items():  # by index: a missing buffer shifts nothing
                    name = self.manifest.trainable[index].name
                    grad += np.float32(mu) * (self._engine.parameter_view(name) - anchors[index])
            self._engine.optimizer_step()
            self.step += 1
        self._engine.reset_grad()

    def evaluate(
        self, data: Mapping[str, np.ndarray], *, batch_size: int | None = None, progress: bool = False
    ) -> dict[str, float]:
        """Mean loss over ``data`` (and accuracy for classification) with the eval graph, ``batch_size``
        rows at a time (default: the manifest's ``eval_batch_size``, the memory plan's micro-batch,
        else 256); ``progress`` shows a bar on a terminal."""
        from ._progress import progress_bar

        self._check_evaluation("evaluate")
        batch_size = self._eval_batch_size(batch_size)
        checked = check_data(self.manifest, data)
        size = len(next(iter(checked.values())))
        meter = Meter(self.manifest)
        scores = self._fetch_index(meter.scores) if meter.labels in checked else None
        parts = batches(checked, min(batch_size, size), shuffle=False, seed=0, epoch=0)
        with progress_bar(total=math.ceil(size / min(batch_size, size)), disable=not progress) as bar:
            for batch in parts:
                with self._reading():
                    fetched = self._engine.eval_step(self._trimmed(list(batch.values())))
                count = meter.weight(batch, len(next(iter(batch.values()))))
                held = None if scores is None else fetched[scores]
                meter.add(float(fetched[0]), count, held, batch.get(meter.labels))
                bar.update(1)
        return meter.result()

    def predict(
        self, data: Mapping[str, np.ndarray], *, batch_size: int | None = None, progress: bool = False
    ) -> dict[str, np.ndarray]:
        """Every output of the model for every example of ``data`` (inputs only, no labels), from the eval
        graph with the current weights, ``batch_size`` rows at a time (default: the manifest's
        ``eval_batch_size``). The same values as the exported model's (``odt export``; within float
        rounding where LoRA adapters are folded there), without writing or loading a second model:
        the loss reads placeholder labels and is dropped."""
        from ._progress import progress_bar

        self._check_evaluation("predict")
        batch_size = self._eval_batch_size(batch_size)
        checked = check_data(self.manifest, data, labels=False)
        size = len(next(iter(checked.values())))
        parts: list[list[np.ndarray]] = []
        with progress_bar(total=math.ceil(size / batch_size), disable=not progress) as bar:
            for start in range(0, size, batch_size):
                feeds = [array[start : start + batch_size] for array in checked.values()]  # untrimmed: outputs
                with self._reading():
                    fetched = self._engine.eval_step(feeds + self._placeholder_labels(feeds))  # keep widths
                parts.append(fetched[1 : 1 + len(self._train_names)])
                bar.update(1)
        return {name: np.concatenate([part[i] for part in parts]) for i, name in enumerate(self._train_names)}

    def _eval_batch_size(self, batch_size: int | None) -> int:
        """``batch_size``, checked, or the manifest's ``eval_batch_size`` when None."""
        batch_size = self.manifest.eval_batch_size if batch_size is None else batch_size
        if not (isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1):
            raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
        return batch_size

    def _placeholder_labels(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        """Zeros shaped as the manifest's targets for these input rows (named axes sized as the inputs')."""
        sizes = {dim: array.shape[axis] for spec, array in zip(self.manifest.inputs, feeds)
                 for axis, dim in enumerate(spec.shape) if isinstance(dim, str)}  # fmt: skip
        rows = len(feeds[0])
        return [
            np.zeros([rows if axis == 0 else dim if isinstance(dim, int) else sizes.get(dim, 1)
                      for axis, dim in enumerate(target.shape)], target.dtype)  # fmt: skip
            for target in self.manifest.targets
        ]

    def _check_evaluation(self, what: str) -> None:
        if not self._engine.with_eval:
            raise ConfigError(
                f"{what} needs the eval graph, but this trainer was loaded with evaluation=False. "
                f"Load it with Trainer.load({os.fspath(self.directory)!r}) to evaluate."
            )

    # -- weights -------------------------------------------------------------------------------
    def get_flat_weights(self) -> np.ndarray:
        """All trainable parameters as one float32 buffer in manifest order."""
        return self._engine.get_flat(trainable_only=True)

    def get_weights(self) -> dict[str, np.ndarray]:
        """Trainable parameters by name, in manifest order."""
        flat = self.get_flat_weights()
        return {p.name: flat[p.offset : p.offset + p.size].reshape(p.shape) for p in self.manifest.trainable}

    def set_weights(self, weights: np.ndarray | Mapping[str, np.ndarray]) -> None:
        """Replace the trainable parameters from a flat buffer or a name -> array mapping."""
        flat = flatten_weights(self.manifest, weights)
        if not np.isfinite(flat).all():
            raise WeightsError(f"weights hold {int(np.count_nonzero(~np.isfinite(flat)))} NaN/Inf values.")
        self._engine.set_flat(flat, trainable_only=True)

    def parameter(self, name: str) -> np.ndarray:
        """A copy of one parameter, trainable or frozen, by its manifest (``state_dict``) name."""
        if name not in {p.name for p in (*self.manifest.trainable, *self.manifest.frozen)}:
            raise WeightsError(f"{name!r} is not a parameter of these artifacts; `odt inspect` lists them.")
        stored = self.manifest.frozen_file
        if stored is not None and name in stored["offsets"]:
            data = np.memmap(self.directory / stored["file"], np.uint8, "r")
            return widened(stored_arrays(data, self.manifest), name)  # a narrow base: the values the graphs use
        value = self._engine.get_parameter(name)
        if value.dtype == np.int8:  # a bundle carries an int8 base in its checkpoint, with the scales beside it
            return dequantize_rows(value, self._engine.get_parameter(name + SCALE_SUFFIX))
        return value

    def get_buffers(self) -> dict[str, np.ndarray]:
        """Running statistics the train step updates (BatchNorm mean/var), by name in manifest order."""
        return {name: self._engine.get_parameter(name) for name in self._buffers}

    def set_buffers(self, buffers: Mapping[str, np.ndarray]) -> None:
        """Replace the running statistics (e.g. with a federated average); every buffer must be named."""
        shapes = {p.name: p.shape for p in self.manifest.frozen}
        if not isinstance(buffers, Mapping) or sorted(buffers) != sorted(self._buffers):
            found = sorted(buffers) if isinstance(buffers, Mapping) else type(buffers).__name__
            raise WeightsError(f"buffers must name exactly {self._buffers}, got {found}.")
        for name in self._buffers:
            array = np.asarray(buffers[name], dtype=np.float32)
            if array.shape != shapes[name]:
                raise WeightsError(f"buffer {name!r} needs shape {shapes[name]}, got {array.shape}.")
            if not np.isfinite(array).all():
                raise WeightsError(f"buffer {name!r} holds NaN/Inf values.")
        for name in self._buffers:
            self._engine.set_parameter(name, np.asarray(buffers[name], dtype=np.float32))

    def set_proximal(self, mu: float, anchor: np.ndarray | Mapping[str, np.ndarray] | None = None) -> None:
        """Add FedProx's proximal term ``mu/2 * ||w - anchor||^2`` to every following step.

        ``anchor`` defaults to the current weights (the global model a client just received);
        ``mu=0`` turns the term off.
        """
        if not (mu >= 0 and math.isfinite(mu)):
            raise ConfigError(f"proximal mu must be >= 0 and finite, got {mu}.")
        if mu == 0:
            self._proximal = None
            return
        flat = self.get_flat_weights() if anchor is None else flatten_weights(self.manifest, anchor)
        anchors = [flat[p.offset : p.offset + p.size].reshape(p.shape).copy() for p in self.manifest.trainable]
        self._proximal = (float(mu), anchors)

    # -- checkpoints and export ----------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Save weights, optimizer state and progress to ``path`` atomically, checksummed.

        The old file survives a failure and, if sound, is kept as ``PATH.previous``; a second
        writer of the same path is refused while this one holds it.
        """
        from ._checkpoint import writer_lock

        with writer_lock(Path(path)):
            return self._save(Path(path))

    def _save(self, path: Path) -> Path:
        from ._checkpoint import save_state

        progress = self._progress()
        header = {"manifest_sha256": self._manifest_sha, "epoch": self.epoch, "step": self.step,
                  "engine": self.engine}  # fmt: skip
        return save_state(lambda raw: self._engine.write_checkpoint(raw, progress), path, header)

    def _progress(self) -> dict[str, int | str]:
        return {
            "odt.manifest_sha256": self._manifest_sha,
            "odt.epoch": self.epoch,
            "odt.step": self.step,
            "odt.seed": self.seed,
            "odt.skipped_steps": self.skipped_steps,
            "odt.lr": float(self._lr),
            "odt.schedule": "" if self.schedule is None else json.dumps(asdict(self.schedule)),
        }

    def _restore_progress(self) -> None:
        get = self._engine.get_property
        self.epoch = int(get("odt.epoch"))
        self.step = int(get("odt.step"))
        self.seed = int(get("odt.seed"))
        self.skipped_steps = int(get("odt.skipped_steps"))
        self._lr = float(get("odt.lr"))
        if get("odt.schedule"):
            self.schedule = Schedule(**json.loads(str(get("odt.schedule"))))
        self._engine.set_learning_rate(self._lr)

    def text_generator(self, *, threads: int | None = None) -> TextGenerator:
        """Greedy text completion with the current weights (causal-LM artifacts), without a file:
        the decoder is built in memory as ``export`` would write it. It reads ``frozen.bin`` in place (an int8
        or float16 base as stored, :mod:`ondevice.narrow_decoder`), its pages unmapped while tokens are made when
        the trainer streams its weights or when decoding would otherwise pass the memory plan's budget.

        Examples
        --------
        >>> trainer.text_generator()(["Turn on the fan ->"], max_new_tokens=16)[0].text  # doctest: +SKIP
        """
        from .decode import TextGenerator, decoder_model, over_plan
        from .session import ort, return_freed_memory, session_options

        decoder, tokenizer = self.manifest.decoder, self.manifest.tokenizer
        if decoder is None or tokenizer is None:
            raise ManifestError(f"{self.directory} holds no language model decoder: only causal-lm artifacts "
                                "(`odt generate --task causal-lm`) complete prompts.")  # fmt: skip
        self.manifest.check_files(self.directory, names=(decoder.file, tokenizer.file))
        graph, weights, sources = self._decoder_graph()
        # What the graph reads of frozen.bin as stored, every run feeds from the trainer's own mapping of it: read
        # in place (a session's initializers are copies: SmolLM2's int8 base took 450 MB more).
        fed = {n: weights[n] for n in sources}
        model = decoder_model(graph, weights, fed).SerializeToString()
        del graph
        session = ort.InferenceSession(model, session_options(threads), providers=["CPUExecutionProvider"])
        del model
        return_freed_memory()  # the graph's parsed messages (SmolLM2: 50 MB)
        generator = TextGenerator(session, decoder, (self.directory / tokenizer.file).read_text(), weights=fed)
        if self._frozen is not None:
            read = sum(value.nbytes for value in fed.values())
            generator.streamed = self._frozen.stream or over_plan(self.manifest, read)
            generator.reading = lambda: self._frozen.reading(stream=generator.streamed)  # type: ignore[union-attr]
        return generator

    def _decoder_graph(self) -> tuple[Any, Mapping[str, np.ndarray], dict[str, tuple[Path, int, int]]]:
        """``(the decoder graph, its weights by name, (frozen.bin, offset, length) of each weight it reads from
        frozen.bin as stored)``: an export copies those from the file.

        An int8 or float16 base's matrices are read as stored and widened in the graph, a product at a time
        (:mod:`ondevice.narrow_decoder`), their adapters kept apart; every other weight is float32, adapters
        folded in, read one at a time when asked (:class:`~ondevice.formats.LazyWeights`)."""
        import onnx

        from .formats import LazyWeights
        from .narrow_decoder import narrow_decoder

        graph = onnx.load(self.directory / self.manifest.decoder.file)  # type: ignore[union-attr]
        frozen = self._frozen  # the trainer's one mapping of frozen.bin (none: every weight from LazyWeights)
        stored = frozen.arrays if frozen is not None and frozen.mapping is not None else {}
        narrowed = narrow_decoder(graph, self.manifest, stored)
        changed = {a.weight for a in self.manifest.adapters if a.weight not in narrowed}  # folded in
        changed |= narrow_matrices(self.manifest) - narrowed  # widened to float32
        reads = {t.name for t in graph.graph.initializer if t.name in stored and t.name.split("::")[0] not in changed}
        weights = ChainMap({n: stored[n] for n in reads}, LazyWeights(self, unfolded=narrowed))
        sources = {}
        if reads:  # then frozen.bin is mapped
            path = self.directory / self.manifest.frozen_file["file"]  # type: ignore[index]
            start = frozen.mapping.ctypes.data  # type: ignore[union-attr]
            sources = {n: (path, stored[n].ctypes.data - start, stored[n].nbytes) for n in reads}
        return graph, weights, sources

    def export(self, path: str | os.PathLike[str]) -> Path:
        """Write the current model as an inference ONNX file (outputs: the manifest's outputs).

        LoRA adapters are folded into their base weights: the file is a plain model. The manifest
        (labels, inputs) and the tokenizer travel in its metadata, so ``Predictor(path)`` and
        ``odt predict/evaluate model.onnx`` need nothing else. A causal language model is written
        as its cached decoder (``odt predict model.onnx --prompt TEXT``).
        """
        from ._checkpoint import export_inference, write_model
        from .predict import METADATA_DECODER, METADATA_MANIFEST, METADATA_TOKENIZER

        outputs = [o.name for o in self.manifest.outputs]
        metadata = {METADATA_MANIFEST: self.manifest.to_json()}
        if self.manifest.tokenizer is not None:
            metadata[METADATA_TOKENIZER] = (self.directory / self.manifest.tokenizer.file).read_text()
        decoder = self.manifest.decoder
        if decoder is not None:
            from .decode import decoder_parts

            self.manifest.check_files(self.directory, names=(decoder.file,))
            metadata[METADATA_DECODER] = json.dumps(asdict(decoder))

            def parts(_: Path):  # type: ignore[no-untyped-def]
                graph, weights, sources = self._decoder_graph()
                return decoder_parts(graph, weights, sources)

            return write_model(Path(path), parts, metadata)
        external = None if self.manifest.frozen_file is None else self.directory
        return export_inference(self._engine, outputs, Path(path), self.manifest.adapters, metadata, external)


class _Best:
    """What early stopping tracks through a run: the best monitored value, its epoch and its weights."""

    def __init__(self, rule: EarlyStopping) -> None:
        self.rule = rule
        self.value: float | None = None
        self.epoch = 0
        self.weights: np.ndarray | None = None
        self.buffers: dict[str, np.ndarray] = {}

    def update(self, trainer: Trainer, metrics: dict[str, float]) -> bool:
        """Note this epoch's metrics; True when the run should stop."""
        monitor = self.rule.monitor
        if monitor not in metrics:
            measured = sorted(k for k in metrics if k.startswith("val_"))
            raise ConfigError(f"early stopping monitors {monitor!r}, but validation measures {measured}.")
        if improves(float(metrics[monitor]), self.value, monitor, self.rule.min_delta):
            self.value, self.epoch = float(metrics[monitor]), trainer.epoch
            if self.rule.restore_best:  # one copy of what trains: LoRA's adapters are kilobytes
                self.weights = trainer.get_flat_weights().copy()
                self.buffers = {name: value.copy() for name, value in trainer.get_buffers().items()}
        return trainer.epoch - self.epoch >= self.rule.patience

    def restore(self, trainer: Trainer) -> int:
        """Put the best epoch's weights back (when kept and not the current ones); returns that epoch."""
        if self.weights is not None and self.epoch != trainer.epoch:
            trainer.set_weights(self.weights)
            if self.buffers:
                trainer.set_buffers(self.buffers)
        return self.epoch or trainer.epoch
