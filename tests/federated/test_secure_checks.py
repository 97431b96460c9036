"""The server's SecAgg+ checks as pure functions: share recovery against Flower's own Shamir shares,
accusations settled by the key the accused reveals, the honest-sum range, and the quantization settings."""

from __future__ import annotations

import os

import numpy as np
import pytest
from cryptography.fernet import Fernet
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.supercore.primitives.asymmetric import generate_key_pairs, private_key_to_bytes, public_key_to_bytes

from federated.secure_checks import (
    MOD_RANGE,
    RecoveryError,
    accusation_verdict,
    destinations_problem,
    key_problem,
    levels_for,
    quantization_problem,
    recover,
    share_problem,
    sum_problem,
    token_problem,
)


def _dealt(secret: bytes, threshold: int, count: int) -> dict[int, bytes]:
    return {100 + i: s for i, s in enumerate(create_shares(secret, threshold, count))}


def _garbled(share: bytes, seed: int) -> bytes:
    return share[:4] + np.random.default_rng(seed).bytes(len(share) - 4)


@pytest.mark.parametrize("threshold, count", [(2, 2), (3, 6), (5, 9), (8, 15)])
def test_sound_shares_give_the_secret_and_name_nobody(threshold, count):
    secret = os.urandom(32)
    assert recover(_dealt(secret, threshold, count), threshold) == (secret, set())


@pytest.mark.parametrize("bad", [[100], [105], [100, 108], [101, 102, 103]])
def test_bad_shares_anywhere_are_named_and_the_rest_give_the_secret(bad):
    secret = os.urandom(32)
    shares = _dealt(secret, 4, 9)
    for i, node in enumerate(bad):
        shares[node] = _garbled(shares[node], i)
    assert recover(shares, 4) == (secret, set(bad))


def test_a_copied_share_index_and_an_odd_length_are_set_aside():
    secret = os.urandom(32)
    shares = _dealt(secret, 3, 7)
    shares[101] = shares[100][:4] + shares[101][4:]  # two shares claim index 1: neither is used
    shares[104] = shares[104][:-16]
    found, bad = recover(shares, 3)
    assert found == secret and bad == {100, 101, 104}


def test_too_few_good_shares_cannot_be_told_apart():
    secret = os.urandom(32)
    shares = _dealt(secret, 3, 4)  # one spare share detects a bad one but cannot say which it is
    shares[102] = _garbled(shares[102], 0)
    with pytest.raises(RecoveryError, match="confirmed"):
        recover(shares, 3)
    with pytest.raises(RecoveryError, match="2 usable shares of 2, 3 needed"):
        recover(dict(list(_dealt(secret, 3, 4).items())[:2]), 3)


def test_a_checkable_secret_is_found_with_no_spare_share():
    """A secret key can be checked against its public key: threshold good shares suffice."""
    private, public = generate_key_pairs()
    key, pem = private_key_to_bytes(private), public_key_to_bytes(public)
    shares = _dealt(key, 3, 4)
    shares[100] = _garbled(shares[100], 1)

    def opens(secret: bytes) -> bool:
        from flwr.supercore.primitives.asymmetric import bytes_to_private_key

        try:
            return public_key_to_bytes(bytes_to_private_key(secret).public_key()) == pem
        except ValueError:
            return False

    assert recover(shares, 3, opens) == (key, {100})


def _sent(sender: int, receiver: int, receiver_public, *, names=None, key=None):
    """A ciphertext of shares as a client sends it: under a one-off key pair's ECDH with the receiver's
    key (Flower's key derivation); ``names`` overrides the (sender, receiver) in the plaintext, ``key``
    encrypts under another Fernet key."""
    from federated.flower_internals import SecAgg

    secret, public = generate_key_pairs()
    shared = key or SecAgg.generate_shared_key(secret, receiver_public)
    plaintext = SecAgg.share_keys_plaintext_concat(*(names or (sender, receiver)), b"s" * 20, b"k" * 52)
    return private_key_to_bytes(secret), public_key_to_bytes(public), SecAgg.encrypt(shared, plaintext)


def test_an_accusation_blames_the_liar_or_the_sender_by_the_revealed_key():
    """accusation_verdict: None (the accuser lied) exactly when the revealed key is the one-off key and
    the ciphertext opens to the sender's shares for the accuser; otherwise why the sender is at fault."""
    _, receiver_public = generate_key_pairs()  # the receiver's private key is never needed
    receiver_key = public_key_to_bytes(receiver_public)
    secret, ephemeral, token = _sent(7, 9, receiver_public)
    assert accusation_verdict(secret, ephemeral, receiver_key, token, 7, 9) is None
    other, _, _ = _sent(7, 9, receiver_public)
    assert "not the one it encrypted with" in accusation_verdict(other, ephemeral, receiver_key, token, 7, 9)
    assert "not the one it encrypted with" in accusation_verdict(b"junk", ephemeral, receiver_key, token, 7, 9)
    secret, ephemeral, token = _sent(7, 9, receiver_public, key=Fernet.generate_key())
    assert "does not decrypt" in accusation_verdict(secret, ephemeral, receiver_key, token, 7, 9)
    secret, ephemeral, token = _sent(7, 9, receiver_public, names=(7, 8))
    assert "name nodes 7 -> 8" in accusation_verdict(secret, ephemeral, receiver_key, token, 7, 9)
    secret, ephemeral, token = _sent(7, 9, receiver_public)
    assert "does not decrypt" in accusation_verdict(secret, ephemeral, receiver_key, token[:-8] + b"AAAAAAAA", 7, 9)


def test_an_honest_sum_passes_and_shifted_or_garbled_ones_do_not():
    nodes, levels = 5, levels_for(5)
    rng = np.random.default_rng(0)
    honest = [rng.integers(0, levels + 1, (nodes, 300)).sum(0) for _ in range(2)]
    factor = 12345
    vector = [np.array([factor]), *honest]
    assert sum_problem(vector, nodes, levels, factor) is None
    shifted = [vector[0], (honest[0] + 2**31) % MOD_RANGE, honest[1]]
    assert "lie outside" in sum_problem(shifted, nodes, levels, factor)
    garbled = [vector[0], honest[0], rng.integers(0, MOD_RANGE, 300)]
    assert "of tensor 1 lie outside" in sum_problem(garbled, nodes, levels, factor)
    assert "weight factor is 12346" in sum_problem([np.array([factor + 1]), *honest], nodes, levels, factor)


def test_quantization_settings_that_cannot_carry_an_update_are_named():
    assert quantization_problem(4.0, levels_for(10), 10, 100_000) is None
    assert "passes half the 2^32 modulus" in quantization_problem(4.0, 2**30, 4, 1000)
    assert "below max-examples" in quantization_problem(4.0, 2**10, 2, 100_000)
    assert "steps of 1.86e+21" in quantization_problem(1e30, 2**30, 2, 1000)
    assert "steps of nan" in quantization_problem(float("nan"), 2**30, 2, 1000)


def test_wire_forms():
    assert key_problem(public_key_to_bytes(generate_key_pairs()[1])) is None
    assert key_problem(b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n") == "not a PEM public key"
    assert token_problem(Fernet(Fernet.generate_key()).encrypt(b"x" * 300)) is None
    assert token_problem(b"!!") == "a ciphertext that is not url-safe base64"
    assert token_problem(b"YWJj") == "a ciphertext that is not a Fernet token"
    (share,) = create_shares(os.urandom(32), 1, 1)
    assert share_problem(share, 1) is None and "index 1 (1 to 0" in share_problem(share, 0)
    assert destinations_problem([2, 3], {2, 3}) is None
    assert "node 2 more than once" in destinations_problem([2, 2, 3], {2, 3})
    assert "node 4, which is not one of the 2" in destinations_problem([2, 4], {2, 3})
    assert "no shares to node 3" in destinations_problem([2], {2, 3})
