"""Frozen weights live once, in frozen.bin (memory-mapped by ORT): not in the checkpoint, not copied at load."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from ondevice import ManifestError, Trainer
from ondevice.manifest import Manifest
from tests.conftest import ROOT

HIDDEN = 2048  # four frozen 2048 x 2048 layers: 67 MB of frozen weights (far above ORT's own load overhead)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.Tanh()]
    return nn.Sequential(nn.Linear(16, HIDDEN), nn.Tanh(), *layers, nn.Linear(HIDDEN, 3))


@pytest.fixture(scope="module")
def frozen_body(tmp_path_factory):  # type: ignore[no-untyped-def]
    from artifacts import generate

    model = _model()
    out = tmp_path_factory.mktemp("frozen") / "artifacts"
    generate(model, {"x": torch.randn(8, 16)}, out, trainable=["0", "10"])
    return out, model


def _batch(size: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((size, 16), dtype=np.float32), "labels": rng.integers(0, 3, size)}


def test_frozen_weights_are_in_the_file_with_pytorchs_values_and_not_in_checkpoints(frozen_body, tmp_path):
    out, model = frozen_body
    manifest = Manifest.load(out)
    frozen_bytes = 4 * manifest.frozen_size
    assert manifest.frozen_file["file"] == "frozen.bin"
    assert sorted(manifest.frozen_file["offsets"]) == sorted(p.name for p in manifest.frozen)
    assert (out / "frozen.bin").stat().st_size == frozen_bytes
    assert (out / "checkpoint").stat().st_size < 0.1 * frozen_bytes

    trainer = Trainer.load(out)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(trainer.parameter(name), value.numpy(), err_msg=name)
    for _ in range(2):
        trainer.train_step(_batch())
    saved = trainer.save(tmp_path / "ckpt" / "latest.ckpt")
    assert saved.stat().st_size < 0.1 * frozen_bytes  # trainable tensors and two AdamW moments only

    resumed = Trainer.load(out, checkpoint=saved)
    for name, value in trainer.get_weights().items():
        np.testing.assert_array_equal(resumed.get_weights()[name], value)
    assert resumed.eval_step(_batch()).loss == trainer.eval_step(_batch()).loss


def test_export_writes_the_frozen_weights_into_the_model(frozen_body, tmp_path):
    import onnxruntime as ort

    out, _ = frozen_body
    trainer = Trainer.load(out)
    trainer.train_step(_batch())
    path = trainer.export(tmp_path / "model.onnx")
    assert path.stat().st_size > 4 * trainer.manifest.frozen_size  # self-contained, no frozen.bin beside it
    batch = _batch()
    (scores,) = ort.InferenceSession(str(path)).run(None, {"x": batch["x"]})
    np.testing.assert_allclose(scores, trainer.eval_step(batch).outputs["output"], rtol=1e-5, atol=1e-6)


LOAD_PEAK = """
import json, sys
def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
from ondevice import Trainer
before = rss("VmHWM")
trainer = Trainer.load(sys.argv[1])
print(json.dumps({"before": before, "after_load": rss("VmHWM")}))
"""


def test_loading_makes_no_copy_of_the_frozen_weights(frozen_body):
    """ORT reads a checkpoint into one buffer and copies every tensor out of it: with the frozen
    weights in the checkpoint, loading peaked at twice their size. Now they are mapped, not read."""
    out, _ = frozen_body
    done = subprocess.run([sys.executable, "-c", LOAD_PEAK, str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    frozen_bytes = 4 * Manifest.load(out).frozen_size
    assert figures["after_load"] - figures["before"] < 0.5 * frozen_bytes, figures


def test_a_frozen_file_layout_that_does_not_tile_is_refused(frozen_body, tmp_path):
    import shutil

    out, _ = frozen_body
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    data = json.loads((copy / "manifest.json").read_text())
    first = next(iter(data["frozen_file"]["offsets"]))
    data["frozen_file"]["offsets"][first] = 4
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"frozen_file.offsets\[.*the tensors tile the file in order"):
        Manifest.load(copy)


def test_a_bundle_carries_the_frozen_weights_in_its_checkpoint_and_trains_the_same(frozen_body, tmp_path):
    from mobile_bridge import load_trainer, make_bundle

    out, _ = frozen_body
    make_bundle(out, tmp_path / "bundle")
    assert not (tmp_path / "bundle" / "frozen.bin").exists()
    assert (tmp_path / "bundle" / "checkpoint").stat().st_size > 4 * Manifest.load(out).frozen_size
    bundled, plain = load_trainer(tmp_path / "bundle", None), Trainer.load(out)
    for _ in range(3):
        assert bundled.train_step(_batch()).loss == pytest.approx(plain.train_step(_batch()).loss, rel=1e-6)
