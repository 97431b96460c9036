"""`odt inspect` reports what the manifest says, as text and JSON."""

from __future__ import annotations

import json

import onnxruntime

from ondevice.cli import main
from ondevice.manifest import Manifest


def test_inspect_json_matches_manifest(digits_artifacts, capsys):
    assert main(["inspect", str(digits_artifacts), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    manifest = Manifest.load(digits_artifacts)
    assert (
        summary["parameters"]["trainable"] == manifest.trainable_size == 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    )
    assert summary["parameters"]["trainable_bytes"] == 4 * manifest.trainable_size
    assert summary["inputs"] == [{"name": "input", "dtype": "float32", "shape": ["batch", 64]}]
    assert summary["verification"]["passed"] is True
    assert summary["versions"]["onnxruntime"] == onnxruntime.__version__  # the runtime that generated them


def test_inspect_text(digits_artifacts, capsys):
    assert main(["inspect", str(digits_artifacts)]) == 0
    text = capsys.readouterr().out
    assert "17,226 trainable" in text and "verified: PASS" in text and "labels: int64[batch]" in text


def test_inspect_refuses_altered_artifacts(digits_artifacts, tmp_path, capsys):
    import shutil

    copy = shutil.copytree(digits_artifacts, tmp_path / "a")
    (copy / "training_model.onnx").write_bytes(b"junk")
    assert main(["inspect", str(copy)]) == 1
    assert "training_model.onnx was altered" in capsys.readouterr().err
