"""The runtime against references: PyTorch for a step, numpy formulas for schedules, itself for resume."""

from __future__ import annotations

import copy
import dataclasses
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from artifacts.optimizers import AdamW, ReferenceOptimizer
from ondevice import ConfigError, Predictor, Schedule, Trainer, lr_at
from ondevice.data import check_data
from ondevice.engines.classic import OrtTraining
from ondevice.manifest import Manifest


def _subset(data, n):
    return {k: v[:n] for k, v in data.items()}


def test_import_and_training_are_torch_free(digits_artifacts, digits_data, tmp_path):
    np.savez(tmp_path / "d.npz", **_subset(digits_data["train"], 64))
    code = (
        "import sys, ondevice\n"
        "from ondevice.data import load_npz\n"
        f"t = ondevice.Trainer.load({str(digits_artifacts)!r})\n"
        f"t.fit(load_npz({str(tmp_path / 'd.npz')!r}), epochs=1, batch_size=16, progress=False)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_one_step_equals_pytorch(digits_no_dropout, digits_data):
    directory, model = digits_no_dropout
    trainer = Trainer.load(directory)
    batch = _subset(digits_data["train"], 32)
    reference = copy.deepcopy(model).train()
    params = list(reference.parameters())
    loss = torch.nn.functional.cross_entropy(
        reference(torch.from_numpy(batch["input"])), torch.from_numpy(batch["labels"])
    )
    loss.backward()
    ReferenceOptimizer(AdamW(), params).step()

    result = trainer.train_step(batch)
    assert result.applied
    assert result.loss == pytest.approx(loss.item(), rel=1e-6)
    for (name, value), ref in zip(trainer.get_weights().items(), params):
        np.testing.assert_allclose(value, ref.detach().numpy(), atol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_schedules_match_their_formulas(kind):
    base, low, total, warmup = 0.1, 0.01, 50, 5
    for step in range(total + 3):
        if kind == "constant":
            expected = base
        elif step < warmup:
            expected = base * (step + 1) / warmup
        else:
            progress = min((step - warmup) / (total - warmup), 1.0)
            shape = 1 - progress if kind == "linear" else (1 + math.cos(math.pi * progress)) / 2
            expected = low + (base - low) * shape
        assert lr_at(step, kind=kind, base=base, total=total, warmup=warmup, min_lr=low) == pytest.approx(expected)


def test_fit_drives_the_learning_rate_by_schedule(digits_sgd, digits_data):
    trainer = Trainer.load(digits_sgd)
    schedule = Schedule("linear", 0.05, total=8, warmup=2)
    seen = []
    trainer._engine.set_learning_rate = lambda lr, original=trainer._engine.set_learning_rate: (
        seen.append(lr),
        original(lr),
    )
    trainer.fit(_subset(digits_data["train"], 64), epochs=1, batch_size=8, schedule=schedule, progress=False)
    expected = [schedule(step) for step in range(8)]
    assert seen == [lr for i, lr in enumerate(expected) if i == 0 or lr != expected[i - 1]]  # set on change only
    assert trainer.lr == expected[-1]


def test_accumulation_equals_large_batch_sgd(digits_sgd, digits_data):
    data = _subset(digits_data["train"], 64)
    large, small = Trainer.load(digits_sgd), Trainer.load(digits_sgd)
    large.fit(data, epochs=1, batch_size=32, shuffle=False, progress=False)
    small.fit(data, epochs=1, batch_size=8, accumulate=4, shuffle=False, progress=False)
    assert large.step == small.step == 2
    np.testing.assert_allclose(small.get_flat_weights(), large.get_flat_weights(), atol=1e-6)


def test_accumulation_equals_large_batch_adamw(digits_no_dropout, digits_data):
    data = _subset(digits_data["train"], 64)
    large, small = Trainer.load(digits_no_dropout[0]), Trainer.load(digits_no_dropout[0])
    large.fit(data, epochs=1, batch_size=32, shuffle=False, progress=False)
    small.fit(data, epochs=1, batch_size=16, accumulate=2, shuffle=False, progress=False)
    np.testing.assert_allclose(small.get_flat_weights(), large.get_flat_weights(), atol=1e-6)


def test_resume_is_exact_even_with_dropout(digits_artifacts, digits_data, tmp_path):
    data = _subset(digits_data["train"], 256)
    straight = Trainer.load(digits_artifacts)
    straight.fit(data, epochs=2, batch_size=32, seed=7, progress=False)

    first = Trainer.load(digits_artifacts)
    first.fit(data, epochs=1, batch_size=32, seed=7, progress=False, checkpoint=tmp_path / "c.ckpt")
    resumed = Trainer.load(digits_artifacts, checkpoint=tmp_path / "c.ckpt")
    assert (resumed.epoch, resumed.step, resumed.seed) == (1, 8, 7)
    resumed.fit(data, epochs=2, batch_size=32, seed=7, progress=False)
    np.testing.assert_array_equal(resumed.get_flat_weights(), straight.get_flat_weights())


def test_a_training_only_trainer_trains_alike_and_refuses_evaluation(digits_artifacts, digits_data, tmp_path):
    """evaluation=False leaves the eval graph out: training (dropout included) is bit-identical,
    and every way to evaluate is refused with a ConfigError before it changes anything."""
    data, val = _subset(digits_data["train"], 128), _subset(digits_data["val"], 64)
    full, lean = Trainer.load(digits_artifacts), Trainer.load(digits_artifacts, evaluation=False)
    full_history = full.fit(data, epochs=2, batch_size=32, seed=3, progress=False)
    lean_history = lean.fit(data, epochs=2, batch_size=32, seed=3, progress=False)
    np.testing.assert_array_equal(lean.get_flat_weights(), full.get_flat_weights())
    assert lean_history.epochs == full_history.epochs
    trained = lean.get_flat_weights()
    for attempt in (
        lambda: lean.evaluate(val),
        lambda: lean.eval_step(_subset(val, 8)),
        lambda: lean.fit(data, epochs=3, batch_size=32, val_data=val, progress=False),
    ):
        with pytest.raises(ConfigError, match="evaluation=False"):
            attempt()
    np.testing.assert_array_equal(lean.get_flat_weights(), trained)
    assert lean.epoch == 2
    with pytest.raises(ConfigError, match="True or False"):
        Trainer.load(digits_artifacts, evaluation="no")
    full.save(tmp_path / "c.ckpt")  # a checkpoint resumes into a training-only trainer too
    resumed = Trainer.load(digits_artifacts, checkpoint=tmp_path / "c.ckpt", evaluation=False)
    np.testing.assert_array_equal(resumed.get_flat_weights(), trained)
    with pytest.raises(ConfigError, match="evaluation=False"):
        resumed.evaluate(val)


def test_resume_without_seed_or_schedule_continues_the_same_run(digits_artifacts, digits_data, tmp_path):
    """The checkpoint carries the seed and the schedule: a resumed fit needs neither again."""
    data = _subset(digits_data["train"], 256)
    schedule = Schedule("cosine", 0.01, total=24, warmup=3)
    straight = Trainer.load(digits_artifacts)
    history = straight.fit(data, epochs=3, batch_size=32, seed=7, schedule=schedule, progress=False)

    first = Trainer.load(digits_artifacts)
    first.fit(data, epochs=1, batch_size=32, seed=7, schedule=schedule, progress=False, checkpoint=tmp_path / "c")
    resumed = Trainer.load(digits_artifacts, checkpoint=tmp_path / "c")
    assert resumed.schedule == schedule and resumed.seed == 7
    rest = resumed.fit(data, epochs=3, batch_size=32, progress=False)
    np.testing.assert_array_equal(resumed.get_flat_weights(), straight.get_flat_weights())
    assert [e["lr"] for e in rest.epochs] == [e["lr"] for e in history.epochs[1:]]


def test_a_schedule_shorter_than_the_run_is_refused_before_any_step(digits_artifacts, digits_data):
    trainer = Trainer.load(digits_artifacts)
    before = trainer.get_flat_weights().copy()
    with pytest.raises(ConfigError, match="spans 10 optimizer steps, but training to epoch 2 takes 16"):
        trainer.fit(_subset(digits_data["train"], 256), epochs=2, batch_size=32, schedule=Schedule("linear", 0.01, 10))
    np.testing.assert_array_equal(trainer.get_flat_weights(), before)
    assert trainer.step == 0


@pytest.mark.parametrize(
    "options, message",
    [
        # no epochs to train
        ({"epochs": 0}, "epochs must be an integer >= 1, got 0"),
        # a float count
        ({"epochs": 1.5}, "epochs must be an integer"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"accumulate": -1}, "accumulate must be an integer >= 1"),
    ],
)
def test_bad_fit_options_are_config_errors(digits_artifacts, digits_data, options, message):
    trainer = Trainer.load(digits_artifacts)
    with pytest.raises(ConfigError, match=message):
        trainer.fit(_subset(digits_data["train"], 64), **{"epochs": 1, "batch_size": 8, **options})


@pytest.mark.parametrize(
    "settings, message",
    [
        # zero base rate
        ({"base": 0.0}, "base > 0"),
        # NaN base rate
        ({"base": float("nan")}, "finite numbers"),
        # warm-up as long as the schedule
        ({"kind": "cosine", "total": 5, "warmup": 5}, "warm-up"),
        ({"kind": "step"}, "schedule must be one of"),
    ],
)
def test_bad_schedules_are_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        Schedule(**{"kind": "linear", "base": 0.01, "total": 10, **settings})


def test_dropout_changes_training_but_seeded_runs_agree(digits_artifacts, digits_data):
    data = _subset(digits_data["train"], 64)
    runs = []
    for seed in (1, 1, 2):
        trainer = Trainer.load(digits_artifacts)
        trainer.fit(data, epochs=1, batch_size=32, seed=seed, shuffle=False, progress=False)
        runs.append(trainer.get_flat_weights())
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_non_finite_step_is_skipped_and_counted(digits_no_dropout, digits_data):
    trainer = Trainer.load(digits_no_dropout[0])
    huge = np.full(trainer.manifest.trainable_size, 3e38, np.float32)
    trainer.set_weights(huge)
    result = trainer.train_step(_subset(digits_data["train"], 8))
    assert not result.applied and not math.isfinite(result.loss)
    assert trainer.skipped_steps == 1 and trainer.step == 0
    np.testing.assert_array_equal(trainer.get_flat_weights(), huge)


@pytest.mark.classic
def test_finite_check_is_the_norm_of_loss_and_accumulated_gradients(digits_no_dropout, digits_data):
    manifest = Manifest.load(digits_no_dropout[0])
    session = OrtTraining(digits_no_dropout[0])
    assert manifest.finite_check is not None
    train = digits_data["train"]
    for micro in range(2):  # the second micro-step's check covers the accumulated gradients
        rows = slice(micro * 16, (micro + 1) * 16)
        fetched = session.train_step([train["input"][rows], train["labels"][rows]])
        gradients = [session.get_gradient(p.name).astype(np.float64) for p in manifest.trainable]
        expected = math.sqrt(float(fetched[0]) ** 2 + sum(float(np.square(g).sum()) for g in gradients))
        assert float(fetched[-1]) == pytest.approx(expected, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("in_graph, engine, kernel", [(True, "classic", "1"), (True, "portable", "0"),
                                                     (True, "portable", "1"), (False, "classic", "1")],
                         ids=["graph-check", "fused-step-check", "kernel-step-check", "python-check"])
@pytest.mark.classic
def test_step_with_finite_loss_but_infinite_gradient_is_skipped(tmp_path, digits_data, in_graph, engine, kernel,
                                                                monkeypatch):  # fmt: skip
    from artifacts import generate
    from ondevice.engines import update_kernel
    from tests.artifacts import models

    monkeypatch.setenv(update_kernel.ENV, kernel)  # the portable engine: the fused step, or the kernel's update
    generate(models.SqrtGate(), torch.randn(8, 64), tmp_path / "gate", verify=False)
    trainer = Trainer.load(tmp_path / "gate", engine=engine)
    assert trainer.manifest.portable_step is not None  # without the kernel, the portable engine runs it fused
    assert engine == "classic" or trainer.update == ("kernel" if kernel == "1" else "graph")
    if not in_graph:  # artifacts made before the in-graph check: the runtime sums the gradients itself
        trainer.manifest = dataclasses.replace(trainer.manifest, finite_check=None)
    before = trainer.get_flat_weights()
    history = trainer.fit(_subset(digits_data["train"], 32), epochs=1, batch_size=16, progress=False)
    assert history.last()["loss"] == pytest.approx(math.log(10), rel=1e-6)  # the loss itself is fine
    assert trainer.skipped_steps == 2 and trainer.step == 0
    np.testing.assert_array_equal(trainer.get_flat_weights(), before)


@pytest.mark.parametrize("flush_bytes", [1, 2**30], ids=["every-batch", "at-the-end"])
@pytest.mark.parametrize("shapes", [[(16,), (16,), (7,)], [(4, 5), (4, 7)]], ids=["rows", "ragged-sequences"])
def test_lazy_accuracy_counts_like_an_argmax_per_batch(digits_artifacts, monkeypatch, flush_bytes, shapes):
    from ondevice._metrics import Meter

    manifest = Manifest.load(digits_artifacts)
    rng = np.random.default_rng(0)
    pairs = [(rng.standard_normal((*shape, 10)).astype(np.float32), rng.integers(0, 10, shape)) for shape in shapes]
    monkeypatch.setattr(Meter, "FLUSH_BYTES", flush_bytes)
    meter = Meter(manifest)
    for scores, labels in pairs:
        meter.add(1.0, len(labels), scores, labels)
    hits = sum(int(np.count_nonzero(s.argmax(axis=-1) == y)) for s, y in pairs)
    assert meter.result()["accuracy"] == hits / sum(y.size for _, y in pairs)
    top3 = sum(int(np.count_nonzero((np.argsort(-s, axis=-1)[..., :3] == y[..., None]).any(-1))) for s, y in pairs)
    assert meter.result()["top3_accuracy"] == top3 / sum(y.size for _, y in pairs) > meter.result()["accuracy"]


@pytest.mark.parametrize("momentum, eps", [(0.1, 1e-5), (1.0, 1e-2)])
def test_batchnorm_statistics_are_updated_by_training(tmp_path, momentum, eps):
    import onnx

    from artifacts import generate
    from tests.artifacts import models

    model = models.cnn()
    for bn in (model.features[1], model.features[5]):  # momentum 1: the running statistics are the batch's own
        bn.momentum, bn.eps = momentum, eps
    generate(model, torch.randn(4, 1, 12, 12), tmp_path / "cnn", verify=False)
    trainer = Trainer.load(tmp_path / "cnn")
    x = np.random.default_rng(0).standard_normal((16, 1, 12, 12), dtype=np.float32)
    batch = {"image": x, "labels": np.arange(16) % 5}
    trainer.train_step(batch)
    reference = copy.deepcopy(model).train()
    reference(torch.from_numpy(x))
    for layer in ("features.1", "features.5"):
        for name in (f"{layer}.running_mean", f"{layer}.running_var"):
            np.testing.assert_allclose(
                trainer._engine.get_parameter(name), reference.state_dict()[name].numpy(), rtol=1e-5, atol=1e-6
            )
    # the update reads the batch statistics of ORT's BatchNorm, not the BatchNorm's input again
    graph = onnx.load(tmp_path / "cnn" / "training_model.onnx").graph
    inputs = {n.input[0] for n in graph.node if n.op_type == "BatchNormInternal"}
    readers = [n for n in graph.node if "odt_running_stats" in n.name and set(n.input) & inputs]
    assert len(inputs) == 2 and {n.op_type for n in readers} == {"Size"}


def test_weights_round_trip_by_name_and_flat(digits_artifacts):
    trainer = Trainer.load(digits_artifacts)
    weights = trainer.get_weights()
    assert list(weights) == [p.name for p in trainer.manifest.trainable]
    shifted = {k: v + 1.0 for k, v in weights.items()}
    trainer.set_weights(shifted)
    np.testing.assert_array_equal(trainer.get_flat_weights(), np.concatenate([v.ravel() for v in shifted.values()]))


def test_export_and_predict_match_the_eval_graph(digits_artifacts, digits_data, tmp_path):
    trainer = Trainer.load(digits_artifacts)
    trainer.fit(_subset(digits_data["train"], 128), epochs=1, batch_size=32, progress=False)
    path = trainer.export(tmp_path / "m.onnx")
    test = digits_data["test"]
    predicted = Predictor(path, Manifest.load(digits_artifacts)).predict({"input": test["input"]})["output"]
    np.testing.assert_allclose(predicted, trainer.eval_step(test).outputs["output"], atol=1e-6)


def test_digits_sample_reaches_95_percent(tmp_path):
    from samples.digits import run

    assert run.main(["--out", str(tmp_path / "digits")]) == 0
    history = __import__("json").loads((tmp_path / "digits" / "history.json").read_text())
    assert history["test"]["accuracy"] >= 0.95
    assert history["test"]["export_accuracy"] == history["test"]["accuracy"]
    assert (tmp_path / "digits" / "curves.png").stat().st_size > 10_000


@pytest.mark.classic
def test_cached_gradient_views_keep_aliasing_ort_buffers(digits_no_dropout, digits_data):
    trainer = Trainer.load(digits_no_dropout[0])
    data = _subset(digits_data["train"], 96)
    trainer.fit(data, epochs=2, batch_size=32, accumulate=3, progress=False)
    views = trainer._gradients()
    trainer._micro_step(list(check_data(trainer.manifest, _subset(data, 32)).values()), micro=0)
    assert sorted(views) == list(range(len(trainer.manifest.trainable)))
    for index, view in views.items():
        spec = trainer.manifest.trainable[index]
        np.testing.assert_array_equal(view, trainer._engine.get_gradient(spec.name), err_msg=spec.name)
        assert np.any(view != 0)


def test_proximal_term_matches_pytorch(digits_no_dropout, digits_data):
    directory, model = digits_no_dropout
    trainer = Trainer.load(directory)
    anchor = {k: v - 0.05 for k, v in trainer.get_weights().items()}
    trainer.set_proximal(0.3, anchor)
    batch = _subset(digits_data["train"], 32)
    reference = copy.deepcopy(model).train()
    params = list(reference.parameters())
    loss = torch.nn.functional.cross_entropy(
        reference(torch.from_numpy(batch["input"])), torch.from_numpy(batch["labels"])
    )
    prox = sum(((p - torch.from_numpy(a)) ** 2).sum() for p, a in zip(params, anchor.values()))
    (loss + 0.3 / 2 * prox).backward()
    ReferenceOptimizer(AdamW(), params).step()
    trainer.train_step(batch)
    for (name, value), ref in zip(trainer.get_weights().items(), params):
        np.testing.assert_allclose(value, ref.detach().numpy(), atol=1e-6, err_msg=name)


def test_a_gradient_buffer_ort_has_not_allocated_shifts_no_other_parameter(digits_no_dropout, digits_data, monkeypatch):
    """The proximal term pairs gradients with their anchors by index: with the first buffer missing,
    every other parameter steps exactly as with all buffers (before, each got its neighbour's term)."""
    directory, _ = digits_no_dropout
    batch = _subset(digits_data["train"], 32)
    steps = {}
    for hidden in (False, True):
        trainer = Trainer.load(directory)
        anchor = {k: v - 0.05 for k, v in trainer.get_weights().items()}
        trainer.set_proximal(0.3, anchor)
        if hidden:
            first = trainer.manifest.trainable[0].name
            view = trainer._engine.gradient_view

            def missing_first(name, first=first, view=view):
                return None if name == first else view(name)

            monkeypatch.setattr(trainer._engine, "gradient_view", missing_first)
        trainer.train_step(batch)
        steps[hidden] = trainer.get_weights()
    names = [p.name for p in Trainer.load(directory).manifest.trainable]
    for name in names[1:]:
        np.testing.assert_array_equal(steps[True][name], steps[False][name], err_msg=name)
    assert not np.array_equal(steps[True][names[0]], steps[False][names[0]])  # it alone missed its term


def test_fit_follows_the_memory_plans_micro_batches_and_takes_the_same_steps(digits_no_dropout, digits_data, tmp_path):
    """A plan's micro-batch splits each batch into accumulated micro-batches: ORT never sees more
    rows than the plan measured, and the weights match training on the whole batches."""
    import json
    import shutil

    directory, _ = digits_no_dropout
    planned = tmp_path / "planned"
    shutil.copytree(directory, planned)
    manifest = json.loads((planned / "manifest.json").read_text())
    manifest["plan"] = {"budget": 10**9, "batch_size": 32, "chosen": "everything", "rows": [], "micro_batch_size": 5}
    (planned / "manifest.json").write_text(json.dumps(manifest))
    data = {k: v[:200] for k, v in digits_data["train"].items()}

    whole, split = Trainer.load(directory), Trainer.load(planned)
    assert split.micro_batches(32) == (4, 8)  # the largest size up to the plan's 5 that tiles 32
    assert whole.micro_batches(32) == (32, 1)
    rows: list[int] = []
    step = split._engine.train_step
    split._engine.train_step = lambda feeds, **options: rows.append(len(feeds[0])) or step(feeds, **options)
    whole.fit(data, epochs=2, batch_size=32, shuffle=True, seed=3, progress=False)
    split.fit(data, epochs=2, batch_size=32, shuffle=True, seed=3, progress=False)
    assert max(rows) == 4 and split.step == whole.step == 2 * 7
    for name, value in whole.get_weights().items():
        np.testing.assert_allclose(split.get_weights()[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    # evaluating (fit's validation too) and predicting stay within the plan as well: 5 rows a step
    evaluated: list[int] = []
    run = split._engine.eval_step
    split._engine.eval_step = lambda feeds: evaluated.append(len(feeds[0])) or run(feeds)
    split.fit(data, epochs=3, batch_size=32, val_data=data, progress=False)
    assert max(evaluated) == 5
    assert split.evaluate(data) == pytest.approx(split.evaluate(data, batch_size=256), rel=1e-5)  # the same metrics
    assert split.manifest.eval_batch_size == 5 and whole.manifest.eval_batch_size == 256
    smaller = dataclasses.replace(split.manifest, plan=dataclasses.replace(split.manifest.plan, batch_size=16))
    assert (smaller.train_batch_size, whole.manifest.train_batch_size) == (16, 32)  # odt train's default batch
    exported = Predictor(split.export(tmp_path / "m.onnx"))  # the plan travels inside the exported model
    predicted: list[int] = []
    run_predictor = exported._session.run
    exported._session.run = lambda names, feeds: predicted.append(len(next(iter(feeds.values())))) or run_predictor(
        names, feeds
    )
    exported.predict({"input": data["input"]})
    assert max(predicted) == 5
