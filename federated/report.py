"""Per-round metrics of a federated run: a JSON file and a PNG of accuracy and loss per round."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ondevice.files import atomic_write_bytes

__all__ = ["round_row", "write_report", "save_weights", "record_failure", "read_outcome", "FAILURE", "REPORT"]

REPORT = "metrics.json"
FAILURE = "run-failed.json"


def round_row(server_round: int, central: dict[str, Any], seen: Any, seconds: float) -> dict[str, Any]:
    """One report row: the central evaluation and what the guard saw in the round (None for round 0),
    with the round's wall time in seconds (sampling, client tasks, aggregation, central evaluation)."""
    row: dict[str, Any] = {"round": server_round, **{f"central.{k}": v for k, v in central.items()}}
    if seen is not None:
        row["seconds"] = seconds
        row.update({f"clients_train.{k}": v for k, v in seen.train_metrics.items()})
        row.update({f"clients_eval.{k}": v for k, v in seen.eval_metrics.items()})
        row["bytes_down"] = seen.bytes_down
        row["bytes_up"] = sum(seen.bytes_up.values())
        # every per-client figure is keyed alike: the partition id, else "node-ID" (RoundLog.key)
        row["bytes_up_per_client"] = {seen.key(k): v for k, v in seen.bytes_up.items()}
        row["excluded"] = {seen.key(k): v for k, v in seen.excluded.items()}
        row["clipped"] = {seen.key(k): v for k, v in seen.clipped.items()}
        if seen.flagged:
            row["flagged"] = {seen.key(k): v for k, v in seen.flagged.items()}
        if seen.refused:
            row["refused"] = seen.refused
        if seen.shift_bound is not None:
            row["secure_shift_bound"] = seen.shift_bound
        if seen.tiers:
            row["tier_per_client"] = {seen.key(k): v for k, v in seen.tiers.items()}
        if seen.eval_by_client:
            row["clients"] = {str(k): v for k, v in sorted(seen.eval_by_client.items())}
        if seen.dp_sampled is not None:
            row["dp_sampled_clients"] = seen.dp_sampled
            row["dp_noise_std"] = seen.dp_noise_std
    return row


def save_weights(path: Path, weights: dict[str, Any], **extra: Any) -> Path:
    """Weights by parameter name as .npz; ``extra`` values go in as ``__name__`` arrays."""
    import io

    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, **weights, **{f"__{k}__": np.asarray(v) for k, v in extra.items()})
    atomic_write_bytes(path, buffer.getvalue())
    return path


def write_report(rows: list[dict[str, Any]], out: Path, settings: dict[str, Any]) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / REPORT
    atomic_write_bytes(metrics, json.dumps({"settings": settings, "rounds": rows}, indent=2).encode())
    plot = out / "rounds.png"
    _plot(rows, plot)
    return metrics, plot


def record_failure(out: Path, run_id: str, exc: BaseException) -> None:
    """Write why the run failed (OUTPUT/run-failed.json, under the run's id) for the runner to quote."""
    from ondevice.errors import OdtError

    reason = str(exc) if isinstance(exc, OdtError) else f"{type(exc).__name__}: {exc}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / FAILURE, json.dumps({"run-id": run_id, "error": reason}).encode())
    except OSError:
        pass  # the log still has it


def read_outcome(out: Path, run_id: str) -> tuple[dict[str, Any] | None, str | None]:
    """(report, None) when this run wrote its report, (None, reason) when it recorded a failure,
    (None, None) when it left neither: a report or failure of another run is never taken for this one."""
    for name in (FAILURE, REPORT):
        try:
            data = json.loads((out / name).read_bytes())
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(data, dict):
            continue
        if name == FAILURE and data.get("run-id") == run_id:
            return None, str(data.get("error"))
        if name == REPORT and data.get("settings", {}).get("run_id") == run_id:
            return data, None
    return None, None


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    x = [row["round"] for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for axis, key, title in ((left, "loss", "loss"), (right, "accuracy", "accuracy")):
        for prefix, label in (
            ("central", "global model, central test set"),
            ("clients_eval", "clients, local validation"),
        ):
            points = [(r, row[f"{prefix}.{key}"]) for r, row in zip(x, rows) if f"{prefix}.{key}" in row]
            if not points:
                points = [(r, row[f"{prefix}.eval-{key}"]) for r, row in zip(x, rows) if f"{prefix}.eval-{key}" in row]
            if points:
                axis.plot(*zip(*points), marker="o", label=label)
        axis.set(xlabel="round", title=title)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        if axis.lines:  # a report without this metric has nothing to label
            axis.legend(loc="best")
    right.set_ylim(0.0, 1.0)
    fig.suptitle("federated training on device (Flower + ONNX Runtime)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
