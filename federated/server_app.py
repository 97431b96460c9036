"""The Flower ServerApp: rounds with a named Flower strategy, guarded updates, central evaluation."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp

from ondevice import Trainer
from ondevice.datafiles import load_data
from ondevice.formats import save_peft, save_safetensors

from .buffers import split_state
from .errors import FederatedError, RoundFailedError
from .pacing import MIN_WAIT, PacedGrid, RoundPace
from .partial import fit_to, union_of
from .privacy import gaussian_epsilon
from .protocol import METRICS, from_arrays, to_arrays
from .report import record_failure, round_row, save_weights, write_report
from .round_log import slow_round
from .run_state import load_run_state, save_run_state
from .secure import SecureGrid, SecureSettings
from .strategy import GuardedStrategy, make_strategy
from .task import Settings

__all__ = ["app"]

log = logging.getLogger(__name__)
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    settings = Settings.from_config(context.run_config)
    try:
        _run(grid, settings)
    except Exception as exc:  # the runner quotes it instead of an old report or Flower's log
        record_failure(Path(settings.output), settings.run_id, exc)
        raise


def _run(grid: Grid, settings: Settings) -> None:  # type: ignore[valid-type]
    artifacts = Path(settings.artifacts).resolve()
    evaluator = Trainer.load(artifacts)
    test = load_data(_test_file(Path(settings.data)), artifacts)
    tiers = {t.manifest_sha256: t for t in (Trainer.load(d.strip()) for d in settings.tiers.split(",") if d.strip())}
    tiers.pop(evaluator.manifest_sha256, None)
    inner = make_strategy(
        settings.strategy,
        min_nodes=settings.min_nodes,
        fraction_train=settings.fraction_train,
        proximal_mu=settings.proximal_mu,
        server_learning_rate=settings.server_lr,
        server_momentum=settings.server_momentum,
        beta=settings.trimmed_beta,
        dp_noise=settings.dp_noise,
        dp_clip=settings.dp_clip,
        dp_mode=settings.dp_mode,
    )
    if settings.dp_noise > 0 and evaluator.manifest.buffers:
        raise FederatedError(
            "differential privacy with BatchNorm running statistics is not supported: the averaged statistics "
            "would be released without noise. Freeze the statistics (BatchNorm in eval mode) or turn DP off."
        )
    if settings.secure_aggregation and evaluator.manifest.buffers:
        raise FederatedError(
            "secure aggregation with BatchNorm running statistics is not supported: they are pooled, not summed. "
            "Freeze the statistics (BatchNorm in eval mode) or turn secure-aggregation off."
        )
    if settings.dp_mode == "client" and settings.dp_clip > 0 and settings.codec != "none":
        raise FederatedError("client-side clipping needs codec 'none': the clipping mod reads full weights.")
    strategy = GuardedStrategy(
        inner,
        evaluator.manifest,
        evaluator.manifest_sha256,
        codec=settings.codec,
        max_examples=settings.max_examples,
        keep_updates=settings.save_updates,
        norm_bound=settings.norm_bound,
        max_update_norm=settings.max_update_norm,
        norm_action=settings.norm_action,
        tiers={sha: t.manifest for sha, t in tiers.items()},
        partial=bool(settings.personal),
        min_nodes=settings.min_nodes,
        round_timeout=lambda: paced.used,
    )
    # Every exchange with the nodes waits as long as the work needs (federated.pacing); innermost, so that
    # secure aggregation's stages are paced too.
    paced = grid = PacedGrid(grid, RoundPace(settings.round_timeout), offset=lambda: strategy.offset,
                             say=lambda line: print(line, flush=True))  # fmt: skip

    def load(arrays: ArrayRecord) -> None:
        if strategy.partial:  # the global model holds every tier's tensors: take this model's part
            evaluator.set_weights({**evaluator.get_weights(), **fit_to(evaluator.manifest, from_arrays(arrays))})
            return
        weights, buffers = split_state(evaluator.manifest, from_arrays(arrays))
        evaluator.set_weights(weights)
        if buffers:
            evaluator.set_buffers(buffers)

    out = Path(settings.output)
    if settings.personal:
        print(f"odt: tensors {settings.personal} stay on each client and are never averaged: the global model's "
              "copies of them are untrained, so its accuracy below is not the run's result; each client's "
              "accuracy with its own is (clients' validation accuracy with their personal tensors). Each node "
              f"keeps them in {out / 'personal'}/client-PARTITION.safetensors.", flush=True)  # fmt: skip
    try:
        initial = union_of(
            [{**evaluator.get_weights(), **evaluator.get_buffers()}, *(t.get_weights() for t in tiers.values())]
        )
    except ValueError as exc:
        raise FederatedError(f"the tiers do not share one base model: {exc}.") from None
    rows: list[dict] = []
    if settings.resume:
        state = load_run_state(out, inner, evaluator.manifest_sha256)
        if state is not None:
            strategy.offset, initial, rows = state.server_round, state.arrays, state.rows[: state.server_round + 1]
            print(f"odt: resuming after round {state.server_round} of {settings.num_server_rounds}", flush=True)

    ended = [time.monotonic()]  # when the previous round ended

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Evaluate the global model, then record the round (report row, updates, run state)."""
        server_round += strategy.offset
        load(arrays)
        metrics = evaluator.evaluate(test)
        now = time.monotonic()
        seconds, ended[0] = now - ended[0], now
        print(f"round {server_round}: {_headline(metrics)}  loss {metrics['loss']:.4f}", flush=True)
        warning = slow_round(server_round, seconds, paced.pace.fixed) if server_round > strategy.offset else None
        if warning:
            print(warning, flush=True)
        if server_round == len(rows):
            rows.append(round_row(server_round, metrics, strategy.rounds.get(server_round), seconds))
            if settings.dp_noise > 0 and server_round > 0:  # the privacy spent so far (an upper bound)
                rows[-1]["dp_epsilon"] = gaussian_epsilon(settings.dp_noise, server_round, settings.dp_delta)
                rows[-1]["dp_delta"] = settings.dp_delta
            for node, (count, weights) in getattr(strategy.rounds.get(server_round), "accepted", {}).items():
                save_weights(out / "updates" / f"round{server_round}-node{node}.npz", weights, num_examples=count)
            save_run_state(out, server_round=server_round, arrays=from_arrays(arrays), strategy=inner, rows=rows,
                           manifest_sha256=evaluator.manifest_sha256)  # fmt: skip
        return MetricRecord(metrics)

    remaining = settings.num_server_rounds - strategy.offset
    final = to_arrays(initial)
    if remaining > 0 and settings.fraction_train < 1:  # sampled rounds: the same sample in every run
        strategy.seed = settings.seed
        wait = max(settings.round_timeout or MIN_WAIT, 60.0)
        strategy.node_order = node_partitions(grid, settings.min_nodes, wait)
    if settings.secure_aggregation:  # the strategy trains through SecAgg+ and receives only the sum
        grid = strategy.secure = SecureGrid(grid, SecureSettings(
            shares=settings.secagg_shares, threshold=settings.secagg_threshold,
            clipping_range=settings.secagg_clipping_range, quantization=settings.secagg_quantization,
            max_weight=float(settings.max_examples),
        ))  # fmt: skip
    if remaining > 0:
        result = strategy.start(
            grid,
            final,
            num_rounds=remaining,
            timeout=paced.used,  # PacedGrid gives each exchange its own wait
            train_config=ConfigRecord({"local-epochs": settings.local_epochs}),
            evaluate_fn=central,
        )
        final = result.arrays if result.arrays else final  # no round aggregated: the model it started from
    metrics, plot = write_report(rows, out, asdict(settings))
    save_weights(out / "global_weights.npz", from_arrays(final))  # with the running statistics
    load(final)
    save_safetensors(evaluator, out / "global_model.safetensors")  # by the PyTorch model's state_dict names
    if evaluator.manifest.adapters:
        save_peft(evaluator, out / "global_peft")  # PeftModel.from_pretrained(base, OUTPUT/global_peft)
    if evaluator.manifest.outputs:
        evaluator.export(out / "global_model.onnx")
    print(f"federated report: {metrics} and {plot}", flush=True)


def node_partitions(grid: Grid, min_nodes: int, timeout: float) -> dict[int, int]:
    """Each node's partition id, asked once with a query message once ``min_nodes`` are connected:
    Flower gives nodes new random ids each run, their partitions stay. Nodes without one answer -1.

    Raises RoundFailedError when ``min_nodes`` have not connected within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while len(nodes := list(grid.get_node_ids())) < min_nodes:
        if time.monotonic() > deadline:
            raise RoundFailedError(
                f"only {len(nodes)} of the {min_nodes} nodes a round needs (min-nodes) connected within "
                f"{timeout:.0f} s. Start more nodes or lower min-nodes."
            )
        time.sleep(min(1.0, timeout / 10))
    queries = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in nodes]
    order = {}
    for reply in grid.send_and_receive(queries, timeout=timeout):
        metrics = None if reply.has_error() else reply.content.metric_records.get(METRICS)
        if metrics is not None and "partition-id" in metrics:
            order[reply.metadata.src_node_id] = int(metrics["partition-id"])
    return order


def _headline(metrics: dict[str, float]) -> str:
    """The global model's main metric: a language model's perplexity, else accuracy."""
    if "perplexity" in metrics:
        return f"global perplexity {metrics['perplexity']:.4g}"
    return f"global accuracy {metrics.get('accuracy', float('nan')):.4f}"


def _test_file(data: Path) -> Path:
    """DATA/test.npz, or DATA/test.jsonl for artifacts that read text."""
    text = data / "test.jsonl"
    return text if text.is_file() and not (data / "test.npz").is_file() else data / "test.npz"
