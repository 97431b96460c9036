"""The digits sample end to end: data, verified artifacts, on-device training, evaluation, export.

Run by `make demo`. Everything it writes goes under --out (default out/digits).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from samples import print_round

from .data import prepare

EPOCHS = 20
BATCH = 32


def make_artifacts(out: Path) -> Path:
    """Workstation step (torch): generate and verify the artifacts."""
    import torch

    from artifacts import generate
    from artifacts.verify import format_table
    from ondevice.engines import installed_engines

    from .model import build

    # ORT-format copies of the classic graphs (ORT Mobile) where the training build is here to write them
    ort_format = "classic" in installed_engines()
    example = {"input": torch.randn(BATCH, 64)}
    manifest = generate(build(), example, out / "artifacts", force=True, ort_format=ort_format)
    print(format_table(manifest.verification))
    print(f"   {manifest.trainable_size:,} trainable parameters -> {out / 'artifacts'}")
    return out / "artifacts"


def train_on_device(artifacts: Path, data: dict[str, Path], out: Path, engine: str = "auto") -> dict[str, float]:
    """Device step (numpy + ONNX Runtime only): train, evaluate, export, plot."""
    from ondevice import Predictor, Schedule, Trainer
    from ondevice.data import load_npz

    train, val, test = (load_npz(str(data[split])) for split in ("train", "val", "test"))
    trainer = Trainer.load(artifacts, engine=engine)
    steps = EPOCHS * -(-len(train["labels"]) // BATCH)
    schedule = Schedule("cosine", 3e-3, total=steps, warmup=steps // 20)
    history = trainer.fit(
        train,
        epochs=EPOCHS,
        batch_size=BATCH,
        val_data=val,
        schedule=schedule,
        checkpoint=out / "checkpoints" / "latest.ckpt",
    )
    metrics = trainer.evaluate(test)
    model = trainer.export(out / "model.onnx")
    predicted = Predictor(model, trainer.manifest).predict({"input": test["input"]})["output"].argmax(-1)
    metrics["export_accuracy"] = float((predicted == test["labels"]).mean())
    (out / "history.json").write_text(json.dumps({"epochs": history.epochs, "test": metrics}, indent=2))
    plot(history.epochs, out / "curves.png")
    return metrics


def federate(artifacts: Path, out: Path) -> dict:
    """A short federated run with Flower's simulation runtime; prints the global accuracy per round."""
    from federated.runner import simulate

    config = {
        "num-server-rounds": 3,
        "artifacts": str(artifacts.resolve()),
        "data": str((out / "data").resolve()),
        "output": str((out / "federated").resolve()),
        "local-epochs": 2,
    }
    return simulate(5, config, work=out / "federated" / "logs", on_line=print_round)


def plot(epochs: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [e["epoch"] for e in epochs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(x, [e["loss"] for e in epochs], label="train")
    left.plot(x, [e["val_loss"] for e in epochs], label="validation")
    left.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
    right.plot(x, [e["accuracy"] for e in epochs], label="train")
    right.plot(x, [e["val_accuracy"] for e in epochs], label="validation")
    right.set(xlabel="epoch", ylabel="accuracy", title="accuracy", ylim=(0.0, 1.0))
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend(loc="center right")
    fig.suptitle("digits, trained on device with ONNX Runtime")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="out/digits", help="output directory (default out/digits)")
    parser.add_argument("--engine", choices=["auto", "classic", "portable"], default="auto",
                        help="what trains on the device (default auto: the training build where installed)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    print("1. data: scikit-learn's bundled digits -> .npz")
    data = prepare(out / "data")
    print("2. workstation: PyTorch model -> ONNX Runtime training artifacts, verified against PyTorch")
    artifacts = make_artifacts(out)
    print(f"3. device: train {EPOCHS} epochs with ONNX Runtime (no torch), evaluate, export")
    metrics = train_on_device(artifacts, data, out, args.engine)
    print(
        f"   test accuracy {metrics['accuracy']:.4f} (exported model: {metrics['export_accuracy']:.4f}), "
        f"test loss {metrics['loss']:.4f}"
    )
    print("4. federated: Flower simulation, 5 clients x 3 rounds of FedAvg over the same artifacts")
    report = federate(artifacts, out)
    final = report["rounds"][-1]["central.accuracy"]
    print(f"   global test accuracy after {len(report['rounds']) - 1} rounds: {final:.4f}")
    print(
        f"outputs: {out}/artifacts, {out}/model.onnx, {out}/checkpoints/latest.ckpt, "
        f"{out}/history.json, {out}/curves.png, {out}/federated/metrics.json, {out}/federated/rounds.png"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
