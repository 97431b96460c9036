"""What `odt inspect` shows: a plain summary of an artifact directory from its manifest."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Collection

from .manifest import Manifest

__all__ = ["summarize", "describe"]


def _stored(manifest: Manifest, base: str) -> Collection[str]:
    """The frozen matrices stored in ``base`` (``odt generate --base int8`` or ``--base float16``)."""
    return (manifest.frozen_file or {}).get(base, ())


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
            **{f"frozen_{base}": sum(p.size for p in manifest.frozen if p.name in _stored(manifest, base))
               for base in ("int8", "float16")},
        },
        "loss": {"kind": manifest.loss.kind, **manifest.loss.options},
        "optimizer": {"kind": manifest.optimizer.kind, "lr": manifest.optimizer.lr, **manifest.optimizer.options},
        "versions": dict(manifest.versions),
        "engines": {"carried": list(manifest.engines), "installed": list(_installed()), "runs": _runs(manifest),
                    "portable": manifest.portable},  # fmt: skip
        "files": {name: (Path(directory) / name).stat().st_size for name in manifest.files},
        "labels": list(manifest.labels),
        "tokenizer": None
        if manifest.tokenizer is None
        else {
            "file": manifest.tokenizer.file,
            "ids": manifest.tokenizer.ids,
            "mask": manifest.tokenizer.mask,
            "max_length": manifest.tokenizer.max_length,
        },
        "adapters": [{"weight": a.weight, "rank": _rank(manifest, a), "scale": a.scale} for a in manifest.adapters],
        "trainable_tensors": [{"name": t.name, "shape": list(t.shape)} for t in manifest.trainable],
        "padding_rows": dict(manifest.padding),
        "index_limits": dict(manifest.index_limits),
        "buffers": [b.name for b in manifest.buffers],
        "plan": None if manifest.plan is None else asdict(manifest.plan),
        "transformers": None
        if manifest.hf_config is None
        else {
            "architecture": (manifest.hf_config["config"].get("architectures") or ["?"])[0],
            "prefix": manifest.hf_config["prefix"],
        },
        "verification": None
        if verification is None
        else {
            "passed": verification.passed,
            "items": len(verification.rows),
            "worst_abs": max((r.max_abs for r in verification.rows), default=0.0),
            "note": verification.note,
        },
    }


def _installed() -> tuple[str, ...]:
    from .engines import installed_engines

    return installed_engines()


def _runs(manifest: Manifest) -> str | None:
    """The engine `auto` picks here (with the ONNX Runtime version), or None when none can run."""
    from .engines import resolve
    from .errors import EngineError
    from .session import ORT_VERSION

    try:
        return f"{resolve('auto', manifest)} (onnxruntime {ORT_VERSION})"
    except EngineError:
        return None


def _rank(manifest: Manifest, adapter: Any) -> int:
    return next(p.shape[0] for p in (*manifest.trainable, *manifest.frozen) if p.name == adapter.a)


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
        f"{p['frozen']:,} frozen" + "".join(f" ({p[f'frozen_{b}']:,} of them in {b})" for b in ("int8", "float16")
                                           if p[f"frozen_{b}"]),
        f"loss:     {summary['loss']['kind']} ({options(summary['loss'])})",
        f"optimizer: {summary['optimizer']['kind']} ({options(summary['optimizer'])})",
        "versions: " + ", ".join(f"{k} {val}" for k, val in summary["versions"].items()),
        f"engines:  {', '.join(summary['engines']['carried'])}; here: {summary['engines']['runs'] or 'none'}"
        + ("" if "portable" in summary["engines"]["carried"] else
           f" (no portable graphs: {(summary['engines']['portable'] or {}).get('unsupported', 'made before them')})"),
        "files:    " + ", ".join(f"{n} {size / 1024:.1f} KiB" for n, size in summary["files"].items()),
        f"verified: {verdict}",
    ]
    labels = summary["labels"]
    if labels:
        lines.append(f"labels:   {len(labels)}: " + ", ".join(labels[:20]) + (", ..." if len(labels) > 20 else ""))
    if summary["tokenizer"]:
        t = summary["tokenizer"]
        lines.append(f"text:     {t['file']} fills {t['ids']}" + (f" and {t['mask']}" if t["mask"] else "")
                     + f", up to {t['max_length']} tokens")  # fmt: skip
    if summary["adapters"]:
        a = summary["adapters"]
        layers = ", ".join(x["weight"].removesuffix(".weight") for x in a[:6]) + (", ..." if len(a) > 6 else "")
        lines.append(f"LoRA:     rank {a[0]['rank']}, scale {a[0]['scale']:g} on {len(a)} layers: {layers}")
    names = [t["name"] for t in summary["trainable_tensors"]]
    lines.append("trains:   " + ", ".join(names[:8]) + (f", ... ({len(names)} tensors)" if len(names) > 8 else ""))
    if summary["transformers"]:
        hf = summary["transformers"]
        lines.append(f"hf:       {hf['architecture']} under '{hf['prefix'] or '(the model)'}' (odt export --format hf)")
    if summary["plan"]:
        lines.append("plan:     " + _plan_line(summary["plan"]))
    return "\n".join(lines)


def _plan_line(plan: dict[str, Any]) -> str:
    """The memory plan in words: what it chose for which budget, and how the runtime loads it to stay inside."""
    how = [f"batch {plan['batch_size']}"]
    if plan.get("micro_batch_size"):
        how.append(f"in micro-batches of {plan['micro_batch_size']}")
    if plan.get("lean_memory"):
        how.append("lean memory (ORT's arena off)")
    if plan.get("stream_weights"):
        how.append(f"streamed frozen weights ({plan.get('engine') or 'portable'} engine)")
    return f"{plan['chosen']!r} for a {plan['budget'] / 1e6:.0f} MB budget: " + ", ".join(how)
