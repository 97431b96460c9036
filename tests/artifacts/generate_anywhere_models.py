"""Models generated in a fresh environment without the training build (tests/artifacts/test_generate_anywhere.py),
and the 20 training steps both sides take. Plain torch and transformers: the file runs beside the built wheel."""

import json
import sys

import numpy as np
import torch
from torch import nn

STEPS = 20


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30, 8)
        self.lstm = nn.LSTM(8, 12, batch_first=True)
        self.head = nn.Linear(12, 30)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embedding(ids))[0][:, -1])


def _bert() -> nn.Module:
    import transformers

    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return transformers.BertForSequenceClassification(config)


class Decoder(nn.Module):
    """A tiny Llama with grouped-query attention (4 query, 2 key/value heads); next-token loss on its logits."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                          attn_implementation="eager")  # fmt: skip
        self.model = transformers.LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits[:, -1]


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 5))  # fmt: skip


# name -> (build, input name, example shape or vocabulary, classes, LoRA targets)
MODELS = {
    "digits": (lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), "input", (16, 64), 10, None),
    "bert-lora": (_bert, "input_ids", ("ids", 40, 12), 3, ["query", "value"]),
    "lstm": (Recurrent, "ids", ("ids", 30, 6), 30, None),
    "cnn-batchnorm": (_cnn, "image", (16, 1, 8, 8), 5, None),
    "gqa-decoder-lora": (Decoder, "ids", ("ids", 24, 8), 24, ["q_proj", "v_proj"]),
}


def example(shape: tuple, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if shape[0] == "ids":
        return torch.randint(1, shape[1], (8, shape[2]), generator=generator)
    return torch.randn(*shape, generator=generator)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name][0]()
    if hasattr(model, "config"):  # Hugging Face classifiers return an output object: keep the logits
        inner = model

        class Logits(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
                return self.inner(input_ids=input_ids).logits

        model = Logits()
    return model


def generate_all(out: str) -> dict:
    from artifacts import Lora, generate

    made = {}
    for name, (_, input_name, shape, _, targets) in MODELS.items():
        lora = {"lora": Lora(rank=4, targets=tuple(targets))} if targets else {}
        manifest = generate(build(name), {input_name: example(shape, 0)}, f"{out}/{name}", **lora)
        made[name] = {"engines": list(manifest.engines), "passed": manifest.verification.passed}
    return made


def losses(artifacts: str, name: str, engine: str) -> list[float]:
    from ondevice import Trainer

    _, input_name, shape, classes, _ = MODELS[name]
    trainer = Trainer.load(f"{artifacts}/{name}", engine=engine)
    rng = np.random.default_rng(0)
    found = []
    for step in range(STEPS):
        feeds = {input_name: example(shape, step + 1).numpy(), "labels": rng.integers(0, classes, 8 if shape[0] == "ids"
                 else shape[0]).astype(np.int64)}  # fmt: skip
        found.append(trainer.train_step(feeds).loss)
    return found


def workstation_admits(installed: str) -> bool:
    """Whether the installed wheel's [workstation] extra, its markers evaluated on this platform, asks for
    exactly one torch requirement and admits ``installed``."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    wanted = [Requirement(line) for line in requires("ondevice-training") or []]
    torch_wanted = [r for r in wanted if r.name == "torch" and r.marker and r.marker.evaluate({"extra": "workstation"})]
    return len(torch_wanted) == 1 and torch_wanted[0].specifier.contains(installed.split("+")[0])


if __name__ == "__main__":  # in the environment without the training build: generate, then train
    import onnxruntime

    from ondevice.engines import installed_engines

    made = generate_all(sys.argv[1])
    report = {"python": "%d.%d" % sys.version_info[:2], "torch": torch.__version__,
              "workstation_admits_torch": workstation_admits(torch.__version__),
              "onnxruntime": onnxruntime.__version__, "engines_installed": list(installed_engines()),
              "made": made, "losses": {name: losses(sys.argv[1], name, "auto") for name in MODELS}}
    print(json.dumps(report))
