"""Exported model files whose weights a session maps instead of copying.

ONNX Runtime reads an embedded initializer into its parsed model and then into a tensor of its own: `odt predict
model.onnx` on MiniLM (91 MB of weights) peaked at 222 MB, over the 200 MB plan its artifacts were made for, where
predicting from the artifact directory took 135 MB. So :func:`write_initializer` writes each initializer as a
message of its own whose raw bytes start on a 64-byte boundary of the file (an unknown field pads the header;
protobuf readers skip it), and :func:`mapped_model` reads such a file back as a model whose large weights are
graph inputs, plus numpy arrays mapped from the file that every run feeds them: the weights are the file's pages,
shared with the page cache, as ``frozen.bin``'s are for training. (Handed to a session as initializers instead,
they were copied: ``add_external_initializers`` copies on ONNX Runtime 1.19 and 1.32, and ``add_initializer``
needs an initializer entry that 1.32 validates against a file.) The file stays one plain ONNX model that any
reader loads.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import IO

import numpy as np

__all__ = ["ALIGN", "MAPPED", "write_initializer", "plain_initializer", "mapped_model"]

ALIGN = 64
"""Byte alignment of each initializer's raw data in an exported file."""
MAPPED = 1 << 16
"""Initializers of at least this many bytes are mapped; smaller ones stay in the parsed model."""

_GRAPH, _INITIALIZER, _INPUT, _RAW_DATA = 7, 5, 11, 9
"""Field numbers: ModelProto.graph, GraphProto.initializer and .input, TensorProto.raw_data."""
_PAD = 1000
"""An unknown TensorProto field number carrying padding bytes."""
_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
           10: np.float16, 11: np.float64}  # fmt: skip
"""ONNX's TensorProto.DataType -> numpy, for the types a model's weights have."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _delimited(field: int, payload: bytes) -> bytes:
    return _tag(field, 2) + _varint(len(payload)) + payload


def plain_initializer(tensor: bytes) -> bytes:
    """``ModelProto{graph{initializer{tensor}}}``: a serialized TensorProto as a message of its own."""
    return _delimited(_GRAPH, _delimited(_INITIALIZER, tensor))


def write_initializer(handle: IO[bytes], header: bytes, data: bytes | tuple[Path, int, int]) -> None:
    """One ``ModelProto{graph{initializer{header, padding, raw_data}}}`` message at ``handle``'s position, the raw
    bytes (``data``, or ``(file, offset, length)`` copied a block at a time) starting on an :data:`ALIGN` boundary.
    Protobuf merges such messages into one graph and accepts fields in any order."""
    length = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else data[2]
    raw_head = _tag(_RAW_DATA, 2) + _varint(length)
    pad, position = b"", handle.tell()
    for _ in range(4):  # a longer pad can lengthen the varints before it: settle
        tensor = len(header) + len(pad) + len(raw_head) + length
        prefix = _tag(_GRAPH, 2) + _varint(len(_tag(_INITIALIZER, 2)) + len(_varint(tensor)) + tensor)
        prefix += _tag(_INITIALIZER, 2) + _varint(tensor) + header
        start = position + len(prefix) + len(pad) + len(raw_head)
        if start % ALIGN == 0:
            break
        total = len(pad) + (-start) % ALIGN
        total += ALIGN if total < 3 else 0  # the smallest pad field: a 2-byte tag and a 1-byte length
        pad = _delimited(_PAD, bytes(total - 3))
    handle.write(prefix + pad + raw_head)
    if isinstance(data, (bytes, bytearray, memoryview)):
        handle.write(data)
        return
    path, offset, left = data
    with open(path, "rb") as source:
        source.seek(offset)
        while left:
            block = source.read(min(left, 1 << 20))
            if not block:
                raise OSError(f"{path} ends before the {length:,} bytes of a weight at offset {offset:,}")
            handle.write(block)
            left -= len(block)


def _fields(buffer: memoryview, start: int, end: int):  # type: ignore[no-untyped-def]
    """``(field, wire type, value start, value end, field start)`` of each field in ``buffer[start:end]``."""
    position = start
    while position < end:
        begin = position
        key, position = _read_varint(buffer, position)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, after = _read_varint(buffer, position)
            yield field, wire, position, after, begin
        elif wire == 2:
            size, position = _read_varint(buffer, position)
            after = position + size
            yield field, wire, position, after, begin
        elif wire in (1, 5):
            after = position + (8 if wire == 1 else 4)
            yield field, wire, position, after, begin
        else:
            raise ValueError(f"wire type {wire} at byte {begin}")
        position = after
    if position != end:
        raise ValueError("a field runs past its message")


def _read_varint(buffer: memoryview, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def _mappable(buffer: memoryview, start: int, end: int):  # type: ignore[no-untyped-def]
    """``(name, dims, numpy dtype, raw start, raw end)`` of an initializer whose only data is large, aligned raw
    bytes; None for any other."""
    name, dims, dtype, raw = None, [], None, None
    for field, wire, value_start, value_end, _ in _fields(buffer, start, end):
        if field == 8 and wire == 2:
            name = bytes(buffer[value_start:value_end]).decode()
        elif field == 1 and wire == 0:
            dims.append(_read_varint(buffer, value_start)[0])
        elif field == 1 and wire == 2:  # packed dims
            position = value_start
            while position < value_end:
                dim, position = _read_varint(buffer, position)
                dims.append(dim)
        elif field == 2 and wire == 0:
            dtype = _DTYPES.get(_read_varint(buffer, value_start)[0])
        elif field == _RAW_DATA and wire == 2:
            raw = (value_start, value_end)
        elif field == 14 and wire == 0 and _read_varint(buffer, value_start)[0] == 0:
            continue  # data_location DEFAULT, written out
        elif field not in (_PAD, 3, 12, 16):  # typed values, external data: not mapped
            return None
    if name is None or dtype is None or raw is None or raw[1] - raw[0] < MAPPED or raw[0] % ALIGN:
        return None
    if raw[1] - raw[0] != int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize:
        return None
    return name, dims, dtype, raw


def _graph_input(name: str, dims: list[int], dtype: type) -> bytes:
    """A ValueInfoProto declaring ``name`` as a tensor input of ``dims`` and ``dtype``."""
    code = next(k for k, v in _DTYPES.items() if v is dtype)
    shape = b"".join(_delimited(1, _tag(1, 0) + _varint(d)) for d in dims)
    tensor = _tag(1, 0) + _varint(code) + _delimited(2, shape)
    return _delimited(1, name.encode()) + _delimited(2, _delimited(1, tensor))


def mapped_model(path: Path) -> tuple[bytes | None, dict[str, np.ndarray]]:
    """The model at ``path`` as (its bytes with its large initializers turned into graph inputs, those
    initializers as read-only arrays mapped from the file, to feed every run); ``(None, {})`` when the file has
    no large aligned initializers (a small model, one another tool wrote) or is not laid out as protobuf fields:
    the caller loads the file as it is (and whatever reads it says what is wrong)."""
    if Path(path).stat().st_size < MAPPED:
        return None, {}
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    buffer = memoryview(mapping)
    try:
        top, graph, mapped = bytearray(), bytearray(), {}
        for field, wire, value_start, value_end, begin in _fields(buffer, 0, len(buffer)):
            if field != _GRAPH or wire != 2:
                top += buffer[begin:value_end]
                continue
            for inner, inner_wire, inner_start, inner_end, inner_begin in _fields(buffer, value_start, value_end):
                found = _mappable(buffer, inner_start, inner_end) if inner == _INITIALIZER and inner_wire == 2 else None
                if found is None:
                    graph += buffer[inner_begin:inner_end]
                    continue
                name, dims, dtype, (raw_start, raw_end) = found
                count = (raw_end - raw_start) // np.dtype(dtype).itemsize
                mapped[name] = np.frombuffer(mapping, dtype=dtype, count=count, offset=raw_start).reshape(dims)
                graph += _delimited(_INPUT, _graph_input(name, dims, dtype))
    except (ValueError, IndexError, UnicodeDecodeError):
        mapped = {}
    buffer.release()
    if not mapped:
        mapping.close()
        return None, {}
    return bytes(top + _delimited(_GRAPH, bytes(graph))), mapped
