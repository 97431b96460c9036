"""Hostile and careless inputs across the CLI: each ends as a typed one-line error, never "unexpected".

One row per case; the exit code is 2 for a usage error, 1 for anything else refused.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from ondevice.cli import main

ODT = str(Path(sys.executable).parent / "odt")


@pytest.fixture()
def files(tmp_path, digits_artifacts, digits_data) -> dict[str, str]:
    good = {k: v[:32] for k, v in digits_data["train"].items()}
    np.savez(tmp_path / "good.npz", **good)
    (tmp_path / "zero.npz").write_bytes(b"")
    (tmp_path / "table.csv").write_text("a,b,label\n1,2,0\n")
    (tmp_path / "data.txt").write_text("1 2 3\n")
    (tmp_path / "truncated.npz").write_bytes((tmp_path / "good.npz").read_bytes()[:300])
    np.save(tmp_path / "array.npy", good["input"])
    os.replace(tmp_path / "array.npy", tmp_path / "array.npz")  # a bare .npy under an .npz name
    np.savez(tmp_path / "nan.npz", input=np.full((8, 64), np.nan, np.float32), labels=np.zeros(8, np.int64))
    np.savez(tmp_path / "labels.npz", input=good["input"], labels=good["labels"] + 100)
    np.savez(tmp_path / "cube.npz", input=np.zeros((8, 4, 64), np.float32), labels=np.zeros(8, np.int64))
    np.savez(tmp_path / "floatlabels.npz", input=good["input"], labels=good["labels"] + 0.5)
    (tmp_path / "cut.onnx").write_bytes(b"\x08\x07\x12\x04" + bytes(40))  # an ONNX header, cut short
    (tmp_path / "private").write_text("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    model = "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(64, 10))\n"
    (tmp_path / "model.py").write_text(model)
    (tmp_path / "exits.py").write_text("import sys\n\ndef build():\n    sys.exit(3)\n")
    nan = model.replace("    return", "    m = ") + "    m[0].weight.data[0, 0] = float('nan')\n    return m\n"
    (tmp_path / "nanmodel.py").write_text(nan)
    return {"art": str(digits_artifacts), **{p.stem: str(p) for p in tmp_path.iterdir()}, "tmp": str(tmp_path)}


CASES = [
    # data that is not data
    (["train", "{art}", "--data", "{zero}"], 1, "is not an .npz archive"),
    (["train", "{art}", "--data", "{table}"], 1, "takes 64 features per example (64,), the file has 2 feature"),
    (["train", "{art}", "--data", "{tmp}/data.txt"], 1, "odt reads .npz (named arrays"),  # says which formats it reads
    (["train", "{art}", "--data", "{truncated}"], 1, "is not an .npz archive"),
    (["train", "{art}", "--data", "{array}"], 1, "a single .npy array has no names"),
    (["train", "{art}", "--data", "{tmp}/none.npz"], 1, "does not exist"),
    (["train", "{art}", "--data", "{nan}"], 1, "NaN/Inf"),
    (["train", "{art}", "--data", "{labels}"], 1, "class indices in [0, 9]"),
    # a 3-D input for a (batch, 64) model stops at the data check, not in ORT's loss kernel
    (["train", "{art}", "--data", "{cube}"], 1, "needs 2 dimensions"),
    (["train", "{art}", "--data", "{floatlabels}"], 1, "'labels' must be int64"),
    # options out of range
    (["train", "{art}", "--data", "{good}", "--batch-size", "0"], 2, "batch_size must be an integer >= 1"),
    (["train", "{art}", "--data", "{good}", "--epochs", "0"], 2, "epochs must be an integer >= 1"),
    (["train", "{art}", "--data", "{good}", "--lr", "nan"], 2, "finite"),
    (["train", "{art}", "--data", "{good}", "--lr", "-1"], 2, "base > 0"),
    (["train", "{art}", "--data", "{good}", "--batch-size", "1000"], 1, "larger than the dataset"),
    # bundles
    (["bundle", "{art}", "--out", "{tmp}/b", "--lr", "-1"], 1, "base > 0"),
    (["bundle", "{art}", "--out", "{tmp}/b", "--schedule", "cosine"], 1, "needs --total-steps"),
    (["bundle", "{art}", "--out", "{tmp}/b", "--schedule", "linear", "--total-steps", "0"], 1, "total >= 1"),
    (["bundle", "{art}", "--out", "{tmp}/b", "--sign-key", "{private}"], 1, "is a public key"),
    (["verify-bundle", "{tmp}"], 1, "has no bundle.json"),
    # outputs under a path that is a file
    (["bundle", "{art}", "--out", "{good}/b"], 1, "Choose a writable --out"),
    (["keygen", "--out", "{good}/k"], 1, "Choose a writable --out"),
    (["export", "{art}", "--out", "{good}/m.onnx"], 1, "cannot create export directory"),
    # artifacts that are not artifacts
    (["train", "{tmp}", "--data", "{good}"], 1, "not an artifact directory"),
    (["predict", "{tmp}/none.onnx", "--data", "{good}", "--artifacts", "{art}"], 1, "cannot load inference model"),
    (["predict", "{cut}", "--data", "{good}", "--artifacts", "{art}"], 1, "it is not a whole ONNX model"),
    # federated run config
    (["fl", "simulate", "--artifacts", "{art}", "--data", "{tmp}", "--set", "rounds=3"], 2, "mean 'num-server-rounds'"),
    (["fl", "simulate", "--artifacts", "{art}", "--data", "{tmp}"], 2, "has no train.npz"),
    # issue 22's corpus: each of these was silent, untyped, a hang or a crash before
    (["bridge", "serve", "{tmp}", "--port", "99999"], 2, "--port must be a TCP port, 1 to 65535, got 99999"),
    (["bridge", "enroll", "{tmp}", "--count", "10000000"], 2, "--count must be 1 to 10,000"),
    # issue 40's corpus (point 7)
    (["bridge", "serve", "{tmp}", "--max-examples", "0"], 2, "--max-examples must be at least 1, got 0"),
    (["bridge", "serve", "{tmp}", "--max-examples", "-5"], 2, "--max-examples must be at least 1, got -5"),
    (["bridge", "serve", "{tmp}", "--trusted-proxy", "not-an-ip"], 2, "--trusted-proxy takes an IP address"),
    (["predict", "{art}", "--data", "{good}", "--out", "/proc/x.npz"], 1, "cannot write /proc/x.npz"),
    (["train", "{art}", "--data", "{good}", "--seed", "-1"], 2, "seed must be an integer in [0, 2**32), got -1"),
    (
        [
            "generate",
            "--model",
            "{model}:build",
            "--input",
            "input:4x64:float32",
            "--class-weights",
            "1,2",
            "--out",
            "{tmp}/g",
        ],
        1,
        "2 class weights given, but the output 'output' has 10 classes",
    ),
    (
        ["generate", "--model", "{model}:build", "--input", "input:4x64:float32", "--out", "/proc/x"],
        1,
        "cannot write in /proc",
    ),
    (
        ["generate", "--model", "{model}:build", "--input", "input:4x64:float32", "--atol", "-1", "--out", "{tmp}/g"],
        2,
        "atol must be a finite number >= 0, got -1.0",
    ),
    (
        ["generate", "--model", "{exits}:build", "--input", "input:4x64:float32", "--out", "{tmp}/g"],
        1,
        "build() called sys.exit(3)",
    ),
    (
        ["generate", "--model", "{nanmodel}:build", "--input", "input:4x64:float32", "--out", "{tmp}/g"],
        1,
        "'0.weight' holds 1 NaN/Inf",
    ),
]


@pytest.mark.parametrize("argv, code, message", CASES, ids=[f"{i:02d}-{c[0][0]}" for i, c in enumerate(CASES)])
def test_hostile_input_is_a_typed_one_line_error(files, capsys, monkeypatch, argv, code, message):
    monkeypatch.chdir(files["tmp"])  # `odt train` without --checkpoint makes ./NAME.ckpt/ here, not in the repository
    argv = [a.format(**files) for a in argv]
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert "unexpected" not in err and "Traceback" not in err and err.count("\n") == 1
    assert not (Path(files["tmp"]) / "b").exists()  # nothing half-written


def test_decompression_bomb_is_refused_before_reading(files, tmp_path, monkeypatch, capsys):
    """64 MB of zeros compress to ~60 KB: the declared size is checked against the limit first."""
    np.savez_compressed(tmp_path / "bomb.npz", input=np.zeros((262_144, 64), np.float32), labels=np.zeros(262_144))
    assert (tmp_path / "bomb.npz").stat().st_size < 1_000_000
    monkeypatch.setenv("ODT_MAX_DATA_BYTES", str(16 * 2**20))
    assert main(["train", files["art"], "--data", str(tmp_path / "bomb.npz")]) == 1
    err = capsys.readouterr().err
    assert "decompresses to 69,2" in err and "bytes, over the limit of 16,777,216" in err  # 64 + 2 MB + headers


def test_json_mode_reports_hostile_input_as_json(files, capsys):
    assert main(["evaluate", files["art"], "--data", files["zero"], "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "DataError"


def test_an_npy_header_that_claims_terabytes_is_refused_before_allocating(files, tmp_path, capsys):
    """An .npz of a few hundred bytes whose header says (2**40,) float32: a DataError, not a MemoryError."""
    import io
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (2**40,)})
    with zipfile.ZipFile(tmp_path / "forged.npz", "w") as archive:
        archive.writestr("input.npy", header.getvalue() + b"\0" * 64)
        archive.writestr("labels.npy", header.getvalue())
    assert main(["train", files["art"], "--data", str(tmp_path / "forged.npz")]) == 1
    err = capsys.readouterr().err
    assert "claims shape (1099511627776,)" in err and "damaged or forged" in err
