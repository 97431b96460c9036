"""What `odt inspect` shows: a plain summary of an artifact directory from its manifest."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .manifest import Manifest

__all__ = ["summarize", "describe"]


def summarize(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Summary of an artifact directory (the manifest is read and every file hash checked)."""
    manifest = Manifest.load(directory)
    trainable, frozen = manifest.trainable_size, manifest.frozen_size
    verification = manifest.verification
    return {
        "directory": str(Path(directory)),
        "name": manifest.name,
        "inputs": [_tensor(t) for t in manifest.inputs],
        "targets": [_tensor(t) for t in manifest.targets],
        "outputs": [_tensor(t) for t in manifest.outputs],
        "parameters": {
            "trainable": trainable,
            "frozen": frozen,
            "trainable_bytes": 4 * trainable,
            "trainable_share": trainable / (trainable + frozen) if trainable + frozen else 0.0,
            "trainable_tensors": len(manifest.trainable),
            "frozen_tensors": len(manifest.frozen),
        },
        "loss": {"kind": manifest.loss.kind, **manifest.loss.options},
        "optimizer": {"kind": manifest.optimizer.kind, "lr": manifest.optimizer.lr, **manifest.optimizer.options},
        "versions": dict(manifest.versions),
        "files": {name: (Path(directory) / name).stat().st_size for name in manifest.files},
        "verification": None
        if verification is None
        else {
            "passed": verification.passed,
            "items": len(verification.rows),
            "worst_abs": max((r.max_abs for r in verification.rows), default=0.0),
            "note": verification.note,
        },
    }


def _tensor(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, "dtype": spec.dtype, "shape": list(spec.shape)}


def _shape(t: dict[str, Any]) -> str:
    return f"{t['name']}: {t['dtype']}[{', '.join(str(d) for d in t['shape'])}]"


def describe(summary: dict[str, Any]) -> str:
    """The summary as text for a person."""
    p = summary["parameters"]
    v = summary["verification"]
    verdict = (
        "not run"
        if v is None
        else ("PASS" if v["passed"] else "FAIL") + f" ({v['items']} items, worst abs diff {v['worst_abs']:.2e})"
    )
    options = lambda d: ", ".join(f"{k}={val}" for k, val in d.items() if k != "kind" and val is not None)  # noqa: E731
    lines = [
        f"{summary['name']}  ({summary['directory']})",
        "inputs:   " + "; ".join(_shape(t) for t in summary["inputs"]),
        "targets:  " + ("; ".join(_shape(t) for t in summary["targets"]) or "none (the model computes its loss)"),
        "outputs:  loss; " + "; ".join(_shape(t) for t in summary["outputs"]),
        f"params:   {p['trainable']:,} trainable ({p['trainable_bytes'] / 1024:.1f} KiB, "
        f"{100 * p['trainable_share']:.1f}% of {p['trainable'] + p['frozen']:,}) in {p['trainable_tensors']} tensors; "
        f"{p['frozen']:,} frozen",
        f"loss:     {summary['loss']['kind']} ({options(summary['loss'])})",
        f"optimizer: {summary['optimizer']['kind']} ({options(summary['optimizer'])})",
        "versions: " + ", ".join(f"{k} {val}" for k, val in summary["versions"].items()),
        "files:    " + ", ".join(f"{n} {size / 1024:.1f} KiB" for n, size in summary["files"].items()),
        f"verified: {verdict}",
    ]
    return "\n".join(lines)
