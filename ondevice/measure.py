"""Measure what training costs on this machine: peak RSS and step time of one artifact directory.

Run as ``python -m ondevice.measure DIR --data BATCH.npz`` in a fresh process (the memory planner
does). It does what ``odt train --val`` does, on one batch: loads the training and eval sessions,
reads 1,000 examples of data (texts through the tokenizer, for artifacts that read text), trains,
validates and saves a checkpoint. So the peak is that whole process (imports, sessions, weights,
gradients, optimizer state, activations, data), and ``odt train``, ``odt evaluate`` and ``odt
predict``, which load the same or less, stay under it; a much larger dataset comes on top.
Prints one JSON object: ``peak_rss`` (bytes, the whole run), ``peak_rss_train`` (before
validation) and ``step_ms`` (median train step after the first).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["main", "EXAMPLES"]

EXAMPLES = 1000
"""Rows of data the measured process holds: a plan includes this much of the user's data."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ondevice.measure", description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--data", required=True, help=".npz holding one batch of the manifest's feeds")
    parser.add_argument("--steps", type=int, default=4, help="train steps (default 4; the first is warm-up)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--examples", type=int, default=EXAMPLES,
                        help=f"rows of data held as odt train holds them (default {EXAMPLES:,})")  # fmt: skip
    parser.add_argument("--lean-memory", action="store_true", help="ORT's memory arena off (Trainer.load)")
    parser.add_argument("--stream-weights", action="store_true", help="frozen.bin streamed (Trainer.load)")
    parser.add_argument("--engine", default="auto", help="the engine that trains (Trainer.load; default auto)")
    args = parser.parse_args(argv)

    import tempfile

    from .data import load_npz
    from .trainer import Trainer

    trainer = Trainer.load(args.directory, threads=args.threads, lean_memory=args.lean_memory,
                           stream_weights=args.stream_weights, engine=args.engine)  # fmt: skip
    batch = load_npz(args.data)
    rows = len(next(iter(batch.values())))
    with tempfile.TemporaryDirectory(prefix="odt-measure-") as tmp:
        data = _user_data(trainer, batch, max(args.examples, rows), Path(tmp))
        times = []
        for _ in range(max(args.steps, 2)):
            start = time.perf_counter()
            trainer.train_step(batch)
            times.append(time.perf_counter() - start)
        train_peak = peak_rss()
        first = {name: array[:rows] for name, array in data.items()}  # one step, validation, a save
        trainer.fit(first, epochs=1, batch_size=rows, val_data=first, checkpoint=Path(tmp) / "latest.ckpt")
    print(json.dumps({"peak_rss": peak_rss(), "peak_rss_train": train_peak,
                      "step_ms": statistics.median(times[1:]) * 1e3}))  # fmt: skip
    return 0


def _user_data(trainer, batch: dict[str, np.ndarray], examples: int, work: Path) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    """``examples`` rows of data as ``odt train`` holds them: the batch repeated, and for artifacts that
    read text, the texts its token ids spell written to a .jsonl and read back through the tokenizer."""
    from .datafiles import load_data
    from .text import TextEncoder

    index = np.arange(examples) % len(next(iter(batch.values())))
    manifest = trainer.manifest
    if manifest.tokenizer is None:
        return {name: array[index] for name, array in batch.items()}
    texts = TextEncoder(trainer.directory, manifest).decode(batch[manifest.tokenizer.ids])
    labels = batch[manifest.targets[0].name].tolist() if manifest.targets else [None] * len(texts)
    names = manifest.labels or None
    lines = [json.dumps({"text": texts[i], "label": names[labels[i]] if names else labels[i]}) for i in index]
    path = work / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return load_data(str(path), trainer.directory)


def peak_rss() -> int:
    """This process's peak resident set in bytes.

    Linux's VmHWM starts afresh at exec; ``ru_maxrss`` does not (a child forked from a large
    parent reports the parent's size), so it is only the fallback elsewhere (macOS: bytes).
    """
    from .session import process_status

    peak = process_status("VmHWM")
    if peak is not None:
        return peak
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage if sys.platform == "darwin" else usage * 1024


if __name__ == "__main__":
    sys.exit(main())
