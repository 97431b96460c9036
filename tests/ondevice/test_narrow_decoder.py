"""A causal LM's cached decoder on an int8 or float16 base reads the base as stored (widened a product at a
time, the tied head in row blocks, LoRA adapters as products of their own) and computes what the decoder filled
with the widened float32 weights and folded adapters computes; its export stores the narrow matrices as they are
and decodes the same tokens; streamed weights decode the same tokens too."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from ondevice import Manifest, Predictor, Trainer, frozen
from ondevice.cli import main
from ondevice.decode import decoder_model, over_plan, positions_of
from ondevice.formats import LazyWeights
from ondevice.frozen import narrow_matrices
from ondevice.manifest import Plan
from ondevice.session import ort, process_status, session_options
from tests.artifacts.test_causal_lm import PAIRS, save_tiny_lm

BASES = ("int8", "float16")


@pytest.fixture(scope="module", params=BASES)
def narrow(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    """Tiny Llama artifacts (tied embedding, LoRA r4 on q/v) on a narrow base whose embedding is stored in row
    blocks (a small block size). The tests set the adapters to random values, so that they change every product."""
    base = request.param
    folder = save_tiny_lm(tmp_path_factory.mktemp(f"hf-{base}"))
    out = tmp_path_factory.mktemp(f"lm-{base}") / "a"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(frozen, "BLOCK_VALUES", 64)  # the 27 x 32 embedding: blocks of 2 rows
        assert main(["generate", "--model", f"hf:{folder}", "--task", "causal-lm", "--max-length", "24",
                     "--lora", "4", "--base", base, "--out", str(out)]) == 0  # fmt: skip
    return out


def _randomized(directory, **options) -> Trainer:  # type: ignore[no-untyped-def]
    trainer = Trainer.load(directory, engine="portable", **options)
    weights = trainer.get_flat_weights()
    trainer.set_weights(np.random.default_rng(0).normal(0, 0.3, weights.shape).astype(np.float32))
    return trainer


def _runs(session: ort.InferenceSession, spec, weights=None) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    """Logits and cache of a left-padded prompt batch, then of one cached step."""
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int64)
    ids = np.array([[0, 0, 3, 4, 6], [3, 5, 6, 7, 11]], np.int64)
    past = [np.zeros((2, spec.kv_heads, 0, spec.head_dim), np.float32)] * (2 * spec.layers)
    feeds = {"ids": ids, "mask": mask, "positions": positions_of(mask), **dict(zip(spec.past_names(), past))}
    first = session.run(None, {**feeds, **(weights or {})})
    mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
    feeds = {"ids": np.array([[9], [12]], np.int64), "mask": mask, "positions": positions_of(mask)[:, -1:],
             **dict(zip(spec.past_names(), first[1:]))}  # fmt: skip
    return first + session.run(None, {**feeds, **(weights or {})})


def test_the_decoder_reads_the_base_as_stored_and_computes_the_widened_folded_decoder(narrow):
    trainer = _randomized(narrow)
    spec = trainer.manifest.decoder
    generator = trainer.text_generator()
    graph, weights, sources = trainer._decoder_graph()
    narrowed = narrow_matrices(trainer.manifest)
    types = {t.name: t.data_type for t in graph.graph.initializer}
    assert narrowed and all(types[n] in (onnx.TensorProto.INT8, onnx.TensorProto.FLOAT16) for n in narrowed)
    assert set(sources) >= narrowed  # fed from frozen.bin as stored, not widened copies
    assert any("::rows" in name for name in sources)  # the tied head's row blocks
    # the reference: the generator's decoder as exported, filled with widened float32 weights, adapters folded
    reference = decoder_model(onnx.load(narrow / spec.file), LazyWeights(trainer))
    folded = ort.InferenceSession(reference.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    expected = _runs(folded, spec)
    got = _runs(generator._session, spec, generator._weights)
    assert len(got) == len(expected)
    for value, want in zip(got, expected):
        np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-5)
    assert float(np.abs(expected[0]).max()) > 0.0


def test_the_export_stores_the_narrow_base_and_decodes_the_same_tokens(narrow, tmp_path):
    trainer = _randomized(narrow)
    prompts = [p for p, _ in PAIRS]
    here = trainer.text_generator()(prompts, max_new_tokens=6)
    path = trainer.export(tmp_path / "lm.onnx")
    stored = {t.name: t.data_type for t in onnx.load(path).graph.initializer}
    assert all(stored[n] != onnx.TensorProto.FLOAT for n in narrow_matrices(trainer.manifest))
    exported = Predictor(path).text_generator()(prompts, max_new_tokens=6)
    assert [c.tokens for c in exported] == [c.tokens for c in here]
    assert any(c.tokens for c in here)


def test_streamed_weights_decode_the_same_tokens(narrow):
    prompts = [p for p, _ in PAIRS]
    made = [_randomized(narrow, stream_weights=s).text_generator()(prompts, max_new_tokens=6) for s in (False, True)]
    assert [c.tokens for c in made[0]] == [c.tokens for c in made[1]]


def test_decoding_streams_the_mapped_weights_when_it_would_pass_the_plans_budget(narrow, tmp_path):
    """Over the plan's budget (this process's RSS + the mapped weights + a margin), the artifacts' and the
    exported file's mapped weights are unmapped while tokens are made; the tokens stay the same."""
    manifest = Manifest.load(narrow)
    assert not over_plan(manifest, 1 << 40)  # no plan: nothing to keep within
    roomy, tight = (dataclasses.replace(manifest, plan=Plan(budget=b, batch_size=4)) for b in (10**12, 10**6))
    assert not over_plan(roomy, 1 << 20) and over_plan(roomy, 10**12) and over_plan(tight, 0)
    before = process_status("VmRSS")
    held = np.ones(64 << 20, np.uint8)  # the rule reads the resident set now, not a figure from earlier
    assert before is not None and process_status("VmRSS") - before >= 48 << 20 and held[-1]
    del held
    trainer = _randomized(narrow)
    path = trainer.export(tmp_path / "lm.onnx")
    prompts = [p for p, _ in PAIRS]
    made = []
    for planned in (roomy, tight):
        generator = Predictor(path, planned).text_generator()
        assert generator.streamed == (planned is tight)
        made.append([c.tokens for c in generator(prompts, max_new_tokens=6)])
    assert made[0] == made[1]


def test_stock_onnxruntime_decodes_the_narrow_decoder_and_its_export_alike(narrow, stock_python, tmp_path):
    """On stock onnxruntime (the portable engine's), from the artifacts with a checkpoint and from the export."""
    import json
    import subprocess

    trainer = _randomized(narrow)
    trainer.save(tmp_path / "ck" / "latest.ckpt")
    exported = trainer.export(tmp_path / "lm.onnx")
    prompts = [p for p, _ in PAIRS]
    here = [c.text for c in trainer.text_generator()(prompts, max_new_tokens=6)]
    loads = (f"Predictor({str(exported)!r})",
             f"Trainer.load({str(narrow)!r}, checkpoint={str(tmp_path / 'ck' / 'latest.ckpt')!r})")  # fmt: skip
    for load in loads:
        script = (f"import json; from ondevice import Predictor, Trainer; made = {load}.text_generator()"
                  f"({prompts!r}, max_new_tokens=6); print(json.dumps([c.text for c in made]))")  # fmt: skip
        done = subprocess.run([*stock_python, "-c", script], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == here
    assert any(here)
