"""A lookup table's gradient scattered into the portable engine's own gradient buffer.

The lookup-grad pass (and the GatherGrad lowering) scatter the rows of dY into zeros the graph makes every
step: ``ScatterElements(ConstantOfShape(table), ids, dY, reduction="add")``. Where that scatter is a trained
table's gradient output, the zeros are table-sized (BERT's 30522 x 256: 29.8 MiB, made and freed every step)
beside the gradient buffer the engine binds as the output. This pass reads the zeros from a graph input,
:func:`~ondevice.engines.contract.gradient_seed`, instead. The portable engine binds the gradient's own buffer
there, zeroed, and as the output; ONNX Runtime's ScatterElements kernel copies nothing when its input and
output are one buffer, so the rows are added in place. Graphs run without those bindings (the fused step, the
bundles) get their zeros back with :func:`ondevice.engines.step_graph.unseed`.
"""

from __future__ import annotations

from collections import Counter

import onnx
from onnx import helper, numpy_helper

from ondevice.engines.contract import gradient_output, gradient_seed
from ondevice.lora import prune

__all__ = ["seed_lookup_gradients"]


def _zeros(node: onnx.NodeProto | None) -> bool:
    """Whether ``node`` is a ``ConstantOfShape`` of float zeros (its default value is float zero too)."""
    if node is None or node.op_type != "ConstantOfShape":
        return False
    value = next((a.t for a in node.attribute if a.name == "value"), None)
    return value is None or (value.data_type == onnx.TensorProto.FLOAT and not numpy_helper.to_array(value).any())


def seed_lookup_gradients(model: onnx.ModelProto) -> list[str]:
    """Read the zeros of every trained parameter's scattered gradient from its seed input, in place; returns
    the parameters, in the graph's output order. The scatter must add (``reduction="add"``) into zeros only it
    reads; an ``Identity`` between it and the gradient output (the own gradient builder's graphs have one) goes."""
    graph = model.graph
    producer = {o: node for node in graph.node for o in node.output}
    readers = Counter(i for node in graph.node for i in node.input)
    parameters = {i.name: i for i in graph.input}
    outputs = {o.name for o in graph.output}
    dropped: set[int] = set()
    seeded = []
    for output in graph.output:
        parameter = output.name.removesuffix("_grad")
        if parameter not in parameters or gradient_output(parameter) != output.name:
            continue
        node = producer.get(output.name)
        identity = node if node is not None and node.op_type == "Identity" else None
        if identity is not None:
            node = producer.get(identity.input[0])
            if readers[identity.input[0]] != 1 or identity.input[0] in outputs:
                continue
        reduction = next((a.s for a in node.attribute if a.name == "reduction"), b"") if node is not None else b""
        if node is None or node.op_type != "ScatterElements" or reduction != b"add":
            continue
        if not _zeros(producer.get(node.input[0])) or readers[node.input[0]] != 1:
            continue
        if identity is not None:
            node.output[0] = output.name
            dropped.add(id(identity))
        node.input[0] = gradient_seed(parameter)
        seed = helper.make_tensor_value_info(node.input[0], onnx.TensorProto.FLOAT, None)
        seed.type.tensor_type.CopyFrom(parameters[parameter].type.tensor_type)
        graph.input.append(seed)
        seeded.append(parameter)
    if seeded:
        kept = [node for node in graph.node if id(node) not in dropped]
        del graph.node[:]
        graph.node.extend(kept)
        prune(graph, inputs=False)  # the zeros and their shape's nodes
    return seeded
