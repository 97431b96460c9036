"""`odt generate`: maps command-line options onto `artifacts.build` (torch is imported lazily)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from ondevice.schema import LOSSES, OPTIMIZERS

__all__ = ["register"]


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "generate",
        help="PyTorch model -> verified ONNX Runtime training artifacts",
        description="Export a PyTorch model, build ORT training artifacts with a manifest, and verify "
        "them against PyTorch (eval outputs, loss, gradients, one optimizer step) on every engine they carry: the "
        "portable one always (stock onnxruntime), the classic one where ONNX Runtime's training build is installed.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="FILE.py:FACTORY or package.module:FACTORY returning an nn.Module, an existing MODEL.onnx, or "
        "hf:SOURCE for a pretrained Hugging Face model (local files only): a folder, an installed weights package, "
        "or a .gguf file; an encoder with a head for --task sequence-classification, or a decoder for --task "
        "causal-lm",
    )
    p.add_argument("--weights", help="state_dict file to load into the model (default: the factory's weights)")
    p.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME:SHAPE:DTYPE",
        help="example input in forward() order, e.g. input:32x64:float32 (repeat per input; "
        "the first dimension is the batch and becomes dynamic; AXIS=SIZE makes another dimension dynamic, "
        "e.g. ids:32xseq=20:int64; required for a PyTorch model, optional for .onnx)",
    )
    p.add_argument(
        "--output-name",
        action="append",
        metavar="NAME",
        help="names of the model outputs in order (default: output, or output0, output1, ...)",
    )
    p.add_argument("--out", required=True, help="artifact directory to create")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (default: refuse)")

    g = p.add_argument_group("loss")
    g.add_argument(
        "--loss",
        default="cross_entropy",
        choices=[kind for kind in LOSSES if kind != "custom"],  # a custom loss needs Python
        help="loss on the model output (default cross_entropy; 'model': forward returns its loss)",
    )
    g.add_argument("--loss-output", help="which output the loss reads (default: the first)")
    g.add_argument("--reduction", default="mean", help="mean or sum (default mean)")
    g.add_argument("--class-weights", type=_floats, help="cross_entropy: per-class weights, comma-separated")
    g.add_argument("--ignore-index", type=int, help="cross_entropy: label value that is ignored")
    g.add_argument("--pos-weight", type=_floats, help="bce_with_logits: per-label positive weights")
    g.add_argument("--label-smoothing", type=float, default=0.0, help=argparse.SUPPRESS)

    o = p.add_argument_group("optimizer")
    o.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="default adamw")
    o.add_argument(
        "--lr",
        type=float,
        help="learning rate (default: 2e-3 for hf: models training LoRA adapters or a plan's small set, 1e-4 when "
        "their own weights train; otherwise 1e-3 for adamw, 1e-2 for sgd)",
    )
    o.add_argument("--betas", type=_floats, help="adamw betas (default 0.9,0.999)")
    o.add_argument("--eps", type=float, help="adamw epsilon (default 1e-8)")
    o.add_argument("--weight-decay", type=float, help="adamw decoupled weight decay (default 0)")
    o.add_argument("--max-grad-norm", type=float, help="clip the global gradient norm (default: no clipping)")
    o.add_argument("--momentum", type=float, help="refused: ORT's SGD has no momentum")

    t = p.add_argument_group("what trains (default: every parameter)")
    t.add_argument("--trainable", action="append", default=[], metavar="GLOB", help="train only matches (repeatable)")
    t.add_argument("--freeze", action="append", default=[], metavar="GLOB", help="freeze matches (repeatable)")
    t.add_argument("--train-last", type=int, metavar="N",
                   help="train only the last N modules with parameters the loss depends on")  # fmt: skip
    t.add_argument("--bias-only", action="store_true", help="train biases only (BitFit)")
    t.add_argument("--lora", type=int, metavar="RANK", help="add LoRA adapters of this rank (they train)")
    t.add_argument("--lora-alpha", type=float, help="LoRA scale numerator: scale = alpha / rank (default 2 x rank)")
    t.add_argument(
        "--lora-from",
        metavar="DIR",
        help="start LoRA from a PEFT adapter folder (its rank, alpha, targets and weights; e.g. from "
        "`odt export --format peft` or PeftModel.save_pretrained)",
    )
    t.add_argument(
        "--lora-targets",
        default="",
        metavar="NAMES",
        help="comma-separated Linear layer names (or globs) that get adapters (default: the architecture's "
        "query and value projections as PEFT names them: query,value for BERT-like encoders, q_proj,v_proj for "
        "Llama, Qwen, Mistral, Gemma and SmolLM, qkv_proj for Phi-3, q_lin,v_lin for DistilBERT, q,v for T5)",
    )

    t.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="let the planner pick what trains: the most trainable set whose measured training step fits SIZE "
        "(e.g. 200MB) at --batch-size; candidates: LoRA ranks 4/8/16 on --lora-targets (+ --trainable), "
        "last-N modules, biases, everything",
    )
    t.add_argument("--batch-size", type=int, default=16, help="batch size the memory plan is measured at (default 16)")
    t.add_argument("--base", choices=["float32", "float16", "int8"], default="float32",
                   help="how the frozen weights are stored: int8 keeps every frozen matrix read by products and "
                   "lookups as int8 rows with a scale per row (a quarter of the memory), float16 as float16 (a "
                   "half; widened faster by stock onnxruntime, the portable engine); either is widened just "
                   "before each product, and verification compares PyTorch with the same widened weights")  # fmt: skip
    t.add_argument("--recompute", action="store_true",
                   help="recompute each repeated layer in the backward instead of keeping its activations "
                   "(gradient checkpointing): about one layer's activations alive, for a second forward per "
                   "layer; the same values")  # fmt: skip

    x = p.add_argument_group("classes and text")
    x.add_argument("--labels", metavar="A,B,...", help="class names in output order (recorded in the manifest)")
    x.add_argument(
        "--tokenizer",
        metavar="TOKENIZER.json",
        help="a Hugging Face tokenizer.json that fills the first input (ids) and the second (attention mask), "
        "if any; it travels with the artifacts so `odt train --data FILE.jsonl` tokenizes on the device",
    )
    x.add_argument("--max-length", type=int, help="tokens per text (default: the example's sequence length; "
                   "64 for hf: models)")  # fmt: skip
    x.add_argument("--task", default="sequence-classification", choices=["sequence-classification", "causal-lm"],
                   help="what an hf: model learns (default sequence-classification: mean pooling + Linear, sized "
                   "by --labels; causal-lm: a causal language model's next-token loss on .jsonl text, no "
                   "--labels)")  # fmt: skip

    v = p.add_argument_group("export and verification")
    v.add_argument("--opset", type=int, default=17, help="ONNX opset (default 17)")
    v.add_argument("--ort-format", action="store_true", help="also write .ort models and required_operators.config")
    v.add_argument("--no-verify", action="store_true", help="skip the comparison against PyTorch")
    v.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance (default 1e-5)")
    v.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (default 1e-3)")
    v.add_argument(
        "--fd-atol",
        type=float,
        help="an .onnx model's finite-difference gradient rows: absolute tolerance (default 1e-3, widened per row "
        "by twice the difference of the estimates at two step sizes; --atol bounds the other rows)",
    )
    v.add_argument("--fd-rtol", type=float, help="relative tolerance of those rows (default 5e-2)")
    v.add_argument("--seed", type=int, default=0, help="seed of the example data (default 0)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from .progress import reporting

    with reporting(enabled=not args.json):  # stages on stderr as they happen; --json keeps the output to its JSON
        return _generate(args)


def _generate(args: argparse.Namespace) -> int:
    import torch

    from .errors import InputSpecError
    from .loading import DTYPES, load_factory, load_weights, parse_input
    from .verify import format_table

    specs = [parse_input(text) for text in args.input]
    generator = torch.Generator().manual_seed(args.seed)
    if args.model.endswith(".onnx"):
        manifest = _from_onnx(args, specs, generator)
    elif args.model.startswith("hf:"):
        manifest = _from_hf(args, specs)
    else:
        if not specs:
            raise InputSpecError("--input NAME:SHAPE:DTYPE is required for a PyTorch model (once per input).")
        if args.fd_atol is not None or args.fd_rtol is not None:
            raise InputSpecError("--fd-atol/--fd-rtol apply to .onnx models; PyTorch models are checked by autograd.")
        model = load_factory(args.model)
        if args.weights:
            load_weights(model, args.weights)
        high = _index_range(model)
        example = {spec.name: _example(shape, DTYPES[spec.dtype], high, generator) for spec, shape in specs}
        manifest = _from_torch(args, model, example, specs)
    if args.json:
        print(json.dumps(asdict(manifest), indent=2))
        return 0
    if manifest.verification is not None:
        print(format_table(manifest.verification))
    small = False
    if manifest.plan is not None:
        from .planner import format_plan, small_set

        print(format_plan(manifest.plan))
        small = small_set(manifest.plan) and getattr(args, "adapter_rate", False)
    total = manifest.trainable_size + manifest.frozen_size
    print(
        f"trainable: {manifest.trainable_size:,} of {total:,} parameters in {len(manifest.trainable)} tensors "
        f"({manifest.trainable_size * 4 / 1024:.1f} KiB)"
    )
    adapters = " (the adapter rate)" if manifest.adapters else " (the rate of a small trained set)" if small else ""
    rate = f"lr {manifest.optimizer.lr:g}{adapters}"
    print(f"optimizer: {manifest.optimizer.kind}, {rate}; odt train uses it unless --lr")
    print(f"artifacts: {args.out}")
    return 0


def _spec(args: argparse.Namespace) -> Any:
    """The flags as a generation Spec: the one place they are mapped (starting points add what they derive)."""
    from .losses import loss_from_name
    from .optimizers import optimizer_from_name
    from .spec import FD_TOLERANCES, Spec
    from .verify import Tolerances

    return Spec(
        output_names=args.output_name,
        opset=args.opset,
        loss=loss_from_name(args.loss, **_loss_options(args)),
        loss_output=args.loss_output,
        optimizer=optimizer_from_name(args.optimizer, **_optimizer_options(args)),
        trainable=args.trainable,
        freeze=args.freeze,
        train_last=args.train_last,
        bias_only=args.bias_only,
        lora=_lora(args, args.lora),
        lora_from=args.lora_from,
        memory_budget=args.memory_budget,
        batch_size=args.batch_size,
        labels=_labels(args.labels),
        ort_format=args.ort_format,
        base=args.base,
        recompute=args.recompute,
        verify=not args.no_verify,
        tolerances=Tolerances(atol=args.atol, rtol=args.rtol),
        fd_tolerances=Tolerances(FD_TOLERANCES.atol if args.fd_atol is None else args.fd_atol,
                                 FD_TOLERANCES.rtol if args.fd_rtol is None else args.fd_rtol),
        seed=args.seed,
    )  # fmt: skip


def _labels(text: str | None) -> tuple[str, ...]:
    return () if not text else tuple(label.strip() for label in text.split(","))


def _from_onnx(args: argparse.Namespace, specs: list[Any], generator: Any) -> Any:
    from .errors import InputSpecError
    from .from_onnx import generate_from_onnx
    from .loading import DTYPES

    torch_only = [args.weights, args.output_name, args.opset != 17, args.lora is not None, args.tokenizer,
                  args.lora_from, args.memory_budget]  # fmt: skip
    if any(torch_only):
        raise InputSpecError(
            "--weights, --output-name, --opset, --lora, --lora-from, --tokenizer and --memory-budget apply to "
            "PyTorch models, not to an .onnx file."
        )
    example = {spec.name: _example(shape, DTYPES[spec.dtype], 2, generator) for spec, shape in specs} or None
    return generate_from_onnx(args.model, args.out, example_inputs=example, spec=_spec(args), force=args.force)


def _lora(args: argparse.Namespace, rank: int | None) -> Any:
    from .lora import Lora

    if rank is None and args.memory_budget is None:
        return None
    rank = rank if rank is not None else 8
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * rank
    return Lora(rank=rank, alpha=alpha, targets=targets)


HF_LORA_LR = 2e-3
"""AdamW's default rate for a pretrained model with LoRA adapters (the intents sample's; with a cosine
schedule it reached 0.9826 on unseen homes after 2 epochs, benchmarks/results/finetune.md)."""
HF_FINETUNE_LR = 1e-4
"""... and for fine-tuning its own weights (full fine-tuning's 0.9875 in the same benchmark)."""


def _from_hf(args: argparse.Namespace, specs: list[Any]) -> Any:
    """A pretrained encoder + head by name; without a choice of what trains, LoRA r8 + the head (the
    intents sample's proven setting: a phone-sized step)."""
    from .build import generate
    from .errors import InputSpecError
    from .hf import hf_model
    from .progress import stage

    if specs or args.tokenizer or args.weights or args.fd_atol is not None or args.fd_rtol is not None:
        raise InputSpecError("an hf: model brings its inputs (ids, mask) and tokenizer: drop --input, --tokenizer, "
                             "--weights and --fd-atol/--fd-rtol.")  # fmt: skip
    labels = list(_labels(args.labels))
    with stage(f"loading {args.model}"):
        model = hf_model(args.model[3:], labels=labels, task=args.task, max_length=args.max_length or 64,
                         seed=args.seed)  # fmt: skip
    chosen = args.lora is not None or args.lora_from or args.trainable or args.freeze or args.train_last or \
        args.bias_only or args.memory_budget  # fmt: skip
    adapter_lr = None
    if args.lr is None and args.optimizer == "adamw":  # the rates the intents sample and its benchmark proved
        adapters = args.lora is not None or args.lora_from or not chosen
        args.lr = HF_LORA_LR if adapters else HF_FINETUNE_LR
        adapter_lr = HF_LORA_LR  # a memory plan that picks LoRA (or a small set) trains at the adapter rate
        args.adapter_rate = True
    causal = args.task == "causal-lm"
    head = () if causal else ("head",)  # a causal LM's output layer is its own (often tied to its embeddings)
    trainable = head if not chosen or (args.memory_budget and not args.trainable) else args.trainable
    spec = _spec(args).but(
        adapter_lr=adapter_lr,
        dynamic_axes=model.dynamic_axes,
        lora=_lora(args, args.lora if chosen else 8),
        trainable=trainable,  # the new head always trains (under a memory budget: beside LoRA)
        tokenizer=model.tokenizer,
    )
    if causal:  # the model's own next-token loss (shifted, prompt and padding not counted)
        from .losses import loss_from_name

        spec = spec.but(loss=loss_from_name("model"))
    return generate(model.model, model.example, args.out, spec=spec, force=args.force)


def _from_torch(args: argparse.Namespace, model: Any, example: dict[str, Any], specs: list[Any]) -> Any:
    from .build import generate
    from .loading import dynamic_axes_of

    axes = dynamic_axes_of([spec for spec, _ in specs])
    spec = _spec(args).but(dynamic_axes=axes, tokenizer=_tokenizer(args, example))
    return generate(model, example, args.out, spec=spec, force=args.force)


def _tokenizer(args: argparse.Namespace, example: dict[str, Any]) -> Any:
    from ondevice.manifest import TokenizerSpec

    from .errors import InputSpecError

    if args.tokenizer is None:
        if args.max_length is not None:
            raise InputSpecError("--max-length applies with --tokenizer.")
        return None
    names = list(example)
    if example[names[0]].is_floating_point() or example[names[0]].dim() != 2:
        raise InputSpecError(
            f"--tokenizer fills the first input with token ids (batch x seq integers); {names[0]!r} is not."
        )
    mask = names[1] if len(names) > 1 and not example[names[1]].is_floating_point() else None
    length = args.max_length if args.max_length is not None else int(example[names[0]].shape[1])
    if length < 1:
        raise InputSpecError(f"--max-length must be at least 1, got {length}.")
    return TokenizerSpec(args.tokenizer, names[0], mask, length)


def _index_range(model: Any) -> int:
    """Integer example inputs index embeddings: stay below the smallest vocabulary (else 2)."""
    from torch import nn

    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return min(sizes) if sizes else 2


def _example(shape: tuple[int, ...], dtype: Any, high: int, generator: Any) -> Any:
    import torch

    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(0, high, shape, generator=generator).to(dtype)


def _loss_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if args.loss != "model":
        options["reduction"] = args.reduction
    if args.class_weights is not None:
        options["weight"] = args.class_weights
    if args.ignore_index is not None:
        options["ignore_index"] = args.ignore_index
    if args.pos_weight is not None:
        options["pos_weight"] = args.pos_weight
    if args.label_smoothing:
        options["label_smoothing"] = args.label_smoothing
    return options


def _optimizer_options(args: argparse.Namespace) -> dict[str, Any]:
    given = {
        "lr": args.lr,
        "betas": args.betas,
        "eps": args.eps,
        "weight_decay": args.weight_decay,
        "max_grad_norm": args.max_grad_norm,
        "momentum": args.momentum,
    }
    return {k: v for k, v in given.items() if v is not None}
