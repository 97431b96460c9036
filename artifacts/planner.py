"""The memory-budget planner: the most trainable capacity whose training step fits a budget.

Candidates are trainable sets of one model (everything, LoRA ranks on chosen targets, last-N
modules, biases only). Each is estimated before anything is built (``artifacts.estimate``: the
weights it holds and what PyTorch saves for its backward, per row), then the promising ones, in
order, are built (unverified) and MEASURED: a fresh torch-free process does what ``odt train
--val`` does on a batch (``ondevice.measure``: both sessions, 1,000 examples of data through the
tokenizer, train steps, validation, a checkpoint save), and its peak RSS is read from the kernel. Each is measured first
at the largest micro-batch its estimate fits (the runtime trains the same effective batch with
gradient accumulation, so activations shrink and the result is the same), then at smaller ones
while it is over: at each, in the fastest way first, then without ORT's arena; artifacts with a
``frozen.bin`` also on the portable engine with streamed weights, and for them the way that holds
the least is measured first, so a micro-batch over in every way costs one process. The first
candidate that fits is chosen, with the micro-batch and the fastest way that fit.
Estimates only order and prune the work; a choice always rests on a measurement.

Order: everything, then LoRA (largest rank first), then the last-N sets and biases (largest
first). Adapters in every layer come before whole top layers because they learn more per
parameter: on the intents task LoRA r8 + head (86K parameters) reached 0.9826 on unseen homes
after 2 epochs, the last 2 layers + head (3.6M) 0.9465 (``benchmarks/results/finetune.md``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ondevice.manifest import Plan

from .errors import OptionError, SelectionError
from .estimate import Footprint, footprint, reachable_parameters
from .lora import Lora, with_targets
from .progress import note, stage
from .spec import Spec

__all__ = ["Candidate", "Plan", "plan", "parse_size", "candidates", "chosen_changes", "format_plan", "measure",
           "longest_inputs", "small_set"]  # fmt: skip


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str | int) -> int:
    """``"200MB"``, ``"1.5GiB"`` or a byte count -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise OptionError(f"memory budget must look like 200MB, 1.5GiB or a byte count, got {text!r}.")
        value, unit = float(match.group(1)), match.group(2).lower()
    if not math.isfinite(value * _UNITS[unit]):  # 400 nines: a float overflow, not a size
        raise OptionError(f"memory budget {str(text)[:40]!r}... is not a size a machine has: give one like 200MB.")
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise OptionError(f"memory budget must be positive, got {text!r}.")
    return size


@dataclass(frozen=True)
class Candidate:
    """One trainable set, as ``generate`` options."""

    name: str
    options: Mapping[str, Any]
    trainable: int
    footprint: Footprint
    """Estimated peak bytes at a micro-batch size: :func:`artifacts.estimate.footprint`."""
    layers: str = ""
    """Which layers train, in words (the first and last module of a last-N set, LoRA's targets)."""

    def estimate(self, rows: int) -> int:
        return self.footprint.at(rows)

    def streamed(self, rows: int) -> int:
        """The estimate without the frozen weights, which a streamed step does not hold: the least it may
        measure, so what prunes and where the micro-batches start."""
        return self.footprint.at(rows) - self.footprint.frozen


def candidates(
    model: nn.Module,
    example: Mapping[str, torch.Tensor],
    lora: Lora | None,
    ranks: Sequence[int],
    head: Sequence[str],
    base: str = "float32",
    recompute: bool = False,
) -> list[Candidate]:
    """Trainable sets of ``model`` with their sizes and estimates, in the order the planner tries them.
    LoRA sets go on ``lora``'s targets (none named: the architecture's attention projections, if any)."""
    reachable = reachable_parameters(model, example)  # the generator freezes the rest (a pooler never used)
    params = {n: p for n, p in model.named_parameters() if n in reachable}
    total = sum(p.numel() for p in params.values())
    owners = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in params))

    def candidate(name: str, options: Mapping[str, Any], trainable: int, layers: str = "") -> Candidate:
        return Candidate(name, options, trainable, footprint(model, example, options, base, recompute), layers)

    unused = sum(p.numel() for n, p in model.named_parameters() if n not in reachable)
    everything = [candidate("everything", {}, total, f"{unused:,} parameters do not reach the loss" if unused else "")]
    adapters: list[Candidate] = []
    if lora is not None and not lora.targets:  # the architecture's attention projections; none known: no LoRA
        try:
            lora = with_targets(lora, model)
        except SelectionError:
            lora = None
    if lora is not None:
        linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        targeted = [m for n, m in linears.items() if any(n == t or n.endswith("." + t) for t in lora.targets)]
        heads = sum(p.numel() for name, p in params.items() if any(name.startswith(h + ".") for h in head))
        where = f"{len(targeted)} {'/'.join(lora.targets)} layers" + "".join(f" + {h}" for h in head)
        for rank in sorted(ranks, reverse=True) if targeted else ():
            size = sum(rank * (m.in_features + m.out_features) for m in targeted) + heads
            options = {"lora": Lora(rank, lora.alpha / lora.rank * rank, lora.targets), "trainable": list(head)}
            adapters.append(candidate(f"LoRA rank {rank}" + (" + head" if head else ""), options, size, where))
    subsets: list[Candidate] = []
    for n in (32, 16, 8, 4, 2, 1):
        if n < len(owners):
            size = sum(p.numel() for name, p in params.items() if name.rsplit(".", 1)[0] in owners[-n:])
            span = owners[-1] if n == 1 else f"{owners[-n]} ... {owners[-1]}"
            subsets.append(candidate(f"last {n} module{'s' if n > 1 else ''}", {"train_last": n}, size, span))
    biases = sum(p.numel() for name, p in params.items() if name.endswith("bias"))
    if biases:
        subsets.append(candidate("biases only", {"bias_only": True}, biases))
    ordered = everything + adapters + sorted(subsets, key=lambda c: -c.trainable)
    kept: dict[int, Candidate] = {}
    for c in ordered:  # two sets of one size (the last 8 and the last 16 modules of a small model): keep the first
        kept.setdefault(c.trainable, c)
    return list(kept.values())


def plan(
    model: nn.Module,
    example_inputs: Mapping[str, torch.Tensor],
    *,
    spec: Spec,
    generate: Callable[..., Any],
    ranks: Sequence[int] = (4, 8, 16),
    steps: int = 4,
) -> Plan:
    """Measure candidates (in :func:`candidates`' order) until one trains within ``spec.memory_budget``
    at ``spec.batch_size``, whole or in micro-batches.

    LoRA candidates put ranks on ``spec.lora``'s targets (default: query and value) beside what
    ``spec.trainable`` names (a head); the rest of ``spec`` (loss, optimizer, axes...) builds every
    candidate. ``generate`` is :func:`artifacts.generate` (passed in, so the planner does not import
    the module that calls it). Raises SelectionError, with the smallest measured peak, when nothing fits.
    """
    budget = parse_size(spec.memory_budget if spec.memory_budget is not None else "")
    batch_size = spec.batch_size
    if not isinstance(batch_size, int) or batch_size < 1:
        raise OptionError(f"batch size must be a positive integer, got {batch_size!r}.")
    head = spec.trainable
    rows: list[dict[str, Any]] = []
    chosen: dict[str, Any] = {}  # the Plan's fields for the first candidate that fits
    longest = longest_inputs(example_inputs, spec)  # what the device feeds at worst: estimated and measured
    if spec.lora_from is not None:  # the adapter fixes what trains (its rank, targets, saved modules): plan the rest
        from .lora import read_peft, saved_modules

        fixed, start = read_peft(spec.lora_from)
        head = (*head, *(m for m in saved_modules(start) if m not in head))
        adapted = candidates(model, longest, fixed, [fixed.rank], head, spec.base, spec.recompute)
        found = [replace(c, options={**c.options, "lora": fixed}, name=f"{c.name} (from the adapter)")
                 for c in adapted if "lora" in c.options]  # fmt: skip
    else:
        found = candidates(model, longest, spec.lora or Lora(), ranks, head, spec.base, spec.recompute)
    base = spec.but(input_names=None, memory_budget=None, verify=False, decoder=False, lora=None, lora_from=None,
                    trainable=(), train_last=None, bias_only=False)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="odt-plan-"))
    try:
        for candidate in found:
            row: dict[str, Any] = {"candidate": candidate.name, "trainable": candidate.trainable,
                                   "estimate": candidate.estimate(batch_size), "layers": candidate.layers}  # fmt: skip
            rows.append(row)
            if chosen:
                row["fits"] = None  # earlier ones were measured first; this one was not needed
                continue
            if candidate.streamed(1) > 1.25 * budget:  # over even in micro-batches of one row, even streamed
                row["fits"] = False
                row["note"] = "estimate over budget, not measured"
                continue
            directory = work / f"c{len(rows)}"
            with _quiet_logs(), stage(f"{candidate.name}: estimate {_mb(candidate.estimate(batch_size))}, building"):
                manifest = generate(model, example_inputs, directory, spec=base.but(**candidate.options))
            if manifest.trainable_size != candidate.trainable:  # the generator froze what cannot reach the loss
                row["trainable"] = manifest.trainable_size
                row["note"] = f"{candidate.trainable - manifest.trainable_size:,} parameters do not reach the loss"
            sizes = _micro_batches(batch_size)
            start = next((m for m in sizes if candidate.streamed(m) <= budget), 1)  # skip what the estimate rules out
            over: dict[str, int] = {}  # micro-batch -> measured peak, for those that did not fit
            for micro in sizes[sizes.index(start) :]:
                with stage(f"{candidate.name}: measuring in a fresh process at micro-batch {micro}"):
                    measured = _fit(directory, _batch(manifest, longest, micro, work / "batch.npz"), steps, budget,
                                    streamable=bool(manifest.frozen_file and manifest.portable_files),
                                    held=candidate.footprint.frozen)  # fmt: skip
                if measured["fits"] or micro == 1:
                    break
                over[str(micro)] = measured["peak_rss"]
            row["estimate"] = candidate.estimate(micro)
            row.update(measured, micro_batch_size=micro, **({"over_at": over} if over else {}))
            lean = " with lean memory" if row.get("lean_memory") else ""
            lean += " with streamed weights (portable engine)" if row.get("stream_weights") else ""
            split = row["micro_batch_size"] < batch_size
            micro_text = f" in micro-batches of {row['micro_batch_size']}" if split else ""
            verdict = f"fits{micro_text}{lean}" if row["fits"] else "over, even in micro-batches of 1"
            note(f"{candidate.name}: measured peak {_mb(row['peak_rss'])} (estimate {_mb(row['estimate'])}), {verdict}")
            if row["fits"]:
                micro = row["micro_batch_size"]
                chosen = {"chosen": candidate.name, "lean_memory": bool(row.get("lean_memory")),
                          "stream_weights": bool(row.get("stream_weights")), "engine": row.get("engine"),
                          "micro_batch_size": micro if micro < batch_size else None}  # fmt: skip
                row["options"] = {k: _plain(v) for k, v in candidate.options.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = Plan(budget=budget, batch_size=batch_size, rows=tuple(rows), **chosen)
    if result.chosen is None:
        measured = [r for r in result.rows if "peak_rss" in r]
        smallest = min(measured, key=lambda r: r["peak_rss"]) if measured else None
        figure = (
            f"the smallest measured peak is {_mb(smallest['peak_rss'])} ({smallest['candidate']})"
            if smallest
            else "every estimate is over 1.25x the budget, even in micro-batches of one row"
        )
        raise SelectionError(
            f"no trainable set fits {_mb(budget)} at batch size {batch_size}: {figure}. "
            "Raise the budget or lower the batch size.\n" + format_plan(result)
        )
    return result


def _micro_batches(batch_size: int) -> list[int]:
    """The whole batch, then the largest divisor of it up to half the last size, down to 1:
    16 -> 16, 8, 4, 2, 1; 12 -> 12, 6, 3, 1 (micro-batches must tile the batch)."""
    sizes = [batch_size]
    while sizes[-1] > 1:
        sizes.append(max(d for d in range(1, sizes[-1] // 2 + 1) if batch_size % d == 0))
    return sizes


_MODES = ({}, {"lean_memory": True})
"""How each micro-batch may train, fastest first: as loaded by default, then without ORT's arena."""
_STREAMED = ({"engine": "portable", "stream_weights": True},
             {"engine": "portable", "stream_weights": True, "lean_memory": True})  # fmt: skip
"""Then, for artifacts with a ``frozen.bin`` and portable graphs: the frozen weights streamed
(``ondevice.frozen``), on the portable engine (the classic engine holds Python's lock through a step,
so its pages cannot leave while the step runs)."""


def _key(options: Mapping[str, Any]) -> str:
    """The row's name for a mode's peak: ``peak_rss``, ``peak_rss_lean``, ``peak_rss_streamed``..."""
    return "peak_rss" + ("_streamed" if options.get("stream_weights") else "") + (
        "_lean" if options.get("lean_memory") else "")  # fmt: skip


HELD_SHARE = 0.8
"""Of the frozen weights' estimated bytes, the share a step that does not stream them surely holds more than
one that does (a step reads every frozen matrix whole; SmolLM2 int8: 131 MiB)."""


def _fit(directory: Path, batch: Path, steps: int, budget: int, streamable: bool, held: int = 0) -> dict[str, Any]:
    """One micro-batch: the fastest way (:data:`_MODES`, then with ``streamable`` :data:`_STREAMED`) whose
    peak fits ``budget``. With four ways, the one that holds the least (streamed, lean) is measured first:
    when it is over, every way is, and the micro-batch costs one process instead of four (SmolLM2: 10 s,
    not 43); when it fits, the faster ways are measured in order and the first that fits is taken, else
    the least. The ways that hold the frozen weights (``held`` bytes, estimated) are skipped when the least
    peak plus :data:`HELD_SHARE` of them is over. With two ways, the faster is measured first (it mostly fits).

    The row holds the taken (or, over, the first measured) way's figures and options, every measured way's
    peak (``peak_rss_lean``, ``peak_rss_streamed``, ...; the default's as ``peak_rss_arena`` when another
    way is taken). A peak within the budget is measured once more in another fresh process and the
    larger one counts: without the arena, peaks of one batch spread by up to 9 % between processes
    here (MiniLM LoRA at 2 x 64: 157 to 171 MB), and a plan must hold when the device measures it again."""
    peaks: dict[str, float] = {}
    modes: list[Mapping[str, Any]] = list(_MODES)
    first: dict[str, Any] = {}
    least = _STREAMED[-1]
    if streamable:
        first = measure(directory, batch, steps, **least)
        peaks[_key(least)] = first["peak_rss"]
        if first["peak_rss"] > budget:
            return {**first, **least, **peaks, "lean_memory": True, "fits": False}
        if first["peak_rss"] + HELD_SHARE * held > budget:
            modes = []  # holding the frozen weights too would be over: not measured
        modes.append(_STREAMED[0])
    for options in modes:
        found = _peak(directory, batch, steps, budget, options)
        peaks[_key(options)] = found["peak_rss"]
        first = first or found
        if found["fits"]:
            return _taken(found, options, peaks)
    if not streamable:
        return {**first, **peaks, "lean_memory": False, "fits": False}
    second = measure(directory, batch, steps, **least)  # the least fits: measured once more, the larger counts
    found = max(first, second, key=lambda m: m["peak_rss"])
    peaks[_key(least)] = found["peak_rss"]
    return _taken({**found, "fits": found["peak_rss"] <= budget}, least, peaks)


def _taken(found: dict[str, Any], options: Mapping[str, Any], peaks: dict[str, float]) -> dict[str, Any]:
    arena = {"peak_rss_arena": peaks["peak_rss"]} if options and "peak_rss" in peaks else {}
    others = {k: v for k, v in peaks.items() if k != "peak_rss"}
    return {**found, **others, **options, **arena, "lean_memory": bool(options.get("lean_memory"))}


def _peak(directory: Path, batch: Path, steps: int, budget: int, options: Mapping[str, Any]) -> dict[str, Any]:
    first = measure(directory, batch, steps, **options)
    if first["peak_rss"] > budget:
        return {**first, "fits": False}
    second = measure(directory, batch, steps, **options)
    worse = max(first, second, key=lambda m: m["peak_rss"])
    return {**worse, "fits": worse["peak_rss"] <= budget}


SMALL_SHARE = 0.01
"""A plan whose trained set holds at most this share of the parameters trains at the adapter rate."""


def small_set(result: Plan) -> bool:
    """Whether the chosen set is small (:data:`SMALL_SHARE` of what ``everything`` trains, or less)."""
    rows = {row["candidate"]: row for row in result.rows}
    chosen, everything = rows.get(result.chosen or ""), rows.get("everything")
    return bool(chosen and everything and chosen["trainable"] <= SMALL_SHARE * everything["trainable"])


def chosen_changes(result: Plan) -> dict[str, Any]:
    """The chosen candidate as Spec changes: what trains, wholly (the planner recorded its options)."""
    row = result.chosen_row
    options = dict(row.get("options", {})) if row else {}
    if "lora" in options:
        lora = options["lora"]
        options["lora"] = Lora(int(lora["rank"]), float(lora["alpha"]), tuple(lora["targets"]))
    return {"lora": None, "trainable": (), "train_last": None, "bias_only": False, **options}


def measure(
    directory: Path,
    batch: Path,
    steps: int = 4,
    *,
    lean_memory: bool = False,
    stream_weights: bool = False,
    engine: str = "auto",
) -> dict[str, float]:
    """Peak RSS (bytes) and median step time (ms) of training ``directory`` in a fresh process."""
    flags = ["--engine", engine, *(["--lean-memory"] if lean_memory else []),
             *(["--stream-weights"] if stream_weights else [])]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "ondevice.measure", str(directory), "--data", str(batch), "--steps", str(steps), *flags],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if done.returncode != 0:
        raise SelectionError(f"measuring {directory.name} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def longest_inputs(example: Mapping[str, torch.Tensor], spec: Spec) -> dict[str, torch.Tensor]:
    """``example`` at the longest text the device will feed: the inputs the tokenizer fills (ids, mask
    and a causal LM's labels), tiled along their dynamic axes to its ``max_length`` (a batch of text
    pads to its longest, at most that). Without a tokenizer, the example as given."""
    tokenizer = spec.tokenizer
    if tokenizer is None:
        return dict(example)
    longest = dict(example)
    for name in (tokenizer.ids, tokenizer.mask, tokenizer.labels):
        tensor = example.get(name) if name else None
        for axis in spec.dynamic_axes.get(name or "", {}) if tensor is not None else ():
            if 0 < tensor.shape[axis] < tokenizer.max_length:
                repeats = [1] * tensor.dim()
                repeats[axis] = -(-tokenizer.max_length // tensor.shape[axis])
                tensor = tensor.repeat(*repeats).narrow(axis, 0, tokenizer.max_length)
        if tensor is not None:
            longest[name] = tensor
    return longest


def _batch(manifest: Any, example: Mapping[str, torch.Tensor], size: int, path: Path) -> Path:
    """One batch of ``size`` from the example rows (repeated), with labels for the loss."""
    rows = {name: t.detach().numpy() for name, t in example.items()}
    index = np.arange(size) % len(next(iter(rows.values())))
    feeds = {name: value[index] for name, value in rows.items()}
    for target in manifest.targets:
        classes = manifest.num_classes or 2
        shape = (size, *(d for d in target.shape[1:] if isinstance(d, int)))
        feeds[target.name] = (np.arange(math.prod(shape)) % classes).reshape(shape).astype(target.dtype)
    np.savez(path, **feeds)
    return path


def format_plan(result: Plan) -> str:
    lean = " (lean memory: ORT's arena off)" if result.lean_memory else ""
    lean += " (streamed weights, portable engine)" if result.stream_weights else ""
    micro = f", in micro-batches of {result.micro_batch_size}" if result.micro_batch_size else ""
    lines = [f"memory plan: budget {_mb(result.budget)}, batch size {result.batch_size}{micro}{lean}",
             f"   {'candidate':<22} {'trainable':>12}  {'micro':>5}  {'estimate':>9}  {'train':>9}  {'+ val':>9}  "
             f"{'ms/step':>8}  fits"]  # fmt: skip
    for row in result.rows:
        peak = _mb(row["peak_rss"]) if "peak_rss" in row else "-"
        train = _mb(row["peak_rss_train"]) if "peak_rss_train" in row else "-"
        step = f"{row['step_ms']:8.1f}" if "step_ms" in row else f"{'-':>8}"
        size = str(row.get("micro_batch_size", "-"))
        fits = {True: "yes", False: "no", None: "-"}[row.get("fits")] + (" (lean)" if row.get("lean_memory") else "")
        fits += " (streamed)" if row.get("stream_weights") else ""
        mark = "  <- chosen" if row["candidate"] == result.chosen else ""
        lines.append(
            f"   {row['candidate']:<22} {row['trainable']:>12,}  {size:>5}  {_mb(row['estimate']):>9}  "
            f"{train:>9}  {peak:>9}  {step}  {fits}{mark}"
        )
    notes = [f"   {row['candidate']}: " + "; ".join(t for t in (row.get("layers"), row.get("note")) if t)
             for row in result.rows if row.get("layers") or row.get("note")]  # fmt: skip
    if any("peak_rss" in row for row in result.rows):
        notes.append("   train, + val: peak RSS of a fresh process that trains, then validates and saves as "
                     "`odt train --val` does (odt evaluate and predict load no more); the plan fits + val")  # fmt: skip
    if any("peak_rss_lean" in row for row in result.rows):
        notes.append("   over-budget rows were measured again without ORT's arena (lean memory)")
    if any("peak_rss_streamed" in row for row in result.rows):
        notes.append("   and then on the portable engine with streamed weights (odt train --stream-weights), with the "
                     "arena and without")  # fmt: skip
    return "\n".join(lines + notes)


def _mb(size: float) -> str:
    return f"{size / 1e6:.0f} MB"


def _plain(value: Any) -> Any:
    return asdict(value) if isinstance(value, Lora) else value


@contextmanager
def _quiet_logs() -> Iterator[None]:
    """Candidates are built unverified and thrown away: keep their warnings out of the table."""
    logger = logging.getLogger("artifacts")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
