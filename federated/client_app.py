"""The Flower ClientApp: trains the shared artifacts on the node's data with the ondevice trainer.

A node whose config names a ``bridge-device`` stands for a phone or browser: its messages go to
the relay that an installed package registers under the ``odt.relays`` entry point group (the
bridge registers ``bridge``), so this app never imports the bridge.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from .buffers import split_state
from .codec import encode
from .errors import FederatedError
from .protocol import ARRAYS, CONFIG, METRICS, from_arrays, skip_evaluation, train_reply
from .task import Settings, node_data, node_trainer

__all__ = ["app", "RELAY_GROUP"]

RELAY_GROUP = "odt.relays"
RELAY_KEYS = {"bridge-device": "bridge"}
"""Node-config key that marks a relay node -> the relay's entry point name."""


def clipping_when_asked(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's client-side fixed clipping, for tasks from its client-side DP strategy wrapper."""
    config = msg.content.config_records.get(CONFIG)
    if config is not None and KEY_CLIPPING_NORM in config:
        return fixedclipping_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[clipping_when_asked])


def _relay(context: Context) -> Callable[[Message, Context], Message] | None:
    name = next((RELAY_KEYS[key] for key in RELAY_KEYS if key in context.node_config), None)
    if name is None:
        return None
    found = [e for e in entry_points(group=RELAY_GROUP) if e.name == name]
    if not found:
        raise FederatedError(f"this node is a {name} relay, but no package provides the {name!r} relay.")
    return found[0].load()


def _task(msg: Message, context: Context):  # type: ignore[no-untyped-def]
    settings = Settings.from_config(context.run_config)
    config: ConfigRecord = msg.content[CONFIG]
    artifacts = str(context.node_config.get("artifacts", settings.artifacts))
    trainer = node_trainer(artifacts, str(config["manifest-sha256"]))
    global_weights = from_arrays(msg.content[ARRAYS])
    weights, buffers = split_state(trainer.manifest, global_weights)
    trainer.set_weights(weights)
    if buffers:
        trainer.set_buffers(buffers)
    train, val = node_data(settings, context.node_config)
    return settings, config, trainer, global_weights, train, val


@app.train()
def train(msg: Message, context: Context) -> Message:
    relay = _relay(context)
    if relay is not None:
        return relay(msg, context)
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
    return train_reply(
        msg,
        payload,
        size,
        str(config["manifest-sha256"]),
        **{
            "train-loss": float(last.get("loss", float("nan"))),
            "train-accuracy": float(last.get("accuracy", 0.0)),
            "skipped-steps": trainer.skipped_steps,
        },
    )


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    if _relay(context) is not None:  # devices behind a relay do not evaluate: the server does, centrally
        return skip_evaluation(msg)
    _, _, trainer, _, _, val = _task(msg, context)
    result = trainer.evaluate(val)
    metrics = {"num-examples": len(next(iter(val.values()))), "eval-loss": result["loss"]}
    if "accuracy" in result:
        metrics["eval-accuracy"] = result["accuracy"]
    return Message(RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)
