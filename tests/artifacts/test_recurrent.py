"""LSTM/GRU/RNN unrolled into gates ORT 1.19 can train: exact against PyTorch's own layers, then verified."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from artifacts import AdamW, generate
from artifacts.errors import InputSpecError
from artifacts.recurrent import UnrolledRNN

LAYERS = [
    ("lstm", lambda **k: nn.LSTM(6, 5, **k)),
    ("gru", lambda **k: nn.GRU(6, 5, **k)),
    ("rnn-tanh", lambda **k: nn.RNN(6, 5, **k)),
    ("rnn-relu", lambda **k: nn.RNN(6, 5, nonlinearity="relu", **k)),
]
SHAPES = [  # (batch_first, num_layers, bidirectional, bias, with initial states)
    (True, 1, False, True, False),
    (False, 2, True, True, True),
    (True, 2, False, False, True),
]


@pytest.mark.parametrize("make", [m for _, m in LAYERS], ids=[n for n, _ in LAYERS])
@pytest.mark.parametrize("batch_first, layers, bidirectional, bias, initial", SHAPES)
def test_unrolled_layers_equal_pytorchs_in_outputs_and_gradients(make, batch_first, layers, bidirectional, bias,
                                                                 initial):  # fmt: skip
    torch.manual_seed(0)
    original = make(batch_first=batch_first, num_layers=layers, bidirectional=bidirectional, bias=bias)
    unrolled = UnrolledRNN(copy.deepcopy(original))
    assert [n for n, _ in unrolled.named_parameters()] == [n for n, _ in original.named_parameters()]
    x = torch.randn((3, 7, 6) if batch_first else (7, 3, 6))
    states = layers * (2 if bidirectional else 1)
    hx = None
    if initial:
        h0 = torch.randn(states, 3, 5)
        hx = (h0, torch.randn(states, 3, 5)) if isinstance(original, nn.LSTM) else h0
    results = []
    for module in (original, unrolled):
        out, state = module(x, hx)
        flat = [out, *(state if isinstance(state, tuple) else (state,))]
        sum(t.square().sum() * (k + 1) for k, t in enumerate(flat)).backward()
        results.append((flat, [p.grad.clone() for p in module.parameters()]))
        module.zero_grad()
    (ours, our_grads), (theirs, their_grads) = results[1], results[0]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(our_grads, their_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class NextWord(nn.Module):
    """A next-word model: embedding, a 2-layer LSTM, a Linear over the vocabulary at every step."""

    def __init__(self, vocab: int = 40) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True, dropout=0.1)
        self.out = nn.Linear(16, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))
        return self.out(hidden[:, -1])


def test_an_lstm_language_model_generates_verifies_and_trains(tmp_path):
    from ondevice import Trainer

    torch.manual_seed(0)
    manifest = generate(NextWord(), {"ids": torch.randint(0, 40, (8, 6))}, tmp_path / "a", optimizer=AdamW(lr=0.02))
    assert manifest.verification.passed and "checked at input shapes 8x6 and 4x6" in manifest.verification.note
    names = {p.name for p in manifest.trainable}
    assert {"lstm.weight_ih_l0", "lstm.weight_hh_l1", "lstm.bias_hh_l1"} <= names  # PyTorch's own names
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 40, (64, 6))
    data = {"ids": ids, "labels": (ids[:, -1] + 1) % 40}  # the next word follows the last one
    trainer = Trainer.load(tmp_path / "a")
    before = trainer.evaluate(data)["loss"]
    trainer.fit(data, epochs=30, batch_size=16, progress=False)
    after = trainer.evaluate(data)
    assert after["loss"] < before * 0.5 and after["accuracy"] > 0.5


def test_a_dynamic_sequence_length_is_refused_with_the_remedy(tmp_path):
    with pytest.raises(InputSpecError, match="unrolled over a fixed sequence length.*--input ids:32x20:int64"):
        generate(NextWord(), {"ids": torch.randint(0, 40, (8, 6))}, tmp_path / "a", dynamic_axes={"ids": {1: "seq"}})


class Tagger(nn.Module):
    """(batch, time, features) -> a time-major recurrent layer (PyTorch's default layout) -> scores.

    Every input's first dimension is the batch (the SDK's convention), so a time-major layer gets
    its input transposed inside forward."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer, self.out = layer, nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.layer(x.transpose(0, 1))
        return self.out(out).mean(0)


@pytest.mark.parametrize("layer", [lambda: nn.GRU(4, 5, bidirectional=True), lambda: nn.RNN(4, 5, 2, bidirectional=True,
                                                                                            nonlinearity="relu")],
                         ids=["gru-bidirectional", "rnn-relu-2-layers"])  # fmt: skip
def test_grus_and_rnns_generate_and_verify(tmp_path, layer):
    torch.manual_seed(0)
    manifest = generate(Tagger(layer()), {"x": torch.randn(8, 7, 4)}, tmp_path / "a")
    assert manifest.verification.passed and any(p.name.endswith("_reverse") for p in manifest.trainable)


@pytest.mark.classic
def test_recurrent_weight_gradients_are_one_gemm_and_match_pytorch(tmp_path):
    """The training graph sums no per-step weight gradients: each recurrent weight's gradient is one
    Gemm over the stacked steps, each bias's one ReduceSum over all steps' rows (both biases are the
    input projection's C, so they share it), and every gradient still equals PyTorch's."""
    import onnx

    torch.manual_seed(0)
    manifest = generate(NextWord(), {"ids": torch.randint(0, 40, (8, 6))}, tmp_path / "a", optimizer=AdamW(lr=0.02))
    assert manifest.verification.passed
    graph = onnx.load(tmp_path / "a" / "training_model.onnx", load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    for name in ("lstm.weight_hh_l0", "lstm.weight_hh_l1", "lstm.bias_hh_l0", "lstm.bias_hh_l1"):
        node = producer[f"{name}_grad"]
        while node.op_type == "Identity":
            node = producer[node.input[0]]
        assert node.op_type == ("Gemm" if "weight" in name else "ReduceSum"), (name, node.op_type)
        stacked = producer[node.input[0]]
        if "bias" in name:  # the projection's gradient: the steps' rows, as one matrix
            assert stacked.op_type == "Reshape", stacked.op_type
            stacked = producer[stacked.input[0]]
        assert stacked.op_type == "Concat" and len(stacked.input) == 6  # the 6 steps
        assert any(r.item.endswith(name) and r.passed for r in manifest.verification.rows)
    assert not [n for n in graph.node if n.op_type == "Sum" and len(n.input) >= 3]


def test_batching_weight_gradients_keeps_the_values():
    """The pass alone on a graph of per-step products: ORT's results before and after agree."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from artifacts.passes.weightgrad import batch_weight_gradients

    steps, batch, rows, cols = 5, 4, 6, 3
    inputs, nodes, parts, reduced = [], [], [], []
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    for t in range(steps):
        inputs += [helper.make_tensor_value_info(f"dy{t}", TensorProto.FLOAT, [batch, rows]),
                   helper.make_tensor_value_info(f"x{t}", TensorProto.FLOAT, [batch, cols])]  # fmt: skip
        nodes += [helper.make_node("Gemm", [f"dy{t}", f"x{t}"], [f"w{t}"], transA=1),
                  helper.make_node("ReduceSum", [f"dy{t}", "axes"], [f"b{t}"], keepdims=0)]  # fmt: skip
        parts.append(f"w{t}")
        reduced.append(f"b{t}")
    nodes += [helper.make_node("Sum", parts, ["w"]), helper.make_node("Sum", reduced, ["b"])]
    outputs = [helper.make_tensor_value_info("w", TensorProto.FLOAT, [rows, cols]),
               helper.make_tensor_value_info("b", TensorProto.FLOAT, [rows])]  # fmt: skip
    graph = helper.make_graph(nodes, "steps", inputs, outputs, [axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in inputs}  # fmt: skip
    before = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert batch_weight_gradients(rewritten) == 2
    assert sorted(n.op_type for n in rewritten.graph.node) == ["Concat", "Concat", "Concat", "Gemm", "ReduceSum"]
    after = ort.InferenceSession(rewritten.SerializeToString()).run(None, feeds)
    expected = sum(feeds[f"dy{t}"].T.astype(np.float64) @ feeds[f"x{t}"] for t in range(steps))
    np.testing.assert_allclose(after[0], expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(after, before):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
