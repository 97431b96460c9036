"""Today's decoders (grouped-query attention, RMSNorm, SwiGLU, rotary embeddings) with their own
next-token loss: they export (SDPA's enable_gqa as repeated key/value heads), verify against
PyTorch, and train on the portable engine as on the classic one, on stock ONNX Runtime too."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
import transformers
from torch import nn

from artifacts import AdamW, generate
from artifacts.losses import loss_from_name
from ondevice import Trainer

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=None)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=8)),  # q/k norms
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**SMALL)),  # fused qkv_proj
    "gemma": lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**SMALL, head_dim=8)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, head_dim=8)),  # eager, softcaps
}


class CausalLM(nn.Module):
    """``(ids[, mask], labels) -> loss``: the model's own next-token loss (labels -100 are not counted)."""

    def __init__(self, model: nn.Module, mask: bool) -> None:
        super().__init__()
        self.model, self.mask = model, mask

    def forward(self, ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        mask, labels = rest if self.mask else (None, rest[0])
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _example(rows: int = 4, length: int = 12, seed: int = 0, mask: bool = True) -> dict[str, torch.Tensor]:
    """Token ids whose first third is a prompt (label -100, not counted), as a fine-tuning set has."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, SMALL["vocab_size"], (rows, length), generator=generator)
    labels = ids.clone()
    labels[:, : length // 3] = -100
    return {"ids": ids, **({"mask": torch.ones_like(ids)} if mask else {}), "labels": labels}


def _without_dropout(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.0
    return model


@pytest.mark.parametrize(
    ("family", "mask"),
    [("llama", True), ("llama", False), ("qwen2", True), ("mistral", False), ("qwen3", True), ("phi3", True),
     ("gemma", True), ("gemma2", True)],
)  # fmt: skip
@pytest.mark.classic
def test_a_grouped_query_decoder_generates_verifies_and_has_a_portable_graph(tmp_path, family, mask):
    """Without an attention mask, transformers calls SDPA with enable_gqa=True, which torch's exporter
    refused; the export repeats the key/value heads (exact), and verification compares with PyTorch.
    The cached decoder for writing text is proved too (five `decoder:` rows)."""
    torch.manual_seed(0)
    model = CausalLM(FAMILIES[family](), mask)
    manifest = generate(model, _example(mask=mask), tmp_path / "a", loss=loss_from_name("model"))
    assert manifest.verification.passed
    assert manifest.engines == ("classic", "portable"), manifest.portable
    decoder_rows = [r for r in manifest.verification.rows if r.item.startswith("decoder")]
    assert len(decoder_rows) == 5 and manifest.decoder.kv_heads == SMALL["num_key_value_heads"]


def _batches(count: int, mask: bool) -> list[dict[str, np.ndarray]]:
    return [{k: v.numpy() for k, v in _example(seed=10 + i, mask=mask).items()} for i in range(count)]


@pytest.mark.classic
def test_a_decoder_trains_alike_on_both_engines_and_on_stock_onnxruntime(tmp_path, stock_python):
    """20 AdamW steps of a Llama with grouped-query attention and its token loss (prompts ignored):
    the portable graphs (RMSNorm, SiLU and the ignore-index cross-entropy gradients lowered to
    standard operators) give the classic engine's losses, in the training build and in stock ORT."""
    torch.manual_seed(0)
    model = CausalLM(_without_dropout(FAMILIES["llama"]()), mask=True)
    generate(model, _example(), tmp_path / "a", loss=loss_from_name("model"), optimizer=AdamW(lr=3e-3), verify=False)
    batches = _batches(5, mask=True)
    losses = {}
    for engine in ("classic", "portable"):
        trainer = Trainer.load(tmp_path / "a", engine=engine, threads=1)
        losses[engine] = [trainer.train_step(batches[step % 5]).loss for step in range(20)]
    assert losses["classic"][-1] < 0.9 * losses["classic"][0]  # it learns
    np.testing.assert_allclose(losses["portable"], losses["classic"], rtol=2e-5)
    np.savez(tmp_path / "batches.npz", **{f"{i}.{k}": v for i, b in enumerate(batches) for k, v in b.items()})
    script = f"""
import json, numpy as np
from ondevice import Trainer
saved = np.load({str(tmp_path / "batches.npz")!r})
batches = [{{k.split(".", 1)[1]: saved[k] for k in saved if k.startswith(f"{{i}}.")}} for i in range(5)]
trainer = Trainer.load({str(tmp_path / "a")!r}, threads=1)
print(json.dumps([trainer.engine, trainer.ort_version, [trainer.train_step(batches[s % 5]).loss for s in range(20)]]))
"""
    done = subprocess.run([*stock_python, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    engine, version, stock = json.loads(done.stdout.strip().splitlines()[-1])
    assert engine == "portable" and not version.startswith("1.19"), version
    np.testing.assert_allclose(stock, losses["classic"], rtol=1e-4)


@pytest.mark.parametrize(
    ("family", "expected"),
    [("llama", ("q_proj", "v_proj")), ("qwen2", ("q_proj", "v_proj")), ("phi3", ("qkv_proj",))],
)
def test_lora_adapts_the_architectures_attention_projections_by_default(tmp_path, family, expected):
    """`Lora(4)` (`--lora 4`) on a decoder: its q_proj and v_proj, as PEFT's defaults name them."""
    from artifacts import Lora

    torch.manual_seed(0)
    manifest = generate(CausalLM(FAMILIES[family](), True), _example(), tmp_path / "a", loss=loss_from_name("model"),
                        lora=Lora(4))  # fmt: skip
    adapted = sorted(a.weight.rsplit(".", 2)[-2] for a in manifest.adapters)
    assert adapted == sorted(expected * SMALL["num_hidden_layers"]) and manifest.verification.passed


class GPT2Classifier(nn.Module):
    """GPT-2 (tanh GELU, and the last real token of each row picked: a Gather on an activation)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, num_labels=3,
                                         pad_token_id=0, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        self.model = transformers.GPT2ForSequenceClassification(config)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.classic
def test_gpt2_gets_a_portable_graph_that_trains_like_the_classic_engine(tmp_path):
    """FastGeluGrad and the GatherGrad of the last-token pick lower to standard operators: GPT-2 had
    no portable engine before."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 100, (4, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0  # a shorter row: its last real token is picked
    torch.manual_seed(0)
    manifest = generate(GPT2Classifier(), {"ids": ids, "mask": mask}, tmp_path / "a", optimizer=AdamW(lr=3e-3))
    assert manifest.verification.passed and manifest.engines == ("classic", "portable"), manifest.portable
    rng = np.random.default_rng(1)
    batches = [{"ids": rng.integers(1, 100, (4, 12)), "mask": np.ones((4, 12), np.int64),
                "labels": rng.integers(0, 3, 4)} for _ in range(5)]  # fmt: skip
    losses = {}
    for engine in ("classic", "portable"):
        trainer = Trainer.load(tmp_path / "a", engine=engine, threads=1)
        losses[engine] = [trainer.train_step(batches[step % 5]).loss for step in range(20)]
    np.testing.assert_allclose(losses["portable"], losses["classic"], rtol=2e-5)


def test_a_causal_lm_with_dropout_proves_its_cached_decoder_in_eval_mode(tmp_path):
    """GPT-2's default dropouts (0.1): the cached decoder's rows failed by 0.16-0.33 in the logits, its PyTorch
    reference running in training mode after the export restored a new wrapper's mode."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # fmt: skip
    model = CausalLM(transformers.GPT2LMHeadModel(config), mask=True)
    manifest = generate(model, _example(), tmp_path / "a", loss=loss_from_name("model"))
    decoder_rows = [row for row in manifest.verification.rows if row.item.startswith("decoder:")]
    assert manifest.decoder is not None and len(decoder_rows) == 5 and all(row.passed for row in decoder_rows)
    assert "and on with ORT's masks replayed" in manifest.verification.note  # training still drops
    assert model.model.training  # the caller's model is left as it was
