"""Voice-assistant commands from Home Assistant's intent templates, one skewed dataset per home.

Home Assistant's English sentence templates (``home-assistant-intents``) are expanded with its own
template library (``hassil``), filled with each home's area, device and floor names. Every home
has its own names and its own mix of intents (Dirichlet), as real homes do. Training homes take
their names from one pool, the held-out homes from another: the test set is homes the model has
never seen, with area and device names it has never read. Deterministic for a seed.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

AREAS = (
    "kitchen", "living room", "bedroom", "bathroom", "garage", "office", "hallway", "dining room", "basement",
    "attic", "nursery", "guest room", "laundry room", "patio", "porch", "study", "den", "pantry", "playroom",
    "master bedroom", "kids room", "workshop", "garden", "balcony", "library", "gym", "sunroom", "cellar",
    "loft", "mudroom", "family room", "back yard", "front yard", "entrance", "landing", "closet",
)  # fmt: skip
DEVICES = (
    "ceiling light", "floor lamp", "desk lamp", "fan", "heater", "tv", "speaker", "blinds", "curtains",
    "coffee maker", "kettle", "dishwasher", "reading light", "night light", "strip lights", "chandelier",
    "air purifier", "humidifier", "radio", "fairy lights", "spotlight", "porch light", "garage door",
    "wall lamp", "pendant", "sconce", "ceiling fan", "projector", "soundbar", "lava lamp", "aquarium light",
    "heated towel rail", "dehumidifier", "window shade", "skylight", "pool pump",
)  # fmt: skip
FLOORS = ("upstairs", "downstairs", "first floor", "second floor", "ground floor", "top floor")
NAMES = {
    "en": (AREAS, DEVICES, FLOORS),
    "es": (
        (
            "cocina", "salón", "dormitorio", "baño", "garaje", "oficina", "pasillo", "comedor", "sótano", "ático",
            "cuarto del bebé", "cuarto de invitados", "lavadero", "patio", "porche", "estudio", "sala de estar",
            "despensa", "cuarto de juegos", "dormitorio principal", "cuarto de los niños", "taller", "jardín",
            "balcón", "biblioteca", "gimnasio", "solárium", "bodega", "buhardilla", "recibidor", "sala familiar",
            "patio trasero", "jardín delantero", "entrada", "rellano", "vestidor",
        ),
        (
            "lámpara del techo", "lámpara de pie", "lámpara del escritorio", "ventilador", "calefactor", "tele",
            "altavoz", "persianas", "cortinas", "cafetera", "hervidor", "lavavajillas", "luz de lectura",
            "luz de noche", "tira de luces", "araña", "purificador", "humidificador", "radio", "guirnalda",
            "foco", "luz del porche", "puerta del garaje", "aplique", "colgante", "lámpara de pared",
            "ventilador de techo", "proyector", "barra de sonido", "lámpara de lava", "luz del acuario",
            "toallero", "deshumidificador", "estor", "claraboya", "bomba de la piscina",
        ),
        ("arriba", "abajo", "primer piso", "segundo piso", "planta baja", "último piso"),
    ),
}  # fmt: skip
"""Area, device and floor names per language: training homes draw from the first half of each pool,
unseen homes from the second."""
MIN_TEMPLATES = 10
"""Intents with fewer distinct sentences than this are left out (too few to learn from or test)."""
PER_TEMPLATE = 8
"""Expansions kept per sentence template and home (names, areas and wordings vary within them)."""


@dataclass(frozen=True)
class Home:
    name: str
    areas: tuple[str, ...]
    devices: tuple[str, ...]
    floors: tuple[str, ...]
    mix: tuple[float, ...]
    """Share of each intent (in the order of ``INTENTS``) in this home's commands."""


@functools.cache
def _templates(language: str):  # type: ignore[no-untyped-def]
    from hassil import Intents
    from home_assistant_intents import get_intents

    logging.getLogger("hassil").setLevel(logging.ERROR)
    return Intents.from_dict(get_intents(language))


def _expand(home: Home, per_template: int, language: str = "en") -> dict[str, list[str]]:
    """Every intent's sentences for one home: up to ``per_template`` expansions of each template.

    Number slots stay as ``{brightness}`` placeholders (spelling out every number of every range
    is hassil's slow part); :func:`_fill` puts seeded numbers in.

    hassil's ``sample_intents`` caps sentences per intent, in template order, so the first
    template of an intent (e.g. covers for HassTurnOff) would crowd out the rest (lights, fans):
    this walks the same templates and caps each one instead.
    """
    from itertools import islice

    from hassil.intents import TextSlotList
    from hassil.sample import sample_sentence

    intents = _templates(language)
    slots = {
        **intents.slot_lists,
        "area": TextSlotList.from_strings(list(home.areas)),
        "name": TextSlotList.from_strings(list(home.devices)),
        "floor": TextSlotList.from_strings(list(home.floors)),
    }
    sentences: dict[str, list[str]] = {}
    for name, intent in intents.intents.items():
        for data in intent.data:
            rules = {**intents.expansion_rules, **data.expansion_rules}
            for template in data.sentences:
                if any(n in data.wildcard_list_names for n in template.list_names(rules)):
                    continue
                texts = sample_sentence(template, slots, rules, language=language, expand_ranges=False)
                sentences.setdefault(name, []).extend(islice(texts, per_template))
    return sentences


_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_RANGES = {"hours": (1, 5), "minutes": (1, 59), "seconds": (5, 59), "temperature": (15, 30), "volume_step": (1, 20)}


def _fill(text: str, rng: np.random.Generator) -> str:
    """Seeded numbers for the range slots: hours 1-5, minutes 1-59, temperatures 15-30, else 0-100."""

    def number(match: re.Match[str]) -> str:
        low, high = next((r for key, r in _RANGES.items() if key in match.group(1)), (0, 100))
        return str(int(rng.integers(low, high + 1)))

    return _PLACEHOLDER.sub(number, text)


def intent_names(language: str = "en") -> list[str]:
    """The intents with at least ``MIN_TEMPLATES`` expansions, sorted: the classifier's labels."""
    areas, devices, floors = NAMES[language]
    probe = Home("probe", areas[:3], devices[:3], floors[:2], ())
    expanded = _expand(probe, PER_TEMPLATE, language)
    return sorted(i for i, texts in expanded.items() if len(set(texts)) >= MIN_TEMPLATES)


def make_homes(count: int, seed: int, *, unseen: bool, alpha: float, intents: int, language: str = "en") -> list[Home]:
    """``count`` homes with names from the first half of each pool (``unseen``: the second half)."""
    rng = np.random.default_rng(seed + (1_000 if unseen else 0))
    areas, devices, floors = NAMES[language]
    half = slice(len(areas) // 2, None) if unseen else slice(None, len(areas) // 2)
    areas, devices = areas[half], devices[half]
    homes = []
    for index in range(count):
        mix = rng.dirichlet(np.full(intents, alpha))
        homes.append(
            Home(
                name=f"{'unseen-' if unseen else ''}home-{index}",
                areas=tuple(rng.choice(areas, 4, replace=False)),
                devices=tuple(rng.choice(devices, 6, replace=False)),
                floors=tuple(rng.choice(floors, 2, replace=False)),
                mix=tuple(float(m) for m in mix),
            )
        )
    return homes


def home_sentences(home: Home, intents: list[str], size: int, seed: int, language: str = "en") -> list[dict[str, str]]:
    """``size`` labelled commands of one home, drawn by its intent mix (each intent at least twice)."""
    rng = np.random.default_rng(seed)
    pool = _expand(home, PER_TEMPLATE, language)
    counts = np.maximum(np.round(np.asarray(home.mix) * size).astype(int), 2)
    rows = []
    for intent, count in zip(intents, counts):
        texts = sorted(set(pool.get(intent, [])))
        for i in rng.choice(len(texts), count, replace=count > len(texts)):
            rows.append({"text": _fill(texts[i], rng), "label": intent, "home": home.name})
    rng.shuffle(rows)  # type: ignore[arg-type]
    return rows


def write_jsonl(rows: list[dict[str, str]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def prepare(
    out: Path, *, homes: int = 8, unseen_homes: int = 2, per_home: int = 400, alpha: float = 1.0, seed: int = 0,
    language: str = "en",
) -> dict[str, Path]:  # fmt: skip
    """Write ``train/val/test.jsonl`` and ``clients/<home>.jsonl`` under ``out``; returns the paths.

    ``train``/``val`` hold the training homes' commands (90/10 per home), ``clients/`` each
    training home's own share of ``train`` (for federated runs, partitioning ``files``), ``test``
    the unseen homes'. ``labels.json`` lists the intents in label order. ``language``: a key of
    :data:`NAMES` (``en``, ``es``), whose Home Assistant templates and names are used.
    """
    if language not in NAMES:
        raise ValueError(f"language must be one of {sorted(NAMES)}, got {language!r}.")
    intents = intent_names(language)
    train, val, test, paths = [], [], [], {}
    made = make_homes(homes, seed, unseen=False, alpha=alpha, intents=len(intents), language=language)
    for index, home in enumerate(made):
        rows = home_sentences(home, intents, per_home, seed * 7_919 + index, language)
        cut = len(rows) // 10
        val += rows[:cut]
        train += rows[cut:]
        paths[home.name] = write_jsonl(rows[cut:], out / "clients" / f"{home.name}.jsonl")
    unseen = make_homes(unseen_homes, seed, unseen=True, alpha=alpha, intents=len(intents), language=language)
    for index, home in enumerate(unseen):
        test += home_sentences(home, intents, per_home, seed * 7_919 + 100 + index, language)
    (out / "labels.json").write_text(json.dumps(intents))
    return {
        "train": write_jsonl(train, out / "train.jsonl"),
        "val": write_jsonl(val, out / "val.jsonl"),
        "test": write_jsonl(test, out / "test.jsonl"),
        "labels": out / "labels.json",
        **{f"home:{name}": path for name, path in paths.items()},
    }
