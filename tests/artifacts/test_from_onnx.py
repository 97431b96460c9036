"""Start from an existing ONNX model: same pipeline, proved against ORT inference of the original."""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from artifacts import VerificationError
from artifacts.errors import InputSpecError, ModelLoadError
from artifacts.from_onnx import generate_from_onnx
from ondevice import Manifest, Trainer
from ondevice.cli import main

from_onnx_module = importlib.import_module("artifacts.from_onnx")


def _export(model: nn.Module, example: tuple, path, names: list[str], dynamic: dict) -> None:
    torch.onnx.export(model.eval(), example, path, input_names=names, output_names=["logits"],
                      dynamic_axes=dynamic, opset_version=17, dynamo=False)  # fmt: skip


@pytest.fixture()
def cnn_onnx(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 16), nn.GELU(),
        nn.Linear(16, 5),
    )  # fmt: skip
    path = tmp_path / "cnn.onnx"
    _export(model, (torch.randn(2, 1, 8, 8),), path, ["image"], {"image": {0: "b"}, "logits": {0: "b"}})
    return path


def test_onnx_model_generates_verifies_and_trains(cnn_onnx, tmp_path):
    manifest = generate_from_onnx(cnn_onnx, tmp_path / "a")
    assert manifest.verification.passed
    assert "checked at input shapes 8x1x8x8 and 4x1x8x8" in manifest.verification.note
    assert any(r.item.endswith("(finite difference)") for r in manifest.verification.rows)
    assert manifest.inputs[0].shape == ("batch", 1, 8, 8)
    # the eval graph computes what the original computes, at a batch size never seen before
    x = np.random.default_rng(3).standard_normal((3, 1, 8, 8)).astype(np.float32)
    original = ort.InferenceSession(str(cnn_onnx), providers=["CPUExecutionProvider"]).run(None, {"image": x})[0]
    trainer = Trainer.load(tmp_path / "a")
    labels = np.array([0, 1, 2])
    np.testing.assert_allclose(trainer.eval_step({"image": x, "labels": labels}).outputs["logits"], original,
                               atol=1e-5)  # fmt: skip
    data = {"image": np.random.default_rng(4).standard_normal((32, 1, 8, 8)).astype(np.float32),
            "labels": np.arange(32) % 5}  # fmt: skip
    before = trainer.evaluate(data)["loss"]
    trainer.fit(data, epochs=5, batch_size=8, progress=False)
    assert trainer.evaluate(data)["loss"] < before


def test_cli_generates_from_onnx_with_a_selection(cnn_onnx, tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["generate", "--model", str(cnn_onnx), "--out", str(out), "--trainable", "6.*"]) == 0
    assert "verification: PASS" in capsys.readouterr().out
    manifest = Manifest.load(out)
    assert [p.name for p in manifest.trainable] == ["6.weight", "6.bias"]


def test_finite_differences_catch_a_wrong_gradient(tmp_path, monkeypatch):
    """A gradient rewrite that is wrong for this model (a padding row it does not have) fails the proof."""
    torch.manual_seed(0)

    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids).mean(1))

    path = tmp_path / "bag.onnx"
    _export(Bag(), (torch.randint(0, 10, (2, 6)),), path, ["ids"], {"ids": {0: "b"}, "logits": {0: "b"}})
    real_source = from_onnx_module.Source
    monkeypatch.setattr(
        from_onnx_module, "Source", lambda graph, outputs, params, states, padding, describe: real_source(
            graph, outputs, params, states, {"embed.weight": 0}, describe)
    )  # fmt: skip
    with pytest.raises(VerificationError, match=r"grad embed.weight \(finite difference\)"):
        generate_from_onnx(path, tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_bad_onnx_inputs(tmp_path, cnn_onnx):
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="is not a valid ONNX model"):
        generate_from_onnx(tmp_path / "junk.onnx", tmp_path / "a")
    with pytest.raises(ModelLoadError, match="does not exist"):
        generate_from_onnx(tmp_path / "none.onnx", tmp_path / "a")
    model = onnx.load(cnn_onnx)
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "height"
    onnx.save(model, tmp_path / "dynamic.onnx")
    with pytest.raises(InputSpecError, match="give example inputs"):
        generate_from_onnx(tmp_path / "dynamic.onnx", tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_the_sdks_own_export_generates_again_and_the_fd_flags_reach_its_rows(digits_artifacts, tmp_path, capsys):
    """`odt generate --model model.onnx` on `odt export`'s output: a fixed 1e-3 refused 3 of 15
    finite-difference rows of this valid model (ReLU kinks crossed); with each row's bound widened by
    the difference of two step sizes' estimates it passes at several seeds (175 rows over 25 seeds in
    a one-off), and --fd-atol/--fd-rtol reach the rows (a tiny bound fails)."""
    Trainer.load(digits_artifacts).export(tmp_path / "model.onnx")
    for seed in ("0", "1", "3"):
        out = str(tmp_path / f"g{seed}")
        argv = ["generate", "--model", str(tmp_path / "model.onnx"), "--out", out, "--seed", seed]
        assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()
    strict = ["generate", "--model", str(tmp_path / "model.onnx"), "--out", str(tmp_path / "strict"),
              "--fd-atol", "1e-9", "--fd-rtol", "1e-9"]  # fmt: skip
    assert main(strict) == 1
    err = capsys.readouterr().err
    assert "(finite difference)" in err and "--fd-atol" in err
    assert not (tmp_path / "strict").exists()


def test_a_training_mode_export_with_dropout_verifies_with_dropout_off_and_drops_in_training(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3)).train()
    path = tmp_path / "drop.onnx"
    torch.onnx.export(model, (torch.randn(4, 8),), path, input_names=["x"], output_names=["logits"],
                      dynamic_axes={"x": {0: "b"}, "logits": {0: "b"}}, opset_version=17, dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)  # fmt: skip
    manifest = generate_from_onnx(path, tmp_path / "a")
    assert manifest.verification.passed, manifest.verification
    assert "train step checked with 1 Dropout(s) off" in manifest.verification.note
    # the optimizer-step rows keep the given tolerance (they once took the last finite-difference row's)
    assert {(r.atol, r.rtol) for r in manifest.verification.rows if r.item.startswith("step ")} == {(1e-5, 1e-3)}
    trainer = Trainer.load(tmp_path / "a")
    x = np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)
    start = trainer.get_flat_weights()
    losses = set()
    for _ in range(3):  # from the same weights each time: only the dropout masks differ
        losses.add(trainer.train_step({"x": x, "labels": np.arange(32) % 3}).loss)
        trainer.set_weights(start)
    assert len(losses) == 3
