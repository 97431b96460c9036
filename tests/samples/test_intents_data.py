"""The intents sample's data: deterministic, skewed per home, test homes unseen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("hassil")  # in requirements/lock.txt: never skipped under `make test`
from samples.intents import data as intents  # noqa: E402


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_data_is_deterministic_and_test_homes_are_unseen(tmp_path):
    first = intents.prepare(tmp_path / "a", homes=3, unseen_homes=1, per_home=120)
    again = intents.prepare(tmp_path / "b", homes=3, unseen_homes=1, per_home=120)
    for split in ("train", "val", "test"):
        assert first[split].read_bytes() == again[split].read_bytes()
    other = intents.prepare(tmp_path / "c", homes=3, unseen_homes=1, per_home=120, seed=1)
    assert other["train"].read_bytes() != first["train"].read_bytes()

    labels = json.loads(first["labels"].read_text())
    assert len(labels) >= 25 and labels == sorted(labels)
    train, test = _rows(first["train"]), _rows(first["test"])
    assert {r["label"] for r in train} <= set(labels)
    train_homes = intents.make_homes(3, 0, unseen=False, alpha=1.0, intents=len(labels))
    test_home = intents.make_homes(1, 0, unseen=True, alpha=1.0, intents=len(labels))[0]
    seen_names = {n for h in train_homes for n in (*h.areas, *h.devices)}
    assert not seen_names & {*test_home.areas, *test_home.devices}
    assert any(name in r["text"] for r in test for name in test_home.devices)  # its own names are in its commands
    assert not any(name in r["text"] for r in train for name in test_home.devices)


def test_each_client_file_is_one_home_with_its_own_mix(tmp_path):
    paths = intents.prepare(tmp_path, homes=3, unseen_homes=1, per_home=150)
    clients = sorted((tmp_path / "clients").glob("*.jsonl"))
    assert [p.stem for p in clients] == ["home-0", "home-1", "home-2"]
    mixes = []
    for path in clients:
        rows = _rows(path)
        assert {r["home"] for r in rows} == {path.stem}
        counts = {}
        for r in rows:
            counts[r["label"]] = counts.get(r["label"], 0) + 1
        mixes.append(max(counts, key=counts.get))
    assert len(set(mixes)) > 1  # the homes' favourite intents differ (Dirichlet skew)
    assert sum(len(_rows(p)) for p in clients) == len(_rows(paths["train"]))


def test_spanish_homes_take_spanish_names_and_an_unknown_language_is_refused(tmp_path):
    areas, devices, floors = intents.NAMES["es"]
    assert (
        len(areas) == len(intents.AREAS) and len(devices) == len(intents.DEVICES) and len(floors) == len(intents.FLOORS)
    )
    seen = intents.make_homes(3, 0, unseen=False, alpha=1.0, intents=30, language="es")
    unseen = intents.make_homes(2, 0, unseen=True, alpha=1.0, intents=30, language="es")
    assert all(set(h.areas) <= set(areas[: len(areas) // 2]) for h in seen)
    assert all(set(h.devices) <= set(devices[len(devices) // 2 :]) for h in unseen)
    with pytest.raises(ValueError, match="language must be one of \\['en', 'es'\\], got 'fr'"):
        intents.prepare(tmp_path, language="fr")
    assert not any(tmp_path.iterdir())
