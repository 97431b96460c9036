"""The client's side of SecAgg+: Flower's stage functions, with shares encrypted to one-off keys.

Flower's client encrypts the shares it sends each peer under the key pair of its setup stage (pk2).
When a peer then says it cannot open them, nobody but the two can tell which one lies. Here each
ciphertext is encrypted under a fresh key pair of its own (ECDH of the one-off private key with the
receiver's pk2, Flower's key derivation and Fernet), and its public key travels beside it
(:data:`~federated.secure_checks.EPHEMERAL`). A node that a peer accuses reveals, in the prove
stage, the one-off private key of each ciphertext it is accused over: the server opens those
ciphertexts itself, and names the liar (:func:`federated.secure_checks.accusation_verdict`). Such a
key opens nothing but shares its receiver already holds.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from .flower_internals import SecAgg
from .protocol import ARRAYS, METRICS, from_arrays
from .secure_checks import ACCUSERS, EPHEMERAL, PROVE, REJECTED, SECRETS, key_problem, shares_problem

__all__ = ["secure_mod"]

_SENT = "odt.secagg-sent"
"""The node's state record: destination -> the one-off private key of the ciphertext sent to it."""


def secure_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """The client's side of SecAgg+: answers the stages with Flower's stage functions (shares sent
    under one-off keys, accusations answered) and masks the update the ClientApp's train handler
    returns. Other messages pass through."""
    if msg.metadata.message_type != MessageType.TRAIN or SecAgg.CONFIGS not in msg.content.config_records:
        return call_next(msg, context)
    state_record = context.state.config_records.get(SecAgg.STATE, ConfigRecord({}))
    state = SecAgg.State(**state_record)
    configs = msg.content.config_records[SecAgg.CONFIGS]
    if configs.get(SecAgg.Key.STAGE) == PROVE:
        return Message(RecordDict({SecAgg.CONFIGS: ConfigRecord(_prove(state, configs, context), False)}),
                       reply_to=msg)  # fmt: skip
    SecAgg.check_stage(state.current_stage, configs)
    state.current_stage = str(configs.pop(SecAgg.Key.STAGE))
    SecAgg.check_configs(state.current_stage, configs)
    content = RecordDict()
    if state.current_stage == SecAgg.Stage.SETUP:
        state.nid = msg.metadata.dst_node_id
        result = SecAgg.setup(state, configs)
    elif state.current_stage == SecAgg.Stage.SHARE_KEYS:
        result, sent = _share_keys(state, configs)
        context.state.config_records[_SENT] = ConfigRecord(sent)
    elif state.current_stage == SecAgg.Stage.COLLECT_MASKED_VECTORS:
        start = from_arrays(msg.content[ARRAYS])
        del msg.content[SecAgg.CONFIGS]  # the train task as the app's mods and handler know it (one ConfigRecord)
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        content = reply.content
        trained = from_arrays(content[ARRAYS])
        # float64: quantization shifts each value by clipping_range, where float32 would keep only ~7 digits
        update = [trained[name].astype(np.float64) - start[name] for name in sorted(trained)]
        count = int(content[METRICS]["num-examples"])
        rejected = _keep_usable_sources(state, configs)
        result = SecAgg.collect_masked_vectors(state, configs, count, SecAgg.ndarrays_to_parameters(update))
        result[REJECTED] = rejected
        masked = [SecAgg.bytes_to_ndarray(b) for b in result[SecAgg.Key.MASKED_PARAMETERS]]
        # Values modulo 2^32 fit 32 bits: half of Flower's int64 on the wire, as many bytes as float32 weights
        result[SecAgg.Key.MASKED_PARAMETERS] = [SecAgg.ndarray_to_bytes(m.astype(np.uint32)) for m in masked]
        del content[ARRAYS]  # the update leaves the node masked only
    else:
        result = SecAgg.unmask(state, configs)
    context.state.config_records[SecAgg.STATE] = ConfigRecord(state.to_dict())
    content[SecAgg.CONFIGS] = ConfigRecord(result, False)
    return Message(content, reply_to=msg)


def _share_keys(state: Any, configs: ConfigRecord) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Flower's share_keys stage (its checks, its Shamir shares of the mask seed and of sk1), with each
    peer's shares encrypted under a one-off key pair. Returns the reply and the one-off private keys."""
    keys = {int(node): (pk1, pk2) for node, (pk1, pk2) in configs.items()}
    if len(keys) < state.threshold:
        raise ValueError("Available neighbours number smaller than threshold")
    listed = [key for pair in keys.values() for key in pair]
    if len(set(listed)) != len(listed):
        raise ValueError("Some public keys are identical")
    if keys.get(state.nid) != (state.pk1, state.pk2):
        raise ValueError("this node's public keys are listed wrongly")
    state.public_keys_dict = keys
    state.rd_seed = os.urandom(32)
    seed_shares = SecAgg.create_shares(state.rd_seed, state.threshold, state.share_num)
    key_shares = SecAgg.create_shares(state.sk1, state.threshold, state.share_num)
    destinations, ciphertexts, ephemeral, sent = [], [], [], {}
    for index, (node, (_, pk2)) in enumerate(keys.items()):
        if node == state.nid:
            state.rd_seed_share_dict[node], state.sk1_share_dict[node] = seed_shares[index], key_shares[index]
            continue
        secret, public = SecAgg.generate_key_pairs()
        shared = SecAgg.generate_shared_key(secret, SecAgg.bytes_to_public_key(pk2))
        plaintext = SecAgg.share_keys_plaintext_concat(state.nid, node, seed_shares[index], key_shares[index])
        destinations.append(node)
        ciphertexts.append(SecAgg.encrypt(shared, plaintext))
        ephemeral.append(SecAgg.public_key_to_bytes(public))
        sent[str(node)] = SecAgg.private_key_to_bytes(secret)
    reply = {SecAgg.Key.DESTINATION_LIST: destinations, SecAgg.Key.CIPHERTEXT_LIST: ciphertexts, EPHEMERAL: ephemeral}
    return reply, sent


def _keep_usable_sources(state: Any, configs: ConfigRecord) -> list[int]:
    """Drop from the collect stage's ``configs`` the ciphertexts this node cannot use (a source that is
    no peer or came before, a one-off key that is no key, a token that does not open to the source's
    shares for this node) and return their sources; keep the key of each usable one where Flower's
    collect stage looks for it. Flower's client would raise on the first; a hostile peer could then
    stop every round. The server asks each named source to prove its ciphertext."""
    sources, ciphertexts, rejected = [], [], []
    own = SecAgg.bytes_to_private_key(state.sk2)
    ephemeral = configs.pop(EPHEMERAL, [])
    ephemeral = ephemeral if isinstance(ephemeral, list) else []
    listed = zip(configs[SecAgg.Key.SOURCE_LIST], configs[SecAgg.Key.CIPHERTEXT_LIST])
    for index, (source, ciphertext) in enumerate(listed):
        public = ephemeral[index] if index < len(ephemeral) else b""
        usable = source in state.public_keys_dict and source != state.nid and source not in sources
        if usable and isinstance(public, bytes) and key_problem(public) is None:
            shared = SecAgg.generate_shared_key(own, SecAgg.bytes_to_public_key(public))
            usable = shares_problem(shared, ciphertext, source, state.nid) is None
        else:
            usable = False
        if usable:
            state.ss2_dict[source] = shared
            sources.append(source)
            ciphertexts.append(ciphertext)
        else:
            rejected.append(source)
    configs[SecAgg.Key.SOURCE_LIST], configs[SecAgg.Key.CIPHERTEXT_LIST] = sources, ciphertexts
    return rejected


def _prove(state: Any, configs: ConfigRecord, context: Context) -> dict[str, Any]:
    """The prove stage: the one-off private key of the ciphertext sent to each accuser. Once per round,
    after the collect stage, and only for peers this node sent shares to."""
    sent = context.state.config_records.get(_SENT)
    accusers = configs.get(ACCUSERS)
    if state.current_stage != SecAgg.Stage.COLLECT_MASKED_VECTORS or sent is None:
        raise ValueError(f"the {PROVE} stage comes once, after the collect stage")
    if not isinstance(accusers, list) or not accusers or any(str(a) not in sent for a in accusers):
        raise ValueError(f"the {PROVE} stage must name peers this node sent shares to")
    del context.state.config_records[_SENT]  # answered once: a second request reveals nothing more
    return {SECRETS: [sent[str(a)] for a in accusers]}
