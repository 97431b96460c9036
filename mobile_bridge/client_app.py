"""The project's Flower ClientApp: local training (federated.client_app), or relay mode for a
phone/browser when the node config names a ``bridge-device``."""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from federated import client_app as local

from .relay import relay_train

__all__ = ["app"]

app = ClientApp(mods=[local.clipping_when_asked])


@app.train()
def train(msg: Message, context: Context) -> Message:
    if "bridge-device" in context.node_config:
        return relay_train(msg, context)
    return local.train(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    if "bridge-device" in context.node_config:
        # Devices behind the bridge do not evaluate (the server evaluates centrally): a reply with no
        # examples leaves this node out of the round's evaluation instead of failing it.
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 0})}), reply_to=msg)
    return local.evaluate(msg, context)
