"""Trained weights back into PyTorch and PEFT: safetensors by state_dict name, PEFT adapter folders.

Each format is loaded by the library users load it with and compared with ORT's exported model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ondevice import Predictor, Trainer
from ondevice.cli import main


def _trained(directory, data, tmp_path) -> Trainer:
    trainer = Trainer.load(directory)
    trainer.fit(data, epochs=2, batch_size=32, progress=False, checkpoint=tmp_path / "ckpt" / "latest.ckpt")
    return trainer


def test_safetensors_load_into_the_original_model_and_match_orts_export(digits_no_dropout, digits_data, tmp_path):
    """generate -> train on the device -> `odt export --format safetensors` -> load_state_dict(strict)."""
    from safetensors.torch import load_file

    directory, shared = digits_no_dropout
    model = __import__("copy").deepcopy(shared)  # the fixture's model is shared with other tests
    trained = _trained(directory, {k: v[:256] for k, v in digits_data["train"].items()}, tmp_path)
    argv = ["export", str(directory), "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "w.safetensors")]
    assert main(argv) == 0
    assert main([*argv[:-1], str(tmp_path / "m.onnx")]) == 0
    state = load_file(tmp_path / "w.safetensors")
    assert sorted(state) == sorted(model.state_dict())
    x = torch.from_numpy(digits_data["test"]["input"][:64])
    with torch.no_grad():
        untrained = model.eval()(x).numpy()
        model.load_state_dict(state)  # strict: every key, every shape
        ours = model(x).numpy()
    ort = Predictor(str(tmp_path / "m.onnx"), trained.manifest).predict({"input": x.numpy()})["output"]
    np.testing.assert_allclose(ours, ort, atol=1e-5)
    assert not np.allclose(ours, untrained, atol=1e-3)  # the trained weights arrived


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.value, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.query(x)) + self.value(x))


@pytest.fixture(scope="module")
def lora_trained(tmp_path_factory):
    from artifacts import Lora, generate

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = Tiny()
    generate(base, {"x": torch.randn(8, 8)}, root / "a", lora=Lora(4, 8, ("query", "value")), trainable=["head"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype(np.float32)
    trainer = Trainer.load(root / "a")
    trainer.fit({"x": x, "labels": (x[:, 0] > 0).astype(np.int64)}, epochs=5, batch_size=16, progress=False)
    trainer.save(root / "ckpt" / "latest.ckpt")
    return root, base, trainer


def test_a_peft_adapter_loads_with_peft_and_gives_the_sdks_logits(lora_trained, tmp_path):
    from peft import PeftModel

    root, base, trainer = lora_trained
    assert main(["export", str(root / "a"), "--checkpoint", str(root / "ckpt"), "--format", "peft",
                 "--out", str(tmp_path / "adapter")]) == 0  # fmt: skip
    assert main(["export", str(root / "a"), "--checkpoint", str(root / "ckpt"), "--out", str(tmp_path / "m.onnx")]) == 0
    x = np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)
    ort = Predictor(str(tmp_path / "m.onnx"), trainer.manifest).predict({"x": x})
    (scores,) = ort.values()
    reference = Tiny()
    reference.load_state_dict(base.state_dict())
    peft_model = PeftModel.from_pretrained(reference.eval(), tmp_path / "adapter")
    with torch.no_grad():
        np.testing.assert_allclose(peft_model(torch.from_numpy(x)).numpy(), scores, atol=1e-5)
    config = __import__("json").loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["modules_to_save"]) == (4, 8.0, ["head"])


def test_lora_safetensors_are_folded_into_the_plain_model(lora_trained, tmp_path):
    from safetensors.torch import load_file

    root, base, trainer = lora_trained
    assert main(["export", str(root / "a"), "--checkpoint", str(root / "ckpt"),
                 "--out", str(tmp_path / "w.safetensors")]) == 0  # fmt: skip
    plain = Tiny()
    plain.load_state_dict(load_file(tmp_path / "w.safetensors"))  # no lora_A/lora_B keys left
    x = np.random.default_rng(2).normal(size=(16, 8)).astype(np.float32)
    trainer.export(tmp_path / "m.onnx")
    (scores,) = Predictor(str(tmp_path / "m.onnx"), trainer.manifest).predict({"x": x}).values()
    with torch.no_grad():
        np.testing.assert_allclose(plain.eval()(torch.from_numpy(x)).numpy(), scores, atol=1e-5)


def test_export_needs_a_known_format_and_peft_needs_adapters(digits_artifacts, tmp_path, capsys):
    assert main(["export", str(digits_artifacts), "--out", str(tmp_path / "w.bin")]) == 2
    assert "pass --format onnx, safetensors, or peft or hf" in capsys.readouterr().err
    assert main(["export", str(digits_artifacts), "--format", "peft", "--out", str(tmp_path / "p")]) == 1
    assert "no LoRA adapters" in capsys.readouterr().err
    assert main(["export", str(digits_artifacts), "--format", "hf", "--out", str(tmp_path / "h")]) == 1
    assert "not generated from a transformers model" in capsys.readouterr().err


def test_load_into_takes_a_checkpoint_or_a_file_and_refuses_another_model(lora_trained, tmp_path):
    """artifacts.load_into: the checkpoint (LoRA folded) and the exported file give the same model."""
    from artifacts import ModelLoadError, load_into
    from ondevice.formats import save_safetensors

    root, base, trainer = lora_trained
    from_checkpoint, from_file = Tiny(), Tiny()
    assert load_into(from_checkpoint, root / "ckpt" / "latest.ckpt", artifacts=root / "a") == []
    save_safetensors(trainer, tmp_path / "w.safetensors")
    assert load_into(from_file, tmp_path / "w.safetensors") == []
    for name, value in from_checkpoint.state_dict().items():
        torch.testing.assert_close(value, from_file.state_dict()[name], rtol=0, atol=0)
    with pytest.raises(ModelLoadError, match="does not fit this model"):
        load_into(nn.Sequential(nn.Linear(8, 3)), tmp_path / "w.safetensors")
    with pytest.raises(ModelLoadError, match="give artifacts=DIR"):
        load_into(Tiny(), root / "ckpt" / "latest.ckpt")


def test_a_transformers_model_exports_as_a_folder_from_pretrained_loads(tmp_path):
    """BERT (random config) wrapped as (ids, mask) -> logits: trained on the device, exported with
    --format hf, loaded by AutoModelForSequenceClassification: the logits of ORT's exported model."""
    transformers = pytest.importorskip("transformers")  # in requirements/lock.txt: never skipped under make test
    from artifacts import generate
    from tests.artifacts.test_text_models import bert  # BertForSequenceClassification (ids, mask) -> logits

    torch.manual_seed(0)
    example = {"ids": torch.randint(1, 100, (4, 12)), "mask": torch.ones(4, 12, dtype=torch.int64)}
    generate(bert(), example, tmp_path / "a", verify=False)
    rng = np.random.default_rng(0)
    data = {
        "ids": rng.integers(1, 100, (64, 12)),
        "mask": np.ones((64, 12), np.int64),
        "labels": rng.integers(0, 3, 64),
    }
    trainer = Trainer.load(tmp_path / "a")
    trainer.fit(data, epochs=2, batch_size=16, progress=False)
    trainer.save(tmp_path / "ckpt" / "latest.ckpt")
    for out, kind in ((tmp_path / "hf", "hf"), (tmp_path / "m.onnx", "onnx")):
        assert main(["export", str(tmp_path / "a"), "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out),
                     "--format", kind]) == 0  # fmt: skip
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    batch = {k: v[:8] for k, v in data.items() if k != "labels"}
    (ort,) = Predictor(str(tmp_path / "m.onnx"), trainer.manifest).predict(batch).values()
    with torch.no_grad():
        logits = loaded(input_ids=torch.from_numpy(batch["ids"]), attention_mask=torch.from_numpy(batch["mask"])).logits
    np.testing.assert_allclose(logits.numpy(), ort, atol=1e-5)


def test_generation_starts_from_a_peft_adapter(lora_trained, tmp_path):
    """`odt export --format peft`, then `generate(lora_from=...)` on the base model: the new artifacts
    start where the adapter ended (their outputs equal PEFT's), rank and alpha from its config."""
    from peft import PeftModel

    from artifacts import Lora, generate
    from artifacts.errors import SelectionError

    root, base, trainer = lora_trained
    assert main(["export", str(root / "a"), "--checkpoint", str(root / "ckpt"), "--format", "peft",
                 "--out", str(tmp_path / "adapter")]) == 0  # fmt: skip
    manifest = generate(base, {"x": torch.randn(8, 8)}, tmp_path / "b", lora_from=tmp_path / "adapter",
                        trainable=["head"])  # fmt: skip
    assert manifest.verification.passed and manifest.adapters[0].scale == 2.0
    started = Trainer.load(tmp_path / "b")
    for name, value in trainer.get_weights().items():
        np.testing.assert_array_equal(started.get_weights()[name], value, err_msg=name)
    x = np.random.default_rng(3).normal(size=(16, 8)).astype(np.float32)
    started.export(tmp_path / "b.onnx")
    (ours,) = Predictor(str(tmp_path / "b.onnx"), started.manifest).predict({"x": x}).values()
    reference = Tiny()
    reference.load_state_dict(base.state_dict())
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(reference.eval(), tmp_path / "adapter")(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    with pytest.raises(SelectionError, match="differs from the adapter"):
        generate(base, {"x": torch.randn(8, 8)}, tmp_path / "c", lora=Lora(8), lora_from=tmp_path / "adapter")


def test_inspect_shows_adapters_and_what_trains(lora_trained, capsys):
    root, _, trainer = lora_trained
    assert main(["inspect", str(root / "a")]) == 0
    text = capsys.readouterr().out
    assert "LoRA:     rank 4, scale 2 on 2 layers: query, value" in text
    assert "trains:   " in text and "head.weight" in text and "query.lora_A" in text
    assert main(["inspect", str(root / "a"), "--json"]) == 0
    summary = __import__("json").loads(capsys.readouterr().out)
    assert [a["rank"] for a in summary["adapters"]] == [4, 4]
    assert [t["name"] for t in summary["trainable_tensors"]] == [p.name for p in trainer.manifest.trainable]
