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
