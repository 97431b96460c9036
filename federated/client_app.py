"""The Flower ClientApp: trains the shared artifacts on the node's data with the ondevice trainer."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from .buffers import split_state
from .codec import encode, payload_bytes
from .strategy import from_arrays, to_arrays
from .task import Settings, node_data, node_trainer
from .validation import hash_tag

__all__ = ["app"]


def clipping_when_asked(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's client-side fixed clipping, for tasks from its client-side DP strategy wrapper."""
    config = msg.content.config_records.get("config")
    if config is not None and KEY_CLIPPING_NORM in config:
        return fixedclipping_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[clipping_when_asked])


def _task(msg: Message, context: Context):  # type: ignore[no-untyped-def]
    settings = Settings.from_config(context.run_config)
    config: ConfigRecord = msg.content["config"]
    artifacts = str(context.node_config.get("artifacts", settings.artifacts))
    trainer = node_trainer(artifacts, str(config["manifest-sha256"]))
    global_weights = from_arrays(msg.content["arrays"])
    weights, buffers = split_state(trainer.manifest, global_weights)
    trainer.set_weights(weights)
    if buffers:
        trainer.set_buffers(buffers)
    train, val = node_data(settings, context.node_config)
    return settings, config, trainer, global_weights, train, val


@app.train()
def train(msg: Message, context: Context) -> Message:
    settings, config, trainer, global_weights, data, _ = _task(msg, context)
    trainer.set_lr(settings.lr)
    trainer.set_proximal(float(config.get("proximal-mu", 0.0)))
    size = len(data["labels"]) if "labels" in data else len(next(iter(data.values())))
    round_seed = settings.seed * 100_003 + int(config.get("server-round", 0))
    history = trainer.fit(
        data, epochs=settings.local_epochs, batch_size=min(settings.batch_size, size), seed=round_seed, progress=False
    )
    state = {**trainer.get_weights(), **trainer.get_buffers()}  # running statistics travel too
    payload = encode(state, global_weights, str(config.get("codec", "none")))
    last = history.last()
    metrics = MetricRecord(
        {
            "num-examples": size,
            "train-loss": float(last.get("loss", float("nan"))),
            "train-accuracy": float(last.get("accuracy", 0.0)),
            "skipped-steps": trainer.skipped_steps,
            "bytes-up": payload_bytes(payload),
            "manifest-tag": hash_tag(str(config["manifest-sha256"])),
        }
    )
    return Message(RecordDict({"arrays": to_arrays(payload), "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    _, _, trainer, _, _, val = _task(msg, context)
    result = trainer.evaluate(val)
    metrics = {"num-examples": len(next(iter(val.values()))), "eval-loss": result["loss"]}
    if "accuracy" in result:
        metrics["eval-accuracy"] = result["accuracy"]
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
