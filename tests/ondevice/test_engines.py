"""The engine contract: the classic and the portable engine train, save, resume and export alike."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from ondevice import ConfigError, EngineError, OndeviceError, Predictor, Trainer
from ondevice._checkpoint import read_header
from ondevice.engines.classic import OrtTraining
from ondevice.engines.portable import adamw_rates
from ondevice.manifest import MANIFEST_NAME
from ondevice.ort_checkpoint import CheckpointFormatError, read_checkpoint, write_checkpoint

ENGINES = ("classic", "portable")


def _part(data, start, stop):
    return {k: v[start:stop] for k, v in data.items()}


@pytest.fixture(scope="module")
def clipped_artifacts(tmp_path_factory):
    """Digits without dropout, AdamW with weight decay and gradient clipping that binds."""
    import torch

    from artifacts import AdamW, generate
    from samples.digits.model import build

    model = build()
    model[2].p = 0.0
    out = tmp_path_factory.mktemp("clipped") / "artifacts"
    generate(model, {"input": torch.randn(32, 64)}, out, optimizer=AdamW(lr=3e-3, weight_decay=0.05, max_grad_norm=0.3))
    return out


@pytest.mark.parametrize("fixture", ["clipped_artifacts", "digits_sgd"])
@pytest.mark.classic
def test_engines_fit_alike_with_accumulation_clipping_decay_and_sgd(fixture, request, digits_data):
    directory = request.getfixturevalue(fixture)
    train = _part(digits_data["train"], 0, 320)
    results = {}
    for engine in ENGINES:
        trainer = Trainer.load(directory, engine=engine)
        history = trainer.fit(train, epochs=2, batch_size=16, accumulate=2, progress=False)
        results[engine] = ([e["loss"] for e in history.epochs], trainer.get_flat_weights(), trainer.step)
    (classic_loss, classic_w, classic_steps), (portable_loss, portable_w, portable_steps) = results.values()
    assert classic_steps == portable_steps == 20
    np.testing.assert_allclose(portable_loss, classic_loss, rtol=1e-6)
    np.testing.assert_allclose(portable_w, classic_w, atol=2e-6)


@pytest.mark.classic
def test_batches_of_every_size_train_and_evaluate_alike(digits_no_dropout, digits_data):
    """A last batch smaller than the others (and evaluation in batches of another size) on both engines."""
    directory, _ = digits_no_dropout
    train, test = _part(digits_data["train"], 0, 100), _part(digits_data["test"], 0, 70)
    results = {}
    for engine in ENGINES:
        trainer = Trainer.load(directory, engine=engine)
        history = trainer.fit(train, epochs=2, batch_size=32, progress=False)  # 32, 32, 32, 4
        results[engine] = ([e["loss"] for e in history.epochs], trainer.evaluate(test, batch_size=32)["loss"],
                           trainer.eval_step(_part(test, 0, 5)).loss)  # fmt: skip
    np.testing.assert_allclose(results["portable"][0], results["classic"][0], rtol=1e-6)
    assert results["portable"][1:] == pytest.approx(results["classic"][1:], rel=1e-6)


@pytest.mark.classic
def test_a_steps_outputs_stay_the_callers_when_later_steps_run(digits_no_dropout, digits_data):
    """The portable engine keeps its fetches in arrays bound once per batch shape: what a step returned must
    not change under the next steps (of the same or another size), and equals the classic engine's."""
    directory, _ = digits_no_dropout
    sizes = (32, 32, 32, 7, 32, 32)
    results = {}
    for engine in ENGINES:
        trainer = Trainer.load(directory, engine=engine)
        steps, start = [], 0
        for size in sizes:
            result = trainer.train_step(_part(digits_data["train"], start, start + size))
            steps.append((result, {k: v.copy() for k, v in result.outputs.items()}))
            start += size
        for result, outputs in steps:
            assert result.outputs.keys() == outputs.keys()
            for name, value in outputs.items():
                np.testing.assert_array_equal(result.outputs[name], value)
        results[engine] = steps
    for (classic, _), (portable, _) in zip(results["classic"], results["portable"]):
        assert portable.loss == pytest.approx(classic.loss, rel=1e-6)
        assert portable.outputs.keys() == classic.outputs.keys() and classic.outputs
        for name in classic.outputs:
            np.testing.assert_allclose(portable.outputs[name], classic.outputs[name], rtol=1e-5, atol=1e-6)


def test_accumulated_micro_batches_equal_one_large_batch_on_the_portable_engine(digits_no_dropout, digits_data):
    directory, _ = digits_no_dropout
    batch = _part(digits_data["train"], 0, 32)
    whole = Trainer.load(directory, engine="portable")
    whole.fit(batch, epochs=1, batch_size=32, shuffle=False, progress=False)
    parts = Trainer.load(directory, engine="portable")
    parts.fit(batch, epochs=1, batch_size=8, accumulate=4, shuffle=False, progress=False)
    assert whole.step == parts.step == 1
    np.testing.assert_allclose(parts.get_flat_weights(), whole.get_flat_weights(), atol=1e-6)


@pytest.mark.parametrize("fixture, sliced", [("digits_no_dropout", True), ("clipped_artifacts", False)])
def test_the_update_runs_in_slices_that_equal_one_run_over_the_whole_vectors(fixture, sliced, request, digits_data,
                                                                             monkeypatch):
    """An element-wise optimizer graph runs over consecutive slices of the flat vectors (to stay in the cache)
    with the parameters and moments of one run over the whole vectors, bit for bit; a clipping graph reads
    every gradient's norm, so it keeps one run. (The update graph: where the update kernel is not built.)"""
    from ondevice.engines import portable, update_kernel

    monkeypatch.setenv(update_kernel.ENV, "0")

    directory = request.getfixturevalue(fixture)
    directory = directory[0] if isinstance(directory, tuple) else directory
    batch = _part(digits_data["train"], 0, 32)
    runs, default = {}, portable.SLICE
    for size in (default, 1000):
        monkeypatch.setattr(portable, "SLICE", size)
        trainer = Trainer.load(directory, engine="portable")
        trainer.fit(batch, epochs=3, batch_size=16, accumulate=2, shuffle=False, progress=False)  # not fused
        engine = trainer._engine
        runs[size] = (len(engine._update_bindings), trainer.get_flat_weights(),
                      engine._flat["momentum0"].copy(), engine._flat["momentum1"].copy())  # fmt: skip
    size = runs[1000][1].size
    assert size > 4000  # digits: several slices of 1000
    assert [runs[default][0], runs[1000][0]] == ([1, -(-size // 1000)] if sliced else [1, 1])
    for whole, parts in zip(runs[default][1:], runs[1000][1:]):
        np.testing.assert_array_equal(parts, whole)


def _without_fused_step(directory, out):
    """A copy of ``directory`` whose manifest does not name the fused step graph."""
    from dataclasses import replace

    from ondevice.manifest import Manifest

    shutil.copytree(directory, out)
    manifest = Manifest.load(out)
    replace(manifest, portable={k: v for k, v in manifest.portable.items() if k != "step"}).save(out)
    return out


@pytest.mark.parametrize("fixture", ["digits_artifacts", "clipped_artifacts", "digits_sgd"])
def test_the_fused_step_and_the_update_kernel_train_as_the_training_and_optimizer_graphs_do(fixture, request,
                                                                                          digits_data, tmp_path,
                                                                                          monkeypatch):  # fmt: skip
    """Where the update kernel is not built, small models' whole steps run as one graph; where it is, the
    training graph and the kernel. Both give the losses and weights of the two graphs, bit for bit (with
    clipping the kernel's norm may differ in its last bit), through dropout, clipping, SGD, a rate change, a
    step that is not finite (skipped, state untouched) and accumulated micro-batches."""
    import onnx

    from ondevice.engines import update_kernel
    from ondevice.engines.contract import OPTIMIZER_STATE
    from ondevice.manifest import Manifest

    directory = request.getfixturevalue(fixture)
    manifest = Manifest.load(directory)
    assert manifest.portable_step == "step_model.portable.onnx"
    step, update = (onnx.load(directory / name).graph for name in (manifest.portable_step, manifest.portable_files[1]))
    read = {i for node in step.node for i in node.input} | {o.name for o in step.output}
    assert all(any(o in read for o in node.output) for node in step.node)  # the old finite check's nodes went
    fed = {i.name for i in update.input} - set(OPTIMIZER_STATE[:2])
    assert fed <= {i.name for i in step.input}  # the update's inputs stay the step's, read or not
    batches = [_part(digits_data["train"], 16 * k, 16 * k + 16) for k in range(6)]
    batches[3] = {**batches[3], "input": batches[3]["input"] * np.float32(1e38)}  # overflows: not finite
    runs = {}
    copy = _without_fused_step(directory, tmp_path / "copy")
    for kind, source, graph in (("fused", directory, True), ("two graphs", copy, True), ("kernel", directory, False)):
        monkeypatch.setenv(update_kernel.ENV, "0" if graph else "1")
        trainer = Trainer.load(source, engine="portable")
        assert trainer.update == ("graph" if graph else "kernel")
        losses, applied = [], []
        for k, batch in enumerate(batches):
            if k == 4:
                trainer.set_lr(trainer.lr * 0.5)
            result = trainer.train_step(batch)
            losses.append(result.loss)
            applied.append(result.applied)
            gradient = trainer._engine.gradient_view(trainer.manifest.trainable[0].name)
            assert (not gradient.any()) == (kind == "fused")  # the fused step keeps gradients inside
        history = trainer.fit(_part(digits_data["train"], 0, 64), epochs=1, batch_size=16, accumulate=2,
                              shuffle=False, progress=False)  # fmt: skip
        runs[kind] = (losses + [history.last()["loss"]], applied, trainer.get_flat_weights(), trainer.step,
                      trainer.skipped_steps, trainer._engine._flat["momentum1"].copy())  # fmt: skip
    fused, two, kernel = runs["fused"], runs["two graphs"], runs["kernel"]
    assert fused[1] == two[1] == kernel[1] == [True, True, True, False, True, True]
    assert fused[3:5] == two[3:5] == kernel[3:5] == (7, 1)
    for index in (0, 2, 5):
        np.testing.assert_array_equal(fused[index], two[index])
        if fixture == "clipped_artifacts":
            np.testing.assert_allclose(kernel[index], two[index], rtol=1e-5, atol=1e-7)
        else:
            np.testing.assert_array_equal(kernel[index], two[index])


@pytest.mark.classic
def test_the_portable_engine_runs_models_without_convolutions_by_priority(digits_no_dropout, digits_data, monkeypatch):
    """ORT's default order kept activations alive through the forward for the gradient's Shape nodes (a
    transformer's step peaked 1.1-1.3x higher): models without convolution kernels run by priority, in every
    session, and train as the classic engine does. The sessions a step runs spin between kernels, and the
    update runs on the caller's thread (two spinning pools taking turns slowed steps up to 1.7x)."""
    from ondevice.engines import update_kernel
    from ondevice.session import ort

    directory, _ = digits_no_dropout
    kernel = Trainer.load(directory, engine="portable", threads=2)._engine
    assert kernel.update == "kernel" and kernel._fused is None and kernel._update is None  # no update graph
    monkeypatch.setenv(update_kernel.ENV, "0")
    trainer = Trainer.load(directory, engine="portable", threads=2)
    engine = trainer._engine
    engine._train_binding(True)  # opens the training graph's session too (a fused step does not need it)
    sessions = (engine._fused, engine._train, engine._eval, engine._update)
    assert {s.get_session_options().execution_order for s in sessions} == {ort.ExecutionOrder.PRIORITY_BASED}
    spins = [s.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") for s in sessions]
    assert spins == ["1", "1", "0", "0"]
    assert [s.get_session_options().intra_op_num_threads for s in sessions] == [2, 2, 2, 1]
    classic = Trainer.load(directory, engine="classic")
    batch = _part(digits_data["train"], 0, 32)
    for _ in range(3):
        assert trainer.train_step(batch).loss == pytest.approx(classic.train_step(batch).loss, rel=1e-6)


def test_adamw_rates_follow_orts_float32_formula():
    lr, corrected, decay = adamw_rates(1e-3, 3, (0.9, 0.999), 0.01)
    one = np.float32(1)
    alpha = one - np.float32(np.float64(np.float32(0.9)) ** 3)
    beta = one - np.float32(np.float64(np.float32(0.999)) ** 3)
    assert corrected == float(np.float32(1e-3) * (np.sqrt(beta) / alpha))
    assert decay == float(np.float32(1e-3) * np.float32(0.01)) and lr == float(np.float32(1e-3))


@pytest.mark.parametrize("first, second", [("classic", "portable"), ("portable", "classic")])
@pytest.mark.classic
def test_a_checkpoint_crosses_engines_bit_for_bit(first, second, clipped_artifacts, digits_data, tmp_path):
    train = _part(digits_data["train"], 0, 96)
    trainer = Trainer.load(clipped_artifacts, engine=first)
    trainer.fit(train, epochs=1, batch_size=32, progress=False, checkpoint=tmp_path / "a.ckpt")
    assert read_header(tmp_path / "a.ckpt")["engine"] == first
    resumed = Trainer.load(clipped_artifacts, engine=second, checkpoint=tmp_path / "a.ckpt")
    assert (resumed.engine, resumed.epoch, resumed.step) == (second, 1, 3)
    resumed.save(tmp_path / "b.ckpt")
    saved = [read_checkpoint(_payload(tmp_path / name)) for name in ("a.ckpt", "b.ckpt")]
    for name, value in saved[0].trainable.items():
        assert np.array_equal(saved[1].trainable[name], value), name
        for a, b in zip(saved[0].momentums[name], saved[1].momentums[name], strict=True):
            assert np.array_equal(a, b), name
    assert saved[0].step == saved[1].step == 3
    assert {k: v for k, v in saved[1].properties.items() if k != "odt.engine"} == saved[0].properties
    # and both continue with the same step
    again = Trainer.load(clipped_artifacts, engine=first, checkpoint=tmp_path / "a.ckpt")
    batch = _part(train, 0, 32)
    assert resumed.train_step(batch).loss == pytest.approx(again.train_step(batch).loss, rel=1e-6)
    np.testing.assert_allclose(resumed.get_flat_weights(), again.get_flat_weights(), atol=1e-7)


def _payload(path):
    header = read_header(path)
    return path.read_bytes()[header["payload_offset"] :]


@pytest.mark.classic
def test_orts_checkpoint_format_round_trips_through_the_portable_writer(clipped_artifacts, digits_data, tmp_path):
    trainer = Trainer.load(clipped_artifacts, engine="classic")
    trainer.fit(_part(digits_data["train"], 0, 64), epochs=1, batch_size=32, progress=False)
    trainer.save(tmp_path / "c.ckpt")
    original = _payload(tmp_path / "c.ckpt")  # written by ORT's own SaveCheckpoint
    parsed = read_checkpoint(original)
    rewritten = write_checkpoint(parsed)
    again = read_checkpoint(rewritten)
    assert again.properties == parsed.properties and again.step == parsed.step == 2
    (tmp_path / "raw").write_bytes(rewritten)
    loaded = OrtTraining(clipped_artifacts, checkpoint=tmp_path / "raw")  # ORT's own reader takes ours
    for name in parsed.trainable:
        assert np.array_equal(again.trainable[name], parsed.trainable[name])
        assert np.array_equal(loaded.get_parameter(name), parsed.trainable[name])
        assert all(np.array_equal(a, b) for a, b in zip(again.momentums[name], parsed.momentums[name], strict=True))


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[:20],  # truncated inside the root table
        lambda raw: raw[:4] + b"NOPE" + raw[8:],  # another file identifier
        lambda raw: raw[: len(raw) // 2],  # half a file
        lambda raw: b"\xff" * 64,  # garbage
    ],
)
def test_a_damaged_flatbuffer_is_a_typed_error(damage, digits_artifacts):
    raw = (digits_artifacts / "checkpoint").read_bytes()
    with pytest.raises(CheckpointFormatError):
        read_checkpoint(damage(raw))


@pytest.mark.classic
def test_engine_choice_is_checked_and_explained(digits_artifacts, tmp_path):
    with pytest.raises(ConfigError, match="engine must be one of auto, classic, portable"):
        Trainer.load(digits_artifacts, engine="gpu")
    old = tmp_path / "old"
    shutil.copytree(digits_artifacts, old)
    data = json.loads((old / MANIFEST_NAME).read_text())
    for name in data.pop("portable").values():
        data["files"].pop(name)
        (old / name).unlink()
    (old / MANIFEST_NAME).write_text(json.dumps(data))  # as artifacts made before the portable engine
    with pytest.raises(EngineError, match="no portable graphs .generated before the portable engine.*odt generate"):
        Trainer.load(old, engine="portable")
    assert Trainer.load(old).engine == "classic"  # auto: this environment has the training build


def test_a_checkpoint_the_portable_engine_cannot_parse_is_a_checkpoint_error(digits_artifacts, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(digits_artifacts, broken)
    data = json.loads((broken / MANIFEST_NAME).read_text())
    (broken / "checkpoint").write_bytes(b"\x00" * 32)
    from ondevice.files import sha256_file

    data["files"]["checkpoint"] = sha256_file(broken / "checkpoint")
    (broken / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(OndeviceError, match="cannot load the artifacts in .*not an ONNX Runtime training checkpoint"):
        Trainer.load(broken, engine="portable")


@pytest.mark.classic
def test_exports_of_both_engines_predict_alike(digits_no_dropout, digits_data, tmp_path):
    directory, _ = digits_no_dropout
    test = _part(digits_data["test"], 0, 50)
    predictions = {}
    for engine in ENGINES:
        trainer = Trainer.load(directory, engine=engine)
        trainer.fit(_part(digits_data["train"], 0, 64), epochs=1, batch_size=32, progress=False)
        trainer.export(tmp_path / f"{engine}.onnx")
        predictions[engine] = Predictor(tmp_path / f"{engine}.onnx").predict({"input": test["input"]})["output"]
    np.testing.assert_allclose(predictions["portable"], predictions["classic"], atol=1e-5)


def test_two_onnx_runtime_distributions_are_refused_in_one_line(tmp_path):
    from types import SimpleNamespace

    from ondevice.session import _check_distributions

    package = SimpleNamespace(__file__=str(tmp_path / "onnxruntime" / "__init__.py"))
    (tmp_path / "onnxruntime_training-1.19.2.dist-info").mkdir()
    _check_distributions(package)  # one: fine
    (tmp_path / "onnxruntime-1.32.0.dist-info").mkdir()
    with pytest.raises(EngineError, match="two ONNX Runtime distributions are installed .onnxruntime, onnxruntime_"):
        _check_distributions(package)
