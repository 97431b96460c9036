"""The portable lowerings against ONNX Runtime's own training kernels, and both engines against each other."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from artifacts.passes.portable import FUNCTIONS, lower_accumulators, lower_operators, unportable
from benchmarks.compare import _batches
from benchmarks.models import cases
from ondevice import Trainer
from ondevice.engines.contract import FUSED_MAX
from ondevice.session import ort, session_options

RNG = np.random.default_rng(0)
F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def _normalized(x: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=axes, keepdims=True)
    return mean.astype(np.float32), (1 / np.sqrt(x.var(axis=axes, keepdims=True) + 1e-5)).astype(np.float32)


def _r(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _cases() -> list[tuple[str, dict, dict, int, dict]]:
    """(op, inputs by name in order, attributes, outputs, static shapes to declare) for ORT's training operators."""
    x = _r(4, 6, 8)
    ln_mean, ln_inv = _normalized(x, (2,))
    bn_x = _r(5, 3, 4, 4)
    bn_mean, bn_inv = _normalized(bn_x, (0, 2, 3))
    logits = _r(4, 7)
    mask = RNG.random((6, 5)) > 0.3
    rms_inv = (1 / np.sqrt((x * x).mean(axis=2, keepdims=True) + 1e-6)).astype(np.float32)
    log_probs = np.log(_softmax(_r(9, 7), 1))
    tokens = np.array([3, -100, 0, 6, 2, -100, 5, 1, 4], np.int64)
    return [
        ("DropoutGrad", {"dy": _r(6, 5), "mask": mask, "ratio": np.array(0.3, np.float32),
                         "training": np.array(True)}, {}, 1, {}),
        ("SoftmaxGrad_13", {"dy": _r(4, 7), "y": _softmax(logits, 1)}, {"axis": 1}, 1, {}),
        ("LogSoftmaxGrad_13", {"dy": _r(4, 7), "y": np.log(_softmax(logits, -1))}, {"axis": -1}, 1, {}),
        ("LayerNormalizationGrad", {"dy": _r(4, 6, 8), "x": x, "scale": _r(8), "mean": ln_mean, "inv": ln_inv},
         {"axis": -1}, 3, {"scale": [8], "mean": None, "inv": None}),  # statistics of unknown shape, as in a graph
        ("SimplifiedLayerNormalizationGrad", {"dy": _r(4, 6, 8), "x": x, "scale": _r(8), "inv": rms_inv},
         {"axis": -1, "epsilon": 1e-6}, 2, {"scale": [8], "inv": None}),
        ("QuickGeluGrad", {"dy": _r(3, 5), "x": 3 * _r(3, 5)}, {"alpha": 1.0}, 1, {}),
        ("QuickGeluGrad", {"dy": _r(3, 5), "x": 3 * _r(3, 5)}, {}, 1, {}),  # GELU's default alpha, 1.702
        ("SoftmaxCrossEntropyLossGrad", {"dy": np.array(0.7, np.float32), "log_prob": log_probs, "label": tokens},
         {"reduction": "mean", "ignore_index": -100}, 1, {}),  # a causal LM's token loss: prompt and padding ignored
        ("SoftmaxCrossEntropyLossGrad", {"dy": np.array(0.7, np.float32), "log_prob": log_probs, "label": tokens,
                                         "weight": np.abs(_r(7)) + 0.5},
         {"reduction": "mean", "ignore_index": -100}, 1, {}),
        ("SoftmaxCrossEntropyLossGrad", {"dy": np.array(1.3, np.float32), "log_prob": log_probs,
                                         "label": np.abs(tokens) % 7}, {"reduction": "sum"}, 1, {}),
        ("SoftmaxCrossEntropyLossGrad", {"dy": _r(9), "log_prob": log_probs, "label": tokens},
         {"reduction": "none", "ignore_index": -100}, 1, {}),
        # ONNX's own loss, which the training build runs as a kernel and stock ORT only as an inlined function
        ("SoftmaxCrossEntropyLoss", {"scores": _r(9, 7), "label": tokens}, {"reduction": "mean", "ignore_index": -100},
         2, {}),
        ("SoftmaxCrossEntropyLoss", {"scores": _r(9, 7), "label": tokens, "weight": np.abs(_r(7)) + 0.5},
         {"reduction": "mean", "ignore_index": -100}, 1, {}),
        ("SoftmaxCrossEntropyLoss", {"scores": _r(3, 7, 4), "label": np.array([[1, 0, 6, 2]] * 3, np.int64)},
         {"reduction": "sum"}, 2, {}),
        ("SoftmaxCrossEntropyLoss", {"scores": _r(9, 7), "label": tokens}, {"reduction": "none", "ignore_index": -100},
         1, {}),
        ("FastGeluGrad", {"dy": _r(3, 5), "x": 2 * _r(3, 5)}, {}, 1, {}),
        ("GatherGrad", {"shape": np.array([5, 4, 3], np.int64), "indices": np.array([[1, 4], [-1, 1]], np.int64),
                        "dy": _r(2, 2, 4, 3)}, {"axis": 0}, 1, {}),  # repeated and negative rows sum
        ("ConcatTraining", {"a": _r(2, 3), "b": _r(2, 5)}, {"axis": 1}, 2, {}),
        ("SplitTraining", {"x": _r(2, 8), "split": np.array([3, 5], np.int64)}, {"axis": 1}, 2, {}),
        ("SigmoidGrad", {"dy": _r(3, 4), "y": (1 / (1 + np.exp(-_r(3, 4)))).astype(np.float32)}, {}, 1, {}),
        ("TanhGrad", {"dy": _r(3, 4), "y": np.tanh(_r(3, 4))}, {}, 1, {}),
        ("Scale", {"x": _r(3, 4), "s": np.array(0.25, np.float32)}, {"scale_down": 1}, 1, {}),
        ("ReduceAllL2", {"a": _r(3, 4), "b": _r(5), "c": np.array(2.5, np.float32)}, {}, 1, {}),
        ("SliceGrad", {"dy": _r(2, 3, 3), "shape": np.array([2, 5, 4], np.int64), "starts": np.array([1, -3], np.int64),
                       "ends": np.array([4, 2**62], np.int64), "axes": np.array([1, -1], np.int64)}, {}, 1, {}),
        ("BatchNormInternal", {"x": bn_x, "scale": _r(3), "b": _r(3), "rm": _r(3), "rv": np.abs(_r(3)) + 1},
         {"epsilon": 1e-5, "momentum": 0.9, "training_mode": 1}, 5, {"x": [5, 3, 4, 4]}),
        ("BatchNormalizationGrad", {"dy": _r(5, 3, 4, 4), "x": bn_x, "scale": _r(3), "mean": bn_mean.ravel(),
                                    "inv": bn_inv.ravel()}, {"epsilon": 1e-5}, 3, {"x": [5, 3, 4, 4]}),
        ("ConvGrad", {"dy": _r(2, 4, 4, 4), "x": _r(2, 3, 9, 9), "w": _r(4, 3, 3, 3)},
         {"strides": [2, 2], "pads": [1, 0, 0, 1], "kernel_shape": [3, 3], "group": 1}, 3,
         {"x": [2, 3, 9, 9], "w": [4, 3, 3, 3]}),
        # 16 input channels and more: dW by channels-last windows, one product per kernel offset
        ("ConvGrad", {"dy": _r(2, 4, 9, 9), "x": _r(2, 16, 9, 9), "w": _r(4, 16, 3, 3)},
         {"strides": [1, 1], "pads": [1, 1, 1, 1], "kernel_shape": [3, 3], "group": 1}, 3,
         {"x": [2, 16, 9, 9], "w": [4, 16, 3, 3]}),
        ("ConvGrad", {"dy": _r(2, 4, 3, 4), "x": _r(2, 16, 9, 10), "w": _r(4, 16, 3, 2)},
         {"strides": [2, 3], "pads": [1, 0, 0, 1], "dilations": [2, 1], "kernel_shape": [3, 2], "group": 1}, 3,
         {"x": [2, 16, 9, 10], "w": [4, 16, 3, 2]}),
        # depthwise at stride 1: dW by windows; strided (below): by a grouped convolution
        ("ConvGrad", {"dy": _r(2, 6, 9, 8), "x": _r(2, 6, 9, 9), "w": _r(6, 1, 3, 2)},
         {"strides": [1, 1], "pads": [1, 0, 1, 1], "dilations": [1, 2], "kernel_shape": [3, 2], "group": 6}, 3,
         {"x": [2, 6, 9, 9], "w": [6, 1, 3, 2]}),
        ("ConvGrad", {"dy": _r(2, 6, 5, 5), "x": _r(2, 6, 9, 9), "w": _r(6, 1, 3, 3)},
         {"strides": [2, 2], "pads": [1, 1, 1, 1], "kernel_shape": [3, 3], "group": 6}, 3,
         {"x": [2, 6, 9, 9], "w": [6, 1, 3, 3]}),
        ("ConvGrad", {"dy": _r(2, 6, 3, 3), "x": _r(2, 6, 10, 11), "w": _r(6, 1, 3, 3)},
         {"strides": [3, 3], "pads": [0, 1, 2, 1], "dilations": [2, 2], "kernel_shape": [3, 3], "group": 6}, 3,
         {"x": [2, 6, 10, 11], "w": [6, 1, 3, 3]}),
        # fewer than 16 input channels: im2col, strided windows from the input's phases (stride x stride blocks)
        ("ConvGrad", {"dy": _r(2, 4, 4, 4), "x": _r(2, 3, 9, 9), "w": _r(4, 3, 3, 3)},
         {"strides": [2, 2], "pads": [1, 1, 1, 1], "dilations": [2, 2], "kernel_shape": [3, 3], "group": 1}, 3,
         {"x": [2, 3, 9, 9], "w": [4, 3, 3, 3]}),
    ]  # fmt: skip


def _one_node(op: str, inputs: dict, attrs: dict, outputs: int, shapes: dict, unread: tuple[int, ...] = ()):
    types = {np.dtype(np.float32): F, np.dtype(np.int64): I64, np.dtype(np.bool_): BOOL}
    values = [helper.make_tensor_value_info(n, types[a.dtype], shapes.get(n, list(a.shape))) for n, a in inputs.items()]
    names = ["" if i in unread else f"out{i}" for i in range(outputs)]
    domain = "" if op in FUNCTIONS else "com.microsoft"
    node = helper.make_node(op, list(inputs), names, domain=domain, **attrs)
    results = [helper.make_tensor_value_info(n, I64 if (op, n) == ("ConcatTraining", "out1") else F, None)
               for n in names if n]  # fmt: skip
    graph = helper.make_graph([node], op, values, results)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("case", _cases(), ids=lambda case: case[0])
@pytest.mark.classic
def test_each_lowering_matches_orts_training_kernel(case):
    op, inputs, attrs, outputs, shapes = case
    expected = _run(_one_node(op, inputs, attrs, outputs, shapes), inputs)  # ORT 1.19.2's training kernel
    # BatchNorm's running statistics stay unread (odt's graphs update them from the saved statistics);
    # ORT's kernel writes them regardless, so only its reference run has them
    unread = (1, 2) if op == "BatchNormInternal" else ()
    expected = [value for index, value in enumerate(expected) if index not in unread]
    lowered = _one_node(op, inputs, attrs, outputs, shapes, unread)
    assert lower_operators(lowered, 17) == [op]
    assert not unportable(lowered), [n.op_type for n in unportable(lowered)]
    assert not {n.op_type for n in lowered.graph.node} & FUNCTIONS
    found = _run(lowered, inputs)
    assert len(found) == len(expected)
    for index, (want, got) in enumerate(zip(expected, found)):
        scale = float(np.abs(want).max()) if want.size else 1.0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale, err_msg=f"{op} output {index}")


_RUN_AT_ONCE = {"SoftmaxCrossEntropyLossGrad", "LogSoftmaxGrad_13",  # read the forward's last output
                "GatherGrad", "SliceGrad",  # shape arithmetic
                "BatchNormalizationGrad", "ConvGrad"}  # convolutional models keep ORT's default order  # fmt: skip
"""Gradient lowerings whose arithmetic on saved activations alone is not made to wait for the gradient."""


@pytest.mark.parametrize("case", [c for c in _cases() if c[0].removesuffix("_13").endswith("Grad")],
                         ids=lambda case: case[0])  # fmt: skip
def test_a_gradient_lowering_computes_nothing_before_its_gradient_exists(case):
    """The portable step runs by ORT's priority order, which runs a node as soon as its inputs exist: arithmetic
    on the saved activations alone (SiLU's sigmoid, a norm's x * inv_std, a dropout mask as floats) would run in
    the forward and keep new activation-sized tensors until the backward (SmolLM2's step: 377 -> 367 MiB).
    Every lowered node that reads an activation reads the gradient or something computed from it."""
    op, inputs, attrs, outputs, shapes = case
    model = _one_node(op, inputs, attrs, outputs, shapes)
    gradient = model.graph.node[0].input[0]
    assert lower_operators(model, 17) == [op]
    constants = {i.name for i in model.graph.initializer}
    after = {gradient}
    early = []
    for node in model.graph.node:
        if after.intersection(node.input):
            after.update(node.output)
        elif any(name and name not in constants for name in node.input):
            early.append(node.op_type)
    assert bool(early) == (op in _RUN_AT_ONCE), early


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.classic
def test_a_dropout_gradient_with_a_constant_rate_and_mode_folds_them(training):
    """The exported model's ratio and training mode are constants: the lowering folds the mode (nothing reads it)
    and divides by 1 - ratio computed from the ratio (one Sub reads it), and gives what it gives with them as inputs,
    bit for bit (in training mode, the kernel's values too). Verification's dropout-free twin zeroes the ratio: the
    gradient then passes unscaled, as the twin's forward does."""
    rng = np.random.default_rng(3)
    inputs = {"dy": rng.standard_normal((6, 5)).astype(np.float32), "mask": rng.random((6, 5)) > 0.3}
    constants = {"ratio": np.array(0.3, np.float32), "training": np.array(training)}
    fed = _one_node("DropoutGrad", {**inputs, **constants}, {}, 1, {})
    kernel = _run(fed, {**inputs, **constants})[0]
    assert lower_operators(fed, 17) == ["DropoutGrad"]
    folded = _one_node("DropoutGrad", {**inputs, **constants}, {}, 1, {})
    kept = [i for i in folded.graph.input if i.name in inputs]
    del folded.graph.input[:]
    folded.graph.input.extend(kept)
    folded.graph.initializer.extend(onnx.numpy_helper.from_array(v, n) for n, v in constants.items())
    assert lower_operators(folded, 17) == ["DropoutGrad"]
    assert not [n.op_type for n in folded.graph.node if "training" in n.input]
    assert [n.op_type for n in folded.graph.node if "ratio" in n.input] == (["Sub"] if training else [])
    np.testing.assert_array_equal(_run(folded, inputs)[0], _run(fed, {**inputs, **constants})[0])
    if training:
        np.testing.assert_array_equal(_run(folded, inputs)[0], kernel)
        ratio = next(t for t in folded.graph.initializer if t.name == "ratio")
        ratio.CopyFrom(onnx.numpy_helper.from_array(np.array(0.0, np.float32), "ratio"))  # the dropout-free twin
        np.testing.assert_array_equal(_run(folded, inputs)[0], np.where(inputs["mask"], inputs["dy"], 0))


def test_batchnorm_with_its_running_statistics_read_is_left_for_the_error():
    op, inputs, attrs, outputs, shapes = next(c for c in _cases() if c[0] == "BatchNormInternal")
    model = _one_node(op, inputs, attrs, outputs, shapes)  # outputs 1 and 2 are graph outputs: read
    assert lower_operators(model, 17) == []
    assert [n.op_type for n in unportable(model)] == ["BatchNormInternal"]


@pytest.mark.parametrize("parameters", ["trained", "shared", "frozen"])
def test_two_lowered_batchnorms_keep_their_own_statistics_run_after_run(parameters):
    """Stock ORT's training-mode BatchNormalization writes its statistics over the tensors it reads them from: two
    lowered BatchNorms of one width that read one constant overwrote each other's saved mean (the first node's was
    off by 2.7 in the first run of this graph, the second's by 0.29 in the second run). Trained parameters of
    their own get ONNX's kernel; shared (one module applied twice) or frozen ones the lowering's own arithmetic."""
    x = _r(4, 3, 5, 5) + 3
    second = ("s1", "b1") if parameters == "shared" else ("s2", "b2")
    nodes = [helper.make_node("BatchNormInternal", ["x", "s1", "b1", "rm", "rv"], ["y1", "", "", "m1", "i1"],
                              domain="com.microsoft", epsilon=1e-5, momentum=0.9, training_mode=1),
             helper.make_node("Relu", ["y1"], ["r"]),
             helper.make_node("BatchNormInternal", ["r", *second, "rm", "rv"], ["y2", "", "", "m2", "i2"],
                              domain="com.microsoft", epsilon=1e-5, momentum=0.9, training_mode=1)]  # fmt: skip
    values = {"s1": _r(3), "b1": _r(3), "s2": _r(3), "b2": _r(3), "rm": _r(3), "rv": np.abs(_r(3)) + 1}
    constant = {"rm", "rv"} | ({"s1", "b1", "s2", "b2"} if parameters == "frozen" else set())
    feeds = {"x": x, **{n: v for n, v in values.items() if n not in constant}}
    inputs = [helper.make_tensor_value_info(n, F, list(v.shape)) for n, v in feeds.items()]
    graph = helper.make_graph(nodes, "two", inputs,
                              [helper.make_tensor_value_info(n, F, None) for n in ("y2", "m1", "i1", "m2", "i2")],
                              [onnx.numpy_helper.from_array(values[n], n) for n in sorted(constant)])  # fmt: skip
    graph.value_info.append(helper.make_tensor_value_info("r", F, list(x.shape)))
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    assert lower_operators(model, 17) == ["BatchNormInternal"] * 2
    kernels = [n for n in model.graph.node if n.op_type == "BatchNormalization"]  # ONNX's own, in training mode
    assert len(kernels) == (2 if parameters == "trained" else 0)

    def statistics(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = t.astype(np.float64)
        return t.mean((0, 2, 3)), 1 / np.sqrt(t.var((0, 2, 3)) + 1e-5)

    mean1, inv1 = statistics(x)
    shape = (1, 3, 1, 1)
    r = np.maximum((x - mean1.reshape(shape)) * inv1.reshape(shape) * values["s1"].reshape(shape)
                   + values["b1"].reshape(shape), 0)  # fmt: skip
    mean2, inv2 = statistics(r)
    session = ort.InferenceSession(model.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])
    for _ in range(2):  # the second run reads whatever the first left in the tensors
        _, m1, i1, m2, i2 = session.run(None, feeds)
        for got, want in ((m1, mean1), (i1, inv1), (m2, mean2), (i2, inv2)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_accumulators_become_gradient_outputs(digits_artifacts):
    model = onnx.load(digits_artifacts / "training_model.onnx", load_external_data=False)
    before = {i.name for i in model.graph.input}
    parameters = lower_accumulators(model)
    trainable = [p.name for p in Trainer.load(digits_artifacts).manifest.trainable]
    assert parameters == trainable
    inputs = {i.name for i in model.graph.input}
    assert {f"{p}_grad.accumulation.buffer" for p in trainable} | {"lazy_reset_grad"} == before - inputs
    assert [o.name for o in model.graph.output][-len(trainable) :] == [f"{p}_grad" for p in trainable]
    assert not any(n.op_type == "InPlaceAccumulatorV2" for n in model.graph.node)


@pytest.mark.classic
def test_portable_step_equals_the_classic_engine_step_for_step(digits_artifacts, digits_data):
    """Dropout on (same seeds): the digits model's losses and weights agree bit for bit or within rounding."""
    train = {k: v[:256] for k, v in digits_data["train"].items()}
    histories, weights = {}, {}
    for engine in ("classic", "portable"):
        trainer = Trainer.load(digits_artifacts, engine=engine)
        assert trainer.engine == engine
        losses = []
        for start in range(0, 256, 32):
            losses.append(trainer.train_step({k: v[start : start + 32] for k, v in train.items()}).loss)
        histories[engine], weights[engine] = losses, trainer.get_flat_weights()
    np.testing.assert_allclose(histories["portable"], histories["classic"], rtol=1e-6)
    np.testing.assert_allclose(weights["portable"], weights["classic"], atol=1e-6)


def _without_dropout(build):  # type: ignore[no-untyped-def]
    def built():  # type: ignore[no-untyped-def]
        model = build()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        return model

    return built


BENCHMARK_MODELS = [case.name for case in cases()]


@pytest.mark.classic
@pytest.mark.slow
@pytest.mark.parametrize("name", BENCHMARK_MODELS)
def test_every_benchmark_model_trains_alike_on_both_engines(name, tmp_path):
    """50 steps from one checkpoint with dropout off: the first 10 losses within 1e-5 relative, and all 50
    within 1e-5 relative or 5e-5 of the first loss. The engines' roundings differ, and training amplifies
    the difference while the loss falls fast, then shrinks it as the runs converge: MiniLM's last two
    layers differ by 1.4e-7 relative at step 9, by 6.5e-5 at a loss of 1.0 at step 19 (1.9e-5 of the
    first loss, on an Intel Xeon; 1.5e-5 at a loss of 0.15 on an AMD EPYC) and by 4.5e-8 at step 48. The
    BatchNorm statistics the first step updates agree too (later ones drift apart by design: a convolution's
    bias before a BatchNorm has a gradient of rounding noise, which AdamW scales to whole steps of the rate)."""
    from artifacts import AdamW, Lora, generate

    case = next(c for c in cases() if c.name == name)
    case = dataclasses.replace(case, batch=min(case.batch, 8), build=_without_dropout(case.build))
    lora = Lora(**case.lora) if case.lora else None
    manifest = generate(case.build(), case.inputs(case.batch), tmp_path / "art", trainable=case.trainable,
                        optimizer=AdamW(), lora=lora, verify=False)  # fmt: skip
    assert manifest.engines == ("classic", "portable"), manifest.portable
    # small models without an NCHWc variant run whole steps as one graph (tested equal in test_engines)
    small = manifest.trainable_size <= FUSED_MAX and not manifest.portable_variants
    assert (manifest.portable_step is not None) == small
    batches = _batches(case, 5)
    losses, buffers = {}, {}
    for engine in ("classic", "portable"):
        trainer = Trainer.load(tmp_path / "art", engine=engine, threads=2)
        losses[engine] = [trainer.train_step(batches[0]).loss]
        buffers[engine] = trainer.get_buffers()
        losses[engine] += [trainer.train_step(batches[step % 5]).loss for step in range(1, 50)]
    first = abs(losses["classic"][0])
    np.testing.assert_allclose(losses["portable"][:10], losses["classic"][:10], rtol=1e-5)
    np.testing.assert_allclose(losses["portable"], losses["classic"], rtol=1e-5, atol=5e-5 * first)
    for key, value in buffers["classic"].items():
        np.testing.assert_allclose(buffers["portable"][key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_shape_inference_without_the_weights_finds_what_inference_with_them_finds():
    """The passes infer shapes on the graph with each large initializer's values left out (SmolLM2's weights were
    copied three times per inference). A Reshape's target is read by value, so small constants stay."""
    from onnx import numpy_helper

    from artifacts.passes._nodes import inferred_graph

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((64, 96), np.float32), "w"),
               numpy_helper.from_array(rng.standard_normal((1000, 64), np.float32), "table"),
               numpy_helper.from_array(np.array([0, 8, 12], np.int64), "target")]  # fmt: skip
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"]),
             helper.make_node("MatMul", ["rows", "w"], ["h"]),
             helper.make_node("Reshape", ["h", "target"], ["heads"]),
             helper.make_node("Transpose", ["heads"], ["out"], perm=[1, 0, 2])]  # fmt: skip
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], weights)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()

    def shapes(inferred: onnx.GraphProto) -> dict[str, list]:
        return {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
                for v in (*inferred.value_info, *inferred.output)}  # fmt: skip

    light = inferred_graph(model)
    assert shapes(light) == shapes(onnx.shape_inference.infer_shapes(model).graph)
    assert shapes(light)["heads"] == ["batch", 8, 12] and shapes(light)["out"] == [8, "batch", 12]
    carried = {t.name: t.ByteSize() for t in light.initializer}
    assert carried["w"] < 64 and carried["table"] < 64  # name, type and dims only
    assert model.SerializeToString() == before  # the model itself is left as it was
