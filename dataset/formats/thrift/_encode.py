"""Encoder for both protocols: a value as ``decode`` returns it, plus its schema, to bytes.

Containers take what ``decode`` gives back in either form: lists, sets and
numpy arrays for lists and sets; dicts, lists of (key, value) pairs, and a
(keys, values) pair of numpy arrays for maps. Every value is checked against
its schema (type and range) and a mismatch is a ThriftError naming where it is
(``struct.3[1]``), so a bad value never reaches the wire silently wrapped.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._wire import (
    BOOL,
    BYTE,
    DOUBLE,
    I16,
    I32,
    I64,
    INTEGERS,
    LIST,
    MAP,
    SET,
    STRING,
    STRUCT,
    UUID,
    Schema,
    ThriftError,
    wire_type,
)

__all__ = ["encode"]

_BE = {BYTE: ">i1", I16: ">i2", I32: ">i4", I64: ">i8", DOUBLE: ">f8"}
_COMPACT_TYPE = {BOOL: 1, BYTE: 3, I16: 4, I32: 5, I64: 6, DOUBLE: 7, STRING: 8, LIST: 9,
                 SET: 10, MAP: 11, STRUCT: 12, UUID: 13}  # fmt: skip


def encode(value: Mapping[int, Any], schema: Mapping[int, Schema], protocol: str) -> bytes:
    if not isinstance(schema, Mapping):
        raise ValueError(f"encode() needs a struct schema {{field_id: type}}, got {schema!r}")
    w = _Binary() if protocol == "binary" else _Compact()
    _struct(w, value, schema, "struct")
    return b"".join(w.out)


# ---------------------------------------------------------------- checking values


def _int(v: Any, t: int, where: str) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ThriftError(f"{where}: expected an int, got {type(v).__name__}")
    v = int(v)
    if not -INTEGERS[t] <= v < INTEGERS[t]:
        raise ThriftError(f"{where}: {v} does not fit in {_name(t)}")
    return v


def _name(t: int) -> str:
    return {BYTE: "i8", I16: "i16", I32: "i32", I64: "i64"}.get(t, str(t))


def _numeric_array(v: Any, t: int, where: str) -> np.ndarray | None:
    """A numpy array (or a list of numbers) as an array of type t, range-checked;
    None when ``v`` is not an array, so the caller checks element by element."""
    if not isinstance(v, np.ndarray) or (t != BOOL and t != DOUBLE and t not in INTEGERS):
        return None
    if v.ndim != 1:
        raise ThriftError(f"{where}: expected a 1-D array, got shape {v.shape}")
    if t == BOOL:
        if v.dtype != np.bool_:
            raise ThriftError(f"{where}: expected a bool array, got {v.dtype}")
        return v
    if t == DOUBLE:
        if v.dtype.kind not in "fiu":
            raise ThriftError(f"{where}: expected a float array, got {v.dtype}")
        return v.astype(np.float64)
    if v.dtype.kind not in "iu":
        raise ThriftError(f"{where}: expected an integer array for {_name(t)}, got {v.dtype}")
    if len(v) and (int(v.min()) < -INTEGERS[t] or int(v.max()) >= INTEGERS[t]):
        raise ThriftError(f"{where}: values outside {_name(t)} in the array")
    return v.astype(np.int64)


def _pairs(v: Any, where: str) -> tuple[Any, Any]:
    """A map's keys and values, from a dict, a list of pairs or a (keys, values) of arrays."""
    if isinstance(v, Mapping):
        return list(v.keys()), list(v.values())
    if (
        isinstance(v, tuple)
        and len(v) == 2
        and isinstance(v[0], np.ndarray)
        and isinstance(v[1], np.ndarray)
    ):
        if len(v[0]) != len(v[1]):
            raise ThriftError(f"{where}: {len(v[0])} keys but {len(v[1])} values")
        return v
    try:
        items = list(v)
        return [k for k, _ in items], [x for _, x in items]
    except (TypeError, ValueError):
        raise ThriftError(
            f"{where}: expected a dict, (key, value) pairs or (keys, values) arrays, "
            f"got {type(v).__name__}"
        ) from None


# ---------------------------------------------------------------- generic walk


def _struct(w, value: Any, schema: Mapping[int, Schema], where: str) -> None:
    if not isinstance(value, Mapping):
        raise ThriftError(
            f"{where}: expected a dict of field id to value, got {type(value).__name__}"
        )
    unknown = set(value) - set(schema)
    if unknown:
        raise ThriftError(f"{where}: fields {sorted(unknown)} are not in the schema")
    bad = [fid for fid in schema if not isinstance(fid, int) or not -32768 <= fid < 32768]
    if bad:
        raise ValueError(f"{where}: field ids {bad} of the schema are not i16 integers")
    w.struct_begin()
    for fid in sorted(schema):
        v = value.get(fid)
        if v is None:  # absent, as an optional field
            continue
        sub = schema[fid]
        t = wire_type(sub)
        if t == BOOL:
            if not isinstance(v, (bool, np.bool_)):
                raise ThriftError(f"{where}.{fid}: expected a bool, got {type(v).__name__}")
            w.bool_field(fid, bool(v))
            continue
        w.field(t, fid)
        _value(w, v, sub, t, f"{where}.{fid}")
    w.struct_end()


def _value(w, v: Any, schema: Schema, t: int, where: str) -> None:
    if t in INTEGERS:
        w.int(_int(v, t, where), t)
    elif t == STRING:
        if isinstance(v, str):
            v = v.encode("utf-8")
        if not isinstance(v, (bytes, bytearray, memoryview)):
            raise ThriftError(f"{where}: expected str or bytes, got {type(v).__name__}")
        w.binary(bytes(v))
    elif t == DOUBLE:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.number)):
            raise ThriftError(f"{where}: expected a float, got {type(v).__name__}")
        w.double(float(v))
    elif t == BOOL:
        if not isinstance(v, (bool, np.bool_)):
            raise ThriftError(f"{where}: expected a bool, got {type(v).__name__}")
        w.bool(bool(v))
    elif t == UUID:
        try:
            u = v if isinstance(v, uuid.UUID) else uuid.UUID(str(v))
        except ValueError:
            raise ThriftError(f"{where}: {v!r} is not a uuid") from None
        w.raw(u.bytes)
    elif t == STRUCT:
        _struct(w, v, schema, where)
    elif t in (LIST, SET):
        _list(w, v, schema, t, where)
    else:
        _map(w, v, schema, where)


def _list(w, v: Any, schema: Schema, t: int, where: str) -> None:
    esch = schema[1]
    et = wire_type(esch)
    arr = _numeric_array(v, et, where)
    if arr is not None:
        w.list_begin(et, len(arr))
        w.numbers(arr, et)
        return
    if isinstance(v, (str, bytes, Mapping)) or not hasattr(v, "__iter__"):
        raise ThriftError(f"{where}: expected a list or set, got {type(v).__name__}")
    items = list(v)
    w.list_begin(et, len(items))
    for i, item in enumerate(items):
        _value(w, item, esch, et, f"{where}[{i}]")


def _map(w, v: Any, schema: Schema, where: str) -> None:
    ksch, vsch = schema[1], schema[2]
    kt, vt = wire_type(ksch), wire_type(vsch)
    keys, vals = _pairs(v, where)
    w.map_begin(kt, vt, len(keys))
    if isinstance(keys, np.ndarray):
        keys, vals = keys.tolist(), vals.tolist()
    for k, x in zip(keys, vals, strict=True):
        _value(w, k, ksch, kt, f"{where}[key {k!r}]")
        _value(w, x, vsch, vt, f"{where}[{k!r}]")


# ---------------------------------------------------------------- the two wire formats


class _Binary:
    """TBinaryProtocol: big-endian fixed widths, i32 lengths and counts."""

    def __init__(self):
        self.out: list[bytes] = []

    def raw(self, b: bytes) -> None:
        self.out.append(b)

    def struct_begin(self) -> None:
        pass

    def struct_end(self) -> None:
        self.out.append(b"\x00")

    def field(self, t: int, fid: int) -> None:
        self.out.append(struct.pack(">bh", t, fid))

    def bool_field(self, fid: int, v: bool) -> None:
        self.out.append(struct.pack(">bh?", BOOL, fid, v))

    def int(self, v: int, t: int) -> None:
        self.out.append(struct.pack({BYTE: ">b", I16: ">h", I32: ">i", I64: ">q"}[t], v))

    def double(self, v: float) -> None:
        self.out.append(struct.pack(">d", v))

    def bool(self, v: bool) -> None:
        self.out.append(b"\x01" if v else b"\x00")

    def binary(self, b: bytes) -> None:
        self.out.append(struct.pack(">i", len(b)))
        self.out.append(b)

    def list_begin(self, et: int, n: int) -> None:
        self.out.append(struct.pack(">bi", et, n))

    def map_begin(self, kt: int, vt: int, n: int) -> None:
        self.out.append(struct.pack(">bbi", kt, vt, n))

    def numbers(self, a: np.ndarray, t: int) -> None:
        self.out.append(a.astype(np.uint8 if t == BOOL else _BE[t]).tobytes())


class _Compact:
    """TCompactProtocol: zigzag varints, field id deltas, bools in the field header."""

    def __init__(self):
        self.out: list[bytes] = []
        self.last: list[int] = []  # the previous field id of each open struct

    def raw(self, b: bytes) -> None:
        self.out.append(b)

    def struct_begin(self) -> None:
        self.last.append(0)

    def struct_end(self) -> None:
        self.last.pop()
        self.out.append(b"\x00")

    def _header(self, nibble: int, fid: int) -> None:
        delta = fid - self.last[-1]
        if 0 < delta <= 15:
            self.out.append(bytes([delta << 4 | nibble]))
        else:
            self.out.append(bytes([nibble]) + _varint(_zigzag(fid)))
        self.last[-1] = fid

    def field(self, t: int, fid: int) -> None:
        self._header(_COMPACT_TYPE[t], fid)

    def bool_field(self, fid: int, v: bool) -> None:
        self._header(1 if v else 2, fid)

    def int(self, v: int, t: int) -> None:
        if t == BYTE:
            self.out.append(struct.pack(">b", v))
        else:
            self.out.append(_varint(_zigzag(v)))

    def double(self, v: float) -> None:
        self.out.append(struct.pack("<d", v))

    def bool(self, v: bool) -> None:
        self.out.append(b"\x01" if v else b"\x02")

    def binary(self, b: bytes) -> None:
        self.out.append(_varint(len(b)))
        self.out.append(b)

    def list_begin(self, et: int, n: int) -> None:
        ct = _COMPACT_TYPE[et]
        if n < 15:
            self.out.append(bytes([n << 4 | ct]))
        else:
            self.out.append(bytes([0xF0 | ct]) + _varint(n))

    def map_begin(self, kt: int, vt: int, n: int) -> None:
        if n == 0:
            self.out.append(b"\x00")
        else:
            self.out.append(_varint(n) + bytes([_COMPACT_TYPE[kt] << 4 | _COMPACT_TYPE[vt]]))

    def numbers(self, a: np.ndarray, t: int) -> None:
        if t == DOUBLE:
            self.out.append(a.astype("<f8").tobytes())
        elif t == BOOL:
            self.out.append(np.where(a, 1, 2).astype(np.uint8).tobytes())
        elif t == BYTE:
            self.out.append(a.astype(np.int8).tobytes())
        else:
            self.out.append(_varints(a.astype(np.int64)))


def _zigzag(v: int) -> int:
    return (v << 1) ^ (v >> 63)


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _varints(a: np.ndarray) -> bytes:
    """Zigzag varints of an int64 array, all at once."""
    u = (a.astype(np.int64) << 1) ^ (a.astype(np.int64) >> 63)
    u = u.view(np.uint64)
    lens = np.ones(len(u), np.intp)
    for k in range(1, 10):
        lens += u >= np.uint64(1 << (7 * k))
    ends = np.cumsum(lens)
    starts = ends - lens
    out = np.empty(int(ends[-1]) if len(u) else 0, np.uint8)
    for j in range(10):
        m = lens > j
        if not m.any():
            break
        group = (u[m] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (lens[m] - 1 > j).astype(np.uint64) << np.uint64(7)
        out[starts[m] + j] = (group | more).astype(np.uint8)
    return out.tobytes()
