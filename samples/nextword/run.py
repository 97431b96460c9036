"""The next-word sample end to end: a phone keyboard's model, the best-known federated workload.

1. data: the intents sample's commands from 8 homes become (context, next word) examples; a
   word-level tokenizer.json (left-padded to 6 words) travels with the artifacts;
2. workstation: an LSTM language model; ORT 1.19 cannot train ONNX's LSTM, so the generator
   writes it as gates over the same parameters and verifies it against PyTorch;
3. device: train on the .jsonl text (no torch), top-1 accuracy on 2 unseen homes, next words;
4. with --federated: Flower rounds with one client per home, twice: one shared model (its top-1
   and top-3 on the unseen homes beside centralized training's), then the output layer personal
   (each home's top-1 and top-3 on its own held-out text, personal against global).

Run: python -m samples.nextword.run --out out/nextword [--federated 3 [--shared-rounds 24]]
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np

from samples import print_round

from .data import prepare

CONTEXT = 6
BATCH = 64


def make_artifacts(out: Path, data: dict[str, Path]) -> Path:
    """Workstation step (torch): the LSTM model's artifacts, verified against PyTorch."""
    import torch

    from artifacts import AdamW, generate
    from ondevice.manifest import TokenizerSpec

    from .model import NextWord

    vocab = json.loads(data["vocab"].read_text())
    torch.manual_seed(0)
    manifest = generate(
        NextWord(len(vocab)),
        {"ids": torch.randint(1, len(vocab), (8, CONTEXT))},
        out / "artifacts",
        optimizer=AdamW(lr=5e-3),
        labels=vocab,
        tokenizer=TokenizerSpec(str(data["tokenizer"]), "ids", None, CONTEXT),
        force=True,
    )
    print(f"   verification: PASS ({len(manifest.verification.rows)} quantities); "
          f"{manifest.trainable_size:,} parameters, vocabulary {len(vocab):,} words")  # fmt: skip
    return out / "artifacts"


def train_on_device(artifacts: Path, data: dict[str, Path], out: Path, epochs: int) -> dict[str, float]:
    """Device step (numpy + ONNX Runtime + tokenizers)."""
    from ondevice import Trainer
    from ondevice.text import TextEncoder, load_jsonl

    train, test = load_jsonl(data["train"], artifacts), load_jsonl(data["test"], artifacts)
    trainer = Trainer.load(artifacts)
    trainer.fit(train, epochs=epochs, batch_size=BATCH, checkpoint=out / "checkpoints" / "latest.ckpt")
    metrics = trainer.evaluate(test)  # loss, top-1 and top-3 accuracy
    common = Counter(train["labels"].tolist()).most_common(1)[0][0]
    metrics["most_common_word_accuracy"] = float((test["labels"] == common).mean())
    metrics["perplexity"] = float(np.exp(metrics["loss"]))  # exp of the mean cross-entropy per word
    model = trainer.export(out / "model.onnx")
    from ondevice import Predictor

    prompts = ["turn on the", "set the temperature in the", "what is the"]
    scores = Predictor(model).predict(TextEncoder(artifacts)(prompts))["output"]
    for prompt, best in zip(prompts, scores.argmax(-1)):
        print(f"   {prompt!r} -> {trainer.manifest.labels[best]!r}")
    return metrics


def federate(artifacts: Path, data_dir: Path, out: Path, rounds: int, personal: str = "") -> dict:
    """Each home is a Flower client; with ``personal``, those tensors stay home (each home's own
    next words). Returns the last round's report row."""
    from federated.runner import simulate

    where = out / ("federated-personal" if personal else "federated")
    config = {
        "num-server-rounds": rounds, "artifacts": str(artifacts.resolve()), "data": str(data_dir.resolve()),
        "output": str(where.resolve()), "local-epochs": 1, "lr": 0.005, "batch-size": BATCH,
        "partitioning": "files", "personal": personal,
    }  # fmt: skip
    homes = len(list((data_dir / "clients").glob("*.jsonl")))
    simulate(homes, config, work=where / "logs", on_line=print_round)
    return json.loads((where / "metrics.json").read_text())["rounds"][-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/nextword"))
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--homes", type=int, default=8, help="training homes (default 8)")
    parser.add_argument("--per-home", type=int, default=400, help="commands per home (default 400)")
    parser.add_argument("--federated", type=int, default=0, metavar="ROUNDS", help="also run Flower rounds per home")
    parser.add_argument(
        "--shared-rounds", type=int, metavar="ROUNDS", help="the shared model's rounds (default: --federated)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    out = args.out.resolve()
    data = prepare(out / "data", homes=args.homes, per_home=args.per_home, context=CONTEXT)
    rows = {split: sum(1 for _ in data[split].open()) for split in ("train", "test")}
    print(f"1/3 data: {rows['train']:,} next-word examples from {args.homes} homes, "
          f"{rows['test']:,} from 2 unseen homes")  # fmt: skip
    print("2/3 workstation: the LSTM as gates ORT can train, verified against PyTorch")
    artifacts = make_artifacts(out, data)
    print("3/3 device: train on the text (no torch), top-1 next word on the unseen homes")
    metrics = train_on_device(artifacts, data, out, args.epochs)
    baseline = metrics["most_common_word_accuracy"]
    print(f"   top-1 {metrics['accuracy']:.4f} (the most common word alone: {baseline:.4f}), "
          f"top-3 {metrics['top3_accuracy']:.4f}, perplexity {metrics['perplexity']:.1f}")  # fmt: skip
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    if args.federated:
        rounds = args.shared_rounds or args.federated
        print(f"+ federated: {rounds} rounds, one client per home, one shared model")
        shared = federate(artifacts, out / "data", out, rounds)
        print(f"   unseen homes: top-1 {shared['central.accuracy']:.4f}, top-3 {shared['central.top3_accuracy']:.4f} "
              f"(centralized: {metrics['accuracy']:.4f}, {metrics['top3_accuracy']:.4f})")  # fmt: skip
        print(f"+ federated: {args.federated} rounds, the output layer personal")
        homes = federate(artifacts, out / "data", out, args.federated, personal="head.*")["clients"]
        print("   home  top-1 global  top-1 personal  top-3 global  top-3 personal")
        for home, row in sorted(homes.items(), key=lambda item: int(item[0])):
            print(f"   {home:>4}  {row['global-eval-accuracy']:12.4f}  {row['eval-accuracy']:14.4f}  "
                  f"{row['global-eval-top3-accuracy']:12.4f}  {row['eval-top3-accuracy']:14.4f}")  # fmt: skip
        metrics["federated"] = {"shared": shared, "personal": homes}
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
