"""`odt fl simulate` and `odt fl deploy`: thin shells over federated.runner."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .config import BY_NAME, validate
from .errors import RunConfigError

__all__ = ["register", "add_run_options", "run_config", "check_nodes", "echo_rounds"]


def register(commands: argparse._SubParsersAction) -> None:
    fl = commands.add_parser("fl", help="federated training with Flower (simulation or a real local deployment)")
    modes = fl.add_subparsers(dest="mode", required=True, metavar="MODE")
    sim = modes.add_parser("simulate", help="Flower's simulation runtime: N virtual clients on this machine")
    sim.add_argument("--clients", type=int, default=10, help="number of virtual SuperNodes (default 10)")
    dep = modes.add_parser("deploy", help="a real SuperLink and N SuperNode processes on 127.0.0.1")
    dep.add_argument("--nodes", type=int, default=2, help="number of SuperNode processes (default 2)")
    dep.add_argument("--tls", action="store_true", help="throwaway CA + certificates and SuperNode authentication")
    for p in (sim, dep):
        add_run_options(p)
        p.set_defaults(run=_run)
    app = modes.add_parser("app", help='print the Flower app folder (for `flwr run "$(odt fl app)"`)')
    app.set_defaults(run=_run_app)
    table = modes.add_parser("config", help="print the run-config keys with defaults, ranges and help")
    table.add_argument("--json", action="store_true", help="as JSON")
    table.set_defaults(run=_run_config_table)


def _run_app(args: argparse.Namespace) -> int:
    from .runner import APP_DIR

    print(APP_DIR)
    return 0


def _run_config_table(args: argparse.Namespace) -> int:
    from .config import KEYS

    if args.json:
        rows = [{"key": k.name, "type": k.kind.__name__, "default": k.default, "allowed": list(k.choices) or
                 (k.range() if k.kind in (int, float) else None), "help": k.help} for k in KEYS]  # fmt: skip
        print(json.dumps(rows, indent=2))
        return 0
    for k in KEYS:
        allowed = ", ".join(k.choices) if k.choices else k.range() if k.kind in (int, float) else "text"
        print(f"{k.name:<18} {k.kind.__name__:<5} {k.default!s:<22} {allowed:<22} {k.help}")
    return 0


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The run-config options every federated command shares (validated by federated.config)."""

    def option(flag: str, key: str, help: str, **extra: Any) -> None:  # the run-config key's type and default
        k = BY_NAME[key]
        p.add_argument(flag, type=k.kind, default=k.default, help=f"{help} (default {k.default})", **extra)

    option("--rounds", "num-server-rounds", "server rounds")
    option("--artifacts", "artifacts", "artifact directory")
    option("--data", "data", "directory with train.npz (partitioning iid or dirichlet) or clients/*.npz|*.jsonl, "
           "one file per node (partitioning files), and test.npz or test.jsonl for the global evaluation")
    option("--out", "output", "where metrics.json, rounds.png and logs go")
    option("--strategy", "strategy", "fedavg, fedavgm, fedprox, fedadam, fedmedian, ...")
    option("--codec", "codec", "update encoding", choices=BY_NAME["codec"].choices)
    option(
        "--partitioning",
        "partitioning",
        "split DATA/train.npz (iid, dirichlet) or give node i the i-th file of DATA/clients/ (files)",
        choices=BY_NAME["partitioning"].choices,
    )
    option("--alpha", "dirichlet-alpha", "Dirichlet alpha")
    option("--local-epochs", "local-epochs", "epochs each client trains per round, at least")
    option("--local-steps", "local-steps", "train more epochs until that many steps")
    option("--min-nodes", "min-nodes", "nodes a round needs")
    option("--fraction", "fraction-train", "share of nodes sampled per round")
    option("--round-timeout", "round-timeout", "seconds to wait for replies")
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run whose --out was DIR after its last completed round (same settings, same artifacts)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other run-config key")
    p.add_argument("--json", action="store_true", help="print the per-round report as JSON")


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The validated run config of the options above; artifacts and data checked to exist."""
    config = _config(args)
    _check_paths(config)
    if args.resume and not (Path(config["output"]) / "run-state.npz").is_file():
        raise RunConfigError(f"--resume {args.resume}: there is no run-state.npz, so no run to continue there.")
    return config


def _config(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.resume or args.out).resolve()
    config: dict[str, Any] = {
        "num-server-rounds": args.rounds,
        "artifacts": str(Path(args.artifacts).resolve()),
        "data": str(Path(args.data).resolve()),
        "output": str(out),
        "strategy": args.strategy,
        "codec": args.codec,
        "partitioning": args.partitioning,
        "dirichlet-alpha": args.alpha,
        "local-epochs": args.local_epochs,
        "local-steps": args.local_steps,
        "min-nodes": args.min_nodes,
        "fraction-train": args.fraction,
        "round-timeout": args.round_timeout,
        "resume": bool(args.resume),
    }
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise RunConfigError(f"--set needs KEY=VALUE, got {item!r}.")
        config[key] = value  # typed by the schema
    tiers = [t.strip() for t in str(config.get("tiers", "")).split(",") if t.strip()]
    if tiers:  # the apps run elsewhere: every path absolute
        config["tiers"] = ",".join(str(Path(t).resolve()) for t in tiers)
    return validate(config)


def _check_paths(config: dict[str, Any]) -> None:
    """Artifacts and data must be there before any Flower process starts."""
    from ondevice.errors import OdtError
    from ondevice.manifest import Manifest

    from .partial import personal_names, tier_problem

    try:
        base = Manifest.load(config["artifacts"])
    except OdtError as exc:
        raise RunConfigError(f"run config 'artifacts': {exc}") from exc
    for tier in (t.strip() for t in str(config.get("tiers", "")).split(",") if t.strip()):
        try:
            problem = tier_problem(base, Manifest.load(tier))
        except OdtError as exc:
            raise RunConfigError(f"run config 'tiers': {exc}") from exc
        if problem:
            raise RunConfigError(f"run config 'tiers': {tier} is not a tier of {config['artifacts']}: {problem}.")
    personal = str(config.get("personal", ""))
    for glob in (g.strip() for g in personal.split(",") if g.strip()):
        if not personal_names(base, glob):
            names = ", ".join(p.name for p in base.trainable[:6]) + (", ..." if len(base.trainable) > 6 else "")
            raise RunConfigError(
                f"run config 'personal': {glob!r} matches no trainable tensor of {config['artifacts']} ({names})."
            )
    data = Path(config["data"])
    train = data / "clients" if config.get("partitioning") == "files" else data / "train.npz"
    missing = [p.name for p in (train,) if not p.exists()]
    if not any((data / f"test{suffix}").is_file() for suffix in (".npz", ".jsonl")):
        missing.append("test.npz (or test.jsonl)")
    if missing:
        raise RunConfigError(
            f"run config 'data': {config['data']} has no {' or '.join(missing)} "
            "(the clients' training data, and the server's test set)."
        )


def check_nodes(nodes: int, config: dict[str, Any], flag: str) -> None:
    """Refuse a node count the run can never satisfy (it would wait forever for min-nodes)."""
    if nodes < 1:
        raise RunConfigError(f"{flag} must be at least 1, got {nodes}.")
    need = int(config.get("min-nodes", BY_NAME["min-nodes"].default))
    if nodes < need:
        raise RunConfigError(
            f"every round needs min-nodes={need} nodes but {flag} is {nodes}: the run would wait forever. "
            f"Pass --min-nodes {nodes} or {flag} {need}."
        )
    if config.get("partitioning") == "files":
        from .task import data_files

        found = len(data_files(config["data"]))
        if found != nodes:
            raise RunConfigError(
                f"partitioning 'files' gives node i the i-th file of {Path(config['data']) / 'clients'}: found "
                f"{found} files for {flag} {nodes}. Use {flag} {found}, or add or remove files."
            )


def _run(args: argparse.Namespace) -> int:
    from .runner import deploy, simulate

    config = run_config(args)  # a clear error in a second beats one from every node after Flower started
    check_nodes(args.clients if args.mode == "simulate" else args.nodes, config,
                "--clients" if args.mode == "simulate" else "--nodes")  # fmt: skip
    work = Path(config["output"]) / "logs"
    if args.mode == "simulate":
        report = simulate(args.clients, config, work=work, on_line=_quiet if args.json else echo_rounds)
    else:
        report = deploy(args.nodes, config, tls=args.tls, work=work, on_line=_quiet if args.json else echo_rounds)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def echo_rounds(line: str) -> None:
    """Show progress, a run's round lines and its report line; not Flower's own log."""
    if line.startswith(("round ", "odt: ")) or "federated report:" in line:
        print(line, flush=True)


def _quiet(line: str) -> None:
    pass
