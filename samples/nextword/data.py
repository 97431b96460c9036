"""Next-word data from the intents sample's commands: a word vocabulary, a word-level tokenizer and
(context, next word) examples, per home.

Each home writes its own commands with its own area and device names: a natural non-IID, personal
text. The vocabulary comes from the training homes; the test set is two unseen homes.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

from samples.intents.data import prepare as prepare_commands

WORD = re.compile(r"[a-z0-9']+")
PAD, UNK = "[PAD]", "[UNK]"


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def vocabulary(texts: list[str], min_count: int = 2) -> list[str]:
    """[PAD], [UNK], then every word seen ``min_count`` times, most frequent first (ties by word)."""
    counts = collections.Counter(w for t in texts for w in words(t))
    return [PAD, UNK, *sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))]


def next_word_rows(texts: list[str], known: set[str], context: int) -> list[dict[str, str]]:
    """One row per word after the first: the up to ``context`` words before it, and the word (if known)."""
    rows = []
    for text in texts:
        ws = words(text)
        for i in range(1, len(ws)):
            if ws[i] in known:
                rows.append({"text": " ".join(ws[max(0, i - context) : i]), "label": ws[i]})
    return rows


def save_tokenizer(vocab: list[str], context: int, path: Path) -> Path:
    """A word-level tokenizer.json: lowercase, split on spaces, unknown words to [UNK], the last
    ``context`` words kept and padded on the left to exactly ``context`` ids."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.enable_padding(direction="left", pad_id=0, pad_token=PAD, length=context)
    tokenizer.enable_truncation(context, direction="left")
    tokenizer.save(str(path))
    return path


def _texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write(rows: list[dict[str, str]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def prepare(out: Path, *, homes: int = 8, per_home: int = 400, context: int = 6, seed: int = 0) -> dict[str, Path]:
    """``train/test.jsonl``, ``clients/<home>.jsonl``, ``vocab.json`` and ``tokenizer.json`` under ``out``."""
    commands = prepare_commands(out / "commands", homes=homes, per_home=per_home, seed=seed)
    train_texts = _texts(commands["train"]) + _texts(commands["val"])
    vocab = vocabulary(train_texts)
    known = set(vocab[2:])
    paths = {
        "train": _write(next_word_rows(train_texts, known, context), out / "train.jsonl"),
        "test": _write(next_word_rows(_texts(commands["test"]), known, context), out / "test.jsonl"),
        "tokenizer": save_tokenizer(vocab, context, out / "tokenizer.json"),
    }
    for key, path in commands.items():
        if key.startswith("home:"):
            paths[key] = _write(next_word_rows(_texts(path), known, context), out / "clients" / path.name)
    (out / "vocab.json").write_text(json.dumps(vocab))
    paths["vocab"] = out / "vocab.json"
    return paths
