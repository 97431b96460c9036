"""The run config: one typed schema with defaults, ranges and help.

The ClientApp and ServerApp read ``Settings`` from it, ``odt fl`` validates against it before
any process starts, and the Flower app's ``[tool.flwr.app.config]`` table is checked against it
(``odt fl config`` prints that table).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, make_dataclass
from typing import Any, Mapping

from .errors import RunConfigError

__all__ = ["KEYS", "Key", "Settings", "validate", "app_config_toml"]


@dataclass(frozen=True)
class Key:
    """One run-config key: its type, default, allowed values and what it does."""

    name: str
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    low: float | None = None  # inclusive unless low_open
    high: float | None = None  # inclusive unless high_open
    low_open: bool = False
    high_open: bool = False

    @property
    def attr(self) -> str:
        return self.name.replace("-", "_")

    def check(self, value: Any) -> Any:
        """``value`` as this key's type, or a RunConfigError that says what is allowed."""
        value = _cast(self, value)
        if self.choices and value not in self.choices:
            raise RunConfigError(f"run config {self.name!r} must be one of {list(self.choices)}, got {value!r}.")
        if self.kind in (int, float):
            if not math.isfinite(value):
                raise RunConfigError(f"run config {self.name!r} must be finite, got {value!r}.")
            below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
            above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
            if below or above:
                raise RunConfigError(f"run config {self.name!r} must be {self.range()}, got {value!r}.")
        return value

    def range(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low:g}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high:g}")
        return " and ".join(parts) or "any number"


def _cast(key: Key, value: Any) -> Any:
    if key.kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise RunConfigError(f"run config {key.name!r} must be true or false, got {value!r}.")
    if key.kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise RunConfigError(f"run config {key.name!r} must be an integer, got {value!r}.")
    if key.kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise RunConfigError(f"run config {key.name!r} must be a number, got {value!r}.") from None
    if not isinstance(value, str):
        raise RunConfigError(f"run config {key.name!r} must be text, got {value!r}.")
    return value


STRATEGIES = ("fedavg", "fedavgm", "fedprox", "fedadam", "fedmedian", "fedtrimmedavg", "krum")

KEYS: tuple[Key, ...] = (
    Key("num-server-rounds", int, 5, "federated rounds", low=1),
    Key("local-epochs", int, 1, "epochs each client trains per round (at least)", low=1),
    Key("local-steps", int, 40, "clients with little data train more epochs until they take this many steps", low=0),
    Key("batch-size", int, 32, "client batch size", low=1),
    Key("lr", float, 0.01, "client learning rate", low=0, low_open=True),
    Key("strategy", str, "fedavg", "Flower strategy", choices=STRATEGIES),
    Key("fraction-train", float, 1.0, "share of nodes sampled per round", low=0, high=1, low_open=True),
    Key("min-nodes", int, 2, "nodes a round needs", low=1),
    Key("proximal-mu", float, 0.01, "fedprox: proximal term weight", low=0),
    Key("server-lr", float, 1.0, "fedavgm: server learning rate", low=0, low_open=True),
    Key("server-momentum", float, 0.9, "fedavgm: server momentum", low=0, high=1, high_open=True),
    Key("trimmed-beta", float, 0.2, "fedtrimmedavg: share trimmed at each end", low=0, high=0.5, high_open=True),
    Key("dp-noise", float, 0.0, "> 0 with dp-clip: Flower's fixed-clipping differential privacy", low=0),
    Key("dp-clip", float, 0.0, "clipping norm for differential privacy", low=0),
    Key(
        "dp-delta",
        float,
        1e-5,
        "delta of the epsilon the report states per round",
        low=0,
        high=1,
        low_open=True,
        high_open=True,
    ),
    Key("dp-mode", str, "server", "server: the server clips; client: clients clip", choices=("server", "client")),
    Key(
        "partitioning",
        str,
        "iid",
        "how clients get data: split train.npz (iid, dirichlet) or one file of DATA/clients/ each (files)",
        choices=("iid", "dirichlet", "files"),
    ),
    Key("dirichlet-alpha", float, 0.5, "label skew of dirichlet partitions", low=0, low_open=True),
    Key("seed", int, 0, "partitions, client data order, sampling", low=0),
    Key("codec", str, "none", "update encoding: full float32 or fp16/int8 deltas", choices=("none", "fp16", "int8")),
    Key("artifacts", str, "out/digits/artifacts", "artifact directory (relative to where the apps run)"),
    Key("data", str, "out/digits/data", "directory with train and test data (.npz, or .jsonl for text)"),
    Key("output", str, "out/federated", "where metrics.json, rounds.png and the global model go"),
    Key("max-examples", int, 100_000, "largest example count a reply may claim", low=1),
    Key("norm-bound", float, 10.0, "updates over this x the round's median update norm are bounded (0: off)", low=0),
    Key("max-update-norm", float, 0.0, "updates over this L2 norm are bounded (0: off)", low=0),
    Key("norm-action", str, "reject", "what bounding does: reject the update or clip it", choices=("reject", "clip")),
    Key("round-timeout", float, 0.0, "seconds a round waits for replies (0: follow the work: 900 s for the first "
        "exchange, then 4x the slowest so far, at least 120 s)", low=0),
    Key("save-updates", bool, False, "also write every accepted client update to OUTPUT/updates/"),
    Key("personal", str, "", "comma-separated globs of tensors that stay on each client (e.g. head.*)"),
    Key("tiers", str, "", "comma-separated artifact dirs of other tiers (same base, other trainable sets)"),
    Key("secure-aggregation", bool, False, "SecAgg+: the server learns only the sum of the clients' updates"),
    Key(
        "secagg-shares",
        float,
        0.0,
        "share of the sampled nodes each node shares keys with (1: all; 0: all up to 20, then 2 log2(n) + 1)",
        low=0,
        high=1,
    ),
    Key(
        "secagg-threshold",
        float,
        0.5,
        "share of a node's group that must survive to unmask the sum",
        low=0,
        high=1,
        low_open=True,
    ),
    Key(
        "secagg-clipping-range",
        float,
        4.0,
        "each element of a weighted update is clipped to +/- this",
        low=0,
        low_open=True,
    ),
    Key(
        "secagg-quantization",
        int,
        0,
        "quantization levels over the clipping range (0: the most the 2^32 modulus allows for the round's nodes)",
        low=0,
        high=2**30,
    ),
    Key("resume", bool, False, "continue the run in OUTPUT after its last completed round (OUTPUT/run-state.npz)"),
    Key("run-id", str, "", "set by odt fl: the report and any failure are written under this id"),
)
BY_NAME = {k.name: k for k in KEYS}

Settings = make_dataclass(
    "Settings",
    [(k.attr, k.kind, field(default=k.default)) for k in KEYS],
    frozen=True,
    namespace={
        "__doc__": "The run config with types; every key has a default (see federated.config.KEYS).",
        "__module__": __name__,
        "from_config": classmethod(lambda cls, config: cls(**_attrs(validate(config)))),
    },
)


def _attrs(checked: Mapping[str, Any]) -> dict[str, Any]:
    return {BY_NAME[name].attr: value for name, value in checked.items()}


def validate(config: Mapping[str, Any]) -> dict[str, Any]:
    """Typed, range-checked values of ``config``; an unknown key names the closest valid one."""
    checked = {}
    for name, value in config.items():
        key = BY_NAME.get(name)
        if key is None:
            close = [k for k in BY_NAME if name in k][:1] or difflib.get_close_matches(name, BY_NAME, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else f" Valid keys: {', '.join(BY_NAME)}."
            raise RunConfigError(f"unknown run config key {name!r}.{hint}")
        checked[name] = key.check(value)
    noise, clip = (checked.get(k, BY_NAME[k].default) for k in ("dp-noise", "dp-clip"))
    if (noise > 0) != (clip > 0):
        raise RunConfigError(
            f"differential privacy needs both dp-noise > 0 and dp-clip > 0, got dp-noise={noise} and dp-clip={clip}."
        )
    if checked.get("secure-aggregation", False):
        _check_secure(checked)
    return checked


SECURE_STRATEGIES = ("fedavg", "fedavgm", "fedprox", "fedadam")
"""Strategies that need only the weighted average of the updates (the others look at each update)."""


def _check_secure(checked: Mapping[str, Any]) -> None:
    def value(name: str) -> Any:
        return checked.get(name, BY_NAME[name].default)

    problems = []
    if value("strategy") not in SECURE_STRATEGIES:
        problems.append(f"strategy {value('strategy')!r} looks at each update (use one of {SECURE_STRATEGIES})")
    if value("codec") != "none":
        problems.append("codec must be 'none' (the update is quantized inside the protocol)")
    if value("personal") or value("tiers"):
        problems.append("personal tensors and tiers send partial updates (one vector shape per round is needed)")
    if value("dp-noise") > 0 and value("dp-mode") != "client":
        problems.append(
            "with differential privacy, dp-mode must be 'client' (the server cannot clip what it cannot see)"
        )
    if value("min-nodes") < 2:
        problems.append("min-nodes must be at least 2 (one node's sum is its update)")
    if value("save-updates"):
        problems.append("save-updates has nothing to save (the server never holds a client's update)")
    from .secure_checks import levels_for, quantization_problem  # here: it imports Flower, `odt --help` must not

    nodes = max(2, value("min-nodes"))
    levels = value("secagg-quantization") or levels_for(nodes)
    quantization = quantization_problem(value("secagg-clipping-range"), levels, nodes, value("max-examples"))
    if quantization:
        problems.append(f"with min-nodes {nodes}, {quantization}")
    if problems:
        raise RunConfigError("secure-aggregation=true: " + "; ".join(problems) + ".")


def app_config_toml() -> str:
    """The ``[tool.flwr.app.config]`` table of the defaults, with each key's help as a comment."""

    def text(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        return f'"{value}"' if isinstance(value, str) else repr(value)

    lines = ["[tool.flwr.app.config]"]
    for key in KEYS:
        assignment = f"{key.name} = {text(key.default)}"
        lines.append(f"{assignment:<40} # {key.help}")
    return "\n".join(lines) + "\n"
