"""Every bad input to the generator: a typed one-line error, exit code 1 (2 for usage), nothing left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from artifacts import (
    SGD,
    CrossEntropy,
    InputSpecError,
    ModelLoadError,
    OptionError,
    OutputExistsError,
    SelectionError,
    UnsupportedOperatorError,
    generate,
)
from artifacts.errors import ArtifactError
from ondevice.cli import main
from tests.artifacts import models

MODELS = str(Path(__file__).with_name("models.py"))


def _odt(capsys, *args: str) -> tuple[int, str]:
    code = main(["generate", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # factory not found
        (["--model", f"{MODELS}:nope", "--input", "x:4x16:float32"], "has no 'nope'"),
        # module not importable
        (["--model", "no_such_package.models:build", "--input", "x:4x16:float32"], "cannot import module"),
        # factory returns something that is not an nn.Module
        (["--model", f"{MODELS}:not_a_module", "--input", "x:4x16:float32"], "expected a torch.nn.Module"),
        # example input the model rejects
        (["--model", f"{MODELS}:mlp", "--input", "x:4x15:float32"], "the model rejects the example input"),
        # malformed input spec
        (["--model", f"{MODELS}:mlp", "--input", "x:4by16:float32"], "each dimension is a size or AXIS=SIZE"),
        # unknown dtype
        (["--model", f"{MODELS}:mlp", "--input", "x:4x16:float8"], "dtype must be one of"),
        # pattern that matches no parameter
        (["--model", f"{MODELS}:mlp", "--input", "x:4x16:float32", "--trainable", "head.*"], "matches no parameter"),
        # zero trainable parameters
        (["--model", f"{MODELS}:no_bias", "--input", "x:4x4:float32", "--bias-only"], "no parameter is left to train"),
        # operator without a gradient (or exact rewrite) on the trained path: innermost module, op, remedy
        (
            ["--model", f"{MODELS}:cumsum_head", "--input", "x:4x8:float32"],
            "layer '1' (_Scan) exports as ONNX CumSum",
        ),
        # an optimizer option ORT cannot express
        (
            ["--model", f"{MODELS}:mlp", "--input", "x:4x16:float32", "--optimizer", "sgd", "--momentum", "0.9"],
            "no momentum",
        ),
        # a loss option that does not belong to the loss
        (
            ["--model", f"{MODELS}:mlp", "--input", "x:4x16:float32", "--loss", "mse", "--class-weights", "1,2"],
            "does not take",
        ),
        # weights file that does not exist
        (["--model", f"{MODELS}:mlp", "--input", "x:4x16:float32", "--weights", "/nonexistent.pt"], "does not exist"),
    ],
)
def test_cli_bad_input(tmp_path, capsys, args, message):
    code, err = _odt(capsys, *args, "--out", str(tmp_path / "out"))
    usage = ("the model rejects", "each dimension is", "dtype must be one of")  # what the user typed: exit 2
    assert code == (2 if message.startswith(usage) else 1)
    assert err.startswith("error: ") and message in err, err
    assert "Traceback" not in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["generate", "--model", f"{MODELS}:mlp"])
    assert caught.value.code == 2


def test_unsupported_op_error_suggests_freeze_and_replacement():
    with pytest.raises(UnsupportedOperatorError) as caught:
        generate(
            models.cumsum_head(),
            torch.randn(2, 8),
            Path("/tmp/never-written"),
        )
    text = str(caught.value)
    assert "layer '1' (_Scan)" in text and "--freeze '0.*' --freeze '1.proj.*'" in text
    assert "replace it" in text
    assert not Path("/tmp/never-written").exists()


def test_weights_that_do_not_fit(tmp_path):
    from tests.artifacts import models

    weights = tmp_path / "w.pt"
    torch.save({"0.weight": torch.zeros(3, 3)}, weights)
    from artifacts.loading import load_weights

    with pytest.raises(ModelLoadError, match=r"missing .*2\.bias.*wrong shape \['0\.weight: file \(3, 3\)"):
        load_weights(models.mlp(), weights)


def test_existing_output_is_never_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="--force"):
        generate(torch.nn.Linear(3, 2), torch.randn(2, 3), out)
    assert (out / "keep.txt").read_text() == "mine"


def test_unwritable_output(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ArtifactError, match="cannot create"):
        generate(torch.nn.Linear(3, 2), torch.randn(2, 3), blocker / "out")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: CrossEntropy(reduction="none"), "training needs a scalar loss"),  # per-sample loss
        (lambda: CrossEntropy(label_smoothing=0.1), "label_smoothing"),  # not in ORT's loss
        (lambda: CrossEntropy(weight=(1.0, float("nan"))), "finite numbers"),  # bad class weights
        (lambda: SGD(lr=0.1, weight_decay=1e-4), "no weight_decay"),  # not in ORT's SGD
        (lambda: SGD(lr=-1.0), "positive finite"),  # negative learning rate
    ],
)
def test_option_errors(make, message):
    with pytest.raises(OptionError, match=message):
        make()


def test_failed_generation_leaves_nothing(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    with pytest.raises(SelectionError):
        generate(model, torch.randn(2, 4), tmp_path / "out", trainable=["nothing.*"])
    with pytest.raises(InputSpecError):
        generate(model, torch.randn(2, 5), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# --force replaces only what odt wrote: each row is a target a careless command line could name.
FORCE_REFUSED = [
    ("", "--out is empty"),  # an unset shell variable: `--out "$OUT"`
    (".", "working directory"),
    ("..", "working directory or one of its parents"),
    ("user", "holds files odt did not write (no manifest.json)"),  # someone's own directory
    ("made+extra", "holds files odt did not write (notes.txt)"),  # odt's artifacts with a user's file added
    ("a-file", "is not a directory odt wrote"),
]


@pytest.mark.parametrize("target, message", FORCE_REFUSED, ids=[r[1][:24] for r in FORCE_REFUSED])
def test_force_never_replaces_what_odt_did_not_write(tmp_path, monkeypatch, capsys, target, message):
    from ondevice.cli import main

    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    (work / "mine.txt").write_text("a user's file")
    (tmp_path / "work" / "theirs.txt").write_text("another")
    (work / "user").mkdir()
    (work / "user" / "thesis.tex").write_text("years of work")
    (work / "a-file").write_text("data")
    (work / "m.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(3, 2)\n")
    monkeypatch.chdir(work)
    generate(torch.nn.Linear(3, 2), torch.randn(2, 3), work / "made+extra", verify=False)
    (work / "made+extra" / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    argv = ["generate", "--model", "m.py:build", "--input", "input:2x3:float32", "--loss", "mse", "--no-verify",
            "--out", target]  # fmt: skip
    assert main([*argv, "--force"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing deleted or changed


def test_force_replaces_odts_own_output_and_cleans_killed_runs(tmp_path, monkeypatch):
    """An empty directory or one odt wrote is replaced; a killed run's hidden .partial directory (its
    pid no longer alive) is removed by the next run, a live run's is left alone."""
    import os
    import subprocess

    (tmp_path / "empty").mkdir()
    generate(torch.nn.Linear(3, 2), torch.randn(2, 3), tmp_path / "empty", verify=False, force=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".m.{dead.pid}.abc.partial"
    live = tmp_path / f".m.{os.getppid()}.abc.partial"
    for d in (stale, live):
        d.mkdir()
        (d / "training_model.onnx").write_text("half")
    generate(torch.nn.Linear(3, 2), torch.randn(2, 3), tmp_path / "m", verify=False)
    generate(torch.nn.Linear(3, 2), torch.randn(2, 3), tmp_path / "m", verify=False, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["empty", "m", live.name])
