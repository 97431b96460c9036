"""Max pooling before ReLU: the same values and gradients on a quarter of the elements.

ReLU is monotonic, so ``MaxPool(Relu(x)) == Relu(MaxPool(x))`` bit for bit, and the gradients
agree too: where a window's maximum is positive, both send the gradient to its first maximal
element; where it is not, ReLU's gradient is zero either way. After a 2x2 pooling the ReLU and
its gradient (``Greater``, ``Cast``, ``Mul`` after :mod:`.relugrad`) run on a quarter of the
elements. Verification against PyTorch covers it.
"""

from __future__ import annotations

import collections

import onnx

__all__ = ["pool_before_relu"]


def pool_before_relu(model: onnx.ModelProto) -> int:
    """Swap every ``Relu -> MaxPool`` pair whose ReLU output only feeds the pooling; returns how many.

    The pooling must have a single output (no indices) and the ReLU's output must not be a graph
    output. The pooling's output keeps its name, so the nodes after it are unchanged.
    """
    graph = model.graph
    consumers: collections.Counter[str] = collections.Counter(name for n in graph.node for name in n.input)
    produced_by = {out: node for node in graph.node for out in node.output}
    outputs = {o.name for o in graph.output}
    swapped = 0
    for pool in graph.node:
        relu = produced_by.get(pool.input[0]) if pool.op_type == "MaxPool" and pool.input else None
        if (
            relu is None
            or relu.op_type != "Relu"
            or relu.domain not in ("", "ai.onnx")
            or len(pool.output) != 1
            or consumers[relu.output[0]] != 1
            or relu.output[0] in outputs
        ):
            continue
        source, pooled = relu.input[0], pool.output[0]
        before_relu = f"{pooled}.odt_before_relu"
        stale = relu.output[0]
        pool.input[0] = source
        pool.output[0] = before_relu
        relu.input[0] = before_relu
        relu.output[0] = pooled
        # Node order: the pooling now reads the ReLU's input, so it takes the ReLU's place.
        relu_copy, pool_copy = onnx.NodeProto(), onnx.NodeProto()
        relu_copy.CopyFrom(relu)
        pool_copy.CopyFrom(pool)
        relu.CopyFrom(pool_copy)
        pool.CopyFrom(relu_copy)
        produced_by[before_relu], produced_by[pooled] = relu, pool
        kept = [v for v in graph.value_info if v.name != stale]
        del graph.value_info[:]
        graph.value_info.extend(kept)
        swapped += 1
    return swapped
