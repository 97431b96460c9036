"""`odt fl simulate` and `odt fl deploy`: thin shells over federated.runner."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, ContextManager

from .config import BY_NAME, validate
from .errors import RunConfigError
from .report import FAILURE

__all__ = ["register", "add_run_options", "run_config", "check_nodes", "echo_rounds"]


def register(commands: argparse._SubParsersAction) -> None:
    fl = commands.add_parser("fl", help="federated training with Flower (simulation or a real local deployment)")
    modes = fl.add_subparsers(dest="mode", required=True, metavar="MODE")
    sim = modes.add_parser("simulate", help="Flower's simulation runtime: N virtual clients on this machine")
    sim.add_argument("--clients", type=int, help="number of virtual SuperNodes (default 10)")
    dep = modes.add_parser("deploy", help="a real SuperLink and N SuperNode processes on 127.0.0.1")
    dep.add_argument("--nodes", type=int, help="number of SuperNode processes (default 2)")
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
        p.add_argument(flag, type=k.kind, help=f"{help} (default {k.default})", **extra)  # None: not given
        RUN_OPTIONS[flag.removeprefix("--").replace("-", "_")] = key

    option("--rounds", "num-server-rounds", "server rounds")
    option("--artifacts", "artifacts", "artifact directory")
    option(
        "--data",
        "data",
        "directory with train.npz (partitioning iid or dirichlet) or clients/*.npz|*.jsonl, "
        "one file per node (partitioning files), and test.npz or test.jsonl for the global evaluation",
    )
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
    option("--round-timeout", "round-timeout", "seconds a round waits for replies (default 0: follow the work, "
           "900 s for the first exchange, then 4x the slowest so far, at least 120 s)")
    p.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run whose --out was DIR after its last completed round, with that run's settings "
        "(DIR/run-config.json; a flag that contradicts them is refused)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other run-config key")
    p.add_argument("--json", action="store_true", help="print the per-round report as JSON")


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The validated run config of the options above; artifacts and data checked to exist (with ``--resume``,
    first that the directory holds a run: its saved settings name the artifacts and data)."""
    if args.resume and not (Path(args.resume) / "run-state.npz").is_file():
        what = "does not exist" if not Path(args.resume).exists() else "holds no run-state.npz"
        raise RunConfigError(f"--resume {args.resume}: there is no run to continue there (the directory {what}; "
                             "a run's --out directory holds one after its first round). Start a new run with --out.")
    config = _config(args)
    _check_paths(config)
    return config


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The run config of the flags (each one not given takes its default), or with ``--resume DIR`` the
    saved config of the run in DIR, refusing a given flag that contradicts it."""
    record = _saved_run(Path(args.resume)) if args.resume else None
    saved = {k: v for k, v in record["config"].items() if k != "resume"} if record else None
    config: dict[str, Any] = dict(saved) if saved else {k: BY_NAME[k].default for k in RUN_OPTIONS.values()}
    given: dict[str, Any] = {key: getattr(args, dest) for dest, key in RUN_OPTIONS.items()
                             if getattr(args, dest, None) is not None}  # fmt: skip
    for key in ("artifacts", "data", "output"):  # the apps run elsewhere: every path absolute
        if key in given:
            given[key] = str(Path(given[key]).resolve())
    if args.resume:
        out = str(Path(args.resume).resolve())
        if args.out is not None and str(Path(args.out).resolve()) != out:
            raise RunConfigError(f"--resume {args.resume} continues the run there; --out {args.out} is another place.")
        given["output"] = out
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise RunConfigError(f"--set needs KEY=VALUE, got {item!r}.")
        given[key] = value  # typed by the schema
    if saved:  # the run's own settings: a contradicting flag is refused, naming the difference
        typed = validate({**saved, **given})
        changed = sorted(k for k in given if k in saved and typed[k] != saved[k])
        if changed:
            differences = "; ".join(f"{k}: {saved[k]!r} in the run, {typed[k]!r} given" for k in changed)
            raise RunConfigError(
                f"--resume {args.resume} continues that run with its own settings, which these flags contradict: "
                f"{differences}. Drop them, or start a new run with --out."
            )
    config.update(given)
    config.update({k: str(Path(config[k]).resolve()) for k in ("artifacts", "data", "output")})
    config["resume"] = bool(args.resume)
    tiers = [t.strip() for t in str(config.get("tiers", "")).split(",") if t.strip()]
    if tiers:  # the apps run elsewhere: every path absolute
        config["tiers"] = ",".join(str(Path(t).resolve()) for t in tiers)
    return validate(config)


RUN_OPTIONS: dict[str, str] = {}
"""argparse dest -> run-config key of the options :func:`add_run_options` adds."""
RUN_CONFIG = "run-config.json"
"""OUTPUT/run-config.json: the validated run config of a run (and its node count), for ``--resume``."""


def _saved_run(out: Path) -> dict[str, Any] | None:
    """What the run in ``out`` saved of itself: ``{"mode", "nodes", "config"}`` (None: a run that predates the
    file, whose flags must be given again)."""
    try:
        saved = json.loads((out / RUN_CONFIG).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RunConfigError(f"--resume {out}: {RUN_CONFIG} cannot be read ({exc}); start a new run.") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise RunConfigError(f"--resume {out}: {RUN_CONFIG} is not a run config; start a new run.")
    return saved


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


MAX_NODES_PER_CORE = 16
"""SuperNode processes `odt fl deploy` starts per core at most (simulated clients share Ray's workers)."""


def check_nodes(nodes: int, config: dict[str, Any], flag: str) -> None:
    """Refuse a node count the run can never satisfy (it would wait forever for min-nodes)."""
    if nodes < 1:
        raise RunConfigError(f"{flag} must be at least 1, got {nodes}.")
    most = MAX_NODES_PER_CORE * (os.cpu_count() or 1)
    if flag == "--nodes" and nodes > most:  # each SuperNode is a process of its own (about 100 MB)
        raise RunConfigError(
            f"{flag} {nodes} would start {nodes} SuperNode processes on this machine's {os.cpu_count()} cores; "
            f"at most {most} are allowed here. Use odt fl simulate for many virtual clients, or real devices."
        )
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
    from ondevice.files import atomic_write_bytes

    from .runner import deploy, simulate

    config = run_config(args)  # a clear error in a second beats one from every node after Flower started
    flag, default = ("--clients", 10) if args.mode == "simulate" else ("--nodes", 2)
    given = args.clients if args.mode == "simulate" else args.nodes
    record = _saved_run(Path(args.resume)) if args.resume else None
    saved = record.get("nodes") if record else None
    if given is not None and saved is not None and given != saved:
        raise RunConfigError(f"--resume {args.resume}: that run had {flag} {saved}, not {given}. Drop {flag}.")
    nodes = given if given is not None else saved if saved is not None else default
    check_nodes(nodes, config, flag)
    out = Path(config["output"])
    work = out / "logs"
    with run_lock(out):
        if args.resume:
            _keep_previous_logs(work)
        else:
            record = {"mode": args.mode, "nodes": nodes, "config": config}
            atomic_write_bytes(out / RUN_CONFIG, json.dumps(record, indent=2).encode())
        if args.mode == "simulate":
            report = simulate(nodes, config, work=work, on_line=_quiet if args.json else echo_rounds)
        else:
            report = deploy(nodes, config, tls=args.tls, work=work, on_line=_quiet if args.json else echo_rounds)
        (out / FAILURE).unlink(missing_ok=True)  # this run succeeded: an earlier attempt's failure is over
    if args.json:
        print(json.dumps(report, indent=2))
    elif report.get("process_tree", {}).get("peak_pss_bytes"):
        tree = report["process_tree"]
        print(f"odt: peak memory of the run's {tree['processes']} processes together: "
              f"{tree['peak_pss_bytes'] / 2**20:.0f} MiB (PSS; in {out / 'metrics.json'})", flush=True)  # fmt: skip
    return 0


RUN_LOCK = ".odt-run.lock"
"""The lock a federated run holds in its --out while it runs (ondevice.locks)."""


def run_lock(out: Path) -> ContextManager[None]:
    """Hold ``out`` for one run: a second run with the same --out is refused, naming this one's pid."""
    from ondevice.locks import exclusive

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunConfigError(f"cannot create --out {out}: {exc.strerror}. Choose a writable --out.") from None
    return exclusive(out / RUN_LOCK, f"--out {out}", "another odt run writes there (two runs would stop each "
                     "other's processes and mix their rounds): wait for it to end or choose another --out")  # fmt: skip


def _keep_previous_logs(work: Path) -> None:
    """Move the failed attempt's logs aside (NAME.log -> NAME.attempt-N.log) before a resumed run writes its own."""
    logs = [p for p in work.glob("*.log") if ".attempt-" not in p.name] if work.is_dir() else []
    attempt = 1
    while any(work.glob(f"*.attempt-{attempt}.log")):
        attempt += 1
    for path in logs:
        path.rename(path.with_name(f"{path.stem}.attempt-{attempt}.log"))


def echo_rounds(line: str) -> None:
    """Show progress, a run's round lines and its report line; not Flower's own log."""
    if line.startswith(("round ", "odt: ")) or "federated report:" in line:
        print(line, flush=True)


def _quiet(line: str) -> None:
    pass
