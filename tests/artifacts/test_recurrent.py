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
