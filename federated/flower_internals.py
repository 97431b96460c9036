"""Every private part of Flower 1.41 the apps rely on, in one place (tests/test_pinned_internals.py
checks each against the pinned version, so an upgrade that moves one fails there, by name).

- Differential privacy: the noise of Flower's fixed-clipping wrappers is ``noise_multiplier *
  clipping_norm / num_sampled_clients``, set once at construction; :func:`calibrate_dp_noise`
  resets it to the nodes actually sampled in a round (through the wrappers' shared base class).
- Metric averaging: ``strategy_utils.aggregate_metricrecords``, Flower's example-weighted mean.
- Sampling: Flower's strategies sample nodes with the global ``random`` module, in the order the
  grid lists them; :func:`seeded_sampling` and :class:`OrderedGrid` make a seeded run's sample repeat.
- The client's clipping mod reads its norm under ``KEY_CLIPPING_NORM``.
- Messages can be made only in a process where Flower set the task's identity (a ServerApp's):
  :func:`act_as_server_app` sets it for nodes run in-process (:mod:`federated.loopback`).
- Secure aggregation (:data:`SecAgg`): the SecAgg+ client's stage functions and state
  (``flwr.client.mod.secure_aggregation.secaggplus_mod``), the primitives its legacy server
  workflow unmasks with, and the record keys both use.
"""

from __future__ import annotations

import importlib
import random
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Iterator, Mapping

from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.serverapp.strategy.dp_fixed_clipping import DifferentialPrivacyFixedClippingBase
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM


def _secagg() -> SimpleNamespace:
    from flwr.common import bytes_to_ndarray, ndarray_to_bytes, ndarrays_to_parameters
    from flwr.common.secure_aggregation import ndarrays_arithmetic as arithmetic
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
    from flwr.common.secure_aggregation.quantization import dequantize
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage
    from flwr.common.secure_aggregation.secaggplus_utils import (
        pseudo_rand_gen,
        share_keys_plaintext_concat,
        share_keys_plaintext_separate,
    )
    from flwr.supercore.primitives.asymmetric import (
        bytes_to_private_key,
        bytes_to_public_key,
        generate_key_pairs,
        private_key_to_bytes,
        public_key_to_bytes,
    )

    # the package's __init__ shadows the module with the mod function of the same name
    mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")

    return SimpleNamespace(
        CONFIGS=RECORD_KEY_CONFIGS, STATE=RECORD_KEY_STATE, Key=Key, Stage=Stage, State=mod.SecAggPlusState,
        check_stage=mod.check_stage, check_configs=mod.check_configs, setup=mod._setup,
        collect_masked_vectors=mod._collect_masked_vectors, unmask=mod._unmask,
        bytes_to_ndarray=bytes_to_ndarray, ndarray_to_bytes=ndarray_to_bytes,
        ndarrays_to_parameters=ndarrays_to_parameters,
        parameters_addition=arithmetic.parameters_addition, parameters_subtraction=arithmetic.parameters_subtraction,
        parameters_mod=arithmetic.parameters_mod, get_parameters_shape=arithmetic.get_parameters_shape,
        factor_extract=arithmetic.factor_extract, dequantize=dequantize, combine_shares=combine_shares,
        create_shares=create_shares, pseudo_rand_gen=pseudo_rand_gen, generate_shared_key=generate_shared_key,
        encrypt=encrypt, decrypt=decrypt, share_keys_plaintext_concat=share_keys_plaintext_concat,
        share_keys_plaintext_separate=share_keys_plaintext_separate, generate_key_pairs=generate_key_pairs,
        bytes_to_private_key=bytes_to_private_key, bytes_to_public_key=bytes_to_public_key,
        private_key_to_bytes=private_key_to_bytes, public_key_to_bytes=public_key_to_bytes,
    )  # fmt: skip


SecAgg = _secagg()
"""Flower's SecAgg+ pieces under one name (their modules are private: moved ones fail the pinned test)."""

__all__ = [
    "SecAgg",
    "KEY_CLIPPING_NORM",
    "aggregate_metricrecords",
    "calibrate_dp_noise",
    "seeded_sampling",
    "OrderedGrid",
]


def act_as_server_app() -> None:
    """Let this process make Messages as a ServerApp's does (Flower refuses without a task identity)."""
    from flwr.supercore.task_identity import TaskIdentity

    if getattr(TaskIdentity, "_run_id", None) is None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1


def calibrate_dp_noise(strategy: Strategy, sampled: int) -> float | None:
    """Calibrate a DP wrapper's noise to the ``sampled`` nodes of this round; returns its std (None
    when ``strategy`` adds no noise)."""
    if not isinstance(strategy, DifferentialPrivacyFixedClippingBase) or sampled < 1:
        return None
    strategy.num_sampled_clients = sampled
    return strategy.noise_multiplier * strategy.clipping_norm / sampled


@contextmanager
def seeded_sampling(seed: int | None, server_round: int, phase: str) -> Iterator[None]:
    """Seed the ``random`` module for one round and phase (and restore it after), so that a seeded
    run samples the same nodes each time; with no seed, nothing changes."""
    if seed is None:
        yield
        return
    state = random.getstate()
    random.seed(f"odt-{seed}-{server_round}-{phase}")
    try:
        yield
    finally:
        random.setstate(state)


class OrderedGrid:
    """A grid whose node ids come in a fixed order (by ``order``'s keys, then by id) instead of the
    order Flower registered them in, so that a seeded sample of them repeats; all else is the grid's."""

    def __init__(self, grid: Grid, order: Mapping[int, int]) -> None:
        self._grid, self._order = grid, order

    def get_node_ids(self) -> list[int]:
        unknown = max(self._order.values(), default=0) + 1
        return sorted(self._grid.get_node_ids(), key=lambda node: (self._order.get(node, unknown), node))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)
