"""A causal language model's inference graph with a key/value cache, exported and proved against PyTorch.

The training graphs see a whole text at once. Generating text a token at a time needs the keys and
values of the tokens before, so the generator also exports the model's own cached forward (the
``transformers`` cache, filled from graph inputs) as ``decoder.onnx``; ``odt export`` writes it with
the trained weights and ``odt predict --prompt`` decodes with it on any ONNX Runtime.
"""

from __future__ import annotations

import io
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from ondevice.decode import positions_of
from ondevice.manifest import DecoderSpec, VerificationRow
from ondevice.session import ort, session_options

from .errors import ExportError
from .export import _gqa_as_repeated_heads, dropout_to_inference
from .gradients.builder import without_parameters
from .verify import Tolerances, compare

__all__ = ["DECODER_FILE", "Decoder", "causal_lm", "export_decoder"]

DECODER_FILE = "decoder.onnx"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decoder:
    """The cached graph without the weights the artifacts hold (``weights``), what the runtime must
    know of it, and its proof."""

    graph: onnx.ModelProto
    spec: DecoderSpec
    rows: tuple[VerificationRow, ...]
    weights: frozenset[str]


def causal_lm(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(prefix, module)`` of the ``transformers`` causal LM that is ``model`` or one of its direct
    children (``hf.CausalLM`` wraps one as ``model``), or None."""
    for prefix, module in (("", model), *((f"{name}.", child) for name, child in model.named_children())):
        config = getattr(module, "config", None)
        can_generate = getattr(module, "can_generate", None)
        if config is not None and callable(can_generate) and can_generate() and not config.is_encoder_decoder:
            return prefix, module
    return None


class _Cached(nn.Module):
    """``(ids, mask, positions, *past) -> (last logits, *present)``: the model's own forward with its
    cache filled from the inputs, so the graph holds exactly the model's maths."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *past: torch.Tensor):  # type: ignore[no-untyped-def]
        from transformers import DynamicCache

        cache = DynamicCache(config=self.lm.config)
        for layer in range(len(past) // 2):
            cache.update(past[2 * layer], past[2 * layer + 1], layer)
        out = self.lm(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits[:, -1], *present)


def export_decoder(model: nn.Module, opset: int, tolerances: Tolerances = Tolerances()) -> Decoder | None:
    """The cached decoder of the causal LM in ``model`` (None when there is none, or, with a warning,
    when it does not export), its initializers named as in ``model``'s ``state_dict``, proved against
    PyTorch: a left-padded prompt batch, then cached steps, each compared with the model's own forward
    (the last also with the uncached one). The rows join the artifacts' verification."""
    found = causal_lm(model)
    if found is None:
        return None
    prefix, lm = found
    was_training = lm.training
    lm.eval()
    try:
        # In eval mode, the wrapper too: the export restores the wrapper's mode when it ends, and a new module is in
        # training mode, which would switch the model's dropouts back on under the proof's PyTorch reference.
        return _export(_Cached(lm).eval(), prefix, opset, tolerances)
    except ExportError as exc:  # the artifacts still train; only text generation is missing
        log.warning("no cached decoder (odt predict --prompt will not work on these artifacts): %s", exc)
        return None
    finally:
        lm.train(was_training)


def _export(cached: _Cached, prefix: str, opset: int, tolerances: Tolerances) -> Decoder:
    vocab = int(cached.lm.get_input_embeddings().num_embeddings)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (2, 5), generator=generator)
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[1, :2] = 0  # a left-padded row: the traced graph keeps the general masked path
    with torch.no_grad():
        first = cached(prompt, mask, torch.from_numpy(positions_of(mask.numpy())))
    spec = _spec(cached.lm, first[1])
    names = ["ids", "mask", "positions", *spec.past_names()]
    outputs = ["logits", *spec.present_names()]
    axes: dict[str, dict[int, str]] = {"ids": {0: "batch", 1: "new"}, "mask": {0: "batch", 1: "total"},
                                       "positions": {0: "batch", 1: "new"}, "logits": {0: "batch"}}  # fmt: skip
    axes.update({name: {0: "batch", 2: "past"} for name in spec.past_names()})
    axes.update({name: {0: "batch", 2: "total"} for name in spec.present_names()})
    longer = torch.cat([mask, torch.ones(2, 3, dtype=torch.int64)], 1)
    example = (prompt[:, :3], longer, torch.from_numpy(positions_of(longer.numpy())[:, 5:]), *first[1:])
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings(), _gqa_as_repeated_heads(), torch.no_grad():
            warnings.simplefilter("ignore")
            # Training mode keeps one initializer per parameter (eval mode merges equal ones: all-ones norms).
            torch.onnx.export(cached, example, buffer, input_names=names, output_names=outputs, dynamic_axes=axes,
                              opset_version=opset, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                              dynamo=False)  # fmt: skip
    except Exception as exc:
        raise ExportError(f"the cached decoder did not export: {type(exc).__name__}: {exc}") from exc
    graph = onnx.ModelProto()
    with buffer.getbuffer() as view:  # parsed from the buffer's own bytes, not a copy of them
        graph.ParseFromString(view)
    del buffer
    _rename(graph, "lm.", prefix)
    dropout_to_inference(graph)  # exported in training mode: every Dropout becomes the identity it is at inference
    state = {prefix + name: value for name, value in cached.lm.state_dict().items() if value.is_floating_point()}
    weights = set(state) & {initializer.name for initializer in graph.graph.initializer}
    graph = without_weights(graph, weights)
    rows = _prove(graph, {name: state[name].detach().numpy() for name in weights}, cached, spec, vocab, tolerances)
    return Decoder(graph, spec, rows, frozenset(weights))


def _spec(lm: nn.Module, first_key: torch.Tensor) -> DecoderSpec:
    config = lm.config
    eos: list[int] = []
    for source in (config, getattr(lm, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(token, int) and token not in eos:
                eos.append(token)
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    heads = int(getattr(config, "num_attention_heads", first_key.shape[1]))
    if implementation == "sdpa" and first_key.shape[1] != heads:
        implementation = "sdpa-repeated-kv"
    return DecoderSpec(
        file=DECODER_FILE,
        layers=int(config.num_hidden_layers),
        kv_heads=int(first_key.shape[1]),
        head_dim=int(first_key.shape[3]),
        eos=tuple(eos),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 1 << 20),
        attention=implementation if implementation in ("sdpa", "sdpa-repeated-kv") else "eager",
    )


def _rename(graph: onnx.ModelProto, old: str, new: str) -> None:
    """Initializers ``old``+rest become ``new``+rest, where the node inputs read them too."""
    renamed = {}
    for initializer in graph.graph.initializer:
        if initializer.name.startswith(old):
            renamed[initializer.name] = new + initializer.name[len(old) :]
            initializer.name = renamed[initializer.name]
    for node in graph.graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]


def _prove(graph: onnx.ModelProto, weights: dict[str, np.ndarray], cached: _Cached, spec: DecoderSpec, vocab: int,
           tol: Tolerances):  # type: ignore[no-untyped-def]  # fmt: skip
    """The decoder (its weights' data removed) against PyTorch, the weights fed as inputs from the model's own
    tensors: no second copy of them in ONNX Runtime (SmolLM2's generation peaked at 4.2 GB creating this
    session from the full graph)."""
    light, declared = without_parameters(graph, sorted(weights))
    light.graph.input.extend(declared)
    session = ort.InferenceSession(light.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 7), generator=generator)
    mask = torch.ones(2, 4, dtype=torch.int64)
    mask[0, :2] = 0
    past: list[Any] = [np.zeros((2, spec.kv_heads, 0, spec.head_dim), np.float32)] * (2 * spec.layers)
    rows, done = [], 0
    for step, new in enumerate((ids[:, :4], ids[:, 4:5], ids[:, 5:6], ids[:, 6:7])):
        if step:
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.int64)], 1)
        positions = positions_of(mask.numpy())[:, done : done + new.shape[1]]
        feeds = {"ids": new.numpy(), "mask": mask.numpy(), "positions": positions, **dict(zip(spec.past_names(), past))}
        result = session.run(None, {**feeds, **weights})
        with torch.no_grad():
            reference = cached(new, mask, torch.from_numpy(positions), *(torch.from_numpy(p) for p in past))
        item = "decoder: prompt logits" if step == 0 else f"decoder: cached step {step} logits"
        rows.append(_compare_logits(item, result[0], reference[0].numpy(), tol))
        past, done = result[1:], done + new.shape[1]
    with torch.no_grad():  # the cache changes nothing: the last step equals one uncached pass over the text
        whole = cached.lm(input_ids=ids, attention_mask=mask, position_ids=torch.from_numpy(positions_of(mask.numpy())))
    rows.append(_compare_logits("decoder: cached = uncached", result[0], whole.logits[:, -1].numpy(), tol))
    return tuple(rows)


LOGIT_ATOL = 1e-4
"""Logits are compared with an absolute tolerance of this fraction of their largest magnitude (at
least the spec's atol): float32 sums through 30 layers and a 49,152-word vocabulary differ by up to
3e-4 between ONNX Runtime and PyTorch where SmolLM2's logits reach about 30 (measured)."""


def _compare_logits(item: str, ort_logits: np.ndarray, reference: np.ndarray, tol: Tolerances) -> VerificationRow:
    scale = float(np.abs(reference).max()) if reference.size else 0.0
    return compare(item, ort_logits, reference, Tolerances(max(tol.atol, LOGIT_ATOL * scale), tol.rtol))


def without_weights(graph: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """``graph`` with the data of the initializers in ``names`` removed (their name, type and shape
    stay): the artifacts hold those weights already, and ``odt export`` puts the trained ones back."""
    for initializer in graph.graph.initializer:
        if initializer.name in names:
            initializer.ClearField("raw_data")
            for field in ("float_data", "int32_data", "int64_data", "double_data"):
                initializer.ClearField(field)
    return graph
