"""What the SecAgg+ server checks before it uses a peer's reply, as pure functions.

A secure round must survive one hostile node, even an authenticated one: its keys, destinations,
ciphertexts and shares are checked for what an honest node sends (:func:`key_problem`,
:func:`destinations_problem`, :func:`token_problem`, :func:`share_problem`); a secret is rebuilt
from any threshold-sized subset of its shares that the other shares confirm (:func:`recover`); when
a node says it could not open a peer's shares, the key the peer reveals for that one ciphertext
tells who lies (:func:`accusation_verdict`); and the unmasked sum must be one that honest inputs
can produce (:func:`sum_problem`), because a masked vector reveals nothing on its own.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections import Counter
from itertools import combinations
from typing import Any, Callable, Iterable

import numpy as np
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.fernet import InvalidToken
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from flwr.app import RecordDict

from .flower_internals import SecAgg
from .protocol import METRICS

__all__ = [
    "MOD_RANGE",
    "REJECTED",
    "EPHEMERAL",
    "PROVE",
    "ACCUSERS",
    "SECRETS",
    "group_size",
    "levels_for",
    "quantization_problem",
    "reply_problem",
    "key_pair_problem",
    "key_problem",
    "destinations_problem",
    "token_problem",
    "share_problem",
    "recover",
    "RecoveryError",
    "shares_problem",
    "accusation_verdict",
    "sum_problem",
    "shift_bound",
    "MAX_COMBINES",
]

MOD_RANGE = 2**32
"""Masked vectors are summed modulo this (Flower's default modulus range)."""
REJECTED = "odt-rejected"
"""Sources a node's collect reply names because their ciphertexts were no use to it (this SDK's
addition to Flower's SecAgg+: the pair's masks would not cancel, so the server must break it up)."""
EPHEMERAL = "odt-ephemeral-keys"
"""The public keys each ciphertext of the share_keys stage was encrypted with, one fresh key pair per
ciphertext (this SDK's change to Flower's SecAgg+, which encrypts with the node's one key pk2): its
sender can reveal the private key of one ciphertext without exposing any other."""
PROVE = "odt-prove"
"""The stage between collect and unmask, sent only to the nodes some peer named under :data:`REJECTED`:
each reveals the ephemeral private keys of the ciphertexts those peers say they could not open."""
ACCUSERS = "odt-accusers"
"""The prove stage's task: the peers whose ciphertexts from this node they could not open."""
SECRETS = "odt-ephemeral-secrets"
"""The prove stage's reply: the ephemeral private key (PEM) of the ciphertext to each accuser, in order."""
MAX_STEP = 1e-5
"""The largest quantization step (2 x clipping range / levels) a round accepts: a weighted update
element moves in such steps, and example weights (count / max-examples) are often 1e-3 or less."""
MAX_COMBINES = 2000
"""Reconstructions :func:`recover` tries for one secret before it gives up (about 1 s of work)."""
_FERNET_OVERHEAD = 1 + 8 + 16 + 32  # version, timestamp, IV, HMAC around the AES-CBC blocks


class RecoveryError(ValueError):
    """No threshold-sized subset of a secret's shares gives a secret the others confirm."""


def group_size(nodes: int) -> int:
    """SecAgg+'s group for a round of ``nodes``: everyone up to 20, then 2 x ceil(log2 nodes) + 1 (the
    SecAgg+ paper's logarithmic groups: a node's cost stops growing with the round)."""
    return nodes if nodes <= 20 else min(nodes, 2 * math.ceil(math.log2(nodes)) + 1)


def levels_for(nodes: int) -> int:
    """The most quantization levels whose sum over ``nodes`` stays within half the modulus (a power of
    two), so that a sum shifted by half the modulus cannot pass for an honest one."""
    return 2 ** ((MOD_RANGE // (2 * nodes)).bit_length() - 1)


def quantization_problem(clipping_range: float, levels: int, nodes: int, max_weight: float) -> str | None:
    """Why ``levels`` over +/- ``clipping_range`` cannot carry ``nodes`` weighted updates (None when
    they can): the sum must stay within half the 2^32 modulus, a step must be at most
    :data:`MAX_STEP`, and every example count up to ``max_weight`` must keep a weight of its own."""
    if levels * nodes > MOD_RANGE // 2:
        return (f"secagg-quantization {levels} x {nodes} nodes passes half the 2^32 modulus: lower "
                "secagg-quantization (0 picks the most that fits)")  # fmt: skip
    if levels < max_weight:
        return (f"secagg-quantization {levels} is below max-examples ({max_weight:g}): a node's weight is its "
                "example count / max-examples in those levels, so small counts would weigh 0. Raise "
                "secagg-quantization or lower max-examples")  # fmt: skip
    step = 2 * clipping_range / levels
    if not step <= MAX_STEP:
        return (f"secagg-clipping-range {clipping_range:g} in {levels} levels moves an update in steps of "
                f"{step:.3g}, more than {MAX_STEP:g}: lower secagg-clipping-range (a weighted update element "
                "rarely passes 1) or use fewer nodes per round")  # fmt: skip
    return None


def reply_problem(stage: str, content: RecordDict, shapes: list[tuple[int, ...]], max_weight: float) -> str | None:
    """Why a node's reply to ``stage`` cannot be used (None when it can): the values the stage needs,
    of the types and sizes it needs. Replies come from peers the server does not trust."""
    configs = content.config_records.get(SecAgg.CONFIGS)
    if configs is None:
        return "no SecAgg+ record in its reply"
    needs = {
        SecAgg.Stage.SETUP: {SecAgg.Key.PUBLIC_KEY_1: bytes, SecAgg.Key.PUBLIC_KEY_2: bytes},
        SecAgg.Stage.SHARE_KEYS: {SecAgg.Key.DESTINATION_LIST: int, SecAgg.Key.CIPHERTEXT_LIST: bytes,
                                  EPHEMERAL: bytes},
        SecAgg.Stage.COLLECT_MASKED_VECTORS: {SecAgg.Key.MASKED_PARAMETERS: bytes},
        SecAgg.Stage.UNMASK: {SecAgg.Key.NODE_ID_LIST: int, SecAgg.Key.SHARE_LIST: bytes},
        PROVE: {SECRETS: bytes},
    }[stage]
    for key, kind in needs.items():
        value = configs.get(key)
        items = value if isinstance(value, list) else [value]
        if value is None or not all(isinstance(v, kind) and not isinstance(v, bool) for v in items):
            return f"it lacks {key!r} ({kind.__name__} values)"
    lists = [configs[k] for k in needs if isinstance(configs[k], list)]
    if len({len(v) for v in lists}) > 1:
        return "it pairs lists of different lengths"
    if stage == SecAgg.Stage.COLLECT_MASKED_VECTORS:
        metrics = content.metric_records.get(METRICS)
        count = None if metrics is None else metrics.get("num-examples")
        if not isinstance(count, int) or isinstance(count, bool) or not 0 < count <= max_weight:
            return f"its example count is {count!r} (1 to max-examples, {max_weight:g}, expected)"
        try:
            vector = [SecAgg.bytes_to_ndarray(b) for b in configs[SecAgg.Key.MASKED_PARAMETERS]]
        except ValueError as exc:
            return f"its masked vector is not arrays ({exc})"
        if [v.shape for v in vector] != shapes or any(v.dtype.kind not in "iu" for v in vector):
            return "its masked vector does not have the model's shapes (integers)"
        if any(v.size and (v.min() < 0 or v.max() >= MOD_RANGE) for v in vector):
            return "its masked vector holds values outside 0..2^32"
    return None


def key_pair_problem(configs: Any) -> str | None:
    """Why a setup reply's two public keys cannot be used (None when they can)."""
    pair = configs[SecAgg.Key.PUBLIC_KEY_1], configs[SecAgg.Key.PUBLIC_KEY_2]
    if pair[0] == pair[1]:
        return "its two public keys are the same"
    return next((f"pk{i}: {p}" for i, p in enumerate(map(key_problem, pair), 1) if p), None)


def key_problem(pem: bytes) -> str | None:
    """Why ``pem`` is not a public key Flower's SecAgg+ can agree on (None when it is one): an EC
    point on SECP384R1 in PEM (the curve of ``generate_key_pairs``)."""
    try:
        key = load_pem_public_key(pem)
    except (ValueError, TypeError):
        return "not a PEM public key"
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != ec.SECP384R1.name:
        return f"not a {ec.SECP384R1.name} key"
    return None


def destinations_problem(destinations: list[int], expected: set[int]) -> str | None:
    """Why a share_keys reply's ``destinations`` are not exactly ``expected`` (the other nodes whose
    keys it was sent), once each (None when they are)."""
    repeated = sorted(n for n, k in Counter(destinations).items() if k > 1)
    if repeated:
        return f"it sent shares to node {repeated[0]} more than once"
    foreign = sorted(set(destinations) - expected)
    if foreign:
        return f"it sent shares to node {foreign[0]}, which is not one of the {len(expected)} peers it was given"
    missing = sorted(expected - set(destinations))
    if missing:
        return f"it sent no shares to node {missing[0]} (one of the {len(expected)} peers it was given)"
    return None


def token_problem(token: bytes) -> str | None:
    """Why ``token`` cannot be a Fernet token (None when it can be): url-safe base64 of version
    0x80, a timestamp, an IV, whole AES blocks and an HMAC. Only its receiver can check the HMAC."""
    try:
        raw = base64.b64decode(token, altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        return "a ciphertext that is not url-safe base64"
    if len(raw) < _FERNET_OVERHEAD + 16 or (len(raw) - _FERNET_OVERHEAD) % 16 or raw[0] != 0x80:
        return "a ciphertext that is not a Fernet token"
    return None


def share_problem(share: bytes, share_num: int) -> str | None:
    """Why ``share`` is not a Shamir share as Flower writes them (None when it is): a 4-byte index in
    1..``share_num``, then 16 bytes per chunk of the padded secret."""
    if len(share) < 20 or (len(share) - 4) % 16:
        return f"a share of {len(share)} bytes (4 + 16 per chunk expected)"
    index = int.from_bytes(share[:4], "little")
    if not 1 <= index <= share_num:
        return f"a share with index {index} (1 to {share_num} expected)"
    return None


def _combine(shares: Iterable[bytes]) -> bytes | None:
    try:
        return SecAgg.combine_shares(list(shares))
    except ValueError:
        return None


def recover(
    shares: dict[int, bytes], threshold: int, valid: Callable[[bytes], bool] | None = None
) -> tuple[bytes, set[int]]:
    """The secret behind ``shares`` (sender -> share) and the senders whose shares do not fit it.

    When the first and the last ``threshold`` shares give the same secret, it is taken (a bad share
    in either subset moves its result). Otherwise subsets that leave out ever more senders are
    tried, and a candidate is taken when ``valid`` accepts it, or (without ``valid``) when a share
    outside the subset confirms it, so telling bad shares apart needs ``threshold`` + 1 good ones.
    Raises :class:`RecoveryError` when none is found.
    """
    lengths = Counter(len(s) for s in shares.values())
    length = max(sorted(lengths), key=lambda n: lengths[n]) if shares else 0
    indices = Counter(s[:4] for s in shares.values() if len(s) == length)
    usable = {n: s for n, s in sorted(shares.items()) if len(s) == length and indices[s[:4]] == 1}
    bad = set(shares) - set(usable)
    senders = list(usable)
    if len(senders) < threshold:
        raise RecoveryError(f"{len(senders)} usable shares of {len(shares)}, {threshold} needed")
    secret = _combine(usable[n] for n in senders[:threshold])  # the first and the last threshold agree:
    if secret is not None and (valid is None or valid(secret)):  # twice the work of trusting one subset
        if len(senders) == threshold or _combine(usable[n] for n in senders[-threshold:]) == secret:
            return secret, bad
    combines = 0
    for left_out in range(len(senders) - threshold + 1):
        for out in combinations(senders, left_out):
            if combines > MAX_COMBINES:
                raise RecoveryError(f"no subset of {len(senders)} shares is confirmed within {MAX_COMBINES} tries")
            rest = [n for n in senders if n not in out]
            subset, others = rest[:threshold], rest[threshold:] + list(out)
            combines += 1 + len(others)
            secret = _combine(usable[n] for n in subset)
            if secret is None or (valid is not None and not valid(secret)):
                continue
            fits = {n for n in others if _combine([*(usable[m] for m in subset[1:]), usable[n]]) == secret}
            if valid is not None or fits:
                return secret, bad | (set(others) - fits)
    raise RecoveryError(f"no subset of {len(senders)} shares is confirmed by the others")


def shares_problem(key: bytes, token: bytes, sender: int, receiver: int) -> str | None:
    """Why ``token`` under the Fernet ``key`` is not ``sender``'s shares for ``receiver`` (None when it
    is): what a receiver checks before it takes shares, and what the server checks for it when the
    receiver says they do not open."""
    try:
        plaintext = SecAgg.decrypt(key, token)
        named = SecAgg.share_keys_plaintext_separate(plaintext)[:2]
    except (InvalidToken, ValueError, TypeError, IndexError):
        return "the ciphertext does not decrypt to shares"
    if tuple(named) != (sender, receiver):
        return f"the shares name nodes {named[0]} -> {named[1]}, not {sender} -> {receiver}"
    return None


def accusation_verdict(secret: bytes, ephemeral: bytes, receiver_key: bytes, token: bytes, sender: int,
                       receiver: int) -> str | None:  # fmt: skip
    """Who is at fault when ``receiver`` says it could not open ``token`` from ``sender``: the reason
    the sender is (the key it revealed, ``secret``, is not the private key of the ``ephemeral`` public
    key it sent the token with, or the token does not open under it to its shares for the receiver,
    whose encryption key is ``receiver_key``), or None when the token opens, so the receiver lied."""
    try:
        key = SecAgg.bytes_to_private_key(secret)
        if not isinstance(key, ec.EllipticCurvePrivateKey) or SecAgg.public_key_to_bytes(key.public_key()) != ephemeral:
            raise ValueError
        shared = SecAgg.generate_shared_key(key, SecAgg.bytes_to_public_key(receiver_key))
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return "the key it revealed is not the one it encrypted with"
    return shares_problem(shared, token, sender, receiver)


def sum_problem(vector: list[np.ndarray], nodes: int, levels: int, factor: int) -> str | None:
    """Why an unmasked, quantized sum cannot come from ``nodes`` honest inputs (None when it can):
    every element within 0..``nodes`` x ``levels`` (each input is quantized into 0..levels), and the
    weight factor (element 0) equal to ``factor``, the sum of the quantized example counts the nodes
    reported. A shifted, replayed or garbled masked vector lands outside with near certainty."""
    found = int(np.asarray(vector[0]).ravel()[0])
    if found != factor:
        return f"its weight factor is {found}, the reported example counts make {factor}"
    top = nodes * levels
    for index, array in enumerate(vector[1:]):
        outside = int(np.count_nonzero((array < 0) | (array > top)))
        if outside:
            return (f"{outside} of {array.size} elements of tensor {index} lie outside 0..{top}, the range "
                    f"of {nodes} quantized updates")  # fmt: skip
    return None


def shift_bound(nodes: int, clipping_range: float, levels: int, factor: int) -> float:
    """The most one client can move an element of a secure round's average while the sum still
    passes :func:`sum_problem`: masked values stay in the field, so nothing bounds one client's
    input on its own, only the sum (each element in 0..``nodes`` x ``levels``). One client can move
    an element of that sum by up to ``nodes`` x ``levels`` levels of 2 x ``clipping_range`` /
    ``levels`` each, and the average divides the sum by the weight ``factor`` / ``levels``. An
    honest client moves it by at most 2 x ``clipping_range`` / that weight (its own range)."""
    return 2 * nodes * clipping_range * levels / factor
