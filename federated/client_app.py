"""The Flower ClientApp: trains the shared artifacts on the node's data with the ondevice trainer.

A node whose config names a ``bridge-device`` stands for a phone or browser: its messages go to
the relay that an installed package registers under the ``odt.relays`` entry point group (the
bridge registers ``bridge``), so this app never imports the bridge.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable

from ondevice.formats import save_tensors

from .buffers import split_state
from .codec import encode
from .errors import FederatedError
from .flower_internals import KEY_CLIPPING_NORM, SecAgg
from .partial import fit_to, personal_names
from .protocol import ARRAYS, CONFIG, METRICS, from_arrays, skip_evaluation, to_arrays, train_reply
from .secure import secure_mod
from .task import Settings, local_epochs, node_artifacts, node_data, node_trainer

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


def secure_or_relayed(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """SecAgg+ (:func:`federated.secure.secure_mod`) for nodes that train themselves. A relay node hands
    each stage on to its device, which makes its own keys and masks its own update, so the relay never
    holds that update in the clear (:mod:`mobile_bridge.secagg`)."""
    relay = _relay(context) if SecAgg.CONFIGS in msg.content.config_records else None
    if relay is not None:
        return relay(msg, context)
    return secure_mod(msg, context, call_next)


app = ClientApp(mods=[secure_or_relayed, clipping_when_asked])


def _relay(context: Context) -> Callable[[Message, Context], Message] | None:
    name = next((RELAY_KEYS[key] for key in RELAY_KEYS if key in context.node_config), None)
    if name is None:
        return None
    found = [e for e in entry_points(group=RELAY_GROUP) if e.name == name]
    if not found:
        raise FederatedError(f"this node is a {name} relay, but no package provides the {name!r} relay.")
    return found[0].load()


PERSONAL = "odt.personal"
"""Key of the node's own state record that keeps its personal tensors between rounds."""


def _task(msg: Message, context: Context, *, for_evaluation: bool = False):  # type: ignore[no-untyped-def]
    settings = Settings.from_config(context.run_config)
    config: ConfigRecord = msg.content[CONFIG]
    artifacts = node_artifacts(settings, context.node_config)
    trainer = node_trainer(
        artifacts,
        str(config["manifest-sha256"]),
        str(config.get("tier-sha256s", "")),
        for_evaluation=for_evaluation,
        engine=str(context.node_config.get("engine", "auto")),
    )
    global_weights = from_arrays(msg.content[ARRAYS])
    if config.get("partial"):  # mixed tiers or personal tensors: take the global part this node trains
        weights, buffers = {**trainer.get_weights(), **fit_to(trainer.manifest, global_weights)}, {}
        if PERSONAL in context.state.array_records:
            weights.update(from_arrays(context.state.array_records[PERSONAL]))
    else:
        weights, buffers = split_state(trainer.manifest, global_weights)
    trainer.set_weights(weights)
    if buffers:
        trainer.set_buffers(buffers)
    train, val = node_data(settings, context.node_config, artifacts)
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
        data,
        epochs=local_epochs(settings.local_epochs, settings.local_steps, size, settings.batch_size),
        batch_size=min(settings.batch_size, size),
        seed=round_seed,
        progress=False,
    )
    state = {**trainer.get_weights(), **trainer.get_buffers()}  # running statistics travel too
    personal = personal_names(trainer.manifest, settings.personal)
    if personal:  # they never leave the node: kept in its own state for the next round, and on its disk
        mine = {name: state.pop(name) for name in personal}
        context.state[PERSONAL] = to_arrays(mine)
        partition = int(context.node_config.get("partition-id", -1))
        save_tensors(Path(settings.output) / "personal" / f"client-{partition}.safetensors", mine)
    payload = encode(state, global_weights, str(config.get("codec", "none")))
    last = history.last()
    return train_reply(
        msg,
        payload,
        size,
        trainer.manifest_sha256,  # its own artifacts (in a mixed-tier run, its tier)
        **{
            "train-loss": float(last.get("loss", float("nan"))),
            "client": int(context.node_config.get("partition-id", -1)),
            "train-accuracy": float(last.get("accuracy", 0.0)),
            "skipped-steps": trainer.skipped_steps,
        },
    )


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    if _relay(context) is not None:  # devices behind a relay do not evaluate: the server does, centrally
        return skip_evaluation(msg)
    settings, _, trainer, global_weights, _, val = _task(msg, context, for_evaluation=True)
    result = trainer.evaluate(val)
    metrics = {"num-examples": len(next(iter(val.values()))), "eval-loss": result["loss"]}
    for key in ("accuracy", "top3_accuracy"):
        if key in result:
            metrics[f"eval-{key.replace('_', '-')}"] = result[key]
    metrics["client"] = int(context.node_config.get("partition-id", -1))
    personal = personal_names(trainer.manifest, settings.personal)
    if personal:  # the same node with the global values of its personal tensors: the global model
        trainer.set_weights({**trainer.get_weights(), **fit_to(trainer.manifest, global_weights)})
        shared = trainer.evaluate(val)
        metrics["global-eval-loss"] = shared["loss"]
        for key in ("accuracy", "top3_accuracy"):
            if key in shared:
                metrics[f"global-eval-{key.replace('_', '-')}"] = shared[key]
    return Message(RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The node's partition id (-1 when it has none): the server orders nodes by it, so that a
    seeded run samples the same clients whatever ids Flower gave the nodes."""
    partition = int(context.node_config.get("partition-id", -1))
    return Message(RecordDict({METRICS: MetricRecord({"partition-id": partition})}), reply_to=msg)
