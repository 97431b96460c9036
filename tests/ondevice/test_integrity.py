"""What the graphs were built for is sealed in the manifest, and ids are range-checked before ORT sees them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ondevice import ArtifactIntegrityError, DataError, Manifest, ManifestError, Trainer
from tests.artifacts import models


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from artifacts import generate

    out = tmp_path_factory.mktemp("enc") / "artifacts"
    generate(models.encoder(), torch.randint(0, 50, (4, 16)), out, input_names=["ids"], verify=False)
    return out


def _edit(directory, change) -> None:
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


# Hand edits that used to load without notice: each changes what the graphs were built for.
SEALED_EDITS = [
    ("loss kind", lambda d: d["loss"].update(kind="mse")),  # dropped the label check; +-1e9 crashed ORT
    ("class count", lambda d: d["outputs"][0]["shape"].__setitem__(-1, 20)),  # label 15 then trained silently
    ("trainable swapped", lambda d: d["trainable"].reverse()),
    ("trainable dropped", lambda d: d["trainable"].pop()),
    ("labels", lambda d: d.update(labels=["off", "on", "dim"])),
    ("index limit", lambda d: d["index_limits"].update(ids=10**6)),
]


@pytest.mark.parametrize("change", [c for _, c in SEALED_EDITS], ids=[n for n, _ in SEALED_EDITS])
def test_an_edited_manifest_is_refused(encoder, tmp_path, change):
    import shutil

    copy = tmp_path / "a"
    shutil.copytree(encoder, copy)
    try:
        _edit(copy, change)
    except (KeyError, IndexError):
        pytest.fail("the edit does not apply to these artifacts")
    with pytest.raises((ArtifactIntegrityError, ManifestError), match="Regenerate"):  # the schema or the seal
        Trainer.load(copy)


def test_unsealed_settings_may_change_and_the_seal_survives_a_round_trip(encoder, tmp_path):
    import shutil

    copy = tmp_path / "a"
    shutil.copytree(encoder, copy)
    _edit(copy, lambda d: d.update(name="renamed") or d["optimizer"].update(lr=0.005))
    manifest = Manifest.load(copy)
    assert manifest.optimizer.lr == 0.005 and manifest.index_limits == {"ids": 50}
    assert Manifest.from_json(manifest.to_json()) == manifest


@pytest.mark.parametrize("bad, shown", [(50, "holds 50"), (-1, "holds -1"), (10**9, "holds 1000000000")])
def test_ids_outside_the_table_are_a_data_error_naming_the_example(encoder, bad, shown):
    trainer = Trainer.load(encoder)
    ids = np.random.default_rng(0).integers(0, 50, (8, 16))
    labels = np.zeros(8, np.int64)
    before = trainer.get_flat_weights()
    trainer.evaluate({"ids": ids, "labels": labels})  # in range: fine
    ids[5, 3] = bad
    for call in (lambda: trainer.fit({"ids": ids, "labels": labels}, epochs=1, batch_size=4, progress=False),
                 lambda: trainer.evaluate({"ids": ids, "labels": labels})):  # fmt: skip
        with pytest.raises(DataError, match=f"'ids' must hold ids in \\[0, 49\\].*example 5 {shown}"):
            call()
    np.testing.assert_array_equal(trainer.get_flat_weights(), before)
