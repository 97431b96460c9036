"""`--base int8` and `--base float16`: frozen matrices stored as int8 rows with a scale per row, or as
float16, widened in the step graphs.

The reference is a float32 twin: the same model with each of those matrices replaced by its widened
values. The narrow artifacts must train, evaluate and export exactly as the twin does, on both
engines, while ``frozen.bin`` holds a quarter (int8) or a half (float16) of the bytes.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers
from onnx import helper, numpy_helper
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from artifacts import InputSpecError, generate
from artifacts.from_onnx import generate_from_onnx
from artifacts.narrow_base import NARROW, dequantize_rows, quantize_rows
from mobile_bridge import BundleError, make_bundle
from ondevice import Manifest, Predictor, Trainer, frozen
from ondevice.cli import main
from ondevice.frozen import BLOCK_VALUES, SCALE_SUFFIX, narrow_matrices
from ondevice.inspect import summarize
from ondevice.widen import widen_in_graph
from tests.artifacts.test_causal_lm import PAIRS, WORDS
from tests.artifacts.test_lora import HEAD, LORA, Classifier, _data, _example

BASES = ("int8", "float16")


def _widened(matrix: np.ndarray, base: str) -> np.ndarray:
    """What the graphs compute with for ``matrix`` stored in ``base``."""
    if base == "int8":
        return dequantize_rows(*quantize_rows(matrix))
    return matrix.astype(np.float16).astype(np.float32)


def test_rows_quantize_within_half_a_step_and_a_zero_row_stays_zero():
    rng = np.random.default_rng(0)
    matrix = rng.normal(size=(6, 40)).astype(np.float32) * np.array([[1e-3], [1], [30], [0], [5], [1e4]], np.float32)
    q, scale = quantize_rows(matrix)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and np.abs(q).max() == 127
    error = np.abs(dequantize_rows(q, scale) - matrix)
    assert (error <= scale[:, None] * 0.5001).all()
    assert scale[3] == 1 and not q[3].any()


def _product_graph(op: str, x_shape: tuple[int, ...], **attributes) -> onnx.ModelProto:
    x_type = onnx.TensorProto.INT64 if op == "Gather" else onnx.TensorProto.FLOAT
    inputs = ["W", "x"] if op == "Gather" else ["x", "W"]
    node = helper.make_node(op, inputs, ["y"], name="product", **attributes)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.mark.parametrize(
    "op, x_shape, attributes",
    [
        ("Gemm", (5, 24), {"transB": 1}),  # forward: y = x W^T, blocks give column blocks
        ("Gemm", (5, 40), {"transB": 0, "alpha": 0.5}),  # backward: y = x W, blocks give partial sums
        ("MatMul", (2, 5, 40), {}),
        ("Gather", (3, 4), {"axis": 0}),  # a lookup widens only its rows
    ],
)
@pytest.mark.parametrize("block", [BLOCK_VALUES, 24])
@pytest.mark.parametrize("base", BASES)
def test_widened_reads_compute_what_the_widened_float_matrix_computes(op, x_shape, attributes, block, base, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    monkeypatch.setattr(frozen, "BLOCK_VALUES", block)  # 24 values: blocks of one row (the matrix is over 4 x 24)
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(40, 24)).astype(np.float32)
    q, scale = quantize_rows(weight) if base == "int8" else (weight.astype(np.float16), None)
    blocks = frozen.row_blocks(q.shape)
    assert len(blocks) == (1 if block == BLOCK_VALUES else 40)
    feed = rng.integers(0, 40, x_shape) if op == "Gather" else rng.normal(size=x_shape).astype(np.float32)
    twin = _product_graph(op, x_shape, **attributes)
    twin.graph.initializer.append(numpy_helper.from_array(_widened(weight, base), "W"))
    model = _product_graph(op, x_shape, **attributes)
    stored = {"W": q, **({f"W{SCALE_SUFFIX}": scale} if base == "int8" else {}),
              **{frozen.block_name("W", a): q[a:b] for a, b in blocks}}  # fmt: skip
    model.graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in stored.items())
    assert widen_in_graph(model, {"W": weight.shape}, half={"W"} if base == "float16" else ()) == 1
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    expected = ort.InferenceSession(twin.SerializeToString()).run(None, {"x": feed})[0]
    found = ort.InferenceSession(model.SerializeToString(), options).run(None, {"x": feed})[0]
    if block < weight.size and op == "Gemm" and not attributes["transB"]:
        np.testing.assert_allclose(found, expected, rtol=1e-6, atol=1e-6)  # partial sums: another order
    else:
        np.testing.assert_array_equal(found, expected)
    # ORT folded nothing into a copy of the matrix (float32, int8 or float16) when the session loaded
    optimized = onnx.load(tmp_path / "optimized.onnx")
    given = {"W", *(frozen.block_name("W", a) for a, _ in blocks)}
    copies = [i.name for i in optimized.graph.initializer if len(i.dims) == 2 and i.name not in given]
    assert not copies, copies
    # nor the activation's slices into one Split, which copies the whole activation at once (SmolLM2's LM head
    # backward: 12 MiB of its step's peak)
    assert "Split" not in {n.op_type for n in optimized.graph.node}


@pytest.fixture(scope="module", params=BASES)
def pair(request, tmp_path_factory):
    """(narrow artifacts, float32 twin artifacts) of a small BERT with LoRA on query/value and a head."""
    base = request.param
    root = tmp_path_factory.mktemp(base)
    torch.manual_seed(0)
    model = Classifier()
    narrow = generate(model, _example(), root / base, lora=LORA, trainable=HEAD, base=base)
    twin = copy.deepcopy(model)
    state = twin.state_dict()
    with torch.no_grad():
        for name in narrow_matrices(narrow):
            state[name].copy_(torch.from_numpy(_widened(state[name].numpy(), base)))
    generate(twin, _example(), root / "twin", lora=LORA, trainable=HEAD)
    return root / base, root / "twin"


def test_a_narrow_base_stores_a_quarter_or_a_half_and_verifies_against_the_widened_model(pair):
    narrow, twin = (Manifest.load(p) for p in pair)
    base = pair[0].name
    assert narrow.verification.passed
    stored_narrow = narrow_matrices(narrow)
    matrices = {p.name for p in narrow.frozen if len(p.shape) == 2}
    assert stored_narrow == matrices == set(narrow.frozen_file[base])  # read by products and lookups only
    assert "model.bert.embeddings.word_embeddings.weight" in narrow.frozen_file["lookups"]
    size = sum(p.size for p in narrow.frozen if p.name in stored_narrow)
    counted = [summarize(p)["parameters"][f"frozen_{base}"] for p in pair]
    assert counted == [size, 0]
    stored, float_stored = ((d / "frozen.bin").stat().st_size for d in pair)
    saved = 4 - NARROW[base].itemsize
    assert stored <= float_stored - saved * size + 4 * 64 * len(stored_narrow)  # scales and padding aside
    trainer, reference = Trainer.load(pair[0]), Trainer.load(pair[1])
    for name in stored_narrow:
        np.testing.assert_array_equal(trainer.parameter(name), reference.parameter(name))


@pytest.mark.parametrize("engine", [pytest.param("classic", marks=pytest.mark.classic), "portable"])
def test_it_trains_and_exports_as_its_widened_float_twin(pair, engine, tmp_path):
    data = _data()
    trainers = [Trainer.load(d, engine=engine) for d in pair]
    batches = [{k: v[i : i + 8] for k, v in data.items()} for i in range(0, 32, 8)]
    losses = [[t.train_step(batch).loss for batch in batches] for t in trainers]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    for a, b in zip(*(t.get_weights().values() for t in trainers)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    paths = [t.export(tmp_path / f"{i}.onnx") for i, t in enumerate(trainers)]
    stored = [{i.name: i for i in onnx.load(p).graph.initializer} for p in paths]
    base = pair[0].name
    for name in narrow_matrices(Manifest.load(pair[0])):  # the file keeps the narrow base (adapters stay unfolded)
        assert stored[0][name].data_type == helper.np_dtype_to_tensor_dtype(NARROW[base])
        assert 4 * len(stored[0][name].raw_data) == NARROW[base].itemsize * len(stored[1][name].raw_data)
    feeds = {"ids": data["ids"][:8], "mask": data["mask"][:8]}
    outputs = [Predictor(p).predict(feeds) for p in paths]
    assert outputs[0].keys() == outputs[1].keys()
    for name, value in outputs[0].items():
        np.testing.assert_allclose(value, outputs[1][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base", BASES)
def test_a_narrow_base_is_refused_where_it_cannot_go(base, tmp_path):
    with pytest.raises(InputSpecError, match="ort_format"):
        generate(Classifier(), _example(), tmp_path / "ort", lora=LORA, base=base, ort_format=True)
    with pytest.raises(InputSpecError, match="float32, float16, int8"):
        generate(Classifier(), _example(), tmp_path / "half", lora=LORA, base="bfloat16")
    with pytest.raises(InputSpecError, match="built for PyTorch models"):
        generate_from_onnx(tmp_path / "model.onnx", tmp_path / "from-onnx", base=base)


@pytest.mark.parametrize("pair", ["float16"], indirect=True)
def test_a_float16_base_is_refused_by_a_bundle_and_nothing_is_written(pair, tmp_path):
    with pytest.raises(BundleError, match=r"float16 .* cannot load float16 tensors from a checkpoint.*--base int8"):
        make_bundle(pair[0], tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("base", ["int8"])
@pytest.mark.classic
def test_a_narrow_base_travels_in_a_bundle_as_stored_and_trains_as_the_artifacts(base, monkeypatch, tmp_path):
    """Blocks of 4 rows (every 32-column matrix over 4 x 128 values is multiplied in 8 blocks): parameters.bin holds
    each array the portable graph reads as the artifacts store it (int8 matrices and float32 scales, or float16
    matrices, row blocks as views of their matrix's bytes, so no byte twice), and the bundle trains on both
    engines as the artifacts do, its checkpoint carrying the same arrays for the training builds."""
    monkeypatch.setattr(frozen, "BLOCK_VALUES", 128)
    torch.manual_seed(0)
    manifest = generate(Classifier(), _example(), tmp_path / base, lora=LORA, trainable=HEAD, base=base,
                        verify=False)  # fmt: skip
    description = make_bundle(tmp_path / base, tmp_path / "bundle")
    stored = frozen.stored_arrays(np.fromfile(tmp_path / base / "frozen.bin", np.uint8), manifest)
    bundled = np.fromfile(tmp_path / "bundle" / "parameters.bin", np.uint8)
    entries = description["portable"]["frozen"]
    blocks = [t for t in entries if "::rows" in t["name"]]
    assert len(blocks) >= 8 and {t["dtype"] for t in entries} == {base, "float32"}
    for t in entries:
        array = np.frombuffer(bundled, t["dtype"], int(np.prod(t["shape"])), t["byte_offset"]).reshape(t["shape"])
        np.testing.assert_array_equal(array, stored[t["name"]], err_msg=t["name"])
    frozen_bytes = (tmp_path / base / "frozen.bin").stat().st_size
    assert bundled.size <= 4 * manifest.trainable_size + frozen_bytes + 4 * sum(p.size for p in manifest.frozen
                                                                                 if p.name not in stored)  # fmt: skip
    data = _data()
    batches = [{k: v[i : i + 8] for k, v in data.items()} for i in range(0, 32, 8)]
    for engine in ("classic", "portable"):
        trainers = [Trainer.load(tmp_path / d, engine=engine) for d in (base, "bundle")]
        losses = [[t.train_step(batch).loss for batch in batches] for t in trainers]
        assert losses[0] == losses[1], engine
        for name in narrow_matrices(manifest):  # the bundle's checkpoint: the stored arrays, widened alike
            np.testing.assert_array_equal(trainers[1].parameter(name), trainers[0].parameter(name))


@pytest.mark.parametrize(
    "pair, change, message",
    [
        ("int8", lambda f, name: f["int8"].__setitem__(name, f["int8"][name] + 1),
         r"frozen_file.int8\[.*the scales follow"),
        ("int8", lambda f, name: f["int8"].__setitem__("no.such.matrix", 0), r"frozen_file.int8.*in frozen_file"),
        ("int8", lambda f, name: f.__setitem__("block_values", 0), r"frozen_file"),
        ("float16", lambda f, name: f["float16"].append("no.such.matrix"), r"frozen_file.float16.*tensors in frozen"),
        ("float16", lambda f, name: f["float16"].remove(name), r"the tensors tile the file in order"),
    ],
    indirect=["pair"],
)  # fmt: skip
def test_a_narrow_layout_that_does_not_tile_is_refused(pair, change, message, tmp_path):
    import json
    import shutil

    from ondevice.errors import ManifestError

    copy = tmp_path / "copy"
    shutil.copytree(pair[0], copy)
    data = json.loads((copy / "manifest.json").read_text())
    change(data["frozen_file"], next(iter(data["frozen_file"][pair[0].name])))
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=message):
        Manifest.load(copy)


@pytest.mark.parametrize("base", BASES)
def test_a_causal_lm_on_a_narrow_base_completes_prompts_as_its_widened_twin(base, tmp_path):
    """A tiny Llama with tied embeddings: the embedding is read as rows (lookup) and as the output
    layer (product); the cached decoder reads the widened weights. Same tokens as the twin."""
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(["</s>"])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=None, eos_token_id=2,
                                      tie_word_embeddings=True)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    folders = {base: tmp_path / f"hf-{base}", "twin": tmp_path / "hf-twin"}
    model.save_pretrained(folders[base])
    tokenizer.save(str(folders[base] / "tokenizer.json"))
    out = {}
    for kind in (base, "twin"):
        out[kind] = tmp_path / kind
        if kind == "twin":  # the matrices the narrow artifacts store, replaced by their widened values
            state = model.state_dict()
            with torch.no_grad():
                for name in narrow_matrices(Manifest.load(out[base])):
                    key = name.removeprefix("model.")
                    state[key].copy_(torch.from_numpy(_widened(state[key].numpy(), base)))
            model.save_pretrained(folders["twin"])
            tokenizer.save(str(folders["twin"] / "tokenizer.json"))
        how = ["--base", base] if kind == base else ["--no-verify"]  # the twin needs no proof of its own
        assert main(["generate", "--model", f"hf:{folders[kind]}", "--task", "causal-lm", "--max-length", "24",
                     "--out", str(out[kind]), *how]) == 0  # fmt: skip
    prompts = [p for p, _ in PAIRS]
    made = [Trainer.load(out[kind]).text_generator()(prompts, max_new_tokens=6) for kind in (base, "twin")]
    assert [c.tokens for c in made[0]] == [c.tokens for c in made[1]]
