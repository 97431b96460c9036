"""SecAgg+ stages as JSON for devices: what the relay hands a device, and what it may answer.

A browser behind the bridge takes part in a secure round as a full SecAgg+ client: it makes its
own keys, shares and masks (``web/odt-secagg.mjs``), so neither the relay nor the bridge ever
holds its update unmasked. The relay turns each stage's Flower ConfigRecord into a task for the
device (:func:`stage_task`) and the device's answer back into the values Flower's server side
reads (:func:`stage_values`); the bridge checks an answer's shape before it stores it
(:func:`answer_problem`), because a device is a peer like any other.

Node ids are unsigned 64-bit integers, which JSON numbers cannot carry into JavaScript exactly:
they travel as decimal strings. Bytes travel as base64. The collect stage's answer is binary (the
masked vector, uint32 little-endian) and goes through the update endpoint, not through here.

Task (``secagg`` of a device's task) and answer, by stage:

=====================  ========================================================  =================================
stage                  task                                                      answer
=====================  ========================================================  =================================
setup                  node, sample_num, share_num, threshold, clipping_range,   pk1, pk2
                       target_range, mod_range, max_weight
share_keys             node, keys: [[node, pk1, pk2], ...]                       destinations, ciphertexts,
                                                                                 ephemeral
collect_masked_vectors node, sources, ciphertexts, ephemeral,                    (binary, see above; the sources
                       order: [[offset, size], ...], clipping_norm (or null)     it could not decrypt as the
                                                                                 update's ``rejected`` query)
odt-prove              node, accusers                                            secrets
unmask                 node, active, dead                                        nodes, shares
=====================  ========================================================  =================================

``ephemeral`` is the one-off public key each ciphertext is encrypted with, ``secrets`` the one-off
private keys of the ciphertexts sent to ``accusers`` (:mod:`federated.secure_client`). Any stage may
be answered ``{"declined": "why"}`` (a device that lost the round's state, say): its relay then
fails the stage, and the server counts the node as dropped (or, in the prove stage, excludes it).
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from flwr.app import ConfigRecord

from federated.flower_internals import SecAgg
from federated.secure_checks import (
    ACCUSERS,
    EPHEMERAL,
    PROVE,
    SECRETS,
    destinations_problem,
    key_pair_problem,
    key_problem,
    share_problem,
    token_problem,
)

__all__ = ["stage_task", "answer_problem", "stage_values", "rejected_problem", "masked_size", "KEY_STAGES"]

KEY_STAGES = (SecAgg.Stage.SETUP, SecAgg.Stage.SHARE_KEYS, PROVE, SecAgg.Stage.UNMASK)
"""Stages a device answers in JSON; the collect stage's answer is the masked vector."""

MAX_BYTES = 4096
"""Longest byte string (decoded) a device may send in an answer: a PEM key or a Fernet token of shares."""
_NODE = re.compile(r"^[0-9]{1,20}$")
_ANSWERS = {
    SecAgg.Stage.SETUP: {"pk1": bytes, "pk2": bytes},
    SecAgg.Stage.SHARE_KEYS: {"destinations": list[int], "ciphertexts": list[bytes], "ephemeral": list[bytes]},
    PROVE: {"secrets": list[bytes]},
    SecAgg.Stage.UNMASK: {"nodes": list[int], "shares": list[bytes]},
}
_FLOWER_KEYS = {
    "pk1": SecAgg.Key.PUBLIC_KEY_1,
    "pk2": SecAgg.Key.PUBLIC_KEY_2,
    "destinations": SecAgg.Key.DESTINATION_LIST,
    "ciphertexts": SecAgg.Key.CIPHERTEXT_LIST,
    "ephemeral": EPHEMERAL,
    "secrets": SECRETS,
    "nodes": SecAgg.Key.NODE_ID_LIST,
    "shares": SecAgg.Key.SHARE_LIST,
}


def masked_size(weights: int) -> int:
    """Values of a masked vector: the weight factor, then every weight."""
    return 1 + weights


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def stage_task(
    configs: ConfigRecord,
    node: int,
    *,
    order: list[tuple[int, int]] | None = None,
    clipping_norm: float | None = None,
) -> dict[str, Any]:
    """The device's task for one stage: ``configs`` is the stage's SecAgg+ ConfigRecord from the server,
    ``node`` the SuperNode's id (the device's id in the protocol); for the collect stage, ``order`` is
    the (offset, size) of each tensor in the weight buffer in the order the vector is masked in, and
    ``clipping_norm`` the client-side DP clipping bound (None: no clipping)."""
    stage = str(configs[SecAgg.Key.STAGE])
    task: dict[str, Any] = {"stage": stage, "node": str(node)}
    if stage == SecAgg.Stage.SETUP:
        task.update({key: value for key, value in configs.items() if key != SecAgg.Key.STAGE})  # numbers
    elif stage == SecAgg.Stage.SHARE_KEYS:
        task["keys"] = [[k, _b64(v[0]), _b64(v[1])] for k, v in configs.items() if k != SecAgg.Key.STAGE]
    elif stage == SecAgg.Stage.COLLECT_MASKED_VECTORS:
        if order is None:
            raise ValueError("the collect stage needs the order of the weight buffer's tensors")
        task["sources"] = [str(n) for n in configs[SecAgg.Key.SOURCE_LIST]]
        task["ciphertexts"] = [_b64(c) for c in configs[SecAgg.Key.CIPHERTEXT_LIST]]
        task["ephemeral"] = [_b64(k) for k in configs[EPHEMERAL]]
        task["order"] = [list(segment) for segment in order]
        task["clipping_norm"] = clipping_norm
    elif stage == PROVE:
        task["accusers"] = [str(n) for n in configs[ACCUSERS]]
    elif stage == SecAgg.Stage.UNMASK:
        task["active"] = [str(n) for n in configs[SecAgg.Key.ACTIVE_NODE_ID_LIST]]
        task["dead"] = [str(n) for n in configs[SecAgg.Key.DEAD_NODE_ID_LIST]]
    else:
        raise ValueError(f"unknown SecAgg+ stage {stage!r}")
    return task


def _value(kind: Any, value: Any) -> Any:
    """One answer value as Flower's type (ValueError when it is not one)."""
    if kind is bytes:
        if not isinstance(value, str) or len(value) > 4 * MAX_BYTES // 3 + 4:
            raise ValueError("base64 text")
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("base64 text") from None
    if kind is int:
        if not isinstance(value, str) or not _NODE.match(value) or int(value) >= 2**64:
            raise ValueError("node ids as decimal strings")
        return int(value)
    (item,) = kind.__args__
    if not isinstance(value, list):
        raise ValueError("a list")
    return [_value(item, v) for v in value]


def answer_problem(stage: str, answer: Any, task: dict[str, Any]) -> str | None:
    """Why a device's JSON answer to ``stage`` cannot be used (None when it can): the checks the
    server makes (:mod:`federated.secure_checks`), made against ``task``, the stage task the device
    was handed, so that a device that breaks the protocol is told at once and its relay never
    forwards the answer."""
    if not isinstance(answer, dict):
        return "the answer must be a JSON object"
    if set(answer) == {"declined"}:
        return None if isinstance(answer["declined"], str) and len(answer["declined"]) <= 300 else \
            "declined must be a reason (text of at most 300 characters)"  # fmt: skip
    if stage not in _ANSWERS:
        return f"the {stage} stage is answered with the masked vector (push it as the task's update) or declined"
    wanted = _ANSWERS[stage]
    if set(answer) != set(wanted):
        return f"the {stage} answer must hold exactly {sorted(wanted)}, found {sorted(answer)}"
    peers = sum(len(task.get(k, [])) for k in ("keys", "accusers", "active", "dead"))
    values = {}
    for key, kind in wanted.items():
        if isinstance(answer[key], list) and len(answer[key]) > peers:
            return f"{key} holds {len(answer[key])} entries, more than the {peers} nodes the task names"
        try:
            values[key] = _value(kind, answer[key])
        except ValueError as exc:
            return f"{key} must be {exc}"
    lists = [values[key] for key in wanted if isinstance(values[key], list)]
    if len({len(v) for v in lists}) > 1:
        return f"{' and '.join(k for k in wanted)} must be lists of the same length"
    return _protocol_problem(stage, values, task)


def _protocol_problem(stage: str, values: dict[str, Any], task: dict[str, Any]) -> str | None:
    if stage == SecAgg.Stage.SETUP:
        return key_pair_problem({_FLOWER_KEYS[k]: v for k, v in values.items()})
    if stage == SecAgg.Stage.SHARE_KEYS:
        expected = {int(k[0]) for k in task.get("keys", [])} - {int(task["node"])}
        problems = (*map(token_problem, values["ciphertexts"]), *map(key_problem, values["ephemeral"]))
        return destinations_problem(values["destinations"], expected) or next((p for p in problems if p), None)
    if stage == PROVE:
        wanted = len(task.get("accusers", []))
        return None if len(values["secrets"]) == wanted else f"secrets must hold {wanted} keys, one per accuser"
    asked = [int(n) for n in (*task.get("active", []), *task.get("dead", []))]
    if values["nodes"] != asked:
        return "nodes must list the task's active nodes, then its dead ones, each once and in that order"
    problems = (share_problem(s, share_num=2**32 - 1) for s in values["shares"])  # the server checks the index
    return next((p for p in problems if p), None)


def stage_values(stage: str, answer: dict[str, Any]) -> dict[str, Any]:
    """A checked answer as the values of Flower's SecAgg+ reply ConfigRecord."""
    return {_FLOWER_KEYS[key]: _value(kind, answer[key]) for key, kind in _ANSWERS[stage].items()}


def rejected_problem(rejected: str, task: dict[str, Any]) -> str | None:
    """Why ``rejected`` (the collect stage's update query: comma-separated node ids) does not name
    sources of ``task`` whose ciphertexts the device could not decrypt (None when it does)."""
    named = [n for n in rejected.split(",") if n]
    if not all(_NODE.match(n) for n in named) or len(set(named)) != len(named):
        return "rejected must list node ids (decimal, comma-separated), each once"
    foreign = sorted(set(named) - set(task.get("sources", [])))
    return f"rejected names node {foreign[0]}, which sent this task no shares" if foreign else None
