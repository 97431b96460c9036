"""ONNX Runtime's training checkpoint (a flatbuffer), read and written without the training build.

Both engines keep their state in this one format, so a checkpoint saved by either loads in the
other: the classic engine hands the bytes to ``CheckpointState``; the portable engine reads and
writes them here. Written from ORT's schema (``ort_training_checkpoint.fbs`` and ``Tensor`` in
``ort.fbs``) with the ``flatbuffers`` package, which every ONNX Runtime wheel depends on. ORT's own
writer is the reference: tests/ondevice/test_engines.py round-trips its files byte-for-value and
loads ours back into the training build.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import flatbuffers
import numpy as np
from flatbuffers.table import Table

__all__ = ["CheckpointData", "read_checkpoint", "write_checkpoint", "CheckpointFormatError"]

IDENTIFIER = b"ODTC"
VERSION = 2
"""The format version ORT 1.19.2 writes (read off its files); files of other versions are refused."""

# ONNX TensorProto data types <-> numpy (what checkpoints of these artifacts can hold).
_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 5: np.int16, 6: np.int32, 7: np.int64, 9: np.bool_,
           10: np.float16, 11: np.float64}  # fmt: skip
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}


class CheckpointFormatError(ValueError):
    """The bytes are not an ORT training checkpoint this runtime can read."""


@dataclass
class CheckpointData:
    """What a checkpoint holds: parameters, optimizer state (one group) and properties.

    ``momentums`` maps a trainable parameter to its optimizer state tensors in ORT's order
    (AdamW: first, then second moments); ``step`` counts optimizer steps taken. Arrays read from a
    checkpoint are read-only views of its bytes (no copy): copy what you keep.
    """

    trainable: dict[str, np.ndarray] = field(default_factory=dict)
    frozen: dict[str, np.ndarray] = field(default_factory=dict)
    momentums: dict[str, list[np.ndarray]] = field(default_factory=dict)
    step: int = 0
    initial_lr: float = 0.001
    group: str = "group0"
    properties: dict[str, int | float | str] = field(default_factory=dict)


# -- reading ----------------------------------------------------------------------------------


def _field(table: Table, slot: int) -> int:
    return table.Offset(4 + 2 * slot)


def _string(table: Table, slot: int) -> str:
    offset = _field(table, slot)
    return table.String(offset + table.Pos).decode() if offset else ""


def _scalar(table: Table, slot: int, kind, default):  # type: ignore[no-untyped-def]
    offset = _field(table, slot)
    return table.Get(kind, offset + table.Pos) if offset else default


def _tables(table: Table, slot: int) -> list[Table]:
    offset = _field(table, slot)
    if not offset:
        return []
    start = table.Vector(offset)
    return [Table(table.Bytes, table.Indirect(start + 4 * i)) for i in range(table.VectorLen(offset))]


def _child(table: Table, slot: int) -> Table | None:
    offset = _field(table, slot)
    return Table(table.Bytes, table.Indirect(offset + table.Pos)) if offset else None


def _tensor(table: Table) -> tuple[str, np.ndarray]:
    name = _string(table, 0)
    dims_at = _field(table, 2)
    dims = [] if not dims_at else list(table.GetVectorAsNumpy(flatbuffers.number_types.Int64Flags, dims_at))
    code = _scalar(table, 3, flatbuffers.number_types.Int32Flags, 0)
    if code not in _DTYPES:
        raise CheckpointFormatError(f"tensor {name!r} has data type {code}, which this runtime does not read")
    if _scalar(table, 6, flatbuffers.number_types.Int64Flags, -1) != -1:
        raise CheckpointFormatError(f"tensor {name!r} keeps its data in an external file (checkpoints over 2 GB)")
    raw_at = _field(table, 4)
    raw = b"" if not raw_at else table.Bytes[table.Vector(raw_at) : table.Vector(raw_at) + table.VectorLen(raw_at)]
    array = np.frombuffer(raw, dtype=np.dtype(_DTYPES[code]).newbyteorder("<"))
    return name, array.astype(_DTYPES[code], copy=False).reshape([int(d) for d in dims])


def read_checkpoint(data: bytes | bytearray | memoryview) -> CheckpointData:
    """Parse ORT checkpoint bytes; the arrays are views of ``data`` (on MiniLM, a copy of 88 MB saved)."""
    buffer = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
    if len(buffer) < 8 or bytes(buffer[4:8]) != IDENTIFIER:
        raise CheckpointFormatError("not an ONNX Runtime training checkpoint (no ODTC identifier)")
    try:
        root = Table(buffer, flatbuffers.encode.Get(flatbuffers.packer.uoffset, buffer, 0))
        version = _scalar(root, 0, flatbuffers.number_types.Int32Flags, 0)
        if version != VERSION:
            raise CheckpointFormatError(f"checkpoint format version {version}; this runtime reads {VERSION}")
        out = CheckpointData()
        module = _child(root, 1)
        if module is not None:
            if _scalar(module, 2, flatbuffers.number_types.BoolFlags, False):
                raise CheckpointFormatError("a nominal checkpoint (shapes only, no values)")
            out.trainable = dict(_tensor(t) for t in _tables(module, 0))
            out.frozen = dict(_tensor(t) for t in _tables(module, 1))
        groups = _tables(root, 2)
        if len(groups) > 1:
            raise CheckpointFormatError(f"{len(groups)} optimizer groups; artifacts of odt have one")
        for group in groups:
            out.group = _string(group, 0)
            out.step = int(_scalar(group, 1, flatbuffers.number_types.Int64Flags, 0))
            out.initial_lr = float(_scalar(group, 2, flatbuffers.number_types.Float32Flags, 0.0))
            for state in _tables(group, 3):
                moments = sorted((_tensor(t) for t in _tables(state, 1)), key=lambda item: item[0])
                out.momentums[_string(state, 0)] = [array for _, array in moments]
        bag = _child(root, 3)
        if bag is not None:
            kinds = ((0, flatbuffers.number_types.Int64Flags, int), (1, flatbuffers.number_types.Float32Flags, float))
            for slot, flags, cast in kinds:
                for entry in _tables(bag, slot):
                    out.properties[_string(entry, 0)] = cast(_scalar(entry, 1, flags, 0))
            for entry in _tables(bag, 2):
                out.properties[_string(entry, 0)] = _string(entry, 1)
        return out
    except CheckpointFormatError:
        raise
    except (IndexError, ValueError, TypeError, KeyError, OverflowError, struct.error) as exc:
        raise CheckpointFormatError(f"damaged checkpoint flatbuffer ({exc})") from None


# -- writing ----------------------------------------------------------------------------------


def _vector(builder: flatbuffers.Builder, offsets: list[int]) -> int:
    builder.StartVector(4, len(offsets), 4)
    for offset in reversed(offsets):
        builder.PrependUOffsetTRelative(offset)
    return builder.EndVector()


def _write_tensor(builder: flatbuffers.Builder, name: str, array: np.ndarray) -> int:
    array = np.ascontiguousarray(array)
    if array.dtype not in _CODES:
        raise CheckpointFormatError(f"tensor {name!r} has dtype {array.dtype}, which a checkpoint cannot hold")
    raw = builder.CreateNumpyVector(np.frombuffer(array.astype(array.dtype.newbyteorder("<")).tobytes(), np.uint8))
    dims = builder.CreateNumpyVector(np.asarray(array.shape, dtype=np.int64))
    label = builder.CreateString(name)
    builder.StartObject(7)
    builder.PrependUOffsetTRelativeSlot(0, label, 0)
    builder.PrependUOffsetTRelativeSlot(2, dims, 0)
    builder.PrependInt32Slot(3, _CODES[array.dtype], 0)
    builder.PrependUOffsetTRelativeSlot(4, raw, 0)
    return builder.EndObject()


def _property(builder: flatbuffers.Builder, name: str, value: int | float | str) -> int:
    label = builder.CreateString(name)
    text = builder.CreateString(value) if isinstance(value, str) else None
    builder.StartObject(2)
    builder.PrependUOffsetTRelativeSlot(0, label, 0)
    if text is not None:
        builder.PrependUOffsetTRelativeSlot(1, text, 0)
    elif isinstance(value, int):
        builder.PrependInt64Slot(1, value, 0)
    else:
        builder.PrependFloat32Slot(1, value, 0.0)
    return builder.EndObject()


def write_checkpoint(data: CheckpointData) -> memoryview:
    """Serialize ``data`` the way ORT's ``SaveCheckpoint`` lays it out (parameters in the given order).

    Returns a view of the builder's buffer (write it to a file, or ``bytes()`` it): no second copy of
    every parameter and moment at save time."""
    size = sum(a.nbytes for a in (*data.trainable.values(), *data.frozen.values()))
    size += sum(m.nbytes for moments in data.momentums.values() for m in moments)
    builder = flatbuffers.Builder(size + 4096)
    trainable = _vector(builder, [_write_tensor(builder, n, a) for n, a in data.trainable.items()])
    frozen = _vector(builder, [_write_tensor(builder, n, a) for n, a in data.frozen.items()])
    builder.StartObject(4)
    builder.PrependUOffsetTRelativeSlot(0, trainable, 0)
    builder.PrependUOffsetTRelativeSlot(1, frozen, 0)
    module = builder.EndObject()

    states = []
    for name, moments in data.momentums.items():
        tensors = _vector(builder, [_write_tensor(builder, f"momentum{i}", m) for i, m in enumerate(moments)])
        label = builder.CreateString(name)
        builder.StartObject(2)
        builder.PrependUOffsetTRelativeSlot(0, label, 0)
        builder.PrependUOffsetTRelativeSlot(1, tensors, 0)
        states.append(builder.EndObject())
    groups = []
    if data.momentums or data.step:
        state_vector = _vector(builder, states)
        group_name = builder.CreateString(data.group)
        builder.StartObject(4)
        builder.PrependUOffsetTRelativeSlot(0, group_name, 0)
        builder.PrependInt64Slot(1, int(data.step), 0)
        builder.PrependFloat32Slot(2, float(data.initial_lr), 0.0)
        builder.PrependUOffsetTRelativeSlot(3, state_vector, 0)
        groups.append(builder.EndObject())
    group_vector = _vector(builder, groups)

    kinds: list[list[int]] = [[], [], []]
    for name, value in data.properties.items():
        kind = 2 if isinstance(value, str) else 0 if isinstance(value, (int, np.integer)) else 1
        kinds[kind].append(_property(builder, name, value if kind != 0 else int(value)))
    bag_vectors = [_vector(builder, entries) for entries in kinds]
    builder.StartObject(3)
    for slot, vector in enumerate(bag_vectors):
        builder.PrependUOffsetTRelativeSlot(slot, vector, 0)
    bag = builder.EndObject()

    builder.StartObject(4)
    builder.PrependInt32Slot(0, VERSION, 0)
    builder.PrependUOffsetTRelativeSlot(1, module, 0)
    builder.PrependUOffsetTRelativeSlot(2, group_vector, 0)
    builder.PrependUOffsetTRelativeSlot(3, bag, 0)
    builder.Finish(builder.EndObject(), file_identifier=IDENTIFIER)
    return memoryview(builder.Bytes)[builder.Head() :]
