"""Dropout trains as PyTorch's does: every Dropout drops in the training graph (attention dropout
included) and in no eval graph, and verification replays ORT's own masks in PyTorch."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

import artifacts.passes as passes
from artifacts import VerificationError, generate
from artifacts.replay import replayed_dropout
from ondevice import Manifest

from .test_text_models import Classifier, _example

transformers = pytest.importorskip("transformers")  # in requirements/lock.txt: never skipped under `make test`

SMALL = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=64, num_labels=3)  # fmt: skip


class Encoder(nn.Module):
    """``(ids, mask) -> logits`` from the first position of an encoder without a classification head."""

    def __init__(self, encoder: nn.Module, width: int) -> None:
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(width, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0])


class Pixels(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixels).logits


def _classifier(family: str, **config: object) -> Classifier:
    made = getattr(transformers, f"{family}Config")(**config)
    return Classifier(getattr(transformers, f"{family}ForSequenceClassification")(made))


FAMILIES = {
    # name: (model, Dropout nodes of its training graph); attention dropout through SDPA unless said
    "bert": (lambda: _classifier("Bert", **SMALL), 8),
    "roberta": (lambda: _classifier("Roberta", **SMALL, pad_token_id=1), 9),
    "distilbert": (lambda: _classifier("DistilBert", vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                       max_position_embeddings=64, num_labels=3), 6),
    "gpt2": (lambda: _classifier("GPT2", vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                 num_labels=3, pad_token_id=0, bos_token_id=0, eos_token_id=0), 7),
    "llama": (lambda: _classifier("Llama", **{**SMALL, "num_key_value_heads": 4, "attention_dropout": 0.1,
                                              "pad_token_id": 0}), 2),
    # T5's eager attention: functional dropout at the config's rate (relative position bias, no SDPA)
    "t5": (lambda: Encoder(transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.1,
        attn_implementation="eager")), 32), 10),
    "vit": (lambda: Pixels(transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=3))), 7),
}  # fmt: skip


def _dropouts(path) -> list[tuple[str, float, bool | None]]:  # type: ignore[no-untyped-def]
    """``(node, ratio, training_mode)`` of every Dropout in an ONNX file (None: no training_mode input)."""
    model = onnx.load(path, load_external_data=False)
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    constants |= {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                  if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"}  # fmt: skip
    found = []
    for node in model.graph.node:
        if node.op_type == "Dropout":
            ratio = float(constants[node.input[1]]) if len(node.input) > 1 and node.input[1] else 0.5
            mode = bool(constants[node.input[2]]) if len(node.input) > 2 and node.input[2] else None
            found.append((node.name, ratio, mode))
    return found


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.classic
def test_every_dropout_drops_in_training_and_matches_pytorchs_masks(tmp_path, family):
    build, count = FAMILIES[family]
    torch.manual_seed(0)
    example = {"pixels": torch.randn(4, 3, 16, 16)} if family == "vit" else _example()
    manifest = generate(build(), example, tmp_path / "a")

    assert manifest.verification.passed
    assert f"{count} Dropout(s) off, and on with ORT's masks replayed" in manifest.verification.note
    items = {row.item for row in manifest.verification.rows}
    assert {"dropout train loss", *(f"dropout grad {p.name}" for p in manifest.trainable)} <= items
    graphs = {"training_model.onnx": True, "eval_model.onnx": False}
    graphs |= {manifest.portable_files[0]: True} if manifest.portable_files else {}
    for graph, active in graphs.items():
        found = _dropouts(tmp_path / "a" / graph)
        assert len(found) == count, graph
        assert all(mode is active for _, ratio, mode in found if ratio > 0), (graph, found)
    assert any(ratio > 0 for _, ratio, _ in _dropouts(tmp_path / "a" / "training_model.onnx"))


def test_verification_with_dropout_on_fails_on_the_attention_dropout_as_it_was(tmp_path, monkeypatch):
    # without the dropout-training-mode pass the attention dropout is inactive in ORT's forward while its
    # gradient is scaled by 1 / (1 - p): the dropout-off check cannot see it, the dropout-on check must
    monkeypatch.setattr(passes, "REGISTRY", tuple(p for p in passes.REGISTRY if p.name != "dropout-training-mode"))
    torch.manual_seed(0)
    with pytest.raises(VerificationError) as failed:
        generate(FAMILIES["bert"][0](), _example(), tmp_path / "a")
    rows = failed.value.verification.rows
    wrong = [row.item for row in rows if not row.passed]
    assert wrong and all(item.split(": ")[-1].startswith("dropout ") for item in wrong), wrong  # any engine's graph
    assert "only the train step with dropout on fails" in str(failed.value)
    assert not (tmp_path / "a").exists()


class Functional(nn.Module):
    """Dropout only through functional calls: F.dropout at its own rate and SDPA's causal dropout_p."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(F.dropout(x, 0.3, self.training)).view(x.shape[0], 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2 if self.training else 0.0, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(x.shape[0], 5, 8).mean(1))


def test_functional_dropout_is_replayed_with_orts_masks_and_switched_off_for_the_deterministic_check(tmp_path):
    torch.manual_seed(0)
    manifest = generate(Functional(), torch.randn(6, 5, 8), tmp_path / "a", input_names=["x"])
    assert manifest.verification.passed
    assert "2 Dropout(s) off, and on with ORT's masks replayed" in manifest.verification.note
    assert [ratio for _, ratio, _ in _dropouts(tmp_path / "a" / "training_model.onnx")] == pytest.approx([0.3, 0.2])


class ZeroRate(nn.Module):
    """Dropouts of p = 0 (a config default in Hugging Face audio and vision models) beside a real one: as a module
    (the exporter writes no node) and as a call (it writes one of ratio 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.zero = nn.Linear(8, 16), nn.Linear(16, 3), nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.dropout(torch.relu(self.a(self.zero(x))), 0.0, self.training)
        return self.b(F.dropout(hidden, 0.25, self.training))


def test_a_dropout_of_rate_zero_replays_whether_or_not_it_has_a_node(tmp_path):
    """A rate-0 dropout without a node took the next node's mask, and generation stopped with "not in the order
    PyTorch runs them" (a tiny ViT with hidden dropout 0 and attention dropout 0.1, too)."""
    torch.manual_seed(0)
    manifest = generate(ZeroRate(), torch.randn(6, 8), tmp_path / "a", input_names=["x"])
    assert manifest.verification.passed and "and on with ORT's masks replayed" in manifest.verification.note
    assert 0.25 in [ratio for _, ratio, _ in _dropouts(tmp_path / "a" / "training_model.onnx")]


@pytest.mark.parametrize(
    ("layer", "said"),
    [
        (nn.AlphaDropout(0.2), "'1' is AlphaDropout(p=0.2), whose masks ONNX's Dropout cannot draw"),
        (nn.Dropout2d(0.2), "'1' is Dropout2d(p=0.2), whose masks ONNX's Dropout cannot draw"),
        (nn.Dropout(1.0), "'1' is Dropout(p=1): it drops every value, so nothing reaches the loss"),
    ],
)
def test_dropouts_the_graph_cannot_hold_are_refused_naming_the_layer(layer, said, tmp_path):
    from artifacts.errors import ModelLoadError

    model = nn.Sequential(nn.Linear(8, 8), layer, nn.Linear(8, 3))
    with pytest.raises(ModelLoadError, match=None) as caught:
        generate(model, torch.randn(4, 8), tmp_path / "a", input_names=["x"])
    assert said in str(caught.value) and not (tmp_path / "a").exists()


def test_replay_refuses_masks_that_do_not_fit_pytorchs_dropouts():
    x = torch.ones(2, 3)
    with pytest.raises(VerificationError, match="shape \\(2, 3\\).*'second'.*shape \\(3, 2\\)"):
        with replayed_dropout([np.ones((2, 3), bool), np.ones((3, 2), bool)], ["first", "second"]):
            F.dropout(F.dropout(x, 0.5), 0.5)
    with pytest.raises(VerificationError, match="2 Dropout nodes but PyTorch's forward applied 1.*'second'"):
        with replayed_dropout([np.ones((2, 3), bool)] * 2, ["first", "second"]):
            F.dropout(x, 0.5)
    with pytest.raises(VerificationError, match="more dropouts than the training graph has Dropout nodes \\(1\\)"):
        with replayed_dropout([np.ones((2, 3), bool)], ["first"]):
            F.dropout(F.dropout(x, 0.5), 0.5)
    mask = np.array([[True, False, True], [False, True, True]])
    with replayed_dropout([mask], ["first"]):
        dropped = F.dropout(x * 3, 0.25)
    np.testing.assert_array_equal(dropped.numpy(), np.where(mask, np.float32(3) / np.float32(0.75), 0))
    with replayed_dropout(None, ()):  # off: nothing drops, nothing is counted
        assert torch.equal(F.dropout(x, 0.5), x)


RUN_TWICE = """
import json, sys
import numpy as np
from ondevice import Manifest, Trainer
if sys.argv[2] == "onnx":  # the ONNX graphs, which stock ORT's optimizer rewrites at load (the ORT-format copies
    Manifest.portable_ort = property(lambda self: {})  # were optimized by the training build when generated)
trainer = Trainer.load(sys.argv[1], engine="portable")
x = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
labels = np.arange(16) % 3
start = trainer.get_flat_weights()
losses = []
for _ in range(4):  # each step from the same weights: only the masks differ
    losses.append(trainer.train_step({"x": x, "labels": labels}).loss)
    trainer.set_weights(start)
print(json.dumps({"onnxruntime": trainer.ort_version, "losses": losses}))
"""


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.classic
def test_a_dropout_on_a_frozen_path_still_drops_on_the_portable_engine(tmp_path, stock_python, monkeypatch, keep):
    # no gradient reads the Dropout's mask when only the last layer trains; stock ORT's optimizer then deletes
    # the node from the ONNX graph it loads (the training build's does not), unless the portable-dropout-masks
    # pass keeps the mask read. The ORT-format copies, optimized by the training build, drop either way.
    if not keep:
        monkeypatch.setattr(passes, "REGISTRY", tuple(p for p in passes.REGISTRY if p.name != "portable-dropout-masks"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    generate(model, torch.randn(4, 8), tmp_path / "a", input_names=["x"], trainable=["2.weight", "2.bias"])
    graph = onnx.load(tmp_path / "a" / "training_model.portable.onnx", load_external_data=False).graph
    (mask,) = [n.output[1] for n in graph.node if n.op_type == "Dropout"]
    assert [n.op_type for n in graph.node if mask in n.input] == (["Reshape"] if keep else [])

    assert Manifest.load(tmp_path / "a").portable_ort  # frozen.bin: the engine would load the ORT-format copies
    for graphs, drops in (("onnx", keep), ("ort", True)):
        run = subprocess.run([*stock_python, "-c", RUN_TWICE, str(tmp_path / "a"), graphs], capture_output=True,
                             text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        found = json.loads(run.stdout)
        assert found["onnxruntime"] == "1.32.0"
        assert (len(set(found["losses"])) == 4) is drops, (graphs, found)
