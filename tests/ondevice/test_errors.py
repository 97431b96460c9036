"""Every bad input to the runtime: a typed error that says what to do, and nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ondevice import (
    ArtifactIntegrityError,
    CheckpointError,
    DataError,
    ManifestError,
    OdtError,
    Schedule,
    SchemaVersionError,
    Trainer,
    VersionMismatchError,
    WeightsError,
)
from ondevice.cli import main


@pytest.fixture()
def artifacts(digits_artifacts, tmp_path) -> Path:
    """A private copy that a test may damage."""
    return Path(shutil.copytree(digits_artifacts, tmp_path / "artifacts"))


def _edit_manifest(directory: Path, **changes) -> None:
    path = directory / "manifest.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _all(directory: Path, key: str, **changes) -> list:
    return [{**item, **changes} for item in json.loads((directory / "manifest.json").read_text())[key]]


def _edit_files(directory: Path, extra: dict) -> None:
    files = json.loads((directory / "manifest.json").read_text())["files"]
    _edit_manifest(directory, files={**files, **extra})


def _rehash(directory: Path, name: str, content: bytes) -> None:
    import hashlib

    (directory / name).write_bytes(content)
    _edit_files(directory, {name: hashlib.sha256(content).hexdigest()})


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        # no manifest at all
        (lambda d: (d / "manifest.json").unlink(), ManifestError, "not an artifact directory"),
        # manifest that is not JSON
        (lambda d: (d / "manifest.json").write_text("{"), ManifestError, "not valid JSON"),
        # manifest from a newer schema
        (lambda d: _edit_manifest(d, schema_version=99), SchemaVersionError, "schema version 99"),
        # manifest missing a field
        (lambda d: _edit_manifest(d, trainable=None), ManifestError, "trainable must be a list"),
        # an empty file table would turn the integrity check off
        (lambda d: _edit_manifest(d, files={}), ManifestError, "hashes every file the runtime opens"),
        # offsets that do not tile the buffer (all 0) would return wrong tensors silently
        (
            lambda d: _edit_manifest(d, trainable=_all(d, "trainable", offset=0)),
            ManifestError,
            r"trainable\[1\].offset",
        ),
        # a dtype numpy does not have
        (lambda d: _edit_manifest(d, inputs=_all(d, "inputs", dtype="float99")), ManifestError, "inputs.0..dtype"),
        # a learning rate that is not a number
        (lambda d: _edit_manifest(d, optimizer={"kind": "adamw", "lr": "fast"}), ManifestError, "optimizer.lr"),
        # a file name that leaves the directory
        (lambda d: _edit_files(d, {"../../etc/passwd": "0" * 64}), ManifestError, "plain file name"),
        # a zero-size parameter
        (lambda d: _edit_manifest(d, frozen=[{"name": "x", "shape": [0]}]), ManifestError, r"frozen\[0\].shape"),
        # an empty model with a re-hashed manifest: ORT's refusal, without ORT's source paths
        (lambda d: _rehash(d, "training_model.onnx", b""), Exception, r"^(?!.*onnxruntime_src)(?!.*\.cc:).*$"),
        # an adapter whose A and B do not fit its weight (0.weight is 32 x 64 in the digits MLP)
        (
            lambda d: _edit_manifest(d, adapters=[{"weight": "0.weight", "a": "0.bias", "b": "3.weight", "scale": 2}]),
            ManifestError,
            r"adapters\[0\] must be A \(rank x 64\)",
        ),
        # a finite check that is not an output name
        (lambda d: _edit_manifest(d, finite_check=1), ManifestError, "finite_check must be a non-empty string"),
        # class names that do not match, or repeat
        (lambda d: _edit_manifest(d, labels=["a", "a"]), ManifestError, "labels must be distinct class names"),
        # a tokenizer that is not one of the hashed files
        (
            lambda d: _edit_manifest(d, tokenizer={"file": "t.json", "ids": "input", "mask": None, "max_length": 8}),
            ManifestError,
            "tokenizer.file must be a file listed in files",
        ),
        # a decoder graph that is not one of the hashed files
        (
            lambda d: _edit_manifest(d, decoder={"file": "decoder.onnx", "layers": 1, "kv_heads": 1, "head_dim": 4,
                                                 "eos": [0], "max_positions": 8, "attention": "eager"}),  # fmt: skip
            ManifestError,
            "decoder.file must be a file listed in files",
        ),
        # an artifact file altered after generation
        (
            lambda d: (d / "checkpoint").write_bytes((d / "checkpoint").read_bytes()[:-10] + b"0" * 10),
            ArtifactIntegrityError,
            "checkpoint was altered",
        ),
        # an artifact file missing
        (lambda d: (d / "eval_model.onnx").unlink(), ArtifactIntegrityError, "eval_model.onnx is missing"),
        # artifacts made for another ORT
        (
            lambda d: _edit_manifest(d, versions={"onnxruntime": "1.17.0"}),
            VersionMismatchError,
            "onnxruntime-training==1.17.0",
        ),
    ],
)
@pytest.mark.classic
def test_bad_artifact_directory(artifacts, damage, error, message):
    damage(artifacts)
    with pytest.raises(error, match=message) as caught:
        Trainer.load(artifacts)
    assert isinstance(caught.value, OdtError), caught.value  # typed, never a raw ORT or Python error


def test_missing_directory(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        Trainer.load(tmp_path / "nowhere")


def _good(digits_data, n=64):
    return {k: v[:n].copy() for k, v in digits_data["train"].items()}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # wrong input name
        (lambda d: {"pixels": d["input"], "labels": d["labels"]}, r"data has no \['input'\]"),
        # float labels: unsafe cast refused
        (lambda d: {**d, "labels": d["labels"].astype(np.float32)}, "must be int64"),
        # wrong feature shape
        (lambda d: {**d, "input": d["input"][:, :60]}, r"needs shape \(batch, 64\)"),
        # wrong rank
        (lambda d: {**d, "input": d["input"].reshape(-1, 8, 8)}, "needs 2 dimensions"),
        # labels out of range
        (lambda d: {**d, "labels": d["labels"] + 10}, r"class indices in \[0, 9\]"),
        # inputs and labels of different length
        (lambda d: {**d, "labels": d["labels"][:-1]}, "same number of examples"),
        # empty dataset
        (lambda d: {k: v[:0] for k, v in d.items()}, "dataset is empty"),
        # non-finite data
        (
            lambda d: {**d, "input": np.where(np.arange(64)[:, None] == 3, np.nan, d["input"]).astype(np.float32)},
            "NaN/Inf",
        ),
        # not a mapping
        (lambda d: [d["input"], d["labels"]], "must map input names"),
    ],
)
def test_bad_data(digits_artifacts, digits_data, change, message):
    trainer = Trainer.load(digits_artifacts)
    before = trainer.get_flat_weights()
    with pytest.raises(DataError, match=message):
        trainer.fit(change(_good(digits_data)), epochs=1, batch_size=8, progress=False)
    np.testing.assert_array_equal(trainer.get_flat_weights(), before)


def test_safe_casts_are_accepted(digits_artifacts, digits_data):
    data = _good(digits_data)
    cast = {"input": data["input"].astype(np.float64), "labels": data["labels"].astype(np.int32)}
    trainer, twin = Trainer.load(digits_artifacts), Trainer.load(digits_artifacts)
    trainer.train_step(cast)
    twin.train_step(data)
    np.testing.assert_array_equal(trainer.get_flat_weights(), twin.get_flat_weights())


def test_batch_larger_than_data(digits_artifacts, digits_data):
    with pytest.raises(DataError, match="batch size 100 is larger than the dataset"):
        Trainer.load(digits_artifacts).fit(_good(digits_data, 50), epochs=1, batch_size=100, progress=False)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (np.zeros(10, np.float32), "needs 17226 values"),  # wrong length
        (np.full(17226, np.nan, np.float32), "NaN/Inf"),  # non-finite
        (np.zeros(17226, np.int64), "floating point"),  # wrong dtype
        ({"0.weight": np.zeros((128, 64))}, "missing"),  # names missing
    ],
)
def test_bad_weights(digits_artifacts, weights, message):
    trainer = Trainer.load(digits_artifacts)
    before = trainer.get_flat_weights()
    with pytest.raises(WeightsError, match=message):
        trainer.set_weights(weights)
    np.testing.assert_array_equal(trainer.get_flat_weights(), before)


def test_weight_of_wrong_shape(digits_artifacts):
    trainer = Trainer.load(digits_artifacts)
    weights = trainer.get_weights()
    weights["0.weight"] = weights["0.weight"].T
    with pytest.raises(WeightsError, match=r"'0.weight' needs shape \(128, 64\)"):
        trainer.set_weights(weights)


def test_checkpoint_from_other_artifacts(digits_artifacts, digits_sgd, digits_data, tmp_path):
    Trainer.load(digits_sgd).save(tmp_path / "other.ckpt")
    with pytest.raises(CheckpointError, match="saved from other artifacts"):
        Trainer.load(digits_artifacts, checkpoint=tmp_path / "other.ckpt")


def test_truncated_checkpoint(digits_artifacts, tmp_path):
    path = Trainer.load(digits_artifacts).save(tmp_path / "c.ckpt")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        Trainer.load(digits_artifacts, checkpoint=path)
    with pytest.raises(CheckpointError, match="does not exist"):
        Trainer.load(digits_artifacts, checkpoint=tmp_path / "none.ckpt")


def test_unwritable_checkpoint_location(digits_artifacts, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="cannot create checkpoint directory"):
        Trainer.load(digits_artifacts).save(tmp_path / "file" / "c.ckpt")


def test_disk_full_keeps_the_previous_checkpoint(digits_artifacts, tmp_path):
    # A real write failure: the file-size limit (RLIMIT_FSIZE) makes the kernel refuse the write.
    code = f"""
import resource, signal, sys
from ondevice import Trainer, CheckpointError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
t = Trainer.load({str(digits_artifacts)!r})
path = t.save({str(tmp_path / "c.ckpt")!r})
print(path.stat().st_size)
t.epoch = 5
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    t.save(path)
except CheckpointError as exc:
    print("refused:", exc)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    size, refused = result.stdout.strip().splitlines()
    assert refused.startswith("refused: could not write checkpoint") and "previous checkpoint" in refused
    assert "the file-size limit of this process was reached (ulimit -f)" in refused and ".ort.tmp" not in refused
    assert (tmp_path / "c.ckpt").stat().st_size == int(size)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c.ckpt.lock", "c.ckpt"]  # no temporary file left
    assert Trainer.load(digits_artifacts, checkpoint=tmp_path / "c.ckpt").epoch == 0


def test_cli_errors_are_one_line(digits_artifacts, tmp_path, capsys):
    assert main(["train", str(digits_artifacts), "--data", str(tmp_path / "none.npz")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: data file {tmp_path / 'none.npz'} does not exist.\n"
    assert main(["train", str(digits_artifacts), "--data", "x.npz", "--resume"]) == 1
    assert "--resume needs --checkpoint" in capsys.readouterr().err


def test_cli_bad_training_options_are_typed_errors(digits_artifacts, digits_data, tmp_path, capsys):
    np.savez(tmp_path / "train.npz", **_good(digits_data, 64))
    for option, message in (("--epochs", "epochs must be an integer >= 1"), ("--lr", "schedule needs base > 0")):
        argv = ["train", str(digits_artifacts), "--data", str(tmp_path / "train.npz"), option, "0"]
        assert main(argv) == 2  # a usage error
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "unexpected" not in err, err


def test_cli_resume_continues_the_checkpoints_cosine(digits_artifacts, digits_data, tmp_path, capsys):
    """`odt train --resume` with more epochs keeps the original curve; a too-long run is refused."""
    np.savez(tmp_path / "train.npz", **_good(digits_data, 64))
    base = ["train", str(digits_artifacts), "--data", str(tmp_path / "train.npz"), "--checkpoint", str(tmp_path)]
    assert main([*base, "--epochs", "2", "--schedule", "cosine", "--lr", "0.01", "--batch-size", "16"]) == 0
    capsys.readouterr()
    assert main([*base, "--epochs", "3", "--resume", "--batch-size", "16"]) == 2
    assert "the cosine schedule spans 8 optimizer steps, but training to epoch 3 takes 12" in capsys.readouterr().err
    resumed = Trainer.load(digits_artifacts, checkpoint=tmp_path / "latest.ckpt")
    assert resumed.schedule == Schedule("cosine", 0.01, total=8) and resumed.epoch == 2


def test_cli_train_evaluate_export(digits_artifacts, digits_data, tmp_path, capsys):
    np.savez(tmp_path / "train.npz", **_good(digits_data, 128))
    np.savez(tmp_path / "test.npz", **digits_data["test"])
    ckpt = tmp_path / "ckpt"

    def train(epochs: int, *extra: str) -> int:
        data = ["--data", str(tmp_path / "train.npz"), "--checkpoint", str(ckpt), "--json"]
        return main(["train", str(digits_artifacts), *data, "--epochs", str(epochs), *extra])

    assert train(2) == 0
    history = json.loads(capsys.readouterr().out)
    assert [e["epoch"] for e in history["epochs"]] == [1, 2]
    assert train(3, "--resume") == 0
    assert [e["epoch"] for e in json.loads(capsys.readouterr().out)["epochs"]] == [3]
    evaluate = ["evaluate", str(digits_artifacts), "--data", str(tmp_path / "test.npz"), "--checkpoint", str(ckpt)]
    assert main([*evaluate, "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    trained = Trainer.load(digits_artifacts, checkpoint=ckpt / "latest.ckpt").evaluate(digits_data["test"])
    assert metrics == pytest.approx(trained)
    assert main(["export", str(digits_artifacts), "--checkpoint", str(ckpt), "--out", str(tmp_path / "m.onnx")]) == 0
    assert (tmp_path / "m.onnx").stat().st_size > 60_000  # the trained weights are inside


# ORT's messages as they reached users; what is left must name the problem, never ORT's sources.
ORT_MESSAGES = [
    # disk full while saving (measured on a 64 KiB tmpfs)
    (
        "checkpoint.cc:231 ToFile Failed to save checkpoint to file: /x/.c.ckpt.1.ort.tmp. error:No space left on "
        "device errno:28",
        "Failed to save checkpoint to file: /x/.c.ckpt.1.ort.tmp. error:No space left on device",
    ),
    (
        "[ONNXRuntimeError] : 1 : FAIL : /onnxruntime_src/orttraining/orttraining/training_api/module.cc:632 "
        "onnxruntime::training::api::Module::Module(...) inputs.size() == 2 was false. Expected 2 inputs",
        "Expected 2 inputs",
    ),
    (
        "[ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model failed: This is an invalid model.",
        "Load model failed: This is an invalid model.",
    ),
]


@pytest.mark.parametrize("raw, shown", ORT_MESSAGES, ids=["disk full", "module.cc", "invalid graph"])
def test_ort_messages_lose_their_source_locations(raw, shown):
    from ondevice.session import ort_error_message

    message = ort_error_message(RuntimeError(raw))
    assert message.startswith(shown) and ".cc:" not in message and "onnxruntime::" not in message, message


@pytest.mark.parametrize("threads", ["-1", "0", "5000"])
def test_thread_counts_a_machine_cannot_run_are_usage_errors(digits_artifacts, digits_data, tmp_path, capsys, threads):
    """`--threads 5000` made ORT start thousands of threads and hang; `-1` was taken."""
    np.savez(tmp_path / "train.npz", **_good(digits_data, 64))
    argv = ["train", str(digits_artifacts), "--data", str(tmp_path / "train.npz"), "--threads", threads]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: threads must be a whole number from 1 to {4 * (os.cpu_count() or 1)}"), err


def test_ort_format_conversion_writes_a_graph_that_computes_the_same_or_says_why_in_one_line(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from ondevice.ort_format import convert_to_ort_format
    from ondevice.session import ort

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Tanh", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "good.onnx")
    convert_to_ort_format(tmp_path)
    feed = {"x": np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)}
    (found,) = ort.InferenceSession(str(tmp_path / "good.ort"), providers=["CPUExecutionProvider"]).run(None, feed)
    np.testing.assert_allclose(found, np.tanh(feed["x"]), rtol=1e-6)

    (tmp_path / "good.onnx").unlink()
    (tmp_path / "bad.onnx").write_bytes(b"not a graph")
    with pytest.raises(RuntimeError, match="^conversion to ORT format failed: .*bad.onnx") as caught:
        convert_to_ort_format(tmp_path)
    assert "\n" not in str(caught.value) and ".cc:" not in str(caught.value)
