"""The portable engine: the training step as plain ONNX graphs in stock ONNX Runtime sessions.

``InferenceSession``s over the generator's portable graphs: the training step (forward and backward,
gradients out) and the eval step; the optimizer update runs as one native pass where this platform has the
update kernel (:mod:`ondevice.engines.update_kernel`), else as the update graph in a third session (or inside
the fused step graph, for small models). Parameters, gradients and optimizer state are numpy arrays this
engine owns, wrapped once as OrtValues and bound with IOBinding: a step feeds them by reference and ORT
writes gradients straight into the accumulation buffers and the update back into the parameters (never
copied through numpy per step). State loads from and saves to ONNX Runtime's own checkpoint format
(:mod:`ondevice.ort_checkpoint`), so a checkpoint crosses engines.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from ..manifest import Manifest
from ..ort_checkpoint import CheckpointData, read_checkpoint, write_checkpoint
from ..session import ORT_VERSION, OrtValue, ort, session_options, training_graph
from .contract import (
    FUSED_MAX,
    OPTIMIZER_INPUTS,
    OPTIMIZER_STATE,
    OPTIMIZER_UPDATED,
    SLICEABLE,
    gradient_output,
    gradient_seed,
)
from .update_kernel import Bound
from .update_kernel import load as load_kernel

__all__ = ["PortableEngine", "adamw_rates", "execution_order"]

SLICE = FUSED_MAX
"""Values per run of an element-wise optimizer graph (1 MiB of each vector), so that its fourteen passes
read and write the CPU's cache, not memory: AdamW over 3.1 M values (the next-word LSTM has 2.3 M) took 8.5 ms
against 16.1 ms in one run over the whole vectors, over 22.7 M (MiniLM) 66 against 170 ms, and its
temporaries shrink from vector size to slice size (onnxruntime 1.32, 2 threads, interleaved medians)."""


def adamw_rates(lr: float, step: int, betas: Sequence[float], weight_decay: float) -> tuple[float, float, float]:
    """``(lr, lr_corrected, lr * weight_decay)`` for optimizer step ``step`` (1-based), in float32 the
    way ORT's AdamWOptimizer kernel computes them (``std::pow`` in double, cast to float)."""
    b1, b2 = (np.float32(b) for b in betas)
    one = np.float32(1.0)
    alpha = one - np.float32(math.pow(float(b1), step))
    beta = one - np.float32(math.pow(float(b2), step))
    rate = np.float32(lr)
    corrected = rate * (np.sqrt(beta) / alpha)
    return float(rate), float(corrected), float(rate * np.float32(weight_decay))


def execution_order(manifest: Manifest) -> ort.ExecutionOrder:
    """The order ONNX Runtime runs a portable graph's nodes in: by priority (``Shape`` and ``Size`` as soon as
    their input exists, then the graph's own order), except for convolutional models (a weight of four or
    more dimensions: 2-D and 3-D kernels), which keep ONNX Runtime's default.

    ORT's default order runs a node just before the first node that reads its output, so the gradient's
    ``Shape`` of an activation kept that activation alive through the forward. Peak RSS of a training step,
    default against priority order (onnxruntime 1.32, 2 threads, one-off runs of fresh processes): BERT-shaped
    encoder 509 -> 395 MiB (1.19.2 on the same graph: 424 -> 394), the small encoder 213 -> 174, MiniLM LoRA
    383 -> 340, full 715 -> 688, SmolLM2 int8 LoRA 480 -> 446; the MLP and the LSTM alike; step times within
    the runs' noise. The convolutional ones went the other way (MobileNet-style 154 -> 215 MiB, CNN +
    BatchNorm 125 -> 154, U-Net-style 92 -> 114), with or without their NCHWc variant. 1-D convolutions (whose
    kernels have three dimensions, like a position table) were not measured: they run by priority."""
    kernels = any(len(p.shape) >= 4 for p in (*manifest.trainable, *manifest.frozen))
    return ort.ExecutionOrder.DEFAULT if kernels else ort.ExecutionOrder.PRIORITY_BASED


class GraphFiles(NamedTuple):
    """The files a portable engine opens (see :func:`graph_files`)."""

    chosen: str
    """the training graph the step runs: the plain one or a variant (NCHWc)"""
    training: str
    """its file: ``chosen``, or its ORT-format copy"""
    fused: str | None
    """the fused step's file, where there is one for ``chosen``"""
    eval: str
    update: str
    inputs_frozen: frozenset[str]
    """the files that read the frozen weights as graph inputs (the ORT-format copies)"""


def graph_files(manifest: Manifest, graph: str | None, frozen: bool) -> GraphFiles:
    """Which files to open: ``graph`` (default: the NCHWc variant where this ORT has its kernels, x86, CNN steps
    10-30 % faster in one-off A/Bs, else the plain graph); the fused step where the artifacts carry one and the
    plain graph is chosen; and, with ``frozen`` (one mapping of frozen.bin to bind), the ORT-format copies of
    the plain graphs where the artifacts carry them."""
    training, update = manifest.portable_files or ("", "")
    chosen = graph or training_graph(manifest.portable_variants, training)
    plain = chosen == training
    copies = manifest.portable_ort if frozen and plain else {}
    fused = manifest.portable_step if plain else None
    return GraphFiles(chosen=chosen, training=copies.get("training", chosen),
                      fused=copies.get("step", fused) if fused else None,
                      eval=copies.get("eval", "eval_model.onnx"), update=update,
                      inputs_frozen=frozenset(copies.values()))  # fmt: skip


def _value(array: np.ndarray) -> OrtValue:
    """An OrtValue over ``array``'s own memory (ORT reads and writes it in place)."""
    return OrtValue.ortvalue_from_numpy(array)


def _flat(sizes: Sequence[int]) -> np.ndarray:
    return np.zeros(sum(sizes), np.float32)


class PortableEngine:
    """Train one artifact directory with stock ONNX Runtime (see the module docstring).

    Trainable parameters, their gradients and AdamW's moments each live in one flat float32 vector in
    the manifest's order; every tensor the graphs see is a view of it, bound once. So the optimizer is
    one update of a few long passes, and ``get_flat`` is a copy of the vector.
    """

    name = "portable"

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        checkpoint: Path,
        *,
        threads: int | None = None,
        with_eval: bool = True,
        lean_memory: bool = False,
        graph: str | None = None,
        frozen: Mapping[str, OrtValue] | None = None,
    ) -> None:
        self.directory, self.manifest, self.with_eval, self.lean_memory = directory, manifest, with_eval, lean_memory
        self.ort_version = ORT_VERSION
        self._frozen = dict(frozen or {})  # one mapping of frozen.bin for all sessions (ondevice.frozen)

        order = execution_order(manifest)
        shared = self._frozen  # not self: the session opener below is kept by the engine (no reference cycle, so an
        # engine and its sessions go as soon as the last reference does, not at the next garbage collection)
        files = graph_files(manifest, graph, bool(self._frozen))
        self.graph = files.chosen

        def open_session(name: str, spin: bool = False, caller_only: bool = False) -> ort.InferenceSession:
            options = session_options(1 if caller_only else threads, lean_memory)
            # Pre-packing copies every weight it packs: measured 1.43x the classic engine's peak on
            # MiniLM LoRA with it on, 0.92x with it off at the same speed (field notes).
            options.add_session_config_entry("session.disable_prepacking", "1")
            options.enable_mem_pattern = False
            # A step runs the training session, then the update. The training session's pool threads spin
            # between its kernels; the update runs on the caller's thread alone, so no second pool wakes up
            # while those threads still spin (with both pools spinning the LSTM's step took 68.5 ms; with
            # neither, 41.3; this way 34.3). Measured one-off (onnxruntime 1.32, 2 threads, medians of 5
            # alternating processes), no spin -> this: MobileNet-style 63.9 -> 49.9 ms, U-Net-style 25.1 ->
            # 20.0, small encoder 118.7 -> 104.1; MiniLM full fine-tuning 828 -> 727 (3 processes). The
            # fused step is the only session a step runs, and spins: digits 390-540 -> 320-340 us a step.
            options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
            options.execution_order = order
            if name not in files.inputs_frozen:  # the copies read them as inputs, bound once
                for frozen_name, value in shared.items():
                    options.add_initializer(frozen_name, value)
            return ort.InferenceSession(os.fspath(directory / name), options, providers=["CPUExecutionProvider"])

        # The update kernel, where it loads, replaces the update graph and the fused step (whose update is that
        # graph): its one pass beat the graph's twelve 4-7x, more than the fused step's one run saves.
        self._kernel = load_kernel() if manifest.optimizer.kind in ("adamw", "sgd") else None
        self._kernel_step: Bound | None = None  # the kernel bound to the flat vectors
        # with a fused step, the training graph's own session opens when a step first accumulates micro-batches
        # (a second copy of the graph's kernels: MiniLM LoRA's peak 413 MiB with both open, 404 without)
        self._fused = open_session(files.fused, spin=True) if files.fused and self._kernel is None else None
        self._open = lambda: open_session(files.training, spin=True)
        self._train = None if self._fused else self._open()
        self._eval = open_session(files.eval) if with_eval else None
        self._update = None if self._kernel is not None else open_session(files.update, caller_only=True)
        state = read_checkpoint(checkpoint.read_bytes())
        self._trainable = [p.name for p in manifest.trainable]
        missing = [n for n in self._trainable if n not in state.trainable]
        if missing:
            raise ValueError(f"the checkpoint lacks trainable parameters {missing[:3]}")
        sizes = [p.size for p in manifest.trainable]
        self._flat = {kind: _flat(sizes) for kind in ("value", "grad", "momentum0", "momentum1")}
        self._views = {kind: self._split(flat) for kind, flat in self._flat.items()}
        for name in self._trainable:
            self._views["value"][name][...] = state.trainable[name]
            for index, moment in enumerate(state.momentums.get(name, ())):
                self._views[f"momentum{index}"][name][...] = moment
        self._params = {**{n: a.copy() for n, a in state.frozen.items()}, **self._views["value"]}
        self.step, self.properties, self._group = state.step, dict(state.properties), state.group
        del state  # its arrays were views of the checkpoint's bytes, freed here
        self._grads = self._views["grad"]
        self._scratch = np.zeros(0, np.float32)  # gradients of later micro-batches, made when first needed
        self._lr = float(manifest.optimizer.lr)
        self._feeds = list(manifest.feed_names)
        gradients = {gradient_output(name) for name in self._trainable}
        outputs = [o.name for o in (self._fused or self._train).get_outputs()]
        self._fetch = [name for name in outputs if name not in gradients and name not in OPTIMIZER_UPDATED]
        self._values = {name: _value(array) for name, array in self._params.items()}
        self._values.update(self._frozen if files.inputs_frozen else {})  # bound where a session reads them as inputs
        self._reset = True
        self._bindings: dict[bool, object] = {}
        self._seeded: dict[bool, list[np.ndarray]] = {}  # per binding: the gradient buffers its graph scatters into
        self._fetched: dict[object, tuple[tuple, list[np.ndarray]]] = {}  # binding -> feeds' shapes, fetch arrays
        fetch = [] if self._eval is None else [o.name for o in self._eval.get_outputs()]
        self._eval_binding = None if self._eval is None else self._bound(self._eval, fetch)
        self._rates = {n: np.zeros((), np.float32) for n in OPTIMIZER_INPUTS}
        self._bind_optimizer()
        self._bind_fused()

    @property
    def update(self) -> str:
        """``"kernel"`` where the update kernel runs the update, else ``"graph"``."""
        return "kernel" if self._kernel is not None else "graph"

    def _split(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        views, offset = {}, 0
        for p in self.manifest.trainable:
            views[p.name] = flat[offset : offset + p.size].reshape(p.shape)
            offset += p.size
        return views

    def _bound(self, session: ort.InferenceSession, fetch: list[str]):  # type: ignore[no-untyped-def]
        """A binding with the state inputs and the fetched outputs bound (the feeds are bound per step)."""
        binding = session.io_binding()
        for graph_input in session.get_inputs():
            if graph_input.name in self._values:
                binding.bind_ortvalue_input(graph_input.name, self._values[graph_input.name])
        for name in fetch:
            binding.bind_output(name, "cpu")
        return binding

    def _train_binding(self, reset: bool):  # type: ignore[no-untyped-def]
        """The training graph's binding: gradients into the accumulation buffers when a new optimizer step
        starts, else into scratch buffers that are then added in (only for accumulation)."""
        if reset not in self._bindings:
            if self._train is None:
                self._train = self._open()
            binding = self._bound(self._train, self._fetch)
            if not reset:
                self._scratch = _flat([p.size for p in self.manifest.trainable])
            targets = self._grads if reset else self._split(self._scratch)
            inputs = {i.name for i in self._train.get_inputs()}
            self._seeded[reset] = []
            for name in self._trainable:
                binding.bind_ortvalue_output(gradient_output(name), _value(targets[name]))
                if gradient_seed(name) in inputs:  # a lookup table's rows are added into this buffer, zeroed first
                    binding.bind_ortvalue_input(gradient_seed(name), _value(targets[name]))
                    self._seeded[reset].append(targets[name])
            self._bindings[reset] = binding
        return self._bindings[reset]

    def _bind_fused(self) -> None:
        """The fused step's binding: the update lands in staging vectors, which :meth:`optimizer_step` copies
        over the state when the trainer applies the step (a step that is not finite leaves the state alone)."""
        self._staged: dict[str, np.ndarray] = {}
        self._fused_binding, self._pending = None, False  # pending: a fused step's update is staged
        if self._fused is None:
            return
        outputs = [o.name for o in self._fused.get_outputs()]
        binding = self._bound(self._fused, self._fetch)  # the fetches first: get_outputs keeps this order
        moments = dict(zip(OPTIMIZER_STATE[2:], (self._flat["momentum0"], self._flat["momentum1"])))
        state = {**self._rates, **moments}
        for graph_input in self._fused.get_inputs():
            if graph_input.name in state:
                binding.bind_ortvalue_input(graph_input.name, _value(state[graph_input.name]))
        for name, kind in zip(OPTIMIZER_UPDATED, ("value", "momentum0", "momentum1")):
            if name in outputs:
                self._staged[kind] = np.zeros_like(self._flat[kind])
                binding.bind_ortvalue_output(name, _value(self._staged[kind]))
        self._fused_binding = binding

    # -- steps ---------------------------------------------------------------------------------
    def train_step(self, feeds: Sequence[np.ndarray], scale: float = 1.0, whole: bool = False) -> list[np.ndarray]:
        """Forward and backward (gradients into the accumulation buffers). ``whole``: this batch is the
        optimizer step's only one, so artifacts with a fused step graph also compute the update in the same
        run, staged until :meth:`optimizer_step` applies it (the gradients then stay inside the graph)."""
        if scale != 1.0:
            raise ValueError("the portable engine scales nothing: accumulate whole micro-batches instead")
        if whole and self._fused_binding is not None and self._reset:
            return self._fused_step(feeds)
        reset = self._reset
        binding = self._train_binding(reset)
        for buffer in self._seeded[reset]:
            buffer.fill(0)
        fetched = self._run(self._train, binding, feeds)
        if not reset:
            np.add(self._flat["grad"], self._scratch, out=self._flat["grad"])
        self._reset = False
        return fetched

    def _fused_step(self, feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        self._set_rates(self.step + 1)
        fetched = self._run(self._fused, self._fused_binding, feeds)
        self._reset, self._pending = False, True
        return fetched

    def _run(self, session: ort.InferenceSession, binding, feeds: Sequence[np.ndarray]) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
        """Run ``binding`` on ``feeds``; copies of the fetches. The fetches land in arrays bound once for each
        shape of the feeds. Binding them afresh and wrapping ORT's outputs every step made the engine's digits
        step 246 us against 217 (onnxruntime 1.32, one thread, medians of three alternating processes)."""
        for name, value in zip(self._feeds, feeds):
            binding.bind_cpu_input(name, value)
        shapes = tuple(value.shape for value in feeds)
        shaped, arrays = self._fetched.get(binding, ((), []))
        if shaped == shapes:  # the fetches' shapes follow the feeds' (loss, outputs, buffers, finite check)
            session.run_with_iobinding(binding)
            return [array.copy() for array in arrays]
        for name in self._fetch:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        values = binding.get_outputs()  # in the order bound: the fetches, then the state
        arrays = [values[i].numpy() for i in range(len(self._fetch))]
        for name, array in zip(self._fetch, arrays):
            binding.bind_ortvalue_output(name, _value(array))
        self._fetched[binding] = (shapes, arrays)
        return [array.copy() for array in arrays]

    def eval_step(self, feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        assert self._eval is not None and self._eval_binding is not None, "created without the eval graph"
        for name, value in zip(self._feeds, feeds):
            self._eval_binding.bind_cpu_input(name, value)
        for output in self._eval.get_outputs():
            self._eval_binding.bind_output(output.name, "cpu")
        self._eval.run_with_iobinding(self._eval_binding)
        return self._eval_binding.copy_outputs_to_cpu()

    def _bind_optimizer(self) -> None:
        """The update's inputs and outputs, bound once: outputs alias the parameters and moments. An
        element-wise graph (symbolic length) gets one binding per slice of :data:`SLICE` values."""
        self._update_bindings = []
        if self._update is None:
            return
        wanted = {i.name: i.shape for i in self._update.get_inputs()}
        rates = {name: _value(value) for name, value in self._rates.items() if name in wanted}
        size = self._flat["value"].size
        step = SLICE if wanted[OPTIMIZER_STATE[0]] == [SLICEABLE] else max(size, 1)
        kinds = dict(zip(OPTIMIZER_STATE, ("value", "grad", "momentum0", "momentum1")))
        outputs = {o.name for o in self._update.get_outputs()}
        for start in range(0, max(size, 1), step):
            part = slice(start, start + step)
            binding = self._update.io_binding()
            for name, rate in rates.items():
                binding.bind_ortvalue_input(name, rate)
            for name, kind in kinds.items():
                if name in wanted:
                    binding.bind_ortvalue_input(name, _value(self._flat[kind][part]))
            for name, kind in zip(OPTIMIZER_UPDATED, ("value", "momentum0", "momentum1")):
                if name in outputs:
                    binding.bind_ortvalue_output(name, _value(self._flat[kind][part]))
            self._update_bindings.append(binding)

    def _set_rates(self, step: int) -> None:
        """The optimizer's scalar inputs for optimizer step ``step`` (1-based) at the current rate."""
        spec = self.manifest.optimizer
        if spec.kind == "adamw":
            rates = adamw_rates(self._lr, step, spec.options.get("betas", (0.9, 0.999)),
                                float(spec.options.get("weight_decay", 0.0)))  # fmt: skip
        else:
            rates = (self._lr, self._lr, 0.0)
        for name, rate in zip(OPTIMIZER_INPUTS, rates):
            self._rates[name][...] = rate

    def optimizer_step(self) -> None:
        self.step += 1
        if self._pending:  # the fused step computed it: copy it over the state
            for kind, staged in self._staged.items():
                np.copyto(self._flat[kind], staged)
            self._pending = False
            return
        self._set_rates(self.step)
        if self._kernel is not None:
            self._kernel_update()
            return
        assert self._update is not None
        for binding in self._update_bindings:
            self._update.run_with_iobinding(binding)

    def _kernel_update(self) -> None:
        """The update in one native pass over the flat vectors (the update graph's bits)."""
        assert self._kernel is not None
        spec, flat, rates = self.manifest.optimizer, self._flat, self._rates
        if self._kernel_step is None:  # the vectors never move: bound once
            if spec.kind == "adamw":
                betas = spec.options.get("betas", (0.9, 0.999))
                self._kernel_step = self._kernel.bind_adamw(
                    flat["value"], flat["grad"], flat["momentum0"], flat["momentum1"],
                    betas=(float(betas[0]), float(betas[1])), eps=float(spec.options.get("eps", 1e-8)))  # fmt: skip
            else:
                self._kernel_step = self._kernel.bind_sgd(flat["value"], flat["grad"])
        max_norm = spec.options.get("max_grad_norm")
        clip = 1.0 if max_norm is None else self._kernel.clip_coefficient(flat["grad"], float(max_norm))
        lr, lr_corrected, lr_decay = (float(rates[name]) for name in OPTIMIZER_INPUTS)
        if spec.kind == "adamw":
            self._kernel_step(lr_corrected, lr_decay, clip)
        else:
            self._kernel_step(lr, clip)

    def reset_grad(self) -> None:
        self._reset, self._pending = True, False

    def set_learning_rate(self, lr: float) -> None:
        self._lr = float(lr)

    # -- parameters ----------------------------------------------------------------------------
    def get_flat(self, trainable_only: bool = True) -> np.ndarray:
        return self._flat["value"].copy()

    def set_flat(self, flat: np.ndarray, trainable_only: bool = True) -> None:
        self._flat["value"][...] = flat

    def get_parameter(self, name: str) -> np.ndarray:
        return self._params[name].copy()

    def parameter_view(self, name: str) -> np.ndarray:
        return self._params[name]

    def gradient_view(self, name: str) -> np.ndarray | None:
        return self._grads.get(name)

    def set_parameter(self, name: str, value: np.ndarray) -> None:
        self._params[name][...] = value

    # -- state ---------------------------------------------------------------------------------
    def get_property(self, name: str) -> int | float | str | None:
        return self.properties.get(name)

    def write_checkpoint(self, path: Path, properties: Mapping[str, int | float | str]) -> None:
        """Write ORT-format checkpoint bytes (parameters, moments, step, properties) to ``path``."""
        self.properties.update(properties)
        trainable = set(self._trainable)
        data = CheckpointData(
            trainable={n: self._params[n] for n in self._trainable},
            frozen={n: a for n, a in self._params.items() if n not in trainable},
            momentums={n: [self._views["momentum0"][n], self._views["momentum1"][n]] for n in self._trainable}
            if self.manifest.optimizer.kind == "adamw"
            else {},
            step=self.step,
            initial_lr=self._lr,
            group=self._group,
            properties=dict(self.properties),
        )
        with open(path, "wb") as handle:
            handle.write(write_checkpoint(data))

    def export_model(self, path: Path, outputs: list[str]) -> None:
        """The eval graph with the current parameters as initializers, the loss and labels removed."""
        import onnx
        from onnx import numpy_helper

        from ..lora import prune

        model = onnx.load(self.directory / "eval_model.onnx", load_external_data=False)
        graph = model.graph
        keep_inputs = [i for i in graph.input if i.name not in self._params]
        graph.initializer.extend(numpy_helper.from_array(self._params[i.name], i.name)
                                 for i in graph.input if i.name in self._params)  # fmt: skip
        del graph.input[:]
        graph.input.extend(keep_inputs)
        kept = [o for o in graph.output if o.name in outputs]
        del graph.output[:]
        graph.output.extend(kept)
        prune(graph)
        onnx.save(model, path)
