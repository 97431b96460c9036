"""Bundles: the baked learning rate against set_learning_rate in Python ORT, signatures, tampering."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mobile_bridge import BundleError, SignatureError, keygen, load_trainer, make_bundle, verify_bundle
from ondevice import Trainer, lr_at
from ondevice.cli import main
from ondevice.engines.classic import OrtTraining
from ondevice.session import LOSS_SCALE


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return keygen(tmp_path_factory.mktemp("keys") / "odt")


def _feeds(digits_data, step: int) -> list[np.ndarray]:
    batch = slice(16 * step, 16 * step + 16)
    return [digits_data["train"]["input"][batch], digits_data["train"]["labels"][batch]]


@pytest.mark.parametrize(
    "rate",
    [
        {"kind": "constant", "base": 0.01},
        {"kind": "linear", "base": 0.02, "total": 6, "warmup": 2, "min_lr": 0.001},
        {"kind": "cosine", "base": 0.02, "total": 6, "warmup": 2},
    ],
)
@pytest.mark.classic
def test_baked_rate_equals_set_learning_rate(digits_no_dropout, digits_data, tmp_path, rate):
    directory = digits_no_dropout[0]
    make_bundle(
        directory,
        tmp_path / "bundle",
        lr=rate["base"],
        schedule=rate["kind"],
        total_steps=rate.get("total", 1),
        warmup=rate.get("warmup", 0),
        min_lr=rate.get("min_lr", 0.0),
    )
    reference, baked = OrtTraining(directory), OrtTraining(tmp_path / "bundle")
    for step in range(8):
        lr = lr_at(
            step,
            kind=rate["kind"],
            base=rate["base"],
            total=rate.get("total", 1),
            warmup=rate.get("warmup", 0),
            min_lr=rate.get("min_lr", 0.0),
        )
        reference.set_learning_rate(lr)
        for session in (reference, baked):
            session.train_step(_feeds(digits_data, step))
            session.optimizer_step()
            session.reset_grad()
    np.testing.assert_allclose(baked.get_flat(), reference.get_flat(), rtol=1e-5, atol=1e-7)
    assert not np.allclose(reference.get_flat(), OrtTraining(directory).get_flat())  # it trained


@pytest.mark.classic
def test_the_bundles_loss_scale_input_scales_gradients_and_changes_nothing_fed_one(digits_sgd, digits_data, tmp_path):
    """The bundle's training graph reads the loss gradient's seed from an input: fed 1 it computes
    what the artifacts' graph computes, bit for bit; fed 1/4 every gradient is a quarter."""
    import onnx

    description = make_bundle(digits_sgd, tmp_path / "bundle")
    assert description["loss_scale"] == LOSS_SCALE and description["micro_batch_size"] is None
    graph = onnx.load(tmp_path / "bundle" / "training_model.onnx").graph
    assert [i.name for i in graph.input][:3] == ["input", "labels", LOSS_SCALE]
    original, bundled = OrtTraining(digits_sgd), OrtTraining(tmp_path / "bundle")
    feeds = _feeds(digits_data, 0)
    names = [p.name for p in Trainer.load(digits_sgd).manifest.trainable]
    losses = [session.train_step(feeds)[0] for session in (original, bundled)]
    np.testing.assert_array_equal(losses[0], losses[1])
    for name in names:
        np.testing.assert_array_equal(bundled.get_gradient(name), original.get_gradient(name), err_msg=name)
    bundled.reset_grad()
    bundled.train_step(feeds, scale=0.25)
    for name in names:
        np.testing.assert_array_equal(bundled.get_gradient(name), original.get_gradient(name) * 0.25, err_msg=name)
    with pytest.raises(ValueError, match=LOSS_SCALE):
        original.train_step(feeds, scale=0.5)


@pytest.mark.classic
def test_bundle_contents(digits_artifacts, tmp_path, keys):
    description = make_bundle(digits_artifacts, tmp_path / "b", sign_key=keys[0])
    names = set(description["files"])
    assert {"training_model.ort", "eval_model.ort", "optimizer_model.ort", "required_operators.config"} <= names
    assert {"checkpoint", "manifest.json", "training_model.onnx"} <= names
    assert description["feed_order"] == ["input", "labels", LOSS_SCALE]
    assert description["weights"]["size"] == 17226
    assert description["weights"]["tensors"][1] == {"name": "0.bias", "shape": [128], "offset": 8192}
    assert description["learning_rate"] == {
        "baked": True,
        "kind": "constant",
        "base": 0.001,
        "total": 1,
        "warmup": 0,
        "min_lr": 0.0,
    }
    trainer = load_trainer(tmp_path / "b", keys[1])
    assert isinstance(trainer, Trainer) and trainer.manifest.trainable_size == 17226


def _tamper_file(bundle):
    path = bundle / "eval_model.onnx"
    path.write_bytes(path.read_bytes() + b"\0")


def _tamper_description(bundle):
    data = json.loads((bundle / "bundle.json").read_text())
    data["learning_rate"]["base"] = 1.0
    (bundle / "bundle.json").write_text(json.dumps(data, indent=2, sort_keys=True))


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        (_tamper_file, BundleError, "eval_model.onnx was altered"),  # a model file changed
        (_tamper_description, SignatureError, "signature does not match"),  # bundle.json changed
        (lambda b: (b / "bundle.sig").unlink(), SignatureError, "is not signed"),  # signature removed
        (lambda b: (b / "checkpoint").unlink(), BundleError, "checkpoint is missing"),  # file removed
    ],
)
def test_tampered_bundles_are_refused_before_training(digits_artifacts, tmp_path, keys, damage, error, message):
    make_bundle(digits_artifacts, tmp_path / "b", sign_key=keys[0])
    damage(tmp_path / "b")
    with pytest.raises(error, match=message):
        load_trainer(tmp_path / "b", keys[1])


@pytest.mark.parametrize(
    "options, message",
    [
        # a cosine schedule without its length would end after one step
        ({"schedule": "cosine"}, "needs --total-steps N"),
        # a negative rate diverges
        ({"lr": -1.0}, "base > 0"),
        ({"schedule": "linear", "total_steps": 0}, "total >= 1"),
        ({"schedule": "linear", "total_steps": 4, "warmup": 4}, "warm-up"),
    ],
)
def test_bad_rate_options_are_refused(digits_artifacts, tmp_path, options, message):
    with pytest.raises(BundleError, match=message):
        make_bundle(digits_artifacts, tmp_path / "bundle", **options)
    assert not (tmp_path / "bundle").exists()


def test_other_key_is_refused(digits_artifacts, tmp_path, keys):
    make_bundle(digits_artifacts, tmp_path / "b", sign_key=keys[0])
    _, other = keygen(tmp_path / "other")
    with pytest.raises(SignatureError, match="signed with another key"):
        verify_bundle(tmp_path / "b", other)


def test_cli_keygen_bundle_verify(digits_artifacts, tmp_path, capsys):
    key = tmp_path / "k"
    assert main(["keygen", "--out", str(key)]) == 0
    assert main(["keygen", "--out", str(key)]) == 1  # never overwrites silently
    assert main(["bundle", str(digits_artifacts), "--out", str(tmp_path / "b"), "--sign-key", str(key)]) == 0
    assert main(["verify-bundle", str(tmp_path / "b"), "--public-key", f"{key}.pub"]) == 0
    capsys.readouterr()
    _tamper_file(tmp_path / "b")
    assert main(["verify-bundle", str(tmp_path / "b"), "--public-key", f"{key}.pub"]) == 1
    assert "eval_model.onnx was altered" in capsys.readouterr().err
    assert (key.stat().st_mode & 0o777) == 0o600


def _altered_and_rehashed(bundle):
    """What a hostile copy does: change the parameters, then re-hash bundle.json to match."""
    import hashlib

    data = json.loads((bundle / "bundle.json").read_text())
    name = next(n for n in data["files"] if n.startswith("parameters") or n == "checkpoint")
    path = bundle / name
    path.write_bytes(path.read_bytes()[:-4] + b"\x7f\x7f\x7f\x7f")
    data["files"][name]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (bundle / "bundle.json").write_text(json.dumps(data, indent=2, sort_keys=True))


def test_a_signed_bundle_is_never_passed_on_its_hashes_alone(digits_artifacts, tmp_path, keys, capsys):
    """A signed bundle altered and re-hashed passed `verify-bundle` without a key ("ok: 19 file hashes
    verified") and `bridge serve` served it: without the signer's key a signed bundle is refused, saying its
    signature was not checked, unless --skip-signature; with it, the alteration is caught."""
    from mobile_bridge.server import create_app

    make_bundle(digits_artifacts, tmp_path / "b", sign_key=keys[0])
    _altered_and_rehashed(tmp_path / "b")
    assert main(["verify-bundle", str(tmp_path / "b")]) == 1
    assert "is signed (bundle.sig) but no public key was given, so its signature was not checked" in (
        capsys.readouterr().err)  # fmt: skip
    assert main(["verify-bundle", str(tmp_path / "b"), "--public-key", str(keys[1])]) == 1
    assert "signature does not match" in capsys.readouterr().err
    assert main(["verify-bundle", str(tmp_path / "b"), "--skip-signature"]) == 0  # asked for: said so
    assert "the signature was NOT checked (--skip-signature)" in capsys.readouterr().out
    for options in ({}, {"public_key": keys[1]}):
        with pytest.raises(SignatureError):
            create_app(tmp_path / "b", relay_secret="s" * 32, state=tmp_path / "b.db", **options)
    with pytest.raises(SignatureError, match="no public key was given"):
        load_trainer(tmp_path / "b", None)
    make_bundle(digits_artifacts, tmp_path / "good", sign_key=keys[0])  # the signer's bundle, served with its key
    assert create_app(tmp_path / "good", relay_secret="s" * 32, state=tmp_path / "g.db", public_key=keys[1])


def test_bundle_force_replaces_only_a_bundle(digits_artifacts, tmp_path, monkeypatch, capsys):
    """`odt bundle --force` replaces a bundle it made (signed, with its ORT files) and refuses the working
    directory, an empty --out, someone's directory and a bundle with a user's file added; nothing is lost."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("a user's file")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("mine")
    art = str(digits_artifacts)
    assert main(["bundle", art, "--out", "b", "--lr", "0.01"]) == 0
    assert main(["bundle", art, "--out", "b", "--lr", "0.02", "--force"]) == 0
    assert verify_bundle(tmp_path / "b")["learning_rate"]["base"] == 0.02
    (tmp_path / "b" / "extra.txt").write_text("mine")
    capsys.readouterr()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for target, message in [(".", "working directory"), ("", "--out is empty"), ("docs", "no bundle.json"),
                            ("b", "holds files odt did not write (extra.txt)")]:  # fmt: skip
        assert main(["bundle", art, "--out", target, "--force"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


PHONE_RECIPE = r"""
import json, math, sys
import numpy as np
import onnxruntime as ort
from ondevice.engines.portable import adamw_rates

bundle, data = sys.argv[1], json.load(open(sys.argv[2]))
d = json.load(open(f"{bundle}/bundle.json"))
options = ort.SessionOptions()
options.log_severity_level = 3
training = ort.InferenceSession(f"{bundle}/training_model.portable.ort", options)
optimizer = ort.InferenceSession(f"{bundle}/optimizer_model.portable.ort", options)
stored = np.fromfile(f"{bundle}/parameters.bin", np.uint8)
n, tensors, hyper = d["weights"]["size"], d["weights"]["tensors"], d["portable"]["optimizer_options"]
params, grads, m0, m1 = stored[: 4 * n].view("<f4").copy(), *(np.zeros(n, np.float32) for _ in range(3))
view = lambda a, t: a[t["offset"] : t["offset"] + math.prod(t["shape"])].reshape(t["shape"])
array = lambda t: np.frombuffer(stored, t["dtype"], math.prod(t["shape"]), t["byte_offset"]).reshape(t["shape"])
frozen = {t["name"]: array(t) for t in d["portable"]["frozen"]}
names = [o.name for o in training.get_outputs()]
losses = []
for step, batch in enumerate(data, 1):
    feeds = {"input": np.asarray(batch["input"], np.float32), "labels": np.asarray(batch["labels"], np.int64), **frozen}
    feeds.update({t["name"]: view(params, t) for t in tensors})
    out = dict(zip(names, training.run(None, feeds)))
    losses.append(float(out[names[0]]))
    for t in tensors:
        view(grads, t)[...] = out[t["name"] + "_grad"]
    lr, corrected, decay = adamw_rates(0.01, step, hyper["betas"], hyper["weight_decay"])
    scalar = lambda v: np.asarray(v, np.float32)
    updated = optimizer.run(["odt.parameters.updated", "odt.momentum0.updated", "odt.momentum1.updated"], {
        "odt.lr": scalar(lr), "odt.lr_corrected": scalar(corrected), "odt.lr_decay": scalar(decay),
        "odt.parameters": params, "odt.gradients": grads, "odt.momentum0": m0, "odt.momentum1": m1})
    params, m0, m1 = updated
shapes = lambda args: {a.name: a.shape for a in args}
print(json.dumps({"version": ort.__version__, "losses": losses, "params": params.tolist(),
                  "training": {"inputs": shapes(training.get_inputs()), "outputs": shapes(training.get_outputs())},
                  "optimizer": {"inputs": shapes(optimizer.get_inputs()), "outputs": shapes(optimizer.get_outputs())}}))
"""


def test_the_documented_phone_recipe_trains_the_ort_format_graphs_on_current_onnxruntime(
    digits_no_dropout, digits_data, tmp_path, stock_python
):
    """The README's Kotlin and Swift sketches for current ONNX Runtime Mobile, done in Python on the newest
    stock onnxruntime over the bundle's .ort portable graphs: the same losses and weights as the portable
    engine on the .onnx graphs; and every file, input and output name the sketches use exists in the bundle,
    with the shapes they give (scalar rates, flat vectors of the weight buffer's size)."""
    import re
    import subprocess

    from ondevice.engines.contract import SLICEABLE
    from ondevice.engines.portable import PortableEngine
    from ondevice.manifest import Manifest
    from tests.conftest import ROOT

    bundle = tmp_path / "bundle"
    description = make_bundle(digits_no_dropout[0], bundle, lr=0.01)
    steps = [{"input": b[0].tolist(), "labels": b[1].tolist()} for b in (_feeds(digits_data, i) for i in range(5))]
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    run = subprocess.run([*stock_python, "-c", PHONE_RECIPE, str(bundle), str(tmp_path / "steps.json")],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    phone = json.loads(run.stdout)
    assert phone["version"] != "1.19.2"  # the stock runtime, not the training build
    engine = PortableEngine(bundle, Manifest.load(bundle), bundle / "checkpoint", threads=1, with_eval=False)
    engine.set_learning_rate(0.01)  # the recipe's rate
    losses = []
    for i in range(5):
        losses.append(float(engine.train_step(_feeds(digits_data, i))[0]))
        engine.optimizer_step()
        engine.reset_grad()
    np.testing.assert_allclose(phone["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(phone["params"], engine.get_flat(), atol=1e-5)

    readme = (ROOT / "mobile_bridge" / "README.md").read_text()
    sketches = readme[readme.index("## Android (Kotlin, current") : readme.index("## Android (Kotlin, `com.microsoft")]
    code = "\n".join(re.findall(r"```(?:kotlin|swift)\n(.*?)```", sketches, re.S))
    quoted = {q.lstrip("/") for q in re.findall(r'"([^"\s]+)"', code)}  # Swift's paths: dir + "/NAME"
    training, optimizer = phone["training"], phone["optimizer"]
    assert {q for q in quoted if q.endswith(".ort")} == {"training_model.portable.ort", "optimizer_model.portable.ort"}
    assert {q for q in quoted if q.endswith(".ort") or q.endswith(".bin")} <= set(description["files"])
    assert {"input", "labels"} <= quoted and {"input", "labels"} <= set(training["inputs"])
    odt = {q for q in quoted if q.startswith("odt.")}
    assert odt == set(optimizer["inputs"]) | set(optimizer["outputs"])
    assert "_grad" in quoted
    assert {t["name"] + "_grad" for t in description["weights"]["tensors"]} <= set(training["outputs"])
    assert {t["name"] for t in description["weights"]["tensors"]} <= set(training["inputs"])
    assert all(optimizer["inputs"][name] == [] for name in ("odt.lr", "odt.lr_corrected", "odt.lr_decay"))
    # flat vectors: the symbolic length of an element-wise update (any length, so the sketches' n), or with
    # clipping the weight buffer's size
    lengths = ([SLICEABLE], [description["weights"]["size"]])
    vectors = ("parameters", "gradients", "momentum0", "momentum1")
    assert all(optimizer["inputs"][f"odt.{v}"] in lengths for v in vectors)


def test_the_fused_step_graph_does_what_the_training_and_optimizer_graphs_do(digits_no_dropout, digits_data, tmp_path):
    """step_model.portable.onnx (one run per step, for runtimes that pay per run) gives the two graphs' losses
    and updated parameters and moments, bit for bit, over steps on the bundle's schedule."""
    import onnxruntime as ort

    from ondevice.engines.portable import PortableEngine, adamw_rates
    from ondevice.manifest import Manifest

    bundle = tmp_path / "bundle"
    description = make_bundle(digits_no_dropout[0], bundle, lr=0.01, schedule="linear", total_steps=4)
    manifest, layout = Manifest.load(bundle), description["portable"]
    engine = PortableEngine(bundle, manifest, bundle / "checkpoint", threads=1, with_eval=False)
    step = ort.InferenceSession(str(bundle / layout["step"]), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in step.get_outputs()]
    n = description["weights"]["size"]
    params, m0, m1 = engine.get_flat(), np.zeros(n, np.float32), np.zeros(n, np.float32)
    rate = {k: description["learning_rate"][k] for k in ("kind", "base", "total", "warmup", "min_lr")}
    hyper = layout["optimizer_options"]
    for k in range(4):
        x, y = _feeds(digits_data, k)
        lr, corrected, decay = adamw_rates(lr_at(k, **rate), k + 1, hyper["betas"], hyper["weight_decay"])
        rates = {"odt.lr": lr, "odt.lr_corrected": corrected, "odt.lr_decay": decay}
        feeds = {"input": x, "labels": y, "odt.momentum0": m0, "odt.momentum1": m1,
                 **{name: np.asarray(value, np.float32) for name, value in rates.items()}}  # fmt: skip
        feeds.update({t["name"]: params[t["offset"] : t["offset"] + int(np.prod(t["shape"]))].reshape(t["shape"])
                      for t in description["weights"]["tensors"]})  # fmt: skip
        fused = dict(zip(outputs, step.run(None, feeds)))
        engine.set_learning_rate(lr_at(k, **rate))
        loss = engine.train_step([x, y])[0]
        engine.optimizer_step()
        engine.reset_grad()
        assert fused[outputs[0]] == loss
        params, m0, m1 = (fused[f"odt.{v}.updated"] for v in ("parameters", "momentum0", "momentum1"))
        np.testing.assert_array_equal(params, engine.get_flat())
    assert not any(o.endswith("_grad") for o in outputs)  # the gradients stay inside


def test_the_browsers_graphs_read_the_frozen_arrays_from_parameters_bin_and_compute_the_same(tmp_path):
    """A LoRA bundle over an int8 base: the browser's copies of the training and step graphs hold no frozen
    input; each frozen array (int8 rows, float32 scales and norms) is an initializer stored at its place in
    parameters.bin, read once when the session opens. ORT computes from them exactly what the plain graphs
    compute from the same arrays fed as inputs, and the ORT-format copies stay the plain ones."""
    import onnx
    import onnxruntime as ort
    import torch

    from artifacts import AdamW, Lora, generate
    from artifacts.losses import loss_from_name
    from tests.artifacts.test_decoders import FAMILIES, CausalLM, _example, _without_dropout

    torch.manual_seed(0)
    model = CausalLM(_without_dropout(FAMILIES["llama"]()), mask=True)
    manifest = generate(model, _example(), tmp_path / "llama", loss=loss_from_name("model"), lora=Lora(4),
                        optimizer=AdamW(), base="int8", verify=False)  # fmt: skip
    assert manifest.frozen_file is not None
    bundle = tmp_path / "bundle"
    description = make_bundle(tmp_path / "llama", bundle)
    layout = description["portable"]
    stored = np.fromfile(bundle / "parameters.bin", np.uint8)
    frozen = {t["name"]: np.frombuffer(stored, t["dtype"], int(np.prod(t["shape"])), t["byte_offset"])
              .reshape(t["shape"]) for t in layout["frozen"]}  # fmt: skip
    assert {a.dtype.name for a in frozen.values()} == {"int8", "float32"}
    weights = stored[: 4 * description["weights"]["size"]].view("<f4")
    feeds = {name: np.asarray(value) for name, value in _example(seed=3).items()}
    feeds.update({t["name"]: weights[t["offset"] : t["offset"] + int(np.prod(t["shape"]))].reshape(t["shape"])
                  for t in description["weights"]["tensors"]})  # fmt: skip
    size = description["weights"]["size"]
    rates = {"odt.lr": 1e-3, "odt.lr_corrected": 1e-3, "odt.lr_decay": 0.0}
    feeds.update({name: np.array(rate, np.float32) for name, rate in rates.items()})
    feeds.update({"odt.momentum0": np.full(size, 0.1, np.float32), "odt.momentum1": np.full(size, 0.2, np.float32)})
    options = ort.SessionOptions()
    options.log_severity_level = 3
    assert set(layout["browser"]) == {"training", "step"}
    for kind, name in layout["browser"].items():
        graph = onnx.load(bundle / name, load_external_data=False).graph
        assert not {i.name for i in graph.input} & set(frozen)
        places = {t.name: {e.key: e.value for e in t.external_data} for t in graph.initializer if t.name in frozen}
        assert set(places) == set(frozen)
        assert {p["location"] for p in places.values()} == {"parameters.bin"}
        outputs = []
        for path, given in ((bundle / layout[kind], {**feeds, **frozen}), (bundle / name, feeds)):
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            wanted = {i.name for i in session.get_inputs()}
            assert wanted <= set(given)
            outputs.append(session.run(None, {k: v for k, v in given.items() if k in wanted}))
        assert len(outputs[0]) == len(outputs[1])
        for plain, web in zip(*outputs):
            np.testing.assert_array_equal(plain, web)
        assert description["files"][name]["sha256"] and not (bundle / name.replace(".onnx", ".ort")).exists()


STOCK_LOADS = r"""
import json, math, sys
import numpy as np
import onnxruntime as ort
bundle, feeds = sys.argv[1], dict(np.load(sys.argv[2]))
d = json.load(open(f"{bundle}/bundle.json"))
stored = np.fromfile(f"{bundle}/parameters.bin", np.uint8)
weights = stored[: 4 * d["weights"]["size"]].view("<f4")
for t in d["weights"]["tensors"]:
    feeds[t["name"]] = weights[t["offset"] : t["offset"] + math.prod(t["shape"])].reshape(t["shape"])
for t in d["portable"]["frozen"]:
    feeds[t["name"]] = np.frombuffer(stored, t["dtype"], math.prod(t["shape"]), t["byte_offset"]).reshape(t["shape"])
options = ort.SessionOptions()
options.log_severity_level = 3
loaded = {}
for name in ("training_model.portable.ort", "step_model.portable.ort", "eval_model.ort", "eval_model.onnx"):
    session = ort.InferenceSession(f"{bundle}/{name}", options, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    loaded[name] = float(session.run(None, {k: v for k, v in feeds.items() if k in wanted})[0]) if "eval" in name else 0
print(json.dumps({"version": ort.__version__, "eval_losses": loaded}))
"""


@pytest.mark.classic
def test_a_causal_lms_bundle_loads_in_stock_onnxruntime_in_ort_format(tmp_path, stock_python):
    """A token loss with ignore_index stays an ONNX SoftmaxCrossEntropyLoss after the cross-entropy rewrite: the
    training build has a kernel for it, stock ORT runs the ONNX function it is defined by, inlined when it loads
    an ONNX file but not an ORT-format one (the bundle's .ort graphs, converted with the training build, were
    refused by stock ORT). No graph a current runtime loads holds the node now, and the newest stock onnxruntime
    opens the ORT-format training, step and eval graphs of a small Llama's bundle; its eval loss from the .ort
    graph equals the .onnx graph's and the Python trainer's."""
    import subprocess

    import onnx
    import torch

    from artifacts import AdamW, Lora, generate
    from artifacts.losses import loss_from_name
    from tests.artifacts.test_decoders import FAMILIES, CausalLM, _example, _without_dropout

    torch.manual_seed(0)
    model = CausalLM(_without_dropout(FAMILIES["llama"]()), mask=True)
    manifest = generate(model, _example(), tmp_path / "llama", loss=loss_from_name("model"), lora=Lora(4),
                        optimizer=AdamW(lr=1e-2), verify=False)  # fmt: skip
    make_bundle(tmp_path / "llama", tmp_path / "bundle")
    for name in ("training_model.portable.onnx", "step_model.portable.onnx", "eval_model.onnx"):
        graph = onnx.load(tmp_path / "bundle" / name, load_external_data=False)
        assert "SoftmaxCrossEntropyLoss" not in {n.op_type for n in graph.graph.node}, name
    batch = {name: value.numpy() for name, value in _example(seed=3).items() if name in manifest.feed_names}
    np.savez(tmp_path / "batch.npz", **batch)
    run = subprocess.run([*stock_python, "-c", STOCK_LOADS, str(tmp_path / "bundle"), str(tmp_path / "batch.npz")],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    stock = json.loads(run.stdout)
    assert stock["version"] != "1.19.2"
    python = Trainer.load(tmp_path / "bundle", engine="classic").eval_step(batch)
    assert stock["eval_losses"]["eval_model.ort"] == stock["eval_losses"]["eval_model.onnx"]
    np.testing.assert_allclose(stock["eval_losses"]["eval_model.ort"], python.loss, rtol=1e-6)
