"""Frozen weights live once, in frozen.bin (memory-mapped by ORT): not in the checkpoint, not copied at load."""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

from ondevice import ConfigError, ManifestError, Trainer
from ondevice.manifest import Manifest
from tests.conftest import ROOT

HIDDEN = 2048  # four frozen 2048 x 2048 layers: 67 MB of frozen weights (far above ORT's own load overhead)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.Tanh()]
    return nn.Sequential(nn.Linear(16, HIDDEN), nn.Tanh(), *layers, nn.Linear(HIDDEN, 3))


@pytest.fixture(scope="module")
def frozen_body(tmp_path_factory):  # type: ignore[no-untyped-def]
    from artifacts import generate

    model = _model()
    out = tmp_path_factory.mktemp("frozen") / "artifacts"
    generate(model, {"x": torch.randn(8, 16)}, out, trainable=["0", "10"])
    return out, model


def _batch(size: int = 8, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((size, 16), dtype=np.float32), "labels": rng.integers(0, 3, size)}


def test_frozen_weights_are_in_the_file_with_pytorchs_values_and_not_in_checkpoints(frozen_body, tmp_path):
    out, model = frozen_body
    manifest = Manifest.load(out)
    frozen_bytes = 4 * manifest.frozen_size
    assert manifest.frozen_file["file"] == "frozen.bin"
    assert sorted(manifest.frozen_file["offsets"]) == sorted(p.name for p in manifest.frozen)
    assert (out / "frozen.bin").stat().st_size == frozen_bytes
    assert (out / "checkpoint").stat().st_size < 0.1 * frozen_bytes

    trainer = Trainer.load(out)
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(trainer.parameter(name), value.numpy(), err_msg=name)
    for _ in range(2):
        trainer.train_step(_batch())
    saved = trainer.save(tmp_path / "ckpt" / "latest.ckpt")
    assert saved.stat().st_size < 0.1 * frozen_bytes  # trainable tensors and two AdamW moments only

    resumed = Trainer.load(out, checkpoint=saved)
    for name, value in trainer.get_weights().items():
        np.testing.assert_array_equal(resumed.get_weights()[name], value)
    assert resumed.eval_step(_batch()).loss == trainer.eval_step(_batch()).loss


def test_export_writes_the_frozen_weights_into_the_model(frozen_body, tmp_path):
    import onnxruntime as ort

    out, _ = frozen_body
    trainer = Trainer.load(out)
    trainer.train_step(_batch())
    path = trainer.export(tmp_path / "model.onnx")
    assert path.stat().st_size > 4 * trainer.manifest.frozen_size  # self-contained, no frozen.bin beside it
    batch = _batch()
    (scores,) = ort.InferenceSession(str(path)).run(None, {"x": batch["x"]})
    np.testing.assert_allclose(scores, trainer.eval_step(batch).outputs["output"], rtol=1e-5, atol=1e-6)


LOAD_PEAK = """
import json, sys
def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
from ondevice import Trainer
before = rss("VmHWM")
trainer = Trainer.load(sys.argv[1])
print(json.dumps({"before": before, "after_load": rss("VmHWM")}))
"""


def test_loading_makes_no_copy_of_the_frozen_weights(frozen_body):
    """ORT reads a checkpoint into one buffer and copies every tensor out of it: with the frozen
    weights in the checkpoint, loading peaked at twice their size. Now they are mapped, not read."""
    out, _ = frozen_body
    done = subprocess.run([sys.executable, "-c", LOAD_PEAK, str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    frozen_bytes = 4 * Manifest.load(out).frozen_size
    assert figures["after_load"] - figures["before"] < 0.5 * frozen_bytes, figures


def test_a_frozen_file_layout_that_does_not_tile_is_refused(frozen_body, tmp_path):
    import shutil

    out, _ = frozen_body
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    data = json.loads((copy / "manifest.json").read_text())
    first = next(iter(data["frozen_file"]["offsets"]))
    data["frozen_file"]["offsets"][first] = 4
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"frozen_file.offsets\[.*the tensors tile the file in order"):
        Manifest.load(copy)


def test_a_bundle_carries_the_frozen_weights_in_its_checkpoint_and_trains_the_same(frozen_body, tmp_path):
    from mobile_bridge import load_trainer, make_bundle

    out, _ = frozen_body
    make_bundle(out, tmp_path / "bundle")
    assert not (tmp_path / "bundle" / "frozen.bin").exists()
    assert (tmp_path / "bundle" / "checkpoint").stat().st_size > 4 * Manifest.load(out).frozen_size
    bundled, plain = load_trainer(tmp_path / "bundle", None), Trainer.load(out)
    portable = Trainer.load(tmp_path / "bundle", engine="portable")  # the portable graphs take them as inputs too
    for _ in range(3):
        loss = plain.train_step(_batch()).loss
        assert bundled.train_step(_batch()).loss == pytest.approx(loss, rel=1e-6)
        assert portable.train_step(_batch()).loss == pytest.approx(loss, rel=1e-5)


class _Lookup(nn.Module):
    """A frozen 20000 x 128 table (10 MB) and a frozen projection under a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table, self.project, self.head = nn.Embedding(20_000, 128), nn.Linear(128, 128), nn.Linear(128, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.project(self.table(ids).mean(1))))


def _resident_pages(address: int, length: int) -> int:
    """How many pages of this process's memory in [address, address + length) are mapped in (pagemap's
    present bit, readable without privileges)."""
    import mmap
    import struct

    page = mmap.PAGESIZE
    first, last = address // page, (address + length - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(8 * first)
        entries = struct.unpack(f"{last - first + 1}Q", pagemap.read(8 * (last - first + 1)))
    return sum(entry >> 63 for entry in entries)


def _mappings(path) -> int:
    return sum(line.rstrip("\n").endswith(" " + str(path)) for line in open("/proc/self/maps"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")
def test_a_step_maps_the_rows_of_a_lookup_table_it_reads_then_lets_them_go(tmp_path):
    """With the file in the page cache in large folios, one touched row mapped a whole folio: 64 rows
    of MiniLM's word table put 38 MB into RSS; and every row an epoch read stayed (31 MiB of it after
    64 Spanish commands). Rows now fault in alone, and leave RSS when the step is done."""
    from artifacts import generate

    model = _Lookup()
    out = tmp_path / "artifacts"
    generate(model, {"ids": torch.randint(0, 20_000, (4, 8))}, out, trainable=["head"])
    manifest = Manifest.load(out)
    assert manifest.frozen_file["lookups"] == ["table.weight"]  # the projection is read whole: not a lookup
    (out / "frozen.bin").read_bytes()  # the whole file in the page cache, as after hashing it

    trainer = Trainer.load(out, evaluation=False)
    table = trainer._frozen.values["table.weight"].numpy()  # a view of the one mapping the sessions read
    ids = (np.arange(64, dtype=np.int64) * 311).reshape(8, 8)  # 64 rows spread over the table
    feeds = [ids, np.arange(8) % 3]
    trainer._engine.train_step(feeds)  # the engine's step alone: the rows it read are still mapped
    mapped = _resident_pages(table.ctypes.data, table.nbytes)
    assert 0 < mapped <= 64 * 2, mapped  # each row (512 bytes) within a page or two of its own
    trainer._engine.reset_grad()
    for _ in range(3):
        trainer.train_step({"ids": ids, "labels": np.arange(8) % 3})
    assert _resident_pages(table.ctypes.data, table.nbytes) == 0  # the trainer's step lets them go
    reference = model.table(torch.from_numpy(ids)).detach().numpy()
    np.testing.assert_array_equal(trainer.parameter("table.weight")[ids], reference)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise; reads /proc/self/pagemap")
@pytest.mark.parametrize("engine", [pytest.param("classic", marks=pytest.mark.classic), "portable"])
def test_streamed_weights_leave_rss_after_every_step_and_train_bit_for_bit_the_same(frozen_body, engine):
    """A step reads every frozen page and each stayed mapped: the peak held the whole frozen.bin (SmolLM2
    int8: 131 of 378 MiB). Streamed, the trainer unmaps them as it runs; the pages come back from the
    page cache unchanged, so training computes exactly what it computed before."""
    out, _ = frozen_body
    plain = Trainer.load(out, engine=engine)
    streamed = Trainer.load(out, engine=engine, stream_weights=True)
    for step in range(3):
        batch = _batch(seed=step)
        assert streamed.train_step(batch).loss == plain.train_step(batch).loss
        assert _resident_pages(*streamed._frozen._whole[0]) == 0
        assert _resident_pages(*plain._frozen._whole[0]) > 1_000  # 67 MB read by the step, still mapped
    for name in ("0.weight", "10.weight"):
        np.testing.assert_array_equal(streamed.parameter(name), plain.parameter(name))
    assert streamed.evaluate(_batch(16)) == plain.evaluate(_batch(16))
    assert _resident_pages(*streamed._frozen._whole[0]) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise; reads /proc/self/pagemap")
def test_streaming_unmaps_the_pages_while_a_run_is_still_going(frozen_body):
    """The pages must leave while a step runs (its peak), not only after: inside the block the thread
    unmaps what was read, and the thread is gone when the block ends."""
    out, _ = frozen_body
    frozen = Trainer.load(out, engine="portable", stream_weights=True)._frozen
    address, length = frozen._whole[0]
    weights = np.frombuffer((ctypes.c_char * length).from_address(address), np.uint8)
    with frozen.reading():
        weights[:: mmap.PAGESIZE].sum(dtype=np.int64)  # every page read, as a step reads them
        for _ in range(600):  # what the thread does every 10 ms; waited for, up to 60 s on a busy machine
            if _resident_pages(address, length) == 0:
                break
            time.sleep(0.1)
        assert _resident_pages(address, length) == 0
    assert "odt-stream-weights" not in [thread.name for thread in threading.enumerate()]
    assert not Trainer.load(out)._frozen.stream  # off unless asked for or planned
    assert Trainer.load(out, stream_weights=True).streams_weights and not Trainer.load(out).streams_weights
    with pytest.raises(ConfigError, match="stream_weights must be True, False or None, got 'yes'"):
        Trainer.load(out, stream_weights="yes")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.classic
def test_training_and_eval_sessions_read_one_mapping_of_the_frozen_weights(frozen_body):
    """ORT maps external data once per session and RSS counts a page once per mapping: validation put the
    frozen weights into RSS a second time (MiniLM: odt train --val 180 -> 255 MiB). The runtime now maps
    frozen.bin once for all sessions, and computes what ORT's own mappings computed, bit for bit."""
    from ondevice.engines.classic import OrtTraining
    from ondevice.session import set_seed

    out, _ = frozen_body
    path = (out / "frozen.bin").resolve()
    gc.collect()  # earlier tests' portable trainers (reference cycles) still held their mappings
    assert _mappings(path) == 0
    reference = OrtTraining(out)  # no shared weights: each session maps the file itself
    assert _mappings(path) >= 2
    del reference
    trainer = Trainer.load(out)
    assert _mappings(path) == 1
    reference = OrtTraining(out)
    for _ in range(3):
        set_seed(7)
        ours = trainer.train_step(_batch()).loss
        set_seed(7)
        theirs = float(reference.train_step(list(_batch().values()))[0])
        reference.optimizer_step()
        reference.reset_grad()
        assert ours == theirs
    np.testing.assert_array_equal(trainer.get_flat_weights(), reference.get_flat())
    assert trainer.eval_step(_batch()).loss == float(reference.eval_step(list(_batch().values()))[0])


def test_the_portable_engine_reads_the_frozen_weights_as_inputs_of_ort_format_graphs(frozen_body, monkeypatch):
    """ONNX Runtime keeps less of a graph loaded from its own format (SmolLM2 int8 LoRA: 24 MiB less RSS per
    training session, loaded in 0.9 instead of 5.2 s). Artifacts with frozen.bin carry ORT-format copies of
    the portable training, step and eval graphs, with the frozen weights as inputs: the copies hold none of
    them, the engine binds its one mapping of the file to them, and whole and accumulated steps train, and
    evaluation scores, as on the ONNX graphs."""
    out, _ = frozen_body
    manifest = Manifest.load(out)
    assert manifest.portable_ort == {"training": "training_model.portable.ort", "step": "step_model.portable.ort",
                                     "eval": "eval_model.portable.ort"}
    frozen_bytes = (out / "frozen.bin").stat().st_size
    assert all((out / name).stat().st_size < frozen_bytes / 100 for name in manifest.portable_ort.values())
    rng = np.random.default_rng(3)
    data = {"x": rng.standard_normal((16, 16), dtype=np.float32), "labels": rng.integers(0, 3, 16)}
    from ondevice.engines import update_kernel

    monkeypatch.setenv(update_kernel.ENV, "0")  # the update graph, so the fused step's copy runs too
    runs = {}
    for kind in ("ort", "onnx"):
        if kind == "onnx":
            monkeypatch.setattr(Manifest, "portable_ort", property(lambda self: {}))
        trainer = Trainer.load(out, engine="portable")
        engine = trainer._engine
        names = {i.name for i in engine._fused.get_inputs()}
        assert (set(engine._frozen) <= names) == (kind == "ort")  # the mapping is bound, not copied in
        whole = [trainer.train_step(_batch()).loss for _ in range(3)]
        trainer.fit(data, epochs=1, batch_size=8, accumulate=2, shuffle=False, progress=False)  # the training graph
        for session in (engine._train, engine._eval):
            assert (set(engine._frozen) <= {i.name for i in session.get_inputs()}) == (kind == "ort")
        runs[kind] = (whole, trainer.get_flat_weights(), trainer.eval_step(_batch()).loss)
    np.testing.assert_allclose(runs["ort"][0], runs["onnx"][0], rtol=1e-6)
    np.testing.assert_allclose(runs["ort"][1], runs["onnx"][1], rtol=1e-6, atol=1e-7)
    assert runs["ort"][2] == pytest.approx(runs["onnx"][2], rel=1e-6)


FREED = """
import sys
import numpy as np
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
if sys.argv[1] == "lean":
    from ondevice.session import session_options
    session_options(lean_memory=True)
np.ones(8 << 20, np.uint8)  # glibc mmaps the first large block and raises its threshold when it is freed
before = rss()
np.ones(8 << 20, np.uint8)  # so the second comes from the heap, whose top is not given back
print(rss() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_lean_memory_gives_freed_blocks_back_to_the_system():
    """Without ORT's arena, activations are malloc'd and freed every step in sizes that change with each
    text batch; glibc kept the freed heap top (MiniLM train: 151 -> 213 MiB over an epoch, 188 with this)."""
    kept = {}
    for mode in ("default", "lean"):
        done = subprocess.run([sys.executable, "-c", FREED, mode], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        kept[mode] = int(done.stdout)
    assert kept["default"] >= 4 << 20 and kept["lean"] < 1 << 20, kept


def test_lookups_must_name_tensors_of_the_frozen_file(frozen_body, tmp_path):
    import shutil

    out, _ = frozen_body
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["frozen_file"]["lookups"] = ["no.such.table"]
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"frozen_file.lookups.*a list of tensors in frozen_file.offsets"):
        Manifest.load(copy)


TRAIN_LONG = """
import sys
import numpy as np
from ondevice.cli import main
rng = np.random.default_rng(0)
np.savez(sys.argv[2], x=rng.standard_normal((64, 16), dtype=np.float32), labels=rng.integers(0, 3, 64))
sys.exit(main(["train", sys.argv[1], "--data", sys.argv[2], "--epochs", "100000", "--batch-size", "8",
               "--checkpoint", sys.argv[3], *sys.argv[4:]]))
"""


@pytest.mark.parametrize("engine", ["portable", "portable-streamed",
                                    pytest.param("classic", marks=pytest.mark.classic)])
def test_frozen_bin_truncated_under_training_ends_it_with_a_typed_error(frozen_body, tmp_path, engine):
    """It died of SIGBUS (exit 135, no message, buffered output lost): the read lease holds the truncating
    process until training has stopped, with a typed error, its epoch lines out and its last checkpoint whole."""
    import shutil

    from ondevice._checkpoint import read_header

    out = tmp_path / "artifacts"
    shutil.copytree(frozen_body[0], out)
    options = ["--engine", engine.split("-")[0], *(["--stream-weights"] if "streamed" in engine else [])]
    trainer = subprocess.Popen([sys.executable, "-c", TRAIN_LONG, str(out), str(tmp_path / "d.npz"),
                                str(tmp_path / "ck"), *options], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        lines = []
        while not any(line.startswith("epoch 2") for line in lines):  # two epochs done: a checkpoint exists
            line = trainer.stdout.readline()
            assert line, trainer.stderr.read()[-2000:]
            lines.append(line)
        os.truncate(out / "frozen.bin", 4096)  # held by the kernel until the trainer lets go
        code = trainer.wait(timeout=120)
    finally:
        trainer.kill()
    err = trainer.stderr.read()
    assert code == 1, (code, err[-2000:])
    assert "frozen.bin changed while training read it: another process opened it to write or truncate it" in err
    assert "the last checkpoint is intact" in err and "Traceback" not in err
    assert read_header(tmp_path / "ck" / "latest.ckpt")["epoch"] >= 2  # checksummed, whole


def test_frozen_bin_replaced_between_steps_is_noticed(frozen_body, tmp_path):
    """Without a lease (another thread, another system) a change between steps is still caught."""
    import shutil

    from ondevice.errors import ArtifactIntegrityError

    out = tmp_path / "artifacts"
    shutil.copytree(frozen_body[0], out)
    trainer = Trainer.load(out, engine="portable")
    trainer.train_step(_batch())
    (out / "frozen.new").write_bytes((out / "frozen.bin").read_bytes())
    os.replace(out / "frozen.new", out / "frozen.bin")  # a new file under the name: the mapping keeps the old one
    with pytest.raises(ArtifactIntegrityError, match="frozen.bin changed while training read it: it was removed or "
                                                     "replaced"):  # fmt: skip
        trainer.train_step(_batch())


PREDICT_PEAK = """
import sys
import numpy as np
rng = np.random.default_rng(1)
x = rng.standard_normal((8, 16), dtype=np.float32)
if sys.argv[2] == "mapped":
    from ondevice import Predictor
    out = Predictor(sys.argv[1]).predict({"x": x})["output"]
else:
    import onnxruntime as ort
    session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
    out = session.run(["output"], {"x": x})[0]
np.save(sys.argv[3], out)
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) * 1024)
"""


@pytest.mark.classic
def test_an_exported_model_is_predicted_from_its_mapped_file(frozen_body, tmp_path):
    """`odt predict model.onnx` held the weights twice (ONNX Runtime's parsed model and its tensors): MiniLM's
    91 MB peaked at 222 MB, over its 200 MB plan. Exported weights start aligned in the file, which Predictor maps
    and feeds: the same outputs as a plain session on the file, from a fresh process holding them once."""
    import onnx

    from ondevice.model_file import ALIGN, mapped_model

    out, _ = frozen_body
    path = Trainer.load(out).export(tmp_path / "model.onnx")
    onnx.checker.check_model(str(path))  # a plain ONNX model for any reader
    skeleton, arrays = mapped_model(path)
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    weights = 4 * Manifest.load(out).frozen_size
    assert sum(a.nbytes for a in arrays.values()) >= weights and len(skeleton) < 0.01 * weights
    for name, array in arrays.items():
        np.testing.assert_array_equal(array, stored[name])
        assert array.ctypes.data % ALIGN == 0 and not array.flags.writeable
    peaks, outputs = {}, {}
    for how in ("mapped", "plain"):
        run = subprocess.run([sys.executable, "-c", PREDICT_PEAK, str(path), how, str(tmp_path / f"{how}.npy")],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        peaks[how], outputs[how] = int(run.stdout.split()[-1]), np.load(tmp_path / f"{how}.npy")
    np.testing.assert_allclose(outputs["mapped"], outputs["plain"], rtol=1e-5, atol=1e-6)
    assert peaks["plain"] - peaks["mapped"] > 0.6 * weights, (peaks, weights)  # one copy of the weights less


def test_a_model_another_tool_wrote_loads_as_before(frozen_body, tmp_path):
    import onnx

    from ondevice import Predictor
    from ondevice.model_file import mapped_model

    out, _ = frozen_body
    path = Trainer.load(out).export(tmp_path / "model.onnx")
    onnx.save(onnx.load(str(path)), str(tmp_path / "resaved.onnx"))  # onnx's own layout: aligned by chance only
    resaved = onnx.load(str(tmp_path / "resaved.onnx")).graph.initializer
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in resaved}
    for name, array in mapped_model(tmp_path / "resaved.onnx")[1].items():  # whatever is mapped is the same
        np.testing.assert_array_equal(array, stored[name])
    batch = {"x": _batch()["x"]}
    np.testing.assert_allclose(Predictor(tmp_path / "resaved.onnx").predict(batch)["output"],
                               Predictor(path).predict(batch)["output"], rtol=1e-5, atol=1e-6)  # fmt: skip


PREDICT_LONG = """
import sys
import numpy as np
from ondevice import Predictor
from ondevice.errors import ArtifactIntegrityError
predictor = Predictor(sys.argv[1])
x = np.random.default_rng(0).standard_normal((64, 16), dtype=np.float32)
print("ready", flush=True)
try:
    while True:
        predictor.predict({"x": x}, batch_size=8)
except ArtifactIntegrityError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(1)
"""


def test_an_exported_model_truncated_under_prediction_ends_it_with_a_typed_error(frozen_body, tmp_path):
    """The Predictor maps the exported file's weights: truncating it under a run was a SIGBUS. The read lease holds
    the truncating process until prediction has stopped with a typed error."""
    out, _ = frozen_body
    model = Trainer.load(out).export(tmp_path / "model.onnx")
    predictor = subprocess.Popen([sys.executable, "-c", PREDICT_LONG, str(model)], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert predictor.stdout.readline().strip() == "ready", predictor.stderr.read()[-2000:]
        os.truncate(model, 4096)  # held by the kernel until the predictor lets go
        code = predictor.wait(timeout=120)
    finally:
        predictor.kill()
    err = predictor.stderr.read()
    assert code == 1, (code, err[-2000:])
    assert "model.onnx changed while prediction read it: another process opened it to write" in err, err[-2000:]
    assert "Export the model again" in err and "Traceback" not in err
