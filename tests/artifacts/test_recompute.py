"""`--recompute`: each repeated layer runs its forward again in the backward instead of keeping its
activations. The step computes the same values (bit for bit against the same model without it, on
both engines; against PyTorch in verification, Dropout masks included), the copies run only once the
backward reaches their layer, and the step's memory shrinks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from artifacts import generate, passes
from artifacts.passes.recompute import layer_of
from ondevice import Manifest, Trainer
from ondevice.cli import main

from .test_dropout import FAMILIES
from .test_text_models import _example

WORDS = "<pad> <unk> </s> turn on off the kitchen bedroom lights fan heater please { } intent area : ,".split()
ROOT = Path(__file__).resolve().parents[2]


def _llama(folder: Path, layers: int, width: int, positions: int) -> Path:
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["</s>"])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=width, intermediate_size=3 * width,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=positions, pad_token_id=0, bos_token_id=None,
                                      eos_token_id=2, tie_word_embeddings=True)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _generate(folder: Path, out: Path, length: int, *flags: str) -> Path:
    assert main(["generate", "--model", f"hf:{folder}", "--task", "causal-lm", "--max-length", str(length),
                 "--out", str(out), *flags]) == 0  # fmt: skip
    return out


def _tokens(rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(3, len(WORDS), (rows, length)).astype(np.int64)
    return {"ids": ids, "mask": np.ones_like(ids), "labels": ids.copy()}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("recompute")
    folder = _llama(root / "hf", layers=3, width=32, positions=64)
    kept = _generate(folder, root / "kept", 16, "--no-verify")
    return kept, _generate(folder, root / "recomputed", 16, "--recompute")


def _ancestors(nodes: list[onnx.NodeProto], name: str) -> set[str]:
    producer = {out: node for node in nodes for out in node.output}
    seen, stack = set(), [name]
    while stack:
        tensor = stack.pop()
        if tensor in seen or tensor not in producer:
            continue
        seen.add(tensor)
        stack.extend(producer[tensor].input)
    return seen


@pytest.mark.classic
def test_recomputed_layers_train_bit_for_bit_like_kept_ones(pair):
    kept, recomputed = pair
    assert Manifest.load(recomputed).verification.passed  # against PyTorch's gradients
    nodes = list(onnx.load(recomputed / "training_model.onnx", load_external_data=False).graph.node)
    copies = [n for n in nodes if n.name.endswith("::recompute")]
    assert {layer_of(n.name) for n in copies} == {f"/model/model/layers.{i}" for i in range(3)}
    for node in copies:  # each copy waits for the gradient of its layer's output: it cannot run in the forward
        waited = _ancestors(nodes, node.output[0])
        assert any(t.startswith(layer_of(node.name)) and t.endswith("_output_0_grad") for t in waited), node.name
    # what the forward made and the copies make again is read only on the way to the loss: nothing that
    # only the backward needs (the gradient builder's Shape of an activation) keeps the forward's tensor
    forward = _ancestors(nodes, "output")
    copied = {t.removesuffix("::recompute") for n in copies for t in n.output}
    shared = {t for n in nodes for t in n.input if layer_of(n.name) != layer_of(t)}  # e.g. a rotary table
    late = [(t, n.name) for n in nodes for t in n.input if t in copied - shared and n.output[0] not in forward]
    assert not late, late[:3]
    batches = [_tokens(4, 16, seed) for seed in range(4)]
    for engine in ("classic", "portable"):
        trainers = [Trainer.load(d, engine=engine) for d in pair]
        losses = [[t.train_step(b).loss for b in batches] for t in trainers]
        assert losses[0] == losses[1], engine
        for (name, a), b in zip(trainers[0].get_weights().items(), trainers[1].get_weights().values()):
            np.testing.assert_array_equal(a, b, err_msg=f"{engine}: {name}")


@pytest.mark.classic
def test_swiglu_activations_are_made_again_in_the_backward_bit_for_bit(pair, tmp_path, monkeypatch):
    """Without --recompute, the backward's readers of each layer's SiLU output read a copy that waits for the
    backward, so the forward's output is read by the forward alone; the step is the same to the bit as without
    the pass, on both engines."""
    kept = pair[0]
    monkeypatch.setattr(passes, "REGISTRY", passes.without("silu-recompute"))
    plain = _generate(kept.parent / "hf", tmp_path / "plain", 16, "--no-verify")
    nodes = list(onnx.load(kept / "training_model.onnx", load_external_data=False).graph.node)
    activations = [n.output[0] for n in nodes if n.op_type == "QuickGelu" and "::silu/" not in n.name]
    assert len(activations) == 3  # one per layer
    forward = _ancestors(nodes, "output")
    for activation in activations:
        readers = [n for n in nodes if activation in n.input]
        assert readers and all(n.output[0] in forward for n in readers), activation
    for copy in (n for n in nodes if "::silu/" in n.name and n.op_type == "QuickGelu"):
        assert any(t.endswith("_grad") for t in _ancestors(nodes, copy.output[0])), copy.name
    batches = [_tokens(4, 16, seed) for seed in range(3)]
    for engine in ("classic", "portable"):
        trainers = [Trainer.load(d, engine=engine) for d in (kept, plain)]
        losses = [[t.train_step(b).loss for b in batches] for t in trainers]
        assert losses[0] == losses[1], engine
        for (name, a), b in zip(trainers[0].get_weights().items(), trainers[1].get_weights().values()):
            np.testing.assert_array_equal(a, b, err_msg=f"{engine}: {name}")


def test_dropout_is_not_drawn_twice(tmp_path):
    """BERT's layers drop (hidden and attention dropout): the Dropout nodes are not copied, their
    outputs stay saved, and verification with ORT's masks replayed in PyTorch still passes."""
    build, count = FAMILIES["bert"]
    torch.manual_seed(0)
    manifest = generate(build(), _example(), tmp_path / "a", recompute=True)
    assert manifest.verification.passed
    assert f"{count} Dropout(s) off, and on with ORT's masks replayed" in manifest.verification.note
    nodes = onnx.load(tmp_path / "a" / "training_model.onnx", load_external_data=False).graph.node
    copies = [n for n in nodes if n.name.endswith("::recompute")]
    assert {layer_of(n.name) for n in copies} == {"/model/bert/encoder/layer.0", "/model/bert/encoder/layer.1"}
    assert sum(n.op_type == "Dropout" for n in nodes) == count and not any(n.op_type == "Dropout" for n in copies)


STEP = """
import json, sys
import numpy as np
from ondevice import Trainer
trainer = Trainer.load(sys.argv[1], engine=sys.argv[2])
batch = {k: v for k, v in np.load(sys.argv[3]).items()}
def peak():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) * 1024
loaded = peak()
losses = [trainer.train_step(batch).loss for _ in range(2)]
print(json.dumps({"growth": peak() - loaded, "losses": losses}))
"""


@pytest.fixture(scope="module")
def deep(tmp_path_factory) -> Path:
    """8 layers, kept and recomputed, and a batch of 4 x 256 tokens."""
    root = tmp_path_factory.mktemp("recompute-memory")
    folder = _llama(root / "hf", layers=8, width=96, positions=256)
    for kind, flags in (("kept", ()), ("recomputed", ("--recompute",))):
        _generate(folder, root / kind, 256, "--no-verify", *flags)
    np.savez(root / "batch.npz", **_tokens(4, 256))
    return root


@pytest.mark.parametrize("engine", ["classic", "portable"])
@pytest.mark.classic
def test_the_step_holds_far_less_memory(deep, engine):
    """A step's peak RSS over the loaded trainer, measured in fresh processes."""
    runs = {}
    for kind in ("kept", "recomputed"):
        done = subprocess.run([sys.executable, "-c", STEP, str(deep / kind), engine, str(deep / "batch.npz")],
                              capture_output=True, text=True, cwd=ROOT, check=True)  # fmt: skip
        runs[kind] = json.loads(done.stdout.splitlines()[-1])
    assert runs["kept"]["losses"] == runs["recomputed"]["losses"]
    assert runs["recomputed"]["growth"] < 0.5 * runs["kept"]["growth"], runs
