"""Graph rewrites, one module each, run by the pipeline in the order of :data:`REGISTRY`.

Every pass rewrites an ONNX model in place, ``run(model, context) -> result``, at one stage of
the pipeline:

- ``export``: the exported forward graph, before the trainable set is chosen;
- ``forward``: the forward graph once the trainable set is known (``context.trainable``);
- ``shaped``: the forward graph after symbolic shape inference, before ORT's generator;
- ``training``: ORT's generated training graph;
- ``variant``: a copy of the finished training graph for runtimes with faster kernels (written
  beside it only when a pass changed something; the manifest's ``variants`` names it);
- ``portable``: a copy of the finished training graph with every training-only operator lowered to
  standard ONNX, for the portable engine on stock ONNX Runtime (``artifacts/portable.py``).

Each entry says what it fixes in ONNX Runtime 1.19 (for ``portable`` passes: which operator stock
ONNX Runtime lacks), why the rewrite is exact, and which test
proves it against PyTorch; ``python -m artifacts.passes`` prints that table (the docs' page
``docs/passes.md`` holds it, and a test keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import onnx

from .activations import rewrite_activations
from .avgpool import average_pool_to_conv
from .batchnorm import expose_batchnorm_updates, reuse_batch_statistics
from .broadcast import expand_where_inputs
from .convgrad import rewrite_conv_grad
from .crossentropy import rewrite_cross_entropy
from .dropout import activate_dropout, keep_dropout_masks
from .finite import FINITE_CHECK, add_finite_check
from .gathergrad import rewrite_gather_grad
from .gelugrad import rewrite_gelu_grad
from .hardswish import rewrite_hardswish
from .linear import linear_to_gemm
from .maxpoolgrad import rewrite_max_pool_grad
from .nchwc import convs_to_nchwc
from .outputs import complete_gradient_outputs
from .padding import mask_padding_gradients, padding_rows
from .pixelshuffle import shuffle_as_depth_to_space
from .portable import lower_accumulators, lower_operators
from .recompute import recompute_layers
from .relugrad import rewrite_relu_grad
from .relupool import pool_before_relu
from .seeds import seed_lookup_gradients
from .silu import recompute_silu
from .slices import gather_to_slice
from .weightgrad import batch_weight_gradients

__all__ = ["Pass", "Context", "REGISTRY", "STAGES", "run_stage", "without", "table", "FINITE_CHECK", "padding_rows"]

STAGES = ("export", "forward", "shaped", "training", "variant", "portable")


@dataclass
class Context:
    """What passes may read, and what they returned (``results``, by pass name)."""

    trainable: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    opset: int = 17
    padding: Mapping[str, int] = field(default_factory=dict)
    """Trainable embedding weight -> its padding row."""
    live: Callable[[onnx.NodeProto], bool] = lambda node: True
    """Whether a node is on the trained path (set by the pipeline for the forward stage)."""
    recompute: bool = False
    """Whether the ``recompute`` pass runs (``Spec.recompute``)."""
    results: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    name: str
    stage: str
    run: Callable[[onnx.ModelProto, Context], Any]
    fixes: str
    exact: str
    test: str


REGISTRY: tuple[Pass, ...] = (
    Pass("gradient-outputs", "export", lambda m, c: complete_gradient_outputs(m),
         "LayerNormalization (opset >= 17) and attention Dropout are exported with one output; ORT's gradient "
         "builders read Mean/InvStdDev and the mask",
         "adds optional outputs; no value changes",
         "tests/artifacts/test_text_models.py::test_bert_family_verifies_with_everything_trainable"),
    Pass("dropout-training-mode", "export", lambda m, c: activate_dropout(m),
         "attention-probability dropout (F.scaled_dot_product_attention's dropout_p) is exported without a "
         "training_mode input, so ORT's forward never drops while its DropoutGrad scales by 1 / (1 - p): the "
         "gradient through every attention softmax was 11 % too large at p = 0.1",
         "training_mode = True: the node drops with the exported rate as PyTorch does in training; the eval "
         "graph switches every Dropout off",
         "tests/artifacts/test_dropout.py::test_every_dropout_drops_in_training_and_matches_pytorchs_masks"),
    Pass("average-pool", "export", lambda m, c: average_pool_to_conv(m),
         "the CPU AveragePoolGrad dies with SIGFPE",
         "a depthwise Conv with 1/k weights is the same average (ceil_mode 0; padding counted or absent)",
         "tests/artifacts/test_generate.py::test_cnn_with_batchnorm_dropout_and_pooling"),
    Pass("constant-gather", "export", lambda m, c: gather_to_slice(m),
         "GatherGrad (a locked scatter) took half of an encoder's step for q/k/v and x[:, 0] picks",
         "Squeeze(Slice(x, k, k + 1)) selects the same element; its gradient is a copy",
         "tests/artifacts/test_generate.py::test_constant_index_gathers_become_slices"),
    Pass("linear-gemm", "export", lambda m, c: linear_to_gemm(m),
         "nn.Linear on 3-D input exports as Transpose(W) + MatMul: the transposed copy of every weight stays "
         "alive for the backward (85 MB on MiniLM) and is recomputed each step",
         "Gemm with transB reads the same weight transposed; the Reshapes only fold leading dimensions into rows",
         "tests/artifacts/test_generate.py::test_linear_layers_become_gemm_with_pytorchs_gradients"),
    Pass("pool-before-relu", "export", lambda m, c: pool_before_relu(m),
         "ReLU and its gradient ran on every element before a 2x2 max pooling",
         "ReLU is monotonic: MaxPool(Relu(x)) == Relu(MaxPool(x)) bit for bit, gradients included",
         "tests/artifacts/test_activations.py::test_max_pooling_moves_before_relu_with_identical_values_and_gradients"),
    Pass("activations", "forward", lambda m, c: rewrite_activations(m, c.live),
         "no gradient for Elu, Selu, Celu, Softplus, HardSigmoid, HardSwish, Mish, PRelu, InstanceNorm, ...",
         "each operator rewritten as the formula it computes, with operators that have gradients",
         "tests/artifacts/test_activations.py::test_rewrite_trains_everything_and_matches_pytorch"),
    Pass("broadcast-where", "shaped", lambda m, c: expand_where_inputs(m),
         "ORT's gradient of Where hands a broadcast input the output-shaped gradient, unsummed: T5's relative "
         "position bias [1, heads, q, k] masked by a [batch, 1, q, k] mask failed in the step",
         "the broadcast input goes through Expand to the broadcast shape (the elementwise max of the padded input "
         "shapes) first: the same values, and Expand's gradient is the missing sum over the broadcast axes",
         "tests/artifacts/test_text_models.py::test_t5s_relative_position_bias_trains_through_sdpas_mask"),
    Pass("batchnorm-statistics", "shaped", lambda m, c: expose_batchnorm_updates(m, c.frozen, c.opset),
         "training does not update BatchNorm's running statistics; a training-mode BatchNorm breaks the eval graph",
         "PyTorch's momentum update computed in the training graph and returned as outputs",
         "tests/ondevice/test_trainer.py::test_batchnorm_statistics_are_updated_by_training"),
    Pass("batch-statistics", "training", lambda m, c: reuse_batch_statistics(m),
         "the running-statistics update computed each BatchNorm's batch mean and variance a second time from its "
         "input, next to ORT's single-threaded BatchNorm kernel (3.65 ms of the MobileNet-style step's 40 ms of "
         "kernels)",
         "the update reads the batch mean and 1 / sqrt(variance + epsilon) that ORT's BatchNormInternal already "
         "outputs for its gradient; the variance is 1 / inv_std^2 - epsilon, the same value rounded differently",
         "tests/ondevice/test_trainer.py::test_batchnorm_statistics_are_updated_by_training"),
    Pass("padding-rows", "training", lambda m, c: mask_padding_gradients(m, dict(c.padding)),
         "GatherGrad gives an embedding's padding_idx row the full gradient (PyTorch gives it none)",
         "the incoming gradient is zeroed where the id is the padding index, before the lookup's gradient",
         "tests/artifacts/test_text_models.py::test_padding_row_stays_like_pytorch_after_100_steps"),
    Pass("relu-grad", "training", lambda m, c: rewrite_relu_grad(m),
         "the CPU ReluGrad is a slow per-element loop",
         "Mul(dY, Cast(Greater(X, 0))) is the same values bit for bit",
         "tests/artifacts/test_activations.py::test_relu_gradient_rewrite_matches_orts_relugrad_bit_for_bit"),
    Pass("max-pool-grad", "training", lambda m, c: rewrite_max_pool_grad(m),
         "the gradient of a max pooling needs MaxPool's indices, which make the CPU kernel 19x slower (3.8 against "
         "0.2 ms on the benchmark CNN's first pooling), and MaxPoolGrad scatters by them (2.6 to 3.5 ms)",
         "for 2x2 windows with stride 2 the windows do not overlap: dY goes to the first maximum of a b / c d in "
         "row-major order (top row if max(a, b) >= max(c, d), then left if a >= b), the element the indices name, "
         "ties included: the same values routed to the same places (costs memory: CNN + BatchNorm peak RSS 101 -> "
         "137 MiB for 0.83x the step time)",
         "tests/artifacts/test_activations.py::test_max_pool_gradient_without_indices_equals_orts_and_pytorchs"),
    Pass("hardswish", "training", lambda m, c: rewrite_hardswish(m),
         "no gradient for HardSwish; written as x * Clip(x / 6 + 1/2, 0, 1), ORT keeps three intermediate "
         "tensors per activation for the backward, and its Clip gradient passes the gradient at x = -3 and 3 "
         "(-1/2 and 3/2 where PyTorch has 0 and 1)",
         "ORT's HardSwish kernel forward; the gradient is the same product rule recomputed from x with strict "
         "bounds, PyTorch's hardswish_backward up to rounding",
         "tests/artifacts/test_activations.py::test_hardswish_runs_orts_kernel_with_pytorchs_gradient"),
    Pass("gelu-grad", "training", lambda m, c: rewrite_gelu_grad(m),
         "the CPU GeluGrad and BiasGeluGrad_dX evaluate erf one element at a time: 42.05 ms (11 %) of MiniLM "
         "LoRA's profiled step at 16 x 64 tokens",
         "dY * (Phi(x) + x phi(x)) with Erf, Exp, Neg, Mul and Sum on vectorized kernels (17.6 ms in the same "
         "profile): the same formula, rounded in another order",
         "tests/artifacts/test_activations.py::test_gelu_gradient_rewrite_matches_pytorch_and_orts_kernel"),
    Pass("lookup-grad", "training", lambda m, c: rewrite_gather_grad(m),
         "the CPU GatherGrad takes one shared lock per element",
         "ScatterElements(add) into zeros sums the same rows, in index order",
         "tests/artifacts/test_text_models.py::test_lookup_gradient_sums_repeated_ids_like_pytorch_on_two_threads"),
    Pass("conv-grad", "training", lambda m, c: rewrite_conv_grad(m),
         "the CPU ConvGrad is slow: 11.6 ms for a 32 -> 16 channel 3x3 convolution's gradient at batch 32 x 28x28, "
         "where PyTorch runs the layer's forward and backward in 5.2 ms",
         "the input gradient is a Conv of dY with the flipped, channel-swapped kernel (per channel for a depthwise "
         "Conv; a ConvTranspose for strides above 1) and the bias gradient a ReduceSum of dY: the same products "
         "in another order; ConvGrad keeps the weight gradient",
         "tests/artifacts/test_convgrad.py::test_convolution_gradients_match_pytorch_without_convgrad"),
    Pass("cross-entropy", "training", lambda m, c: rewrite_cross_entropy(m),
         "the CPU SoftmaxCrossEntropyLoss and its gradient walk the scores element by element on one thread: "
         "1.3 ms of the next-word LSTM's step for 32 x 5000 scores, where PyTorch takes 0.12 ms",
         "LogSoftmax, GatherElements and a mean (or sum) give the loss; the gradient is exp(log_prob) with p - 1 "
         "scattered in at each label, times dLoss / count: ORT's kernels' formula, rounded in another order "
         "(with class weights or ignore_index, ORT's kernels stay; the eval graph gets the same loss)",
         "tests/artifacts/test_losses.py::test_cross_entropy_rewrite_keeps_orts_values_and_matches_pytorch"),
    Pass("batched-weight-grad", "training", lambda m, c: batch_weight_gradients(m),
         "a weight used at every step of an unrolled recurrence gets a Gemm per step whose inner dimension is the "
         "batch, then a Sum of as many weight-sized tensors (5.1 ms of the next-word LSTM's step)",
         "the sum of the per-step products is one product of the rows stacked: one Gemm (or ReduceSum) over "
         "the concatenated operands, the same products added in another order",
         "tests/artifacts/test_recurrent.py::test_recurrent_weight_gradients_are_one_gemm_and_match_pytorch"),
    Pass("silu-recompute", "training", lambda m, c: [] if c.recompute else recompute_silu(m),
         "the backward of a SwiGLU MLP (Llama, Qwen, Mistral, SmolLM) reads SiLU's output, kept from the forward "
         "beside SiLU's input, which its gradient keeps anyway: a tensor of the MLP's width per layer for the "
         "whole step (SmolLM2 at 64 tokens: its step's peak 368 -> 359 MiB with this pass)",
         "the backward's readers read a copy made from the same input (``input + 0 * g[0]``, so it runs in the "
         "backward): the same operator on the same values",
         "tests/artifacts/test_recompute.py::test_swiglu_activations_are_made_again_in_the_backward_bit_for_bit"),
    Pass("recompute", "training", lambda m, c: recompute_layers(m) if c.recompute else [],
         "the backward reads activations the forward kept, every layer's at once when the backward starts: an "
         "8-layer Llama at 4 x 256 tokens peaked at 609 MB (217 MB with this pass); opt-in, Spec.recompute / "
         "--recompute",
         "the nodes of each repeated layer that lead to what its backward reads are copied, and run from the "
         "layer's inputs once its output's gradient exists (``input + 0 * g[0]``): the same operators on the "
         "same values; random ones (Dropout) are not run twice, their outputs stay saved",
         "tests/artifacts/test_recompute.py::test_recomputed_layers_train_bit_for_bit_like_kept_ones"),
    Pass("finite-check", "training", lambda m, c: add_finite_check(m),
         "checking loss and gradients for NaN/Inf from Python cost a call per tensor each step",
         "adds one output, the L2 norm of loss and gradients, finite exactly when all are",
         "tests/ondevice/test_trainer.py::test_finite_check_is_the_norm_of_loss_and_accumulated_gradients"),

    Pass("nchwc-conv", "variant", lambda m, c: convs_to_nchwc(m),
         "a Conv with a trained weight runs on im2col kernels (3.17 ms for a 32 -> 64 channel 3x3 convolution "
         "at batch 64 x 14x14), a depthwise one as a tiny matrix product per channel and image (1.43 ms for 64 "
         "channels of 16x16 at batch 32); ORT uses its NCHWc kernels (1.91 and 0.17 ms) only for constant weights",
         "the filter reordered to blocks in the graph, the input and output reordered around ORT's NCHWc Conv: "
         "the same products in another order (x86 runtimes load this variant; others the plain graph). It runs on the "
         "classic and on the portable training graph alike",
         "tests/artifacts/test_nchwc.py::test_nchwc_variant_trains_like_the_portable_graph_and_pytorch"),

    Pass("portable-accumulators", "portable", lambda m, c: lower_accumulators(m),
         "InPlaceAccumulatorV2 (gradient accumulation into buffers the training build owns) is not in stock ORT",
         "the graph returns each parameter's gradient; the portable engine binds that output to the parameter's "
         "accumulation buffer when the step starts a new optimizer step, else adds it in (numpy), as the kernel "
         "does; the finite check reads the same gradient",
         "tests/artifacts/test_portable.py::test_portable_step_equals_the_classic_engine_step_for_step"),
    Pass("portable-finite-check", "portable", lambda m, c: lower_operators(m, c.opset, ("ReduceAllL2",)),
         "ReduceAllL2 (the finite check's multi-tensor norm) is not in stock ORT",
         "Sqrt(Sum(ReduceSumSquare(x) for each input)): the same sum of squares, summed per tensor first as the "
         "kernel does",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-dropout-grad", "portable", lambda m, c: lower_operators(m, c.opset, ("DropoutGrad",)),
         "DropoutGrad is not in stock ORT",
         "Where(mask, dY, 0) * (1 / (1 - ratio)), the kernel's product in its order (a Cast of the mask would run "
         "in the forward and keep a float copy of it); dY where training_mode is false; "
         "with the ratio given (an exported model's), a division by 1 - ratio computed from it (what ORT fuses the "
         "formula to; verification's dropout-free twin zeroes that input) and a constant mode needs no Where",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-dropout-masks", "portable", lambda m, c: keep_dropout_masks(m),
         "stock ORT's basic optimizer deletes a Dropout whose mask output is unused, even in training mode, so a "
         "Dropout on a frozen path (no gradient reads its mask) would stop dropping",
         "Reshape(Y, Shape(Y) + 0 * mask[0]) reads the mask's first element: the same Y, no copy (a Where over "
         "the tensor, the first version, cost a pass per Dropout)",
         "tests/artifacts/test_dropout.py::test_a_dropout_on_a_frozen_path_still_drops_on_the_portable_engine"),
    Pass("portable-softmax-grad", "portable",
         lambda m, c: lower_operators(m, c.opset, ("SoftmaxGrad_13", "LogSoftmaxGrad_13")),
         "SoftmaxGrad_13 and LogSoftmaxGrad_13 are not in stock ORT",
         "Y * (dY - ReduceSum(dY * Y)) and dY - Exp(Y) * ReduceSum(dY) over the softmax axis: the kernels' formulas",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-layernorm-grad", "portable", lambda m, c: lower_operators(m, c.opset, ("LayerNormalizationGrad",)),
         "LayerNormalizationGrad is not in stock ORT",
         "with x_hat = (X - mean) inv_std and a = dY scale: dX = inv_std (a - mean(a) - x_hat mean(a x_hat)), "
         "dscale = sum(dY x_hat), dbias = sum(dY) over the rows: the kernel's formulas, rounded in another order",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-rmsnorm-grad", "portable",
         lambda m, c: lower_operators(m, c.opset, ("SimplifiedLayerNormalizationGrad",)),
         "SimplifiedLayerNormalizationGrad (RMSNorm's gradient: Llama, Qwen, Mistral, SmolLM) is not in stock ORT",
         "with x_hat = X inv_std and a = dY scale: dX = inv_std (a - x_hat mean(a x_hat)), dscale = sum(dY x_hat) "
         "over the rows: the kernel's formulas, rounded in another order",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-silu-grad", "portable", lambda m, c: lower_operators(m, c.opset, ("QuickGeluGrad",)),
         "QuickGeluGrad (the gradient of X sigmoid(alpha X): SwiGLU's SiLU) is not in stock ORT",
         "with v = alpha X and s = Sigmoid(v): dY s (1 + v (1 - s)), the kernel's formula",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-cross-entropy-grad", "portable",
         lambda m, c: lower_operators(m, c.opset, ("SoftmaxCrossEntropyLossGrad",)),
         "SoftmaxCrossEntropyLossGrad (what the cross-entropy pass leaves: a loss with ignore_index or class "
         "weights, as a causal LM's token loss) is not in stock ORT",
         "(Exp(log_prob) - OneHot(label)) w dY / sum(w), w the label's class weight and 0 at ignore_index: the "
         "kernel's formula, rounded in another order; the label's entry gathered, (p - 1) times the scale, and "
         "scattered into the scaled rows, so no one-hot tensor",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-cross-entropy", "portable",
         lambda m, c: lower_operators(m, c.opset, ("SoftmaxCrossEntropyLoss",)),
         "SoftmaxCrossEntropyLoss (what the cross-entropy pass leaves) has no kernel in stock ORT, which runs the "
         "ONNX function that defines it, inlined when it loads an ONNX file. The bundles' ORT-format graphs, "
         "converted with the training build (which has the kernel), kept the node, and stock ORT refused "
         "SmolLM2's. The eval graph gets the same lowering",
         "LogSoftmax over the classes; the label's log-probability gathered, times w (the class weight, 0 at "
         "ignore_index), negated and summed, divided by sum(w) for mean: ONNX's definition, rounded in another "
         "order",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-gpt2-grads", "portable", lambda m, c: lower_operators(m, c.opset, ("FastGeluGrad", "GatherGrad")),
         "FastGeluGrad (GPT-2's tanh GELU) and GatherGrad on an activation (what the lookup-grad pass leaves: a "
         "pick of one position per row) are not in stock ORT",
         "dY (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 (0.044715 x) x)) with t the tanh of the forward; and "
         "ScatterElements(zeros, indices, dY, reduction add) along axis 0: the kernels' formulas, sums in index "
         "order",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-concat-split", "portable",
         lambda m, c: lower_operators(m, c.opset, ("ConcatTraining", "SplitTraining")),
         "ConcatTraining and SplitTraining (Concat and Split that pass each part's length) are not in stock ORT",
         "Concat, plus the lengths as Shape slices when read; Split with the lengths as its split input",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-activation-grads", "portable",
         lambda m, c: lower_operators(m, c.opset, ("SigmoidGrad", "TanhGrad", "Scale")),
         "SigmoidGrad, TanhGrad and Scale are not in stock ORT",
         "dY * Y * (1 - Y), dY * (1 - Y) * (1 + Y), and X * scale (or / scale): the kernels' formulas (1 - Y^2 "
         "as a product of two factors that each start from a constant, so that they wait for dY)",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-slice-grad", "portable", lambda m, c: lower_operators(m, c.opset, ("SliceGrad",)),
         "SliceGrad is not in stock ORT",
         "the gradient of a unit-step Slice is dY padded with zeros to the input's shape, the pads being the clamped "
         "starts and dim - clamped ends (computed in the graph, so dynamic shapes work): the same values copied",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-batchnorm", "portable",
         lambda m, c: lower_operators(m, c.opset, ("BatchNormInternal", "BatchNormalizationGrad")),
         "BatchNormInternal (training-mode BatchNorm with its saved statistics) and BatchNormalizationGrad are not "
         "in stock ORT",
         "the forward as ONNX's BatchNormalization in training mode with momentum 0 (its statistics are the batch "
         "mean and biased variance; 0.06-0.23 ms against 0.25-0.36 for the arithmetic on MobileNet-style's "
         "activations) where scale and bias are that node's own trained inputs, else that arithmetic over every "
         "axis but the channels; inv_std = 1 / sqrt(var + eps); the gradient dX = scale inv_std (dY - mean(dY) - "
         "x_hat mean(dY x_hat)), dscale = sum(dY x_hat), dbias = sum(dY): the kernels' formulas, rounded in "
         "another order",
         "tests/artifacts/test_portable.py::test_every_benchmark_model_trains_alike_on_both_engines"),
    Pass("portable-pixel-shuffle", "portable", lambda m, c: shuffle_as_depth_to_space(m, c.opset),
         "stock ORT 1.32 runs a pixel shuffle's six-axis Transpose (a ConvTranspose with kernel = stride, "
         "forward and gradient) element by element: 1.04 and 0.88 ms on the U-Net-style model's activation "
         "(1.19.2: 0.65 and 0.35)",
         "DepthToSpace (CRD) forward, 0.41 ms; SpaceToDepth and a block Transpose backward, 0.19 ms; Reshapes are "
         "views: values moved, none computed",
         "tests/artifacts/test_upsampling.py::test_a_pixel_shuffle_moves_the_values_its_transposes_move"),
    Pass("portable-conv-grad", "portable", lambda m, c: lower_operators(m, c.opset, ("ConvGrad",)),
         "ConvGrad (what the conv-grad pass leaves of it: the weight gradient) is not in stock ORT",
         "dW, with static sizes: from 16 input channels, dY times the input's window taken channels last, one "
         "product per kernel offset (summing batch and positions at once); with fewer, im2col (the windows "
         "stacked, strided ones taken from the input's phases, SpaceToDepth) times dY per image, summed over the "
         "batch; depthwise at stride 1, each window times dY summed "
         "per channel; else a convolution of the input with dY, the batch axis as channels (grouped for a "
         "depthwise one), stride and dilation swapped, cropped to the kernel. dX is a ConvTranspose, dB sums dY: "
         "the same products summed in another order",
         "tests/artifacts/test_portable.py::test_each_lowering_matches_orts_training_kernel"),
    Pass("portable-gradient-seeds", "portable", lambda m, c: seed_lookup_gradients(m),
         "a trained lookup table's gradient is scattered into table-sized zeros the graph makes every step, beside "
         "the gradient buffer bound as the output (BERT-shaped: 29.8 MiB of zeros; the step's peak RSS 420.7 MiB "
         "with them, 403.7 without, onnxruntime 1.32, two runs each)",
         "the zeros are a graph input the portable engine binds to the gradient's own buffer, zeroed, and the same "
         "buffer is the output: ScatterElements copies nothing onto itself and adds the same rows in the same "
         "order; graphs run without those bindings (fused step, bundles) make the zeros again",
         "tests/artifacts/test_text_models.py::test_a_lookup_gradient_is_added_into_the_engines_own_zeroed_buffer"),
)  # fmt: skip


def run_stage(stage: str, model: onnx.ModelProto, context: Context) -> None:
    """Run the registry's passes of ``stage`` on ``model`` in order; results go to ``context.results``."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    for entry in REGISTRY:
        if entry.stage == stage:
            context.results[entry.name] = entry.run(model, context)


def without(*names: str) -> tuple[Pass, ...]:
    """The registry without the named passes (for measuring or testing what a pass changes)."""
    unknown = set(names) - {p.name for p in REGISTRY}
    if unknown:
        raise ValueError(f"no passes named {sorted(unknown)}; the registry has {[p.name for p in REGISTRY]}")
    return tuple(p for p in REGISTRY if p.name not in names)


def table() -> str:
    """The registry as a markdown table, in the order the pipeline runs it."""
    rows = ["| pass | stage | fixes in ONNX Runtime 1.19 | why it is exact | test |", "|---|---|---|---|---|"]
    rows += [f"| `{p.name}` | {p.stage} | {p.fixes} | {p.exact} | `{p.test}` |" for p in REGISTRY]
    return "\n".join(rows) + "\n"
