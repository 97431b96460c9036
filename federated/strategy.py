"""Flower strategies by name, and the guard that composes the SDK's pieces around one.

The guard (:class:`GuardedStrategy`) stamps tasks and then, per reply: admission
(:func:`federated.validation.update_problem` / ``partial_update_problem``), norm bounds
(:func:`federated.validation.bound_updates`), aggregation by Flower's strategy or, for partial
updates, :func:`federated.partial.aggregate_partial`, DP noise calibrated to the round's sample and
seeded sampling (:mod:`federated.flower_internals`). Each piece is a small unit with its own tests.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Iterable

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

from ondevice.manifest import Manifest

from .buffers import average_buffers, split_state
from .codec import CodecError, decode, payload_bytes
from .config import STRATEGIES
from .errors import FederatedError, RoundFailedError
from .flower_internals import OrderedGrid, aggregate_metricrecords, calibrate_dp_noise, seeded_sampling
from .partial import aggregate_partial
from .protocol import from_arrays, hash_tag, to_arrays
from .round_log import RoundLog, round_problem
from .secure import SecureGrid
from .validation import bound_updates, partial_update_problem, update_problem

__all__ = ["STRATEGIES", "make_strategy", "GuardedStrategy", "RoundLog", "round_problem"]

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
        round_timeout: float | Callable[[], float] = 120.0,
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
        self.round_timeout = round_timeout
        self.manifest = manifest
        self.sha256 = manifest_sha256
        self.codec = codec
        self.max_examples = max_examples
        self.rounds: dict[int, RoundLog] = {}
        self.offset = 0  # rounds already done by the run this one resumes: Flower counts from 1 again
        self._global: dict[str, np.ndarray] = {}
        self.secure: SecureGrid | None = None  # set when the run aggregates securely: one reply, the sum
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
        with seeded_sampling(self.seed, server_round, "train"):
            messages = list(
                self.inner.configure_train(server_round, to_arrays(weights), self._stamp(config), self._grid(grid))
            )
        for message in messages if buffers else ():
            for key, record in list(message.content.array_records.items()):
                message.content[key] = to_arrays({**from_arrays(record), **buffers})
        record = self.rounds[server_round] = RoundLog(bytes_down=payload_bytes(self._global) * len(messages))
        record.sampled = [m.metadata.dst_node_id for m in messages]
        # The noise is calibrated to the nodes actually sampled this round, not to the configured minimum.
        record.dp_noise_std = calibrate_dp_noise(self.inner, len(messages))
        record.dp_sampled = len(messages) if record.dp_noise_std is not None else None
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
        answered = len(replies)
        if self.secure is None:  # a sampled node that sent nothing missed the round: name it (report and console)
            replied = {m.metadata.src_node_id for m in replies}
            waited = self.round_timeout() if callable(self.round_timeout) else self.round_timeout
            for node in (n for n in record.sampled if n not in replied):
                record.excluded[node] = f"no reply within round-timeout ({waited:g} s)"
                print(f"odt: round {server_round}: node {node} sent no update within round-timeout "
                      f"({waited:g} s); the round goes on without it", flush=True)  # fmt: skip
        if self.secure is not None and self.secure.rounds:  # one reply stood for every node that survived
            secure = self.secure.rounds[-1]
            record.bytes_up, record.bytes_down = dict(secure.bytes_up), sum(secure.bytes_down.values())
            record.excluded.update({n: f"dropped out in the {stage} stage" for n, stage in secure.dropped.items()})
            record.excluded.update(secure.excluded)
            record.flagged.update(secure.flagged)
            record.shift_bound = secure.shift_bound
            answered = len(secure.sampled) - len(secure.dropped)
            if secure.refused:  # nothing is applied: the global model stays as it was
                record.refused = secure.refused
                print(f"odt: round {server_round}: the secure sum was refused and not applied: {secure.refused}",
                      flush=True)  # fmt: skip
                return None, None
        problem = round_problem(answered, len(kept), self.min_nodes, record.excluded)
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
        updates = {m.metadata.src_node_id: from_arrays(next(iter(m.content.array_records.values()))) for m in kept}
        bounded = bound_updates(updates, self._global, multiple=self.norm_bound, absolute=self.max_update_norm,
                                action=self.norm_action)  # fmt: skip
        for node, reason in {**bounded.clipped, **bounded.excluded}.items():
            log.warning("round %d: node %s: %s (%s)", server_round, node, reason, self.norm_action)
        record.clipped.update(bounded.clipped)
        record.excluded.update(bounded.excluded)
        for node in bounded.excluded:
            record.buffers.pop(node, None)
            record.accepted.pop(node, None)
        result = []
        for message in kept:
            node = message.metadata.src_node_id
            if node in bounded.clipped:
                (key,) = message.content.array_records.keys()
                message.content[key] = to_arrays(bounded.kept[node])
            if node in bounded.kept:
                result.append(message)
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
            max_examples=self.max_examples * (len(self.secure.rounds[-1].sampled) if self.secure else 1),
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
        if manifest is not None:
            record.tiers[message.metadata.src_node_id] = manifest.name
        problem = partial_update_problem(payload, manifest, self._global, num_examples=metrics.get("num-examples"),
                                         max_examples=self.max_examples)  # fmt: skip
        if problem is None:
            del metrics["manifest-tag"]
        return problem

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round += self.offset
        with seeded_sampling(self.seed, server_round, "evaluate"):
            return list(self.inner.configure_evaluate(server_round, arrays, self._stamp(config), self._grid(grid)))

    def _grid(self, grid: Grid) -> Grid:
        return OrderedGrid(grid, self.node_order) if self.seed is not None else grid

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


def _reply_digest(message: Message) -> bytes:
    """A key that orders replies by their content, whatever order they arrived in."""
    digest = hashlib.sha256()
    for record in message.content.array_records.values():
        for name, array in record.items():
            digest.update(name.encode())
            digest.update(array.data)
    return digest.digest()
