"""The NCHWc variant: convolutions on ORT's blocked kernels train like the portable graph and PyTorch."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from artifacts import generate
from artifacts.passes.nchwc import NCHWC_DOMAIN
from ondevice import ManifestError, Trainer
from ondevice.engines.classic import OrtTraining
from ondevice.manifest import Manifest
from ondevice.session import _NCHWC_PROBE, TRAINING_GRAPH, nchwc_block_size
from ondevice.session import ort as _ort

ExecutionOrder = _ort.ExecutionOrder


def _separable(channels: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.Hardswish(),
        nn.Conv2d(channels, channels, 3, padding=1, groups=channels), nn.ReLU(),  # depthwise, stride 1
        nn.Conv2d(channels, 2 * channels, 1), nn.ReLU(),
        nn.Conv2d(2 * channels, 2 * channels, 3, padding=1), nn.ReLU(),  # a full Conv on blocked channels
        nn.Conv2d(2 * channels, 2 * channels, 3, stride=2, padding=1, groups=2 * channels), nn.Hardswish(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * channels, 5),
    )  # fmt: skip


EXAMPLE = {"x": torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(0))}


def _batch(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(step)
    return [rng.standard_normal((4, 3, 12, 12)).astype(np.float32), rng.integers(0, 5, 4)]


@pytest.mark.classic
def test_nchwc_variant_trains_like_the_portable_graph_and_pytorch(tmp_path):
    manifest = generate(_separable(), EXAMPLE, tmp_path / "a")
    assert manifest.variants == {"nchwc": "training_model.nchwc.onnx"}
    variant = onnx.load(tmp_path / "a" / manifest.variants["nchwc"], load_external_data=False).graph
    blocked = [n for n in variant.node if n.op_type == "Conv" and n.domain == NCHWC_DOMAIN]
    # the stem (read as NCHW), two depthwise and one full 3x3 forward, and the stride-1 ones' input gradients
    assert len(blocked) == 6
    shapes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*variant.input, *variant.value_info]
    }
    plain = [shapes[n.input[1]] for n in variant.node if n.op_type == "Conv" and n.domain == ""]
    assert plain == [[32, 16, 1, 1], [16, 32, 1, 1]]  # the pointwise Conv and its input gradient stay
    assert nchwc_block_size() in (8, 16)  # CI and this machine are x86: the variant is what a device here loads
    assert manifest.verification.passed
    checked = [r.item for r in manifest.verification.rows if r.item.startswith("training_model.nchwc.onnx: grad ")]
    assert len(checked) == len(manifest.trainable)  # every gradient of the variant compared with PyTorch's
    assert Trainer.load(tmp_path / "a")._engine.graph == "training_model.nchwc.onnx"

    plain, blocked_run = (OrtTraining(tmp_path / "a", graph=g) for g in (TRAINING_GRAPH, manifest.variants["nchwc"]))
    for step in range(3):
        losses = [s.train_step(_batch(step))[0] for s in (plain, blocked_run)]
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
        for s in (plain, blocked_run):
            s.optimizer_step()
            s.reset_grad()
    np.testing.assert_allclose(blocked_run.get_flat(), plain.get_flat(), rtol=1e-4, atol=1e-6)


@pytest.mark.classic
def test_the_portable_engine_loads_its_own_nchwc_variant_and_trains_like_the_plain_graph(tmp_path):
    """The portable graph gets the same rewrite (stock ORT has the NCHWc kernels on x86): the portable engine
    loads it here and trains like the portable graph without it, and like the classic engine."""
    from ondevice.engines.contract import PORTABLE_NCHWC, PORTABLE_TRAINING
    from ondevice.engines.portable import PortableEngine

    directory = tmp_path / "a"
    manifest = generate(_separable(), EXAMPLE, directory, verify=False)
    assert manifest.portable_variants == {"nchwc": PORTABLE_NCHWC}
    assert manifest.portable_step is None  # a whole step in one graph is for models without variants
    variant = onnx.load(directory / PORTABLE_NCHWC, load_external_data=False).graph
    assert len([n for n in variant.node if n.op_type == "Conv" and n.domain == NCHWC_DOMAIN]) == 6
    assert Trainer.load(directory, engine="portable")._engine.graph == PORTABLE_NCHWC

    checkpoint = directory / "checkpoint"
    runs = [PortableEngine(directory, manifest, checkpoint, graph=g) for g in (PORTABLE_TRAINING, PORTABLE_NCHWC)]
    runs.append(OrtTraining(directory, graph=manifest.variants["nchwc"]))
    for step in range(3):
        losses = [s.train_step(_batch(step))[0] for s in runs]
        np.testing.assert_allclose(losses[1:], [losses[0]] * 2, rtol=1e-5)
        for s in runs:
            s.optimizer_step()
            s.reset_grad()
    for other in runs[1:]:
        np.testing.assert_allclose(other.get_flat(), runs[0].get_flat(), rtol=1e-4, atol=1e-6)
    for run in runs[:2]:  # convolutional models keep ORT's default order (by priority they peaked 1.2-1.4x higher)
        sessions = [s for s in (run._train, run._eval, run._update) if s is not None]  # no update graph: the kernel
        assert {s.get_session_options().execution_order for s in sessions} == {ExecutionOrder.DEFAULT}


def test_channel_counts_no_block_divides_stay_portable(tmp_path):
    manifest = generate(_separable(channels=12), EXAMPLE, tmp_path / "a", verify=False)
    assert manifest.variants == manifest.portable_variants == {}
    assert not list((tmp_path / "a").glob("*nchwc*"))
    assert manifest.portable_step == "step_model.portable.onnx"  # small, no variant: whole steps fused


def test_a_bundle_carries_the_portable_graph_only(tmp_path):
    from mobile_bridge import make_bundle

    generate(_separable(), EXAMPLE, tmp_path / "a", verify=False)
    make_bundle(tmp_path / "a", tmp_path / "bundle")
    assert not list((tmp_path / "bundle").glob("*nchwc*"))
    bundled = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert bundled.get("variants", {}) == {}
    assert set(bundled["portable"]) == {"training", "optimizer"}


def test_portable_variants_are_graphs_only(digits_artifacts):
    """A manifest whose portable entry says why there are no portable graphs has no portable variants (a
    bundle keeps that reason; it drops only the variants)."""
    from dataclasses import replace

    manifest = Manifest.load(digits_artifacts)
    assert manifest.portable_variants == {}  # digits has no convolution
    assert replace(manifest, portable={"unsupported": "Foo (first in layer '0')"}).portable_variants == {}
    blocked = {"training": "t.onnx", "optimizer": "o.onnx", "nchwc": "v.onnx"}
    assert replace(manifest, portable=blocked).portable_variants == {"nchwc": "v.onnx"}


def test_a_variant_the_file_table_does_not_list_is_refused(tmp_path):
    generate(_separable(), EXAMPLE, tmp_path / "a", verify=False)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "a", copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["variants"]["nchwc"] = "elsewhere.onnx"
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"variants\['nchwc'\].*a file listed in files"):
        Manifest.load(copy)


def test_a_portable_variant_the_file_table_does_not_list_is_refused(tmp_path):
    generate(_separable(), EXAMPLE, tmp_path / "a", verify=False)
    data = json.loads((tmp_path / "a" / "manifest.json").read_text())
    data["portable"]["nchwc"] = "elsewhere.onnx"
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"portable\.nchwc.*a file listed in files"):
        Manifest.load(tmp_path / "a")


def test_the_probe_is_the_model_onnx_builds():
    from onnx import TensorProto, helper

    node = helper.make_node("ReorderInput", ["x"], ["y"], domain=NCHWC_DOMAIN)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 1, 1])
    graph = helper.make_graph([node], "nchwc_probe", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(NCHWC_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="odt", ir_version=8)
    assert model.SerializeToString() == _NCHWC_PROBE
