"""The `odt` command: a thin shell; each package registers its sub-commands (entry points)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from importlib.metadata import entry_points
from typing import Sequence

from .errors import OdtError

__all__ = ["main", "register_inspect"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``odt``: exit 0 on success, 1 on a reported failure, 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="odt", description="Generate, verify and train ONNX Runtime training artifacts on devices."
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks and debug logs")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for entry in sorted(entry_points(group="odt.commands"), key=lambda e: e.name):
        try:
            entry.load()(commands)
        except ImportError as exc:  # an optional extra is not installed: say so when it is used
            _unavailable(commands, entry.name, exc)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except OdtError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if args.debug:
            raise
        print(f"error: unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)", file=sys.stderr)
        return 1


def _unavailable(commands: argparse._SubParsersAction, name: str, exc: ImportError) -> None:
    parser = commands.add_parser(name, help=f"(unavailable: {exc.name} is not installed)")

    def run(args: argparse.Namespace) -> int:
        print(f"error: `odt {name}` needs {exc.name}, which is not installed ({exc}).", file=sys.stderr)
        return 1

    parser.set_defaults(run=run)


def register_inspect(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("inspect", help="describe an artifact directory (no torch needed)")
    parser.add_argument("directory", help="artifact directory made by `odt generate`")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    parser.set_defaults(run=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    from .inspect import describe, summarize

    summary = summarize(args.directory)
    print(json.dumps(summary, indent=2) if args.json else describe(summary))
    return 0
