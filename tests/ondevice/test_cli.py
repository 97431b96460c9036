"""The `odt` shell: lazy sub-commands, --version, --debug anywhere, JSON errors, quiet pipes, predict."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ondevice import Manifest, Predictor, Trainer
from ondevice.cli import main

ODT = str(Path(sys.executable).parent / "odt")


def test_help_and_device_commands_never_import_torch_onnx_or_flwr():
    code = (
        "import sys\nfrom ondevice.cli import main\n"
        "for argv in (['--help'], ['train', '--help'], ['predict', '--help'], ['generate', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "heavy = sorted(m for m in ('torch', 'onnx', 'flwr', 'matplotlib', 'fastapi') if m in sys.modules)\n"
        "assert not heavy, heavy\nprint('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("odt 0.")


def test_debug_after_the_subcommand_shows_the_traceback(tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        main(["inspect", str(tmp_path / "none"), "--debug"])


def test_json_errors_are_json(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "none"), "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "ManifestError" and "does not exist" in error["message"] and error["exit_code"] == 1


def test_broken_pipe_is_quiet(digits_artifacts, digits_data, tmp_path):
    """`odt predict --json | head`: the reader leaves after 10 bytes of ~1 MB; no error, no traceback."""
    np.savez(tmp_path / "x.npz", input=np.tile(digits_data["test"]["input"], (20, 1)))
    command = f"'{ODT}' predict '{digits_artifacts}' --data '{tmp_path / 'x.npz'}' --json | head -c 10"
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True)
    assert result.stdout == '{"output":' and result.returncode == 0, result.stderr
    assert result.stderr.startswith("warning: no --checkpoint given") and result.stderr.count("\n") == 1  # only that


def test_predict_matches_the_trainer(digits_artifacts, digits_data, tmp_path, capsys):
    test = {"input": digits_data["test"]["input"][:20]}
    np.savez(tmp_path / "x.npz", **test)
    assert main(["predict", str(digits_artifacts), "--data", str(tmp_path / "x.npz"), "--json"]) == 0
    predicted = np.array(json.loads(capsys.readouterr().out)["output"], np.float32)
    trainer = Trainer.load(digits_artifacts)
    exported = trainer.export(tmp_path / "m.onnx")
    expected = Predictor(exported, Manifest.load(digits_artifacts)).predict(test)["output"]
    np.testing.assert_allclose(predicted, expected, rtol=1e-6)
    capsys.readouterr()
    for extra in ([], ["--artifacts", str(digits_artifacts)]):  # the manifest inside the file, or the artifacts'
        assert main(["predict", str(tmp_path / "m.onnx"), *extra, "--data", str(tmp_path / "x.npz")]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 20 and lines[0].startswith("0\tclass ")
        assert [int(line.split()[2]) for line in lines] == list(expected.argmax(1))


def test_train_without_checkpoint_keeps_the_weights(digits_artifacts, digits_data, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.savez(tmp_path / "t.npz", input=digits_data["train"]["input"][:64], labels=digits_data["train"]["labels"][:64])
    assert main(["train", str(digits_artifacts), "--data", "t.npz", "--epochs", "1"]) == 0
    saved = tmp_path / f"{Path(digits_artifacts).name}.ckpt" / "latest.ckpt"
    out, err = capsys.readouterr()
    assert f"the trained model is in {saved.relative_to(tmp_path)}" in err
    rate = Manifest.load(digits_artifacts).optimizer.lr
    assert f"training: adamw at lr {rate:g} (from the artifacts), constant schedule, 1 epoch(s) of 2 step(s)" in out
    assert Trainer.load(digits_artifacts, checkpoint=saved).epoch == 1
    assert main(["train", str(digits_artifacts), "--data", "t.npz", "--lr", "0.01", "--schedule", "cosine",
                 "--epochs", "1", "--checkpoint", "other"]) == 0  # fmt: skip
    assert "training: adamw at lr 0.01 (from --lr), cosine schedule" in capsys.readouterr().out


def test_commands_without_checkpoint_use_what_train_saved_or_say_untrained(digits_artifacts, digits_data, tmp_path,
                                                                            monkeypatch, capsys):  # fmt: skip
    """`odt train DIR` saves to ./NAME.ckpt/ by default; evaluate, export and predict without --checkpoint
    then use those weights (said on stderr), and say loudly when there are none; the numbers match
    the explicit --checkpoint run and the untrained trainer."""
    monkeypatch.chdir(tmp_path)
    np.savez("t.npz", **{k: v[:256] for k, v in digits_data["train"].items()})
    art = str(digits_artifacts)
    evaluate = ["evaluate", art, "--data", "t.npz", "--json"]
    assert main(evaluate) == 0
    out, err = capsys.readouterr()
    assert "untrained initial weights" in err
    assert json.loads(out) == Trainer.load(art).evaluate({k: v[:256] for k, v in digits_data["train"].items()})
    assert main(["train", art, "--data", "t.npz", "--epochs", "3", "--json"]) == 0
    capsys.readouterr()
    assert main(evaluate) == 0
    implicit, err = capsys.readouterr()
    assert "note: the weights of artifacts.ckpt/" in err
    assert main([*evaluate, "--checkpoint", "artifacts.ckpt"]) == 0
    assert json.loads(implicit) == json.loads(capsys.readouterr().out) != json.loads(out)
    assert main(["export", art, "--out", "m.onnx"]) == 0 and "note: the weights of" in capsys.readouterr().err
    manifest, batch = Trainer.load(art).manifest, {"input": digits_data["test"]["input"][:8]}
    Trainer.load(art, checkpoint="artifacts.ckpt/latest.ckpt").export("trained.onnx")
    Trainer.load(art).export("initial.onnx")
    scores = {n: Predictor(f"{n}.onnx", manifest).predict(batch)["output"] for n in ("m", "trained", "initial")}
    np.testing.assert_array_equal(scores["m"], scores["trained"])
    assert not np.allclose(scores["m"], scores["initial"])


def test_an_exported_model_is_scored_and_run_alone(digits_artifacts, digits_data, tmp_path, capsys):
    """`odt export` embeds the manifest: `odt evaluate/predict model.onnx` need no artifact directory,
    and score exactly what the artifacts' eval graph scores."""
    trainer = Trainer.load(digits_artifacts)
    trainer.fit({k: v[:256] for k, v in digits_data["train"].items()}, epochs=1, batch_size=32, progress=False)
    trainer.export(tmp_path / "m.onnx")
    test = {k: v[:300] for k, v in digits_data["test"].items()}
    np.savez(tmp_path / "test.npz", **test)
    assert main(["evaluate", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "test.npz"), "--json",
                 "--batch-size", "64"]) == 0  # fmt: skip
    scored = json.loads(capsys.readouterr().out)
    expected = trainer.evaluate(test, batch_size=64)
    assert scored["accuracy"] == expected["accuracy"] and abs(scored["loss"] - expected["loss"]) < 1e-5
    assert main(["predict", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "test.npz"), "--json"]) == 0
    assert np.asarray(json.loads(capsys.readouterr().out)["output"]).shape == (len(test["input"]), 10)
    assert Predictor(tmp_path / "m.onnx").manifest == trainer.manifest


@pytest.mark.parametrize("kind, options", [
    ("cross_entropy", {"reduction": "mean", "weight": [0.5, 2.0, 1.0], "ignore_index": 1}),
    ("mse", {"reduction": "mean"}),
    ("l1", {"reduction": "mean"}),
    ("bce_with_logits", {"reduction": "mean", "pos_weight": [3.0, 0.5, 1.0], "weight": None}),
])  # fmt: skip
def test_exported_scoring_computes_pytorchs_losses(kind, options):
    import torch
    import torch.nn.functional as F

    from ondevice.scoring import batch_loss

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    if kind == "cross_entropy":
        y = rng.integers(0, 3, 16)
        ref = F.cross_entropy(torch.from_numpy(x), torch.from_numpy(y), weight=torch.tensor(options["weight"]),
                              ignore_index=options["ignore_index"])  # fmt: skip
    else:
        y = rng.random((16, 3)).astype(np.float32)
        if kind == "bce_with_logits":
            y = (y > 0.5).astype(np.float32)
        ref = (
            {"mse": F.mse_loss, "l1": F.l1_loss}[kind](torch.from_numpy(x), torch.from_numpy(y))
            if kind != "bce_with_logits"
            else F.binary_cross_entropy_with_logits(
                torch.from_numpy(x), torch.from_numpy(y), pos_weight=torch.tensor(options["pos_weight"])
            )
        )
    assert abs(batch_loss(kind, options, x, y) - float(ref)) < 1e-6


def test_predict_runs_a_large_file_in_batches_with_the_same_scores(digits_artifacts, digits_data, tmp_path):
    exported = Trainer.load(digits_artifacts).export(tmp_path / "m.onnx")
    test = {"input": digits_data["test"]["input"]}
    whole = Predictor(exported).predict(test, batch_size=10**6)["output"]
    predictor = Predictor(exported)
    rows: list[int] = []
    run = predictor._session.run
    predictor._session.run = lambda names, feeds: rows.append(len(feeds["input"])) or run(names, feeds)
    np.testing.assert_allclose(predictor.predict(test, batch_size=50)["output"], whole, rtol=1e-6, atol=1e-6)
    assert max(rows) == 50 and sum(rows) == len(test["input"])


def test_lr_find_suggests_a_rate_that_trains_and_saves_nothing(
    digits_no_dropout, data_dir, tmp_path, monkeypatch, capsys
):
    directory, _ = digits_no_dropout
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(directory), "--data", str(data_dir / "train.npz"), "--lr-find", "--json"]) == 0
    curve = json.loads(capsys.readouterr().out)
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no default checkpoint directory
    rates, losses, found = curve["lr"], curve["loss"], curve["suggested_lr"]
    assert rates == sorted(rates) and 5 <= len(rates) <= 100 and rates[0] == pytest.approx(1e-6)
    assert found is not None and rates[0] < found < rates[int(np.argmin(losses))] * 1.0001
    train = dict(np.load(data_dir / "train.npz"))
    after = {}
    for rate in (rates[0], found):
        trainer = Trainer.load(directory)
        trainer.set_lr(rate)
        after[rate] = trainer.fit(train, epochs=1, batch_size=32, progress=False).epochs[-1]["loss"]
    assert after[found] < 0.7 * after[rates[0]]  # the suggestion trains; the ramp's first rate barely moves


def test_the_suggestion_is_the_steepest_fall_before_the_minimum():
    from ondevice.lr_find import suggest

    rates = list(np.geomspace(1e-5, 1, 50))
    x = np.log10(rates)
    losses = list(2 - np.tanh(2 * (x + 3)) + np.where(x > -1, 10 * (x + 1) ** 2, 0))  # falls fastest at 1e-3
    assert suggest(rates, losses) == pytest.approx(1e-3, rel=0.3)
    assert suggest(rates, sorted(losses)) is None  # never falls: no suggestion


def test_every_data_option_names_the_formats_its_loader_reads():
    from ondevice.cli import _parser
    from ondevice.datafiles import DATA_FORMATS

    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("train", "evaluate", "predict"):
        parser = commands.choices[name]
        helps = {a.dest: a.help for a in parser._actions}
        summary = next(c.help for c in commands._choices_actions if c.dest == name)
        for text in (helps["data"], helps.get("val") or helps["data"]):
            assert all(suffix in text for suffix in DATA_FORMATS), (name, text)
        assert not any(s in summary for s in DATA_FORMATS) or all(s in summary for s in DATA_FORMATS), summary
    modes = next(a for a in commands.choices["fl"]._actions if isinstance(a, argparse._SubParsersAction))
    simulate = modes.choices["simulate"]
    data = next(a.help for a in simulate._actions if a.dest == "data")
    assert "train.npz" in data and "clients/*.npz|*.jsonl" in data and "test.jsonl" in data


@pytest.mark.parametrize("where", ["registering", "running"])
def test_a_missing_module_names_the_commands_extra(where, monkeypatch, capsys):
    """`odt fl` without cryptography (which the bridge uses too) asks for [federated], whose flwr brings it."""
    import argparse

    from ondevice import cli

    missing = ModuleNotFoundError("No module named 'cryptography'", name="cryptography")

    def parser() -> argparse.ArgumentParser:
        made = argparse.ArgumentParser(prog="odt")
        commands = made.add_subparsers(dest="command", required=True)
        if where == "registering":
            cli._unavailable(commands, "fl", missing)
        else:
            commands.add_parser("fl").set_defaults(run=lambda args: (_ for _ in ()).throw(missing))
        return made

    monkeypatch.setattr(cli, "_parser", parser)
    assert cli.main(["fl"]) == 1
    err = capsys.readouterr().err
    assert "needs cryptography" in err and "pip install 'ondevice-training[federated]'" in err, err


def test_generate_help_states_the_rates_and_models_it_takes(capsys):
    """The rate hf: models get (2e-3 with adapters, 1e-4 for their own weights) and every kind of --model."""
    from artifacts.cli import HF_FINETUNE_LR, HF_LORA_LR

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"{HF_LORA_LR:.0e}".replace("e-0", "e-") + " for hf: models" in text
    assert f"{HF_FINETUNE_LR:.0e}".replace("e-0", "e-") + " when their own weights" in text
    assert "encoder only" not in text and ".gguf" in text and "causal-lm" in text


def test_stream_weights_on_artifacts_without_a_frozen_file_says_it_does_nothing(digits_artifacts, digits_data,
                                                                                  tmp_path, capsys):  # fmt: skip
    """`--stream-weights` on artifacts that keep no frozen.bin trained silently as if it applied; now the
    run says the flag has no effect (and still trains)."""
    path = tmp_path / "train.npz"
    np.savez(path, **digits_data["train"])
    assert main(["train", str(digits_artifacts), "--data", str(path), "--epochs", "1", "--stream-weights",
                 "--checkpoint", str(tmp_path / "ck")]) == 0  # fmt: skip
    assert "--stream-weights has no effect" in capsys.readouterr().err
    assert (tmp_path / "ck" / "latest.ckpt").exists()
    assert not Trainer.load(digits_artifacts, stream_weights=True).streams_weights
