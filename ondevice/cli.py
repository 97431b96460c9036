"""The `odt` command: a thin shell; each package registers its sub-commands (entry points)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Sequence

from .errors import CheckpointError, OdtError, UsageError

__all__ = [
    "main",
    "register_inspect",
    "register_train",
    "register_evaluate",
    "register_export",
    "register_predict",
]


def _parser() -> argparse.ArgumentParser:
    """`odt` with every installed package's sub-commands (the docs' commands are parsed by it in a test)."""
    parser = argparse.ArgumentParser(
        prog="odt", description="Generate, verify and train ONNX Runtime training artifacts on devices."
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks and debug logs (anywhere)")
    parser.add_argument("--version", action="version", version=f"odt {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for entry in sorted(entry_points(group="odt.commands"), key=lambda e: e.name):
        try:
            entry.load()(commands)
        except ImportError as exc:  # an optional extra is not installed: say so when it is used
            _unavailable(commands, entry.name, exc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``odt``: exit 0 on success, 1 on a reported failure, 2 on a usage error.

    ``--debug`` may stand anywhere; with ``--json`` an error is printed as JSON on stdout.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP where a command handles them the same way
        print("interrupted", file=sys.stderr)
        return 128 + int(getattr(exc, "signum", 2))
    except BrokenPipeError:  # `odt inspect --json | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ModuleNotFoundError as exc:
        if debug or exc.name is None or exc.name.split(".")[0] not in _EXTRAS:
            raise
        extra = _COMMAND_EXTRAS.get(args.command) or _EXTRAS[exc.name.split(".")[0]]
        print(f"error: `odt {args.command}` needs {exc.name}, which is not installed. "
              f"Install it with: pip install 'ondevice-training[{extra}]'", file=sys.stderr)  # fmt: skip
        return 1
    except Exception as exc:
        if debug:
            raise
        expected = isinstance(exc, OdtError)
        code = 2 if isinstance(exc, UsageError) else 1
        message = (
            str(exc) if expected else f"unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)"
        )
        if getattr(args, "json", False):
            print(json.dumps({"error": {"type": type(exc).__name__, "message": message, "exit_code": code}}))
        else:
            print(f"error: {message}", file=sys.stderr)
        return code


_EXTRAS = {
    "torch": "workstation",
    "onnx": "workstation",
    "flwr": "federated",
    "matplotlib": "federated",
    "fastapi": "bridge",
    "uvicorn": "bridge",
    "cryptography": "bridge",
    "pydantic": "bridge",
    "sklearn": "samples",
}
"""A missing third-party module -> the extra that brings it."""
_COMMAND_EXTRAS = {"generate": "workstation", "fl": "federated", "bundle": "bridge", "bridge": "bridge"}
"""A command -> the extra that installs everything it imports (``odt fl`` missing cryptography, which the bridge
uses too, needs [federated], whose flwr brings it)."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ondevice-training")
    except PackageNotFoundError:
        return "unknown"


def _unavailable(commands: argparse._SubParsersAction, name: str, exc: ImportError) -> None:
    parser = commands.add_parser(name, help=f"(unavailable: {exc.name} is not installed)")

    def run(args: argparse.Namespace) -> int:
        extra = _COMMAND_EXTRAS.get(name) or _EXTRAS.get(str(exc.name).split(".")[0])
        hint = f" Install it with: pip install 'ondevice-training[{extra}]'" if extra else ""
        print(f"error: `odt {name}` needs {exc.name}, which is not installed.{hint}", file=sys.stderr)
        return 1

    parser.set_defaults(run=run)


def _engine_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=["auto", "classic", "portable"],
        default="auto",
        help="what trains: classic (onnxruntime-training 1.19.2) or portable (any stock onnxruntime; the artifacts' "
        "portable graphs) (default auto: classic where the training build is installed and the artifacts carry its "
        "graphs, else portable)",
    )


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


def register_train(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("train", help="train an artifact directory on .npz, .jsonl or .csv data (no torch needed)")
    p.add_argument("directory", help="artifact directory made by `odt generate`")
    p.add_argument(
        "--data",
        required=True,
        help=".npz file whose keys are the manifest's input names, .jsonl of {text, label} lines (artifacts with "
        "a tokenizer), or .csv with a header (a column per input, or text; and a label column)",
    )
    p.add_argument(
        "--val",
        help="validation data (.npz, .jsonl or .csv), evaluated after every epoch; training then stops when the "
        "validation loss stops improving and keeps the best epoch (see --patience)",
    )
    p.add_argument(
        "--epochs",
        type=int,
        help=f"total epochs; a resumed run continues to this count (default {EPOCHS}; with --val, at most "
        f"{EPOCHS_WITH_VAL}: early stopping ends the run)",
    )
    p.add_argument(
        "--patience",
        type=int,
        help=f"with --val: stop after this many epochs without a lower validation loss and go back to the best "
        f"epoch's weights (default {PATIENCE}; 0 trains every epoch and keeps the last)",
    )
    p.add_argument("--batch-size", type=int, help="examples per step, per micro-batch with --accumulate (default: "
                   "the memory plan's batch, else 32)")  # fmt: skip
    p.add_argument(
        "--accumulate",
        type=int,
        help="micro-batches of --batch-size per optimizer step (default: --batch-size examples per step, in the "
        "memory plan's micro-batches when the artifacts have one, else whole)",
    )
    p.add_argument("--lr", type=float, help="peak learning rate (default: the manifest's)")
    p.add_argument(
        "--schedule",
        choices=["constant", "linear", "cosine"],
        help="learning-rate schedule over all optimizer steps up to --epochs (default: constant; with --resume, "
        "the checkpoint's schedule continues unless --schedule, --lr or --warmup is given)",
    )
    p.add_argument("--warmup", type=int, help="linear warm-up steps for linear/cosine (default 0)")
    p.add_argument(
        "--checkpoint",
        metavar="CKPT_DIR",
        help="save CKPT_DIR/latest.ckpt after every epoch (default: ./DIRECTORY-NAME.ckpt/, with a warning)",
    )
    p.add_argument("--resume", action="store_true", help="continue from CKPT_DIR/latest.ckpt")
    p.add_argument("--seed", type=int, help="data order and dropout seed (default 0; with --resume, the checkpoint's)")
    p.add_argument("--threads", type=int, help="ORT intra-op threads (default: ORT's choice)")
    p.add_argument(
        "--lean-memory",
        action="store_true",
        default=None,
        help="lower peak memory: ORT's memory arena off (measured on MiniLM: -19 %% to -32 %% peak RSS, "
        "0-15 %% slower steps)",
    )
    p.add_argument(
        "--stream-weights",
        action="store_true",
        default=None,
        help="lower peak memory where the artifacts keep a frozen.bin (Linux, portable engine): its pages leave RSS "
        "while steps run and are read again from the page cache (SmolLM2 int8 LoRA: 378 -> 262 MiB, 0.96x the "
        "speed; default: the memory plan's choice)",
    )
    p.add_argument(
        "--bucket",
        action="store_true",
        help="text: put commands of similar length in the same optimizer steps, so each batch pads less",
    )
    p.add_argument(
        "--lr-find",
        action="store_true",
        help="do not train: run a learning-rate range test (100 steps, 1e-6 to 1) and print the rate it suggests; "
        "nothing is saved",
    )
    p.add_argument("--json", action="store_true", help="print the history (or the --lr-find curve) as JSON")
    _engine_option(p)
    p.set_defaults(run=_run_train)


_CKPT_DEFAULT = "(default: ./DIRECTORY-NAME.ckpt/ where `odt train` saves, else the initial weights, with a warning)"


def register_evaluate(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "evaluate", help="loss (and accuracy) of artifacts, a checkpoint or an exported .onnx model on labelled data"
    )
    p.add_argument("directory", help="artifact directory, or an .onnx file from `odt export` (a federated run's "
                   "global_model.onnx too)")  # fmt: skip
    p.add_argument("--artifacts", help="with an .onnx file exported before models carried a manifest: its artifacts")
    p.add_argument("--data", required=True, help=".npz keyed by the manifest's input names, .jsonl of texts, or "
                   ".csv with a header")  # fmt: skip
    p.add_argument("--checkpoint", metavar="CKPT_DIR", help=f"evaluate CKPT_DIR/latest.ckpt {_CKPT_DEFAULT}")
    p.add_argument("--batch-size", type=int, help="rows per step (default: the memory plan's micro-batch, else 256)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    _engine_option(p)
    p.set_defaults(run=_run_evaluate)


def register_export(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "export", help="write the (trained) model: an inference ONNX file, safetensors for PyTorch, or a PEFT adapter"
    )
    p.add_argument("directory", help="artifact directory")
    p.add_argument("--out", required=True, help="the .onnx or .safetensors file, or the PEFT folder, to write")
    p.add_argument(
        "--format",
        choices=["onnx", "safetensors", "peft", "hf"],
        help="onnx: inference graph (LoRA folded); safetensors: every weight by the PyTorch model's state_dict "
        "names (LoRA folded); peft: adapter_config.json + adapter_model.safetensors for PeftModel.from_pretrained; "
        "hf: a folder transformers' from_pretrained loads (models generated from transformers) "
        "(default: from --out's suffix, .onnx or .safetensors)",
    )
    p.add_argument("--checkpoint", metavar="CKPT_DIR", help=f"export CKPT_DIR/latest.ckpt {_CKPT_DEFAULT}")
    p.add_argument("--force", action="store_true", help="replace --out if an earlier odt export wrote it "
                   "(default: refuse an existing --out; files odt did not write are never replaced)")  # fmt: skip
    _engine_option(p)
    p.set_defaults(run=_run_export)


def register_predict(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "predict", help="run a trained model (artifacts or an exported .onnx) on .npz, .jsonl or .csv data, or --text"
    )
    p.add_argument("model", help="artifact directory, or an .onnx file from `odt export` (its manifest is inside)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--data", help=".npz keyed by the manifest's input names, .jsonl of texts, or .csv (no labels needed)"
    )
    source.add_argument(
        "--text", action="append", help="a sentence to classify (repeatable; artifacts with a tokenizer); a language "
        "model completes it as with --prompt"
    )
    source.add_argument(
        "--prompt", action="append", help="a prompt a language model completes (repeatable; causal-lm artifacts or "
        "their `odt export`): greedy decoding with its key/value cache"
    )  # fmt: skip
    p.add_argument(
        "--max-new-tokens", type=int, default=32, metavar="N",
        help="with --prompt: stop each completion after N tokens (default 32) or at its end token",
    )  # fmt: skip
    p.add_argument(
        "--checkpoint", metavar="CKPT_DIR", help=f"with an artifact directory: CKPT_DIR/latest.ckpt {_CKPT_DEFAULT}"
    )
    p.add_argument("--artifacts", help="with an .onnx file exported before models carried their manifest: its "
                   "artifact directory (default: the manifest and tokenizer inside the file)")  # fmt: skip
    p.add_argument("--out", help="also write every output to this .npz (default: print only)")
    p.add_argument("--force", action="store_true", help="replace --out if odt wrote it (default: refuse an "
                   "existing --out; files odt did not write are never replaced)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print every output as JSON")
    _engine_option(p)
    p.set_defaults(run=_run_predict)


def _run_predict(args: argparse.Namespace) -> int:
    import numpy as np

    from .datafiles import load_data
    from .text import TextEncoder

    if args.out is not None:  # refused before the work, not after it
        from .errors import OutputRefusedError
        from .files import export_refusal

        refusal = export_refusal(args.out, args.model, folder=False, force=args.force)
        if refusal:
            raise OutputRefusedError(f"{refusal}.")
    if args.prompt:
        return _complete(args, args.prompt)
    note = ""
    if args.model.endswith(".onnx"):
        predictor, encoder = _exported(args.model, args.artifacts)
        if _completes(predictor.manifest, args):
            return _complete(args, args.text, predictor)
        data = encoder(args.text) if args.text else load_data(args.data, args.artifacts, labels=False, encoder=encoder)
        manifest, outputs = predictor.manifest, predictor.predict(data, progress=not args.json)
    else:
        from .manifest import Manifest

        directory = args.model
        if _completes(Manifest.load(directory), args):
            return _complete(args, args.text)
        data = TextEncoder(directory)(args.text) if args.text else load_data(args.data, directory, labels=False)
        trainer, note = _load_trained(args.model, args.checkpoint, args.engine)
        manifest, outputs = trainer.manifest, trainer.predict(data, progress=not args.json)
    if args.out:
        import io
        import zipfile

        from .errors import OndeviceError
        from .files import PRODUCER, atomic_write_bytes

        buffer = io.BytesIO()
        np.savez(buffer, **outputs)
        with zipfile.ZipFile(buffer, "a") as archive:  # a later predict may replace it (files.written_by_odt)
            archive.comment = PRODUCER.encode()
        try:
            atomic_write_bytes(args.out, buffer.getvalue())
        except OSError as exc:
            raise OndeviceError(f"cannot write {args.out}: {exc.strerror}. Choose a writable --out.") from None
    _note(note)
    if args.json:
        print(json.dumps({name: value.tolist() for name, value in outputs.items()}))
        return 0
    scores = outputs.get(manifest.loss_input or "")
    if manifest.num_classes is not None and scores is not None:
        shifted = np.exp(scores - scores.max(-1, keepdims=True))
        probabilities = shifted / shifted.sum(-1, keepdims=True)
        for index, (label, p) in enumerate(zip(scores.argmax(-1), probabilities.max(-1))):
            name = manifest.labels[label] if manifest.labels else f"class {label}"
            text = f"\t{args.text[index]}" if args.text else ""
            print(f"{index}\t{name}\t(p={p:.3f}){text}")
    else:
        for name, value in outputs.items():
            print(f"{name}: shape {value.shape}, first {np.ravel(value)[:5].tolist()}")
    if args.out:
        print(f"outputs: {args.out}")
    return 0


def _completes(manifest: Any, args: argparse.Namespace) -> bool:
    """Whether ``odt predict`` completes texts (a causal LM with its cached decoder): ``--text`` gives the
    prompts; ``--data`` rows are refused (a language model's outputs per row are no answer)."""
    if manifest.decoder is None:
        return False
    if args.data:
        raise UsageError(f"{args.model} is a language model: it completes prompts. Give them with --prompt TEXT "
                         "(repeatable); `odt evaluate --data` measures its loss and perplexity on a file.")  # fmt: skip
    return True


def _complete(args: argparse.Namespace, prompts: list[str], predictor: Any = None) -> int:
    """``odt predict --prompt`` (or ``--text`` on a language model): greedy completions, printed (or as one
    JSON object)."""
    from .predict import Predictor

    if args.out is not None:
        raise UsageError("--out writes model outputs; completions are printed (add --json for a script).")
    note = ""
    if args.model.endswith(".onnx"):
        generator = (predictor or Predictor(args.model)).text_generator()
    else:
        trainer, note = _load_trained(args.model, args.checkpoint, args.engine, evaluation=False)  # no eval graph
        generator = trainer.text_generator()
    completions = generator(prompts, max_new_tokens=args.max_new_tokens, progress=not args.json)
    _note(note)
    if args.json:
        rows = [{"prompt": c.prompt, "completion": c.text, "tokens": len(c.tokens), "stopped": c.stopped}
                for c in completions]  # fmt: skip
        print(json.dumps({"completions": rows, "tokens_per_second": round(generator.tokens_per_second, 2)}))
        return 0
    for completion in completions:
        cut = "" if completion.stopped == "eos" else f"  [{completion.stopped}]"
        print(f"{completion.prompt}{completion.text}{cut}")
    print(f"({generator.tokens_per_second:.1f} tokens/s)", file=sys.stderr)
    return 0


def _exported(model: str, artifacts: str | None):  # type: ignore[no-untyped-def]
    """(Predictor, TextEncoder or None) of an exported model: its own manifest and tokenizer, or the
    artifacts' when given (models exported before they carried them)."""
    from .manifest import Manifest
    from .predict import Predictor
    from .text import TextEncoder

    predictor = Predictor(model, Manifest.load(artifacts) if artifacts else None)
    if predictor.manifest.tokenizer is None:
        return predictor, None
    if artifacts:
        return predictor, TextEncoder(artifacts, predictor.manifest)
    return predictor, TextEncoder(None, predictor.manifest, tokenizer_json=predictor.tokenizer_json)


def _checkpoint_file(directory: str | None) -> str | None:
    return None if directory is None else str(Path(directory) / "latest.ckpt")


EPOCHS = 10
"""``odt train``'s epochs without --val."""
EPOCHS_WITH_VAL = 30
"""The most ``odt train --val`` trains: early stopping ends it first (intents: 529 commands epoch 16, 2,914 epoch 6)."""
PATIENCE = 3


def _run_train(args: argparse.Namespace) -> int:
    import math

    from ._progress import say
    from .datafiles import load_data
    from .schedules import Schedule
    from .stopping import EarlyStopping
    from .trainer import Trainer

    if args.resume and not args.checkpoint:
        raise CheckpointError("--resume needs --checkpoint CKPT_DIR to resume from.")
    if args.patience is not None and (args.patience < 0 or not args.val):
        raise UsageError(f"--patience needs --val and an integer >= 0 (epochs), got {args.patience}"
                         f"{'' if args.val else ' without --val'}.")  # fmt: skip
    patience = PATIENCE if args.patience is None else args.patience
    stopping = EarlyStopping(patience) if args.val and patience else None
    if args.epochs is None:
        args.epochs = EPOCHS_WITH_VAL if stopping else EPOCHS
    # Without --val nothing evaluates: the eval graph's session is not loaded (less memory on a device).
    options = {"threads": args.threads, "lean_memory": args.lean_memory, "evaluation": bool(args.val),
               "engine": args.engine, "stream_weights": args.stream_weights}  # fmt: skip
    trainer = (
        _load_checkpoint(args.directory, Path(_checkpoint_file(args.checkpoint)), **options)
        if args.resume
        else Trainer.load(args.directory, **options)
    )
    if args.stream_weights and not trainer.streams_weights:
        print(f"warning: --stream-weights has no effect on {args.directory}: it keeps no frozen.bin, so there is "
              "nothing to stream.", file=sys.stderr)  # fmt: skip
    train = load_data(args.data, args.directory)
    if args.batch_size is None:
        args.batch_size = trainer.manifest.train_batch_size
    if args.lr_find:
        return _lr_find(trainer, train, args)
    val = load_data(args.val, args.directory) if args.val else None
    named = bool(args.checkpoint)
    if not named:  # never throw the trained weights away
        args.checkpoint = _default_checkpoint_dir(args.directory)
    size = len(next(iter(train.values()))) if train else 0
    micro, accumulate = (args.batch_size, args.accumulate)
    if args.accumulate is None:  # the memory plan's micro-batches, if any
        micro, accumulate = trainer.micro_batches(max(args.batch_size, 1))
    steps = args.epochs * math.ceil(math.ceil(size / max(micro, 1)) / max(accumulate, 1))
    schedule = None  # resuming: the checkpoint's schedule continues
    if trainer.schedule is None or (args.schedule, args.lr, args.warmup) != (None, None, None):
        base = trainer.manifest.optimizer.lr if args.lr is None else args.lr
        schedule = Schedule(args.schedule or "constant", base, total=max(steps, 1), warmup=args.warmup or 0)
    if not args.json:
        rate = (schedule.base if schedule is not None else trainer.lr, "--lr" if args.lr is not None else
                "the checkpoint's schedule" if schedule is None else "the artifacts")  # fmt: skip
        shape = f"{args.schedule or 'constant'} schedule" if schedule is not None else "resumed schedule"
        until = (f"up to {args.epochs} epochs of {steps // max(args.epochs, 1)} steps, stopping {patience} epochs "
                 "after the validation loss last fell" if stopping else
                 f"{args.epochs} epoch(s) of {steps // max(args.epochs, 1)} step(s)")  # fmt: skip
        print(f"training: {trainer.manifest.optimizer.kind} at lr {rate[0]:g} (from {rate[1]}), {shape}, {until}",
              flush=True)  # fmt: skip
    history = trainer.fit(
        train,
        epochs=args.epochs,
        batch_size=args.batch_size,
        accumulate=args.accumulate,
        seed=args.seed,
        val_data=val,
        schedule=schedule,
        checkpoint=_checkpoint_file(args.checkpoint),
        progress=not args.json,
        bucket=args.bucket,
        early_stopping=stopping,
        on_epoch=None if args.json else lambda row: say(_epoch_line(row)),
    )
    if not named:
        print(f"warning: no --checkpoint given; the trained model is in {_checkpoint_file(args.checkpoint)}",
              file=sys.stderr)  # fmt: skip
    if args.json:
        print(json.dumps({"epochs": history.epochs, "best_epoch": history.best_epoch,
                          "stopped_early": history.stopped_early, "skipped_steps": trainer.skipped_steps,
                          "engine": trainer.engine, "onnxruntime": trainer.ort_version, "update": trainer.update,
                          "lr": trainer.schedule.base if trainer.schedule else trainer.lr}, indent=2))  # fmt: skip
    else:
        if history.best_epoch is not None:
            best = history.epochs[[row["epoch"] for row in history.epochs].index(history.best_epoch)]
            why = (f"stopped: no lower validation loss for {patience} epochs; " if history.stopped_early else "")
            print(f"{why}kept epoch {history.best_epoch}'s weights (val_loss {best['val_loss']:.4g}"
                  + (f", val_accuracy {best['val_accuracy']:.4g})" if "val_accuracy" in best else ")"))  # fmt: skip
        print(f"engine: {trainer.engine} (ONNX Runtime {trainer.ort_version}, update: {trainer.update})")
        print(f"checkpoint: {_checkpoint_file(args.checkpoint)}")
    return 0


def _epoch_line(row: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())


def _lr_find(trainer: Any, train: dict[str, Any], args: argparse.Namespace) -> int:
    from .lr_find import find_lr

    curve = find_lr(trainer, train, batch_size=args.batch_size, seed=args.seed or 0)
    if args.json:
        print(json.dumps(curve, indent=2))
        return 0
    for rate, loss in list(zip(curve["lr"], curve["loss"]))[::10]:
        print(f"lr {rate:.2e}  loss {loss:.4f}")
    found = curve["suggested_lr"]
    print(f"suggested --lr {found:.2e} (the steepest fall of the loss)" if found is not None else
          "no suggestion: the loss did not fall over the range (check the data and labels)")  # fmt: skip
    return 0


def _load_checkpoint(directory: str, checkpoint: Path, **options: Any):  # type: ignore[no-untyped-def]
    """Load the checkpoint, or the one before it when it is missing or corrupt (said so on stderr)."""
    from ._checkpoint import previous_of
    from .errors import CheckpointCorruptError
    from .trainer import Trainer

    try:
        return Trainer.load(directory, checkpoint=checkpoint, **options)
    except CheckpointCorruptError as exc:
        previous = previous_of(checkpoint)
        if not previous.is_file():
            raise
        print(f"warning: {exc} Using {previous}.", file=sys.stderr)
    except CheckpointError:
        previous = previous_of(checkpoint)
        if checkpoint.is_file() or not previous.is_file():
            raise
        why = "is not a file" if checkpoint.exists() else "is missing (a save was interrupted)"
        print(f"warning: {checkpoint} {why}; using {previous}.", file=sys.stderr)
    return Trainer.load(directory, checkpoint=previous, **options)


def _load_trained(directory: str, checkpoint_dir: str | None, engine: str = "auto", **options: Any):  # type: ignore[no-untyped-def]
    """(trainer, note): the weights a user means: --checkpoint's, else the checkpoint `odt train DIRECTORY`
    saves by default (./NAME.ckpt/) when it belongs to these artifacts, else the initial weights. The note
    says which, for stderr once the command has succeeded (an error stays the only line)."""
    from ._checkpoint import previous_of, read_header
    from .files import sha256_file
    from .manifest import MANIFEST_NAME
    from .trainer import Trainer

    if checkpoint_dir is not None:
        return _load_checkpoint(directory, Path(_checkpoint_file(checkpoint_dir)), engine=engine, **options), ""
    default = Path(_checkpoint_file(_default_checkpoint_dir(directory)))
    found = next((p for p in (default, previous_of(default)) if p.is_file()), None)
    untrained = "these are the untrained initial weights. Pass --checkpoint CKPT_DIR for trained ones."
    if found is None:
        note = f"warning: no --checkpoint given and none at {default}: {untrained}"
        return Trainer.load(directory, engine=engine, **options), note
    try:
        read_header(found, sha256_file(Path(directory) / MANIFEST_NAME), verify=False)
    except (CheckpointError, OSError) as exc:
        return Trainer.load(directory, engine=engine, **options), f"warning: not using {found}: {exc} So {untrained}"
    note = f"note: the weights of {default.parent}/, where `odt train {directory}` saves (--checkpoint chooses)."
    return _load_checkpoint(directory, default, engine=engine, **options), note


def _default_checkpoint_dir(directory: str) -> str:
    """Where `odt train DIRECTORY` saves without --checkpoint."""
    return f"{Path(directory).resolve().name}.ckpt"


def _run_evaluate(args: argparse.Namespace) -> int:
    from .datafiles import load_data

    if args.directory.endswith(".onnx"):
        from .scoring import evaluate_exported

        predictor, encoder = _exported(args.directory, args.artifacts)
        metrics = evaluate_exported(predictor, load_data(args.data, args.artifacts, encoder=encoder),
                                    batch_size=args.batch_size)  # fmt: skip
        print(json.dumps(metrics) if args.json else "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        return 0
    trainer, note = _load_trained(args.directory, args.checkpoint, args.engine)
    metrics = trainer.evaluate(load_data(args.data, args.directory), batch_size=args.batch_size,
                               progress=not args.json)  # fmt: skip
    print(json.dumps(metrics) if args.json else "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    _note(note)
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from .errors import ConfigError, OutputRefusedError
    from .files import export_refusal
    from .formats import save_hf, save_peft, save_safetensors

    kind = args.format or {".onnx": "onnx", ".safetensors": "safetensors"}.get(Path(args.out).suffix.lower())
    if kind is None:
        raise ConfigError(f"--out {args.out!r} ends in neither .onnx nor .safetensors: pass --format onnx, "
                          "safetensors, or peft or hf (folders).")  # fmt: skip
    refusal = export_refusal(args.out, args.directory, folder=kind in ("peft", "hf"), force=args.force)
    if refusal:
        raise OutputRefusedError(f"{refusal}.")
    from .manifest import Manifest

    lm = Manifest.load(args.directory).decoder is not None  # a decoder's export opens no eval graph
    trainer, note = _load_trained(args.directory, args.checkpoint, args.engine, evaluation=not lm)
    if kind == "onnx":
        print(f"inference model: {trainer.export(args.out)}")
    elif kind == "safetensors":
        print(f"weights by state_dict name: {save_safetensors(trainer, args.out)}")
    elif kind == "peft":
        print(f"PEFT adapter: {save_peft(trainer, args.out)}")
    else:
        print(f"Hugging Face folder: {save_hf(trainer, args.out)}")
    _note(note)
    return 0


def _note(note: str) -> None:
    if note:
        print(note, file=sys.stderr)
