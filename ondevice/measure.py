"""Measure what training costs on this machine: peak RSS and step time of one artifact directory.

Run as ``python -m ondevice.measure DIR --data BATCH.npz`` in a fresh process (the memory planner
does), so the peak is this training alone: imports, ONNX Runtime's training session (not the eval
graph's), weights, gradients, optimizer state and activations, and the tokenizer of artifacts
that train on text. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ondevice.measure", description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--data", required=True, help=".npz holding one batch of the manifest's feeds")
    parser.add_argument("--steps", type=int, default=4, help="train steps (default 4; the first is warm-up)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--lean-memory", action="store_true", help="ORT's memory arena off (Trainer.load)")
    args = parser.parse_args(argv)

    from .data import load_npz
    from .trainer import Trainer

    # A training process: the eval graph's session is not loaded (odt train loads it only for --val).
    trainer = Trainer.load(args.directory, threads=args.threads, lean_memory=args.lean_memory, evaluation=False)
    if trainer.manifest.tokenizer is not None:  # a device that trains on text holds the tokenizer too
        from .text import TextEncoder

        TextEncoder(args.directory, trainer.manifest)(["measure the tokenizer's memory too"])
    batch = load_npz(args.data)
    times = []
    for _ in range(max(args.steps, 2)):
        start = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - start)
    print(json.dumps({"peak_rss": peak_rss(), "step_ms": statistics.median(times[1:]) * 1e3}))
    return 0


def peak_rss() -> int:
    """This process's peak resident set in bytes.

    Linux's VmHWM starts afresh at exec; ``ru_maxrss`` does not (a child forked from a large
    parent reports the parent's size), so it is only the fallback elsewhere (macOS: bytes).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return usage if sys.platform == "darwin" else usage * 1024


if __name__ == "__main__":
    sys.exit(main())
