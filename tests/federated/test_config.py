"""One run-config schema: typed values, ranges, unknown keys, and the app's pyproject table."""

from __future__ import annotations

import time

import pytest
import tomllib

from federated.config import KEYS, Settings, app_config_toml, validate
from federated.errors import RunConfigError
from federated.runner import APP_DIR
from ondevice.cli import main


def test_app_pyproject_table_is_the_schema():
    table = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert table == {k.name: k.default for k in KEYS}
    assert app_config_toml() in (APP_DIR / "pyproject.toml").read_text()
    components = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["components"]
    assert components == {"serverapp": "federated.server_app:app", "clientapp": "federated.client_app:app"}


def test_settings_take_typed_values_from_text():
    settings = Settings.from_config({"lr": "0.01", "local-epochs": "3", "save-updates": "true", "codec": "int8"})
    assert (settings.lr, settings.local_epochs, settings.save_updates, settings.codec) == (0.01, 3, True, "int8")
    assert Settings.from_config({}) == Settings()


@pytest.mark.parametrize(
    "config, message",
    [
        # a typo names the closest key
        ({"local-epoch": 3}, "unknown run config key 'local-epoch'. Did you mean 'local-epochs'?"),
        # text for a number
        ({"lr": "abc"}, "'lr' must be a number, got 'abc'"),
        # a strategy Flower does not have here
        ({"strategy": "fedsgd"}, "'strategy' must be one of"),
        # zero and negative ranges
        ({"lr": 0}, "'lr' must be > 0"),
        ({"num-server-rounds": 0}, "'num-server-rounds' must be >= 1"),
        ({"fraction-train": 1.5}, "'fraction-train' must be > 0 and <= 1"),
        ({"lr": float("nan")}, "must be finite"),
        # a float where an integer is needed
        ({"batch-size": 2.5}, "'batch-size' must be an integer"),
        ({"save-updates": "maybe"}, "must be true or false"),
    ],
)
def test_bad_run_config(config, message):
    with pytest.raises(RunConfigError) as error:
        validate(config)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategy", "fedsgd"], "'strategy' must be one of"),
        (["--set", "lr=abc"], "'lr' must be a number"),
        (["--set", "local-epoch=3"], "Did you mean 'local-epochs'?"),
        (["--artifacts", "/nonexistent"], "does not exist"),
        # node counts a run can never satisfy (each waited forever for min-nodes)
        (["--clients", "0"], "--clients must be at least 1, got 0"),
        (["--clients", "1"], "needs min-nodes=2 nodes but --clients is 1"),
        (["--clients", "2", "--min-nodes", "5"], "Pass --min-nodes 2 or --clients 5"),
        # settings that only failed inside the ServerApp or on every client
        (["--set", "dp-noise=0.5"], "needs both dp-noise > 0 and dp-clip > 0"),
        (["--set", "personal=classifier.*"], "'classifier.*' matches no trainable tensor"),
    ],
)
def test_odt_fl_refuses_bad_config_before_starting_anything(args, message, digits_artifacts, data_dir, tmp_path,
                                                            capsys):  # fmt: skip
    argv = ["fl", "simulate", "--artifacts", str(digits_artifacts), "--data", str(data_dir), "--out", str(tmp_path)]
    started = time.monotonic()
    assert main([*argv, *args]) == 2
    assert time.monotonic() - started < 1.0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "logs").exists()


def test_files_partitioning_needs_one_file_per_client(digits_artifacts, data_dir, tmp_path, capsys):
    """6 files for 8 clients: refused before Flower starts (each client raised it into the log before)."""
    (tmp_path / "data" / "clients").mkdir(parents=True)
    (tmp_path / "data" / "test.npz").write_bytes((data_dir / "test.npz").read_bytes())
    for i in range(6):
        (tmp_path / "data" / "clients" / f"home{i}.npz").write_bytes((data_dir / "val.npz").read_bytes())
    argv = ["fl", "simulate", "--artifacts", str(digits_artifacts), "--data", str(tmp_path / "data"),
            "--out", str(tmp_path / "out"), "--partitioning", "files", "--clients"]  # fmt: skip
    assert main([*argv, "8"]) == 2
    assert "found 6 files for --clients 8. Use --clients 6" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"strategy": "krum"}, "strategy 'krum' looks at each update"),
        ({"codec": "int8"}, "codec must be 'none'"),
        ({"personal": "head.*"}, "personal tensors and tiers"),
        ({"dp-noise": 1.0, "dp-clip": 1.0}, "dp-mode must be 'client'"),
        ({"min-nodes": 1}, "min-nodes must be at least 2"),
        ({"save-updates": True}, "save-updates has nothing to save"),
        ({"secagg-threshold": 0}, "'secagg-threshold' must be > 0 and <= 1"),
        ({"secagg-shares": 1.5}, "'secagg-shares' must be >= 0 and <= 1"),
        # quantization that cannot carry the update (it ruined the model, or made NaN, at run time)
        ({"secagg-clipping-range": 1e30}, r"moves an update in steps of 1.86e\+21, more than 1e-05"),
        ({"secagg-quantization": 1}, "secagg-quantization 1 is below max-examples"),
        ({"secagg-quantization": 2**30, "min-nodes": 4}, r"x 4 nodes passes half the 2\^32 modulus"),
    ],
)
def test_secure_aggregation_refuses_what_needs_each_update(extra, message):
    with pytest.raises(RunConfigError, match=message):
        validate({"secure-aggregation": True, **extra})


def test_the_default_quantization_carries_rounds_up_to_two_thousand_nodes():
    for nodes in (2, 10, 100, 2048):
        validate({"secure-aggregation": True, "min-nodes": nodes})
    with pytest.raises(RunConfigError, match="lower secagg-clipping-range"):
        validate({"secure-aggregation": True, "min-nodes": 2049})
    validate({"secure-aggregation": True, "min-nodes": 2049, "secagg-clipping-range": 2.0})


def test_secure_aggregation_composes_with_client_side_dp():
    checked = validate({"secure-aggregation": "true", "dp-noise": 0.5, "dp-clip": 2.0, "dp-mode": "client",
                        "strategy": "fedadam"})  # fmt: skip
    assert checked["secure-aggregation"] is True


def test_resume_takes_the_runs_own_settings_and_refuses_contradictions(digits_artifacts, data_dir, tmp_path, capsys):
    import argparse
    import json

    from federated.cli import register, run_config

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    out = tmp_path / "run"
    argv = ["fl", "simulate", "--artifacts", str(digits_artifacts), "--data", str(data_dir), "--out", str(out)]
    first = run_config(parser.parse_args([*argv, "--rounds", "7", "--set", "lr=0.01"]))
    out.mkdir()
    (out / "run-config.json").write_text(json.dumps({"mode": "simulate", "nodes": 3, "config": first}))
    (out / "run-state.npz").write_bytes(b"")  # a run to continue (its contents are the ServerApp's to check)
    resumed = run_config(parser.parse_args(["fl", "simulate", "--resume", str(out)]))
    assert resumed == {**first, "resume": True}
    again = run_config(parser.parse_args(["fl", "simulate", "--resume", str(out), "--rounds", "7"]))  # agrees
    assert again == resumed
    assert main(["fl", "simulate", "--resume", str(out), "--rounds", "9", "--set", "lr=0.02"]) == 2
    err = capsys.readouterr().err
    assert "lr: 0.01 in the run, 0.02 given; num-server-rounds: 7 in the run, 9 given. Drop them" in err
    assert main(["fl", "simulate", "--resume", str(out), "--clients", "4"]) == 2
    assert "that run had --clients 3, not 4. Drop --clients." in capsys.readouterr().err
    assert not (out / "logs").exists()


@pytest.mark.parametrize("where", ["missing", "empty", "elsewhere"])
def test_resume_of_a_directory_without_a_run_says_so(where, tmp_path, monkeypatch, capsys):
    """It blamed the default artifacts path (out/digits/artifacts) instead, which the user never gave."""
    from ondevice.cli import main

    target = tmp_path / "not-a-run"
    if where != "missing":
        target.mkdir()
    if where == "elsewhere":
        (target / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)  # no out/digits/artifacts here
    assert main(["fl", "simulate", "--resume", str(target)]) == 2
    err = capsys.readouterr().err
    what = "does not exist" if where == "missing" else "holds no run-state.npz"
    assert f"--resume {target}: there is no run to continue there (the directory {what}" in err, err
    assert "artifacts" not in err and (where == "missing" or sorted(p.name for p in target.iterdir()) ==
                                       ([] if where == "empty" else ["notes.txt"]))  # fmt: skip
