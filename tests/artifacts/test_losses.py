"""The cross-entropy rewrite against ORT's own kernels and PyTorch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from artifacts import CrossEntropy, generate

from .parity import gradients_close_then_step


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.classic
def test_cross_entropy_rewrite_keeps_orts_values_and_matches_pytorch(tmp_path, monkeypatch, reduction):
    from artifacts import passes
    from artifacts.passes.crossentropy import rewrite_cross_entropy
    from ondevice.engines.classic import OrtTraining

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 50))
    loss = CrossEntropy(reduction=reduction)
    manifest = generate(model, torch.randn(6, 8), tmp_path / "fast", loss=loss)  # verified against PyTorch
    assert manifest.verification.passed
    for graph in ("training_model.onnx", "eval_model.onnx"):
        ops = {n.op_type for n in onnx.load(tmp_path / "fast" / graph).graph.node}
        assert not ops & {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad"} and "LogSoftmax" in ops

    monkeypatch.setattr(passes, "REGISTRY", passes.without("cross-entropy"))
    generate(model, torch.randn(6, 8), tmp_path / "ort", loss=loss, verify=False)
    graph = onnx.load(tmp_path / "ort" / "training_model.onnx")
    assert rewrite_cross_entropy(graph) == 1
    onnx.save(graph, tmp_path / "ort" / "rewritten.onnx")

    reference, candidate = OrtTraining(tmp_path / "ort"), OrtTraining(tmp_path / "ort", graph="rewritten.onnx")
    rng = np.random.default_rng(0)
    for scale, rows in ((1.0, 6), (40.0, 9), (1.0, 1)):  # other batch sizes; scores where softmax saturates
        batch = [(scale * rng.standard_normal((rows, 8))).astype(np.float32), rng.integers(0, 50, rows)]
        batch[1][0] = batch[1][-1]  # a label twice
        eval_loss = candidate.eval_step(batch)[0]  # the eval graph's rewritten loss, on the same weights
        losses = [session.train_step(batch)[0] for session in (reference, candidate)]
        np.testing.assert_allclose([losses[1], eval_loss], [losses[0]] * 2, rtol=1e-6)
        gradients_close_then_step(reference, candidate, (p.name for p in manifest.trainable))
    np.testing.assert_allclose(candidate.get_flat(), reference.get_flat(), rtol=1e-5, atol=1e-6)


@pytest.mark.classic
def test_weighted_cross_entropy_keeps_orts_kernels_in_the_training_graph(tmp_path):
    """The classic training graph keeps ORT's kernels for a weighted loss; the eval graph, which stock ORT loads
    too (in ORT format on phones, where ONNX's function for the loss is not inlined), spells it out and gives
    the kernel's loss."""
    manifest = generate(
        nn.Linear(8, 4), torch.randn(6, 8), tmp_path / "w", loss=CrossEntropy(weight=(1.0, 2.0, 0.5, 1.5))
    )
    assert manifest.verification.passed
    for graph, kernels in (("training_model.onnx", 2), ("eval_model.onnx", 0)):
        ops = {n.op_type for n in onnx.load(tmp_path / "w" / graph).graph.node}
        assert len(ops & {"SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossGrad"}) == kernels, graph
    from ondevice.engines.classic import OrtTraining

    session = OrtTraining(tmp_path / "w")
    batch = [np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32), np.array([0, 1, 2, 3, 1, 1])]
    np.testing.assert_allclose(session.eval_step(batch)[0], session.train_step(batch)[0], rtol=1e-6)
