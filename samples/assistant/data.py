"""Spoken commands and the action a home controller runs, per home, from Home Assistant's templates.

The commands are the intents sample's (``home-assistant-intents`` expanded with ``hassil`` for each
home's own area and device names; unseen homes draw their names from another pool). The action is
what hassil itself recognizes in the command: the intent and the ``name`` and ``area`` slots it
fills, as JSON. The prompt is SmolLM2's chat format with a short instruction, so the same prompt
serves the zero-shot model and the fine-tuned one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from samples.intents.data import PER_TEMPLATE, Home, _expand, _fill, _templates, make_homes, write_jsonl

INTENTS = ("HassTurnOn", "HassTurnOff", "HassLightSet", "HassGetState")
"""The intents a home controller acts on here (those whose commands name a device or an area)."""
SYSTEM = (
    'Reply with the JSON action for the smart-home command: {"intent": one of '
    + ", ".join(INTENTS)
    + ', "name": the device or null, "area": the room or null}.'
)
END = "<|im_end|>"


def prompt(command: str) -> str:
    """The chat prompt of one command (SmolLM2's template), ending where the assistant's answer starts."""
    return f"<|im_start|>system\n{SYSTEM}{END}\n<|im_start|>user\n{command}{END}\n<|im_start|>assistant\n"


def action_text(action: dict[str, str | None]) -> str:
    return json.dumps({"intent": action["intent"], "name": action["name"], "area": action["area"]})


def parse_action(text: str) -> dict | None:
    """The action a completion spells (the first JSON object in it), or None when it spells none."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def home_actions(home: Home, size: int, seed: int) -> list[dict[str, str]]:
    """``size`` of one home's commands with the action hassil recognizes in each, drawn evenly over
    :data:`INTENTS`; every one names a device or an area."""
    from hassil import recognize
    from hassil.expression import TextChunk
    from hassil.intents import TextSlotList, TextSlotValue

    rng = np.random.default_rng(seed)
    intents = _templates("en")
    slots = {
        **intents.slot_lists,
        "area": TextSlotList.from_strings(list(home.areas)),
        # a device's domain is context its intents require (HassLightSet: a light); every one is a light here
        "name": TextSlotList(name="name", values=[TextSlotValue(TextChunk(str(d)), str(d), context={"domain": "light"})
                                                  for d in home.devices]),  # fmt: skip
        "floor": TextSlotList.from_strings(list(home.floors)),
    }
    pool = _expand(home, PER_TEMPLATE)
    rows: list[dict[str, str]] = []
    for index, intent in enumerate(INTENTS):
        texts = sorted(set(pool.get(intent, [])))
        count = size // len(INTENTS) + (index < size % len(INTENTS))
        for i in rng.permutation(len(texts)):
            if count == 0:
                break
            command = _fill(texts[i], rng)
            found = recognize(command, intents, slot_lists=slots)
            if found is None or found.intent.name != intent:
                continue
            entities = {k: str(v.value) for k, v in found.entities.items() if k in ("name", "area")}
            if not entities:
                continue
            action = {"intent": intent, "name": entities.get("name"), "area": entities.get("area")}
            rows.append({"prompt": prompt(command), "completion": action_text(action) + END, "home": home.name})
            count -= 1
    rng.shuffle(rows)  # type: ignore[arg-type]
    return rows


def prepare(out: Path, *, homes: int = 8, unseen_homes: int = 2, per_home: int = 30, test_per_home: int = 20,
            seed: int = 0) -> dict[str, Path]:  # fmt: skip
    """Write ``train.jsonl`` and ``clients/<home>.jsonl`` (each training home's share), ``val/<home>.jsonl``
    (a sixth of each training home's commands) and ``test.jsonl`` (the unseen homes') under ``out``."""
    made = make_homes(homes, seed, unseen=False, alpha=1.0, intents=len(INTENTS))
    train: list[dict[str, str]] = []
    paths: dict[str, Path] = {}
    for index, home in enumerate(made):
        rows = home_actions(home, per_home, seed * 7_919 + index)
        cut = len(rows) // 6
        paths[f"val:{home.name}"] = write_jsonl(rows[:cut], out / "val" / f"{home.name}.jsonl")
        paths[f"home:{home.name}"] = write_jsonl(rows[cut:], out / "clients" / f"{home.name}.jsonl")
        train += rows[cut:]
    test: list[dict[str, str]] = []
    for index, home in enumerate(make_homes(unseen_homes, seed, unseen=True, alpha=1.0, intents=len(INTENTS))):
        test += home_actions(home, test_per_home, seed * 7_919 + 100 + index)
    return {"train": write_jsonl(train, out / "train.jsonl"), "test": write_jsonl(test, out / "test.jsonl"), **paths}
