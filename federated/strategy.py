"""Flower strategies by name, wrapped so that every update is decoded and checked before aggregation."""

from __future__ import annotations

import hashlib
import logging
import random
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    Krum,
    Strategy,
)
from flwr.serverapp.strategy.dp_fixed_clipping import DifferentialPrivacyFixedClippingBase
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from ondevice.manifest import Manifest

from .buffers import average_buffers, split_state
from .codec import CodecError, decode, payload_bytes
from .config import STRATEGIES
from .errors import FederatedError, RoundFailedError
from .partial import aggregate_partial, leading, slice_problem
from .protocol import from_arrays, hash_tag, to_arrays
from .validation import norm_bounds, update_norm, update_problem

__all__ = ["STRATEGIES", "make_strategy", "GuardedStrategy"]

log = logging.getLogger(__name__)


def make_strategy(name: str, *, min_nodes: int, fraction_train: float = 1.0, **options: float) -> Strategy:
    """One of Flower's strategies by name; ``options`` are the strategy's own (e.g. proximal_mu).

    With ``dp_noise`` and ``dp_clip`` > 0 it is wrapped in Flower's fixed-clipping differential
    privacy, clipping on the server (``dp_mode="server"``) or on the clients (``"client"``, with
    the ClientApp's clipping mod; needs codec ``none``).
    """
    common: dict[str, Any] = {
        "fraction_train": fraction_train,
        "fraction_evaluate": fraction_train,
        "min_train_nodes": min_nodes,
        "min_evaluate_nodes": min_nodes,
        "min_available_nodes": min_nodes,
    }
    dp_noise, dp_clip = options.pop("dp_noise", 0.0), options.pop("dp_clip", 0.0)
    dp_mode = str(options.pop("dp_mode", "server"))
    kinds: dict[str, Any] = {
        "fedavg": (FedAvg, ()),
        "fedavgm": (FedAvgM, ("server_learning_rate", "server_momentum")),
        "fedprox": (FedProx, ("proximal_mu",)),
        "fedadam": (FedAdam, ("eta", "eta_l", "beta_1", "beta_2", "tau")),
        "fedmedian": (FedMedian, ()),
        "fedtrimmedavg": (FedTrimmedAvg, ("beta",)),
        "krum": (Krum, ("num_malicious_nodes",)),
    }
    if name not in kinds:
        raise FederatedError(f"strategy must be one of {STRATEGIES}, got {name!r}.")
    cls, accepted = kinds[name]
    chosen = {k: v for k, v in options.items() if k in accepted}
    strategy: Strategy = cls(**common, **chosen)
    if dp_noise > 0 or dp_clip > 0:
        if not (dp_noise > 0 and dp_clip > 0):
            raise FederatedError("differential privacy needs both dp-noise > 0 and dp-clip > 0.")
        wrappers = {
            "server": DifferentialPrivacyServerSideFixedClipping,
            "client": DifferentialPrivacyClientSideFixedClipping,  # clients clip (ClientApp mod)
        }
        if dp_mode not in wrappers:
            raise FederatedError(f"dp-mode must be 'server' or 'client', got {dp_mode!r}.")
        # The sample size is a placeholder: GuardedStrategy sets the real one every round.
        strategy = wrappers[dp_mode](
            strategy, noise_multiplier=dp_noise, clipping_norm=dp_clip, num_sampled_clients=min_nodes
        )
    return strategy


@dataclass
class RoundLog:
    """What the guard saw in one round: bytes moved and updates it excluded."""

    bytes_down: int = 0
    bytes_up: dict[int, int] = field(default_factory=dict)
    excluded: dict[int, str] = field(default_factory=dict)
    clipped: dict[int, str] = field(default_factory=dict)
    train_metrics: dict[str, Any] = field(default_factory=dict)  # the strategy's aggregate of client metrics
    eval_metrics: dict[str, Any] = field(default_factory=dict)
    dp_sampled: int | None = None  # clients the DP noise is calibrated to (this round's sample)
    dp_noise_std: float | None = None
    buffers: dict[int, tuple[int, dict[str, np.ndarray]]] = field(default_factory=dict)  # node -> running stats
    eval_by_client: dict[int, dict[str, float]] = field(default_factory=dict)  # partition id -> its eval metrics
    accepted: dict[int, tuple[int, dict[str, np.ndarray]]] = field(default_factory=dict)  # node -> (count, weights)
    partitions: dict[int, int] = field(default_factory=dict)  # node -> the partition id its train reply named
    tiers: dict[int, str] = field(default_factory=dict)  # node -> the name of the tier it trained (mixed tiers)

    def key(self, node: int) -> str:
        """How the report names a client: its partition id (as evaluation does), else its node id."""
        partition = self.partitions.get(node, -1)
        return str(partition) if partition >= 0 else f"node-{node}"


class GuardedStrategy(Strategy):
    """Wraps a Flower strategy: stamps each task with the manifest hash and codec, decodes the
    replies to full weights and drops any update that fails :func:`update_problem`.

    Flower's own strategy (and its differential-privacy wrapper) then aggregates what is left.
    """

    def __init__(
        self,
        inner: Strategy,
        manifest: Manifest,
        manifest_sha256: str,
        *,
        codec: str,
        max_examples: int,
        keep_updates: bool = False,
        norm_bound: float = 10.0,
        max_update_norm: float = 0.0,
        norm_action: str = "reject",
        tiers: dict[str, Manifest] | None = None,
        partial: bool = False,
        min_nodes: int = 1,
    ) -> None:
        """``tiers`` (manifest sha256 -> manifest) are the other artifact sets whose nodes may join;
        with them or with ``partial`` (personal tensors), replies hold only what a node shares and
        are averaged tensor by tensor (:func:`federated.partial.aggregate_partial`), FedAvg only."""
        self.inner = inner
        self.tiers = {manifest_sha256: manifest, **(tiers or {})}
        self.partial = partial or len(self.tiers) > 1
        if self.partial and (type(inner) is not FedAvg or codec != "none" or manifest.buffers):
            raise FederatedError(
                "mixed tiers and personal tensors work with strategy fedavg, codec none and no BatchNorm statistics."
            )
        self.norm_bound, self.max_update_norm, self.norm_action = norm_bound, max_update_norm, norm_action
        self.keep_updates = keep_updates
        self.min_nodes = min_nodes
        self.manifest = manifest
        self.sha256 = manifest_sha256
        self.codec = codec
        self.max_examples = max_examples
        self.rounds: dict[int, RoundLog] = {}
        self.offset = 0  # rounds already done by the run this one resumes: Flower counts from 1 again
        self._global: dict[str, np.ndarray] = {}
        self.seed: int | None = None  # with it, each round's sample of nodes repeats from run to run...
        self.node_order: dict[int, int] = {}  # ...ordered by these keys (node id -> partition id)

    def summary(self) -> None:
        self.inner.summary()

    def _stamp(self, config: ConfigRecord) -> ConfigRecord:
        config["manifest-sha256"] = self.sha256
        config["codec"] = self.codec
        if self.partial:
            config["partial"] = True
            config["tier-sha256s"] = ",".join(self.tiers)
        return config

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round += self.offset
        self._global = from_arrays(arrays)
        weights, buffers = split_state(self.manifest, self._global)
        # The strategy sees the weights only; the running statistics ride along in every task.
        with self._sampling(server_round, "train"):
            messages = list(
                self.inner.configure_train(server_round, to_arrays(weights), self._stamp(config), self._grid(grid))
            )
        for message in messages if buffers else ():
            for key, record in list(message.content.array_records.items()):
                message.content[key] = to_arrays({**from_arrays(record), **buffers})
        record = self.rounds[server_round] = RoundLog(bytes_down=payload_bytes(self._global) * len(messages))
        if isinstance(self.inner, DifferentialPrivacyFixedClippingBase) and messages:
            # Flower's noise std is noise_multiplier * clipping_norm / num_sampled_clients: calibrate it to
            # the nodes the strategy actually sampled this round, not to the configured minimum.
            self.inner.num_sampled_clients = len(messages)
            record.dp_sampled = len(messages)
            record.dp_noise_std = self.inner.noise_multiplier * self.inner.clipping_norm / len(messages)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.offset
        record = self.rounds.setdefault(server_round, RoundLog())
        kept = []
        replies = list(replies)
        for message in replies:
            if message.has_error():
                record.excluded[message.metadata.src_node_id] = f"client error: {message.error.reason}"
                log.warning(
                    "round %d: node %s failed: %s", server_round, message.metadata.src_node_id, message.error.reason
                )
                continue
            problem = self._admit(message, record)
            if problem:
                record.excluded[message.metadata.src_node_id] = problem
                log.warning(
                    "round %d: update from node %s excluded: %s", server_round, message.metadata.src_node_id, problem
                )
            else:
                kept.append(message)
        # Aggregate in a fixed order (not arrival order) so that a run's float32 sums repeat exactly.
        kept = sorted(self._bounded(server_round, kept, record), key=_reply_digest)
        problem = round_problem(len(replies), len(kept), self.min_nodes, record.excluded)
        if problem:
            raise RoundFailedError(f"round {server_round}: {problem}")
        if self.partial:
            arrays, metrics = self._aggregate_partial(kept)
        else:
            arrays, metrics = self.inner.aggregate_train(server_round, kept)
        if arrays is not None and self.manifest.buffers:
            _, previous = split_state(self.manifest, self._global)
            nodes = [m.metadata.src_node_id for m in kept]
            averaged = average_buffers([record.buffers[n] for n in nodes if n in record.buffers]) or previous
            arrays = to_arrays({**from_arrays(arrays), **averaged})
        record.train_metrics = dict(metrics or {})
        return arrays, metrics

    def _aggregate_partial(self, kept: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if not kept:
            return None, None
        updates = [
            (
                int(next(iter(m.content.metric_records.values()))["num-examples"]),
                from_arrays(next(iter(m.content.array_records.values()))),
            )
            for m in kept
        ]
        merged = aggregate_partial(self._global, updates)
        metrics = aggregate_metricrecords([m.content for m in kept], "num-examples")
        return to_arrays(merged), metrics

    def _bounded(self, server_round: int, kept: list[Message], record: RoundLog) -> list[Message]:
        """Updates whose norm is out of bounds (finite poisoning) are rejected or clipped."""
        weights = {m.metadata.src_node_id: from_arrays(next(iter(m.content.array_records.values()))) for m in kept}
        norms = {node: update_norm(w, self._global) for node, w in weights.items()}
        over = norm_bounds(norms, multiple=self.norm_bound, absolute=self.max_update_norm)
        result = []
        for message in kept:
            node = message.metadata.src_node_id
            if node not in over:
                result.append(message)
                continue
            reason = f"update norm {norms[node]:.3g} is over its bound {over[node]:.3g}"
            if self.norm_action == "clip":
                scale = over[node] / norms[node]
                clipped = {}
                for k, v in weights[node].items():
                    start = self._global[k][leading(v.shape)]
                    clipped[k] = start + (v - start) * np.float32(scale)
                (key,) = message.content.array_records.keys()
                message.content[key] = to_arrays(clipped)
                record.clipped[node] = reason
                result.append(message)
            else:
                record.excluded[node] = reason
                record.buffers.pop(node, None)
                record.accepted.pop(node, None)
            log.warning("round %d: node %s: %s (%s)", server_round, node, reason, self.norm_action)
        return result

    def _admit(self, message: Message, record: RoundLog) -> str | None:
        content = message.content
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            return "a train reply needs exactly one ArrayRecord and one MetricRecord"
        (arrays_key,), (metrics_key,) = content.array_records.keys(), content.metric_records.keys()
        metrics = content[metrics_key]
        partition = metrics.get("client")
        if "client" in metrics:  # who it is, for the report; not a metric to average
            del metrics["client"]
        if isinstance(partition, int) and not isinstance(partition, bool):
            record.partitions[message.metadata.src_node_id] = partition
        payload = from_arrays(content[arrays_key])
        record.bytes_up[message.metadata.src_node_id] = payload_bytes(payload)
        if self.partial:
            return self._admit_partial(message, payload, metrics, record)
        try:
            weights = decode(payload, self._global, self.codec)
        except CodecError as exc:
            return str(exc)
        problem = update_problem(
            weights,
            self.manifest,
            num_examples=metrics.get("num-examples"),
            max_examples=self.max_examples,
            tag=metrics.get("manifest-tag"),
            expected_tag=hash_tag(self.sha256),
        )
        if problem is None:
            node, count = message.metadata.src_node_id, int(metrics["num-examples"])
            ordered = {p.name: weights[p.name] for p in self.manifest.trainable}
            _, buffers = split_state(self.manifest, weights)
            if buffers:
                record.buffers[node] = (count, buffers)
            content[arrays_key] = to_arrays(ordered)
            del metrics["manifest-tag"]
            if self.keep_updates:
                record.accepted[node] = (count, {**ordered, **buffers})
        return problem

    def _admit_partial(
        self, message: Message, payload: dict[str, np.ndarray], metrics: MetricRecord, record: RoundLog
    ) -> str | None:
        """A partial update: a known tier, only tensors that tier trains, each a slice of the global one."""
        tiers = {hash_tag(sha): manifest for sha, manifest in self.tiers.items()}
        manifest = tiers.get(metrics.get("manifest-tag"))  # type: ignore[arg-type]
        if manifest is None:
            return "trained on artifacts of no tier of this run (manifest hash differs)"
        record.tiers[message.metadata.src_node_id] = manifest.name
        count = metrics.get("num-examples")
        if not isinstance(count, int) or isinstance(count, bool) or not 0 < count <= self.max_examples:
            return f"example count {count!r} is outside 1..{self.max_examples}"
        trains = {p.name: p.shape for p in manifest.trainable}
        for name, array in payload.items():
            if trains.get(name) != array.shape:
                return f"tensor {name!r} {array.shape} is not one its tier trains"
            problem = slice_problem(name, array, self._global)
            if problem:
                return problem
        del metrics["manifest-tag"]
        return None

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round += self.offset
        with self._sampling(server_round, "evaluate"):
            return list(self.inner.configure_evaluate(server_round, arrays, self._stamp(config), self._grid(grid)))

    @contextmanager
    def _sampling(self, server_round: int, phase: str) -> Iterator[None]:
        """Flower samples nodes with the ``random`` module: seed it per round and phase (then
        restore it), so that a seeded run samples the same nodes each time."""
        if self.seed is None:
            yield
            return
        state = random.getstate()
        random.seed(f"odt-{self.seed}-{server_round}-{phase}")
        try:
            yield
        finally:
            random.setstate(state)

    def _grid(self, grid: Grid) -> Grid:
        return _OrderedGrid(grid, self.node_order) if self.seed is not None else grid

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        server_round += self.offset
        sound = [m for m in replies if self._sound_evaluation(m)]
        metrics = self.inner.aggregate_evaluate(server_round, sound)
        record = self.rounds.setdefault(server_round, RoundLog())
        record.eval_metrics = {k: v for k, v in dict(metrics or {}).items() if k != "client"}
        for message in sound:
            (values,) = message.content.metric_records.values()
            if isinstance(values.get("client"), int) and values["client"] >= 0:
                record.eval_by_client[int(values["client"])] = {k: v for k, v in values.items() if k != "client"}
        if metrics is not None and "global-eval-accuracy" in metrics:
            print(
                f"round {server_round}: clients' validation accuracy {metrics['eval-accuracy']:.4f} with their "
                f"personal tensors, {metrics['global-eval-accuracy']:.4f} with the global ones",
                flush=True,
            )
        return metrics

    def _sound_evaluation(self, message: Message) -> bool:
        if message.has_error() or len(message.content.metric_records) != 1:
            return False
        (metrics,) = message.content.metric_records.values()
        count = metrics.get("num-examples")
        return isinstance(count, int) and 0 < count <= self.max_examples


def round_problem(replies: int, kept: int, min_nodes: int, excluded: Mapping[int, str]) -> str | None:
    """Why a round cannot go on (None when it can): it needs ``min_nodes`` replies and one usable update."""
    first = next(iter(excluded.items()), None)
    cause = f" The first: node {first[0]}: {_first_line(first[1])}" if first else ""
    if replies == 0:
        return "no client replied within round-timeout. Raise round-timeout or check that the nodes are running."
    if replies < min_nodes:
        return f"only {replies} of the {min_nodes} nodes it needs (min-nodes) replied within round-timeout.{cause}"
    if kept == 0:
        return f"every one of the {replies} clients failed or was excluded, so nothing was trained.{cause}"
    return None


def _first_line(reason: str, limit: int = 300) -> str:
    """The client's own error out of Flower's reason (which may hold a Ray or Python traceback)."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    told = [line.split("occurred. Message: ", 1)[1].rstrip("'>") for line in lines if "occurred. Message: " in line]
    raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b: ", line)]
    if told:
        line = told[0]
    elif raised:  # "ondevice.errors.DataError: ..." -> "DataError: ..."
        name, text = raised[-1].split(": ", 1)
        line = f"{name.rsplit('.', 1)[-1]}: {text}"
    else:
        line = lines[0] if lines else reason
    return line[:limit] + ("..." if len(line) > limit else "")


class _OrderedGrid:
    """A grid whose node ids come in a fixed order (by ``order``'s keys, then by id) instead of the
    order Flower registered them in, so that a seeded sample of them repeats; all else is the grid's."""

    def __init__(self, grid: Grid, order: Mapping[int, int]) -> None:
        self._grid, self._order = grid, order

    def get_node_ids(self) -> list[int]:
        unknown = max(self._order.values(), default=0) + 1
        return sorted(self._grid.get_node_ids(), key=lambda node: (self._order.get(node, unknown), node))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)


def _reply_digest(message: Message) -> bytes:
    """A key that orders replies by their content, whatever order they arrived in."""
    digest = hashlib.sha256()
    for record in message.content.array_records.values():
        for name, array in record.items():
            digest.update(name.encode())
            digest.update(array.data)
    return digest.digest()
