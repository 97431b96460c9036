"""The next-word sample: word data per home, a left-padded word tokenizer, an LSTM that learns on device."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("hassil")  # in requirements/lock.txt: never skipped under `make test`
from samples.nextword.data import next_word_rows, vocabulary, words  # noqa: E402


def test_examples_are_each_word_after_its_context():
    assert words("Turn ON the kitchen's lights!") == ["turn", "on", "the", "kitchen's", "lights"]
    vocab = vocabulary(["turn on the light", "turn off the light", "dim"], min_count=2)
    assert vocab == ["[PAD]", "[UNK]", "light", "the", "turn"]
    rows = next_word_rows(["turn on the light"], {"the", "light"}, context=2)
    assert rows == [{"text": "turn on", "label": "the"}, {"text": "on the", "label": "light"}]


def test_the_sample_trains_an_lstm_that_beats_the_most_common_word(tmp_path, capsys):
    from ondevice.text import TextEncoder
    from samples.nextword import run

    assert run.main(["--out", str(tmp_path), "--homes", "3", "--per-home", "150", "--epochs", "6"]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["accuracy"] > metrics["most_common_word_accuracy"] + 0.15
    assert metrics["top3_accuracy"] > metrics["accuracy"] and metrics["perplexity"] < 50
    encoder = TextEncoder(tmp_path / "artifacts")  # left-padded to exactly 6 ids, the last words kept
    ids = encoder(["on the", "one two three four five six seven eight"])["ids"]
    assert ids.shape == (2, 6) and (ids[0, :4] == 0).all() and (ids[0, 4:] != 0).all() and (ids[1] != 0).all()
