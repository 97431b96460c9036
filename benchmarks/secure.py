"""Secure aggregation (SecAgg+) against plain FedAvg, on the digits sample.

1. Accuracy: 10 clients with Dirichlet(0.5) label skew for 20 rounds in Flower's simulation runtime
   (real SuperLink), plain FedAvg against SecAgg+ with the default groups (all 10 nodes at this
   size) and with groups of 5.
2. Overhead per round at 10, 50 and 100 clients, with every node sharing keys with every other
   (secagg-shares 1) and with the default groups (all up to 20 nodes, then 2 log2(n) + 1): the
   protocol's bytes per client (all four stages, up and down) against plain FedAvg's (the weights
   each way), its compute per client and on the server. Nodes run in this process
   (federated.loopback) with the real client mod (Flower's keys, shares, masks) and updates the
   size of the digits model, so the figures are the protocol's own: no training, no network.
3. Dropouts: 30 % of 20 clients vanish after sharing keys; the round must complete with the rest
   and equal numpy's weighted average of the survivors' updates within the quantization bound.
4. A browser client's cost: a round of 10 SecAgg+ clients in headless Chromium (odt-secagg.mjs's
   SecureRound, Web Crypto and BigInt), each client's seconds per stage, beside the Python client
   (Flower's stage functions) on the same vector sizes and group: the digits model and the intents
   sample's MiniLM LoRA r8 + head (86,433 trainable values).
Run: .venv-classic/bin/python -m benchmarks.secure [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._machine import machine
from benchmarks.federation import prepare, run

ROOT = Path(__file__).resolve().parents[1]


def accuracy_rows(artifacts: Path, data: Path, rounds: int, work: Path) -> list[dict]:
    base = {"artifacts": str(artifacts), "data": str(data), "num-server-rounds": rounds, "partitioning": "dirichlet",
            "dirichlet-alpha": 0.5, "min-nodes": 10}  # fmt: skip
    secure = {**base, "secure-aggregation": True}
    return [
        run("FedAvg", 10, base, work),
        run("FedAvg + SecAgg+ (default groups: all 10)", 10, secure, work),
        run("FedAvg + SecAgg+ (groups of 5)", 10, {**secure, "secagg-shares": 0.5}, work),
    ]


def secure_round(start, updates, counts, settings, vanish=None):  # type: ignore[no-untyped-def]
    """One SecAgg+ round over in-process nodes (the real client mod) whose training adds
    ``updates[node]`` to the global weights ``start`` and claims ``counts[node]`` examples.
    Returns the nodes, the secure grid, the aggregate reply and the round's seconds."""
    from flwr.app import Message, MetricRecord, RecordDict

    from federated.loopback import LoopbackGrid
    from federated.protocol import ARRAYS, METRICS, from_arrays, to_arrays
    from federated.secure import SecureGrid, secure_mod

    def node(message: Message, context) -> Message:  # type: ignore[no-untyped-def]
        def train(task: Message, _context) -> Message:  # type: ignore[no-untyped-def]
            weights = from_arrays(task.content[ARRAYS])
            trained = {k: weights[k] + updates[context.node_id][k] for k in weights}
            metrics = MetricRecord({"num-examples": counts[context.node_id], "manifest-tag": 1})
            return Message(RecordDict({ARRAYS: to_arrays(trained), METRICS: metrics}), reply_to=task)

        return secure_mod(message, context, train)

    nodes = LoopbackGrid({n: node for n in updates}, vanish)
    grid = SecureGrid(nodes, settings)
    tasks = [Message(RecordDict({ARRAYS: to_arrays(start)}), dst_node_id=n, message_type="train", group_id="1")
             for n in updates]  # fmt: skip
    began = time.perf_counter()
    (reply,) = grid.send_and_receive(tasks)
    return nodes, grid, reply, time.perf_counter() - began


def overhead(clients: int, shares: float, shapes: dict[str, tuple[int, ...]], repeats: int) -> dict:
    """One secure round over in-process nodes, ``repeats`` times: bytes and seconds per client."""
    from federated.secure import SecureSettings, group_size

    rng = np.random.default_rng(clients)
    start = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    updates = {100 + i: {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
               for i in range(clients)}  # fmt: skip
    counts = dict.fromkeys(updates, 100)
    plain = sum(a.nbytes for a in start.values())
    client_s, server_s, up, down = [], [], [], []
    for _ in range(repeats):
        settings = SecureSettings(shares=shares, max_weight=1000.0)
        nodes, grid, _, wall = secure_round(start, updates, counts, settings)
        client_s.append(statistics.median(nodes.seconds.values()))
        server_s.append(wall - sum(nodes.seconds.values()))
        log = grid.rounds[-1]
        up.append(statistics.median(log.bytes_up.values()))
        down.append(statistics.median(log.bytes_down.values()))
    return {
        "clients": clients,
        "shares": shares,
        "group": clients if shares == 1.0 else group_size(clients),
        "plain_bytes_each_way": plain,
        "bytes_up_per_client": statistics.median(up),
        "bytes_down_per_client": statistics.median(down),
        "up_vs_plain": statistics.median(up) / plain,
        "down_vs_plain": statistics.median(down) / plain,
        "client_s": statistics.median(client_s),
        "server_s": statistics.median(server_s),
    }


def dropouts(shapes: dict[str, tuple[int, ...]], clients: int = 20, share: float = 0.3) -> dict:
    from federated.protocol import ARRAYS, from_arrays
    from federated.secure import SecureSettings

    rng = np.random.default_rng(0)
    start = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    counts = {100 + i: int(rng.integers(50, 300)) for i in range(clients)}
    updates = {n: {k: (0.01 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()} for n in counts}
    vanished = sorted(rng.choice(list(counts), size=round(share * clients), replace=False).tolist())
    vanish = {n: "collect_masked_vectors" for n in vanished}
    _, _, reply, seconds = secure_round(start, updates, counts, SecureSettings(max_weight=1000.0), vanish)
    survivors = [n for n in counts if n not in vanished]
    total = sum(counts[n] for n in survivors)
    expected = {k: start[k] + sum(updates[n][k].astype(np.float64) * counts[n] for n in survivors) / total
                for k in start}  # fmt: skip
    got = from_arrays(reply.content[ARRAYS])
    error = max(float(np.abs(got[k] - expected[k]).max()) for k in start)
    return {"clients": clients, "vanished": len(vanished), "completed": True, "max_error": error,
            "round_s": seconds}  # fmt: skip


BROWSER_SIZES = {"MiniLM LoRA r8 + head": 86_433}
"""Trainable values of the intents sample's MiniLM LoRA r8 + head (its manifest's trainable_size)."""
DIGITS_VALUES = 17_226


def browser_rows(sizes: dict[str, int], clients: int = 10) -> list[dict]:
    """Each size: the browser's and Python's median client seconds over a round of ``clients`` (one group)."""
    from benchmarks.browser import WEB, _in_browser, _serve, _site

    work = Path(tempfile.mkdtemp(prefix="odt-secure-browser-"))
    site = _site(work / "site")
    (site / "odt-secagg.mjs").symlink_to(WEB / "odt-secagg.mjs")
    server = _serve(site)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    rows = []
    try:
        for name, size in sizes.items():
            result = _in_browser(url, {"secureRound": {"nodes": clients, "size": size}}, work)
            stages = {stage: statistics.median(times) for stage, times in result["seconds"].items()}
            python = overhead(clients, 1.0, {"w": (size,)}, 1)["client_s"]
            rows.append({"model": name, "values": size, "clients": clients, "browser_stage_s": stages,
                         "browser_client_s": sum(stages.values()), "python_client_s": python})  # fmt: skip
    finally:
        server.shutdown()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--quick", action="store_true", help="3 rounds, 10 and 50 clients, one repeat")
    parser.add_argument("--browser-only", action="store_true", help="part 4 only, into the existing results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.browser_only:
        result = json.loads((out / "secure.json").read_text())
        result["browser"] = browser_rows({"digits": DIGITS_VALUES, **BROWSER_SIZES})
        result["browser_machine"] = machine()
        (out / "secure.json").write_text(json.dumps(result, indent=2))
        (out / "secure.md").write_text(markdown(result))
        print(markdown(result))
        return 0
    import federated.secure  # noqa: F401  (Flower sets its logger's level when it is first imported)

    logging.getLogger("flwr").setLevel(logging.INFO)  # Flower's SecAgg+ stages log every node at DEBUG
    work = Path(tempfile.mkdtemp(prefix="odt-secure-bench-"))
    artifacts, data, central = prepare(work)
    from ondevice import Manifest

    shapes = {p.name: tuple(p.shape) for p in Manifest.load(artifacts).trainable}
    sizes, repeats = ((10, 50), 1) if args.quick else ((10, 50, 100), 3)
    costs = [overhead(n, shares, shapes, repeats) for n in sizes for shares in (1.0, 0.0)]
    dropped = dropouts(shapes)
    browser = browser_rows({"digits": sum(int(np.prod(s)) for s in shapes.values()), **BROWSER_SIZES})
    rows = accuracy_rows(artifacts, data, 3 if args.quick else 20, work)
    result = {"machine": machine(), "centralized_accuracy": max(central.values()), "accuracy": rows,
              "overhead": costs, "dropouts": dropped, "browser": browser}  # fmt: skip
    (out / "secure.json").write_text(json.dumps(result, indent=2))
    (out / "secure.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [
        f"Measured on {result['machine']['cpu']} ({result['machine']['cores']} cores).",
        "",
        "**Accuracy** (digits, 10 clients, Dirichlet 0.5, Flower simulation runtime):",
        "",
        "| run | rounds | final accuracy | median round (s) | bytes up per round |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in result["accuracy"]:
        lines.append(f"| {row['name']} | {row['rounds']} | {row['final_accuracy']:.4f} | {row['round_s']:.2f} | "
                     f"{row['bytes_up_per_round']:,.0f} |")  # fmt: skip
    lines += [
        "",
        "**Overhead per round** (the protocol alone: nodes in one process, digits-sized updates):",
        "",
        "| clients | group | bytes up per client | vs plain | bytes down per client | vs plain | "
        "client compute (s) | server compute (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["overhead"]:
        lines.append(
            f"| {row['clients']} | {row['group']} | {row['bytes_up_per_client']:,.0f} | {row['up_vs_plain']:.2f}x | "
            f"{row['bytes_down_per_client']:,.0f} | {row['down_vs_plain']:.2f}x | {row['client_s']:.3f} | "
            f"{row['server_s']:.3f} |"
        )
    d = result["dropouts"]
    lines += [
        "",
        f"**Dropouts**: {d['vanished']} of {d['clients']} clients vanished after sharing keys; the round "
        f"{'completed' if d['completed'] else 'failed'} in {d['round_s']:.2f} s with the rest, "
        f"{d['max_error']:.2e} from numpy's weighted average of their updates.",
        "",
        "**A browser client** (headless Chromium, odt-secagg.mjs) against a Python client (Flower's stage "
        "functions), a round of 10 clients in one group, median seconds per client:",
        "",
        "| update | values | setup | share keys | collect (quantize, mask) | unmask | browser total | Python total |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result.get("browser", []):
        b = row["browser_stage_s"]
        lines.append(
            f"| {row['model']} | {row['values']:,} | {b['setup']:.3f} | {b['share_keys']:.3f} | "
            f"{b['collect_masked_vectors']:.3f} | {b['unmask']:.3f} | {row['browser_client_s']:.3f} | "
            f"{row['python_client_s']:.3f} |"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
