"""Schema-less decoder for TBinaryProtocol: ``decode(buf, ...) -> dict keyed by field id``.

The hot path is a container of fixed-width numbers: on the wire it is one run
of big-endian values, read in one call (numpy, or a cached ``struct.Struct``
for maps, whose interleaved keys and values ``struct`` splits for free).
Strings, structs and mixed containers go through tight loops over the bytes.

Hostile input stays bounded: every count is checked against the bytes that
remain before anything is allocated (an element takes at least
``MIN_SIZE`` bytes), every string length likewise, and against the record's
budget of objects (``_wire.MAX_OBJECTS``), nesting is limited, and every
failure is a ThriftError naming the offset. ``_fast.c`` is this decoder in C,
with the same results and errors.
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
    LIST,
    MAP,
    NAME_OF,
    NUMPY_DTYPE,
    SET,
    STOP,
    STRING,
    STRUCT,
    UUID,
    Schema,
    ThriftError,
    as_string,
    element_schema,
    field_schema,
    finish_list,
    make_map,
    over_budget,
    too_deep,
    truncated,
)

__all__ = ["MIN_SIZE", "WIDTH", "decode"]

WIDTH = {BOOL: 1, BYTE: 1, I16: 2, I32: 4, I64: 8, DOUBLE: 8}
# The fewest bytes one element of each type takes: what a count is checked against.
MIN_SIZE = {**WIDTH, STRING: 4, STRUCT: 1, MAP: 6, SET: 5, LIST: 5, UUID: 16}
_CODE = {BOOL: "?", BYTE: "b", I16: "h", I32: "i", I64: "q", DOUBLE: "d"}
_BE = {
    BOOL: np.dtype("u1"),
    BYTE: np.dtype("i1"),
    I16: np.dtype(">i2"),
    I32: np.dtype(">i4"),
    I64: np.dtype(">i8"),
    DOUBLE: np.dtype(">f8"),
}

_I16 = struct.Struct(">h").unpack_from
_I32 = struct.Struct(">i").unpack_from
_U32 = struct.Struct(">I").unpack_from
_I64 = struct.Struct(">q").unpack_from
_DBL = struct.Struct(">d").unpack_from
_LIST_HEAD = struct.Struct(">Bi").unpack_from
_MAP_HEAD = struct.Struct(">BBi").unpack_from
_KEY_ULEN = {t: struct.Struct(">" + _CODE[t] + "I").unpack_from for t in WIDTH}

_STRUCTS_MAX_N = 1024  # maps up to this size unpack with one cached Struct; larger ones via numpy
_structs: dict[tuple[int, int, int], Any] = {}


def _map_unpacker(kt: int, vt: int, n: int):
    key = (kt, vt, n)
    fn = _structs.get(key)
    if fn is None:
        if len(_structs) >= 512:  # bounded: records with ever new sizes cannot grow it
            _structs.clear()
        fn = _structs[key] = struct.Struct(">" + (_CODE[kt] + _CODE[vt]) * n).unpack_from
    return fn


class _Reader:
    """One record being decoded: the bytes, the options every level needs, and the objects
    its budget still allows."""

    __slots__ = ("buf", "end", "left", "max_objects", "numpy")

    def __init__(self, buf: bytes, numpy: bool, max_objects: int):
        self.buf = buf
        self.end = len(buf)
        self.numpy = numpy
        self.max_objects = max_objects
        self.left = max_objects - 1  # the record's own dict


def decode(
    buf: bytes, schema: Mapping[int, Schema] | None, numpy: bool, max_depth: int, max_objects: int
) -> dict:
    r = _Reader(buf, numpy, max_objects)
    value, pos = _struct(r, 0, max_depth, schema)
    if pos != r.end:
        raise ThriftError(f"{r.end - pos} bytes follow the end of the struct at offset {pos}")
    return value


# ---------------------------------------------------------------- errors


def _charge(r: _Reader, n: int, pos: int) -> None:
    """n more objects, made at ``pos``: refused past the record's budget."""
    if n > r.left:
        raise over_budget(r.max_objects, pos)
    r.left -= n


def _bad_count(r: _Reader, pos: int, n: int, kind: str, types: tuple[int, ...]) -> ThriftError:
    """Why a container's count at ``pos`` (its elements start there) is refused."""
    for t in types:
        if t not in MIN_SIZE:
            return ThriftError(f"unknown element type id {t} of a {kind} at offset {pos}")
    what = f"{kind}<{', '.join(NAME_OF[t] for t in types)}>"
    if n < 0:
        return ThriftError(f"negative size {n} of a {what} at offset {pos}")
    need = n * sum(MIN_SIZE[t] for t in types)
    return ThriftError(
        f"a {what} of {n} elements at offset {pos} needs at least {need} bytes; "
        f"{max(r.end - pos, 0)} remain"
    )


# ---------------------------------------------------------------- values


def _struct(r: _Reader, pos: int, depth: int, sch) -> tuple[dict, int]:
    if depth <= 0:
        raise too_deep(pos)
    buf = r.buf
    out: dict[int, Any] = {}
    read = _READ
    try:
        while True:
            t = buf[pos]
            if t == STOP:
                return out, pos + 1
            (fid,) = _I16(buf, pos + 1)
            fn = read[t] if t <= UUID else None
            if fn is None:
                raise ThriftError(f"unknown type id {t} of field {fid} at offset {pos}")
            if r.left <= 0:
                raise over_budget(r.max_objects, pos)
            r.left -= 1
            sub = None if sch is None else field_schema(sch, fid, t)
            out[fid], pos = fn(r, pos + 3, depth - 1, sub)
    except (IndexError, struct.error):
        raise truncated(pos, "a struct field") from None


def _bool(r, pos, depth, sch):
    return r.buf[pos] != 0, pos + 1


def _byte(r, pos, depth, sch):
    return (r.buf[pos] ^ 0x80) - 0x80, pos + 1


def _i16(r, pos, depth, sch):
    return _I16(r.buf, pos)[0], pos + 2


def _i32(r, pos, depth, sch):
    return _I32(r.buf, pos)[0], pos + 4


def _i64(r, pos, depth, sch):
    return _I64(r.buf, pos)[0], pos + 8


def _double(r, pos, depth, sch):
    return _DBL(r.buf, pos)[0], pos + 8


def _string(r, pos, depth, sch):
    (n,) = _I32(r.buf, pos)
    start = pos + 4
    if not 0 <= n <= r.end - start:
        raise ThriftError(f"string length {n} at offset {pos}; {r.end - start} bytes remain")
    raw = r.buf[start : start + n]
    return (as_string(raw, pos) if sch == "string" else raw), start + n


def _uuid(r, pos, depth, sch):
    if pos + 16 > r.end:
        raise truncated(pos, "a uuid")
    return uuid.UUID(bytes=r.buf[pos : pos + 16]), pos + 16


def _numbers(r: _Reader, t: int, n: int, pos: int):
    """n fixed-width numbers of type t at pos: a list, or an array with numpy=True."""
    a = np.frombuffer(r.buf, _BE[t], n, pos)
    if t == BOOL:
        a = a != 0
    else:
        a = a.astype(NUMPY_DTYPE[t])  # native order; a copy, so it does not pin the record
    return a if r.numpy else a.tolist()


def _list(r, pos, depth, sch):
    if depth <= 0:
        raise too_deep(pos)
    buf = r.buf
    et, n = _LIST_HEAD(buf, pos)
    start = pos + 5
    # before anything is allocated, n elements of at least MIN_SIZE bytes must fit
    size = MIN_SIZE.get(et)
    if size is None or n < 0 or n * size > r.end - start:
        raise _bad_count(r, start, n, "list", (et,))
    w = WIDTH.get(et)
    if w is not None:
        _charge(r, 1 if r.numpy else n, start)  # an array costs two objects
        items = _numbers(r, et, n, start)
        return (items if sch is None else finish_list(items, sch, start)), start + n * w
    _charge(r, n, start)
    esch = None if sch is None else element_schema(sch, et, 1)
    pos = start
    items: list = []
    try:
        if et == STRING and esch is None and r.end < 1 << 31:
            # lengths read unsigned only move forward: one bound check after the loop
            append = items.append
            for _ in range(n):
                (ln,) = _U32(buf, pos)
                pos += 4 + ln
                append(buf[pos - ln : pos])
            if pos > r.end:
                raise truncated(pos, f"a string of the list at offset {start}")
        else:
            fn = _READ[et]
            append = items.append
            for _ in range(n):
                v, pos = fn(r, pos, depth - 1, esch)
                append(v)
    except (IndexError, struct.error):
        raise truncated(pos, f"a list<{NAME_OF[et]}> element") from None
    return finish_list(items, sch, start), pos


def _map(r, pos, depth, sch):
    if depth <= 0:
        raise too_deep(pos)
    buf = r.buf
    kt, vt, n = _MAP_HEAD(buf, pos)
    start = pos + 6
    kw, vw = WIDTH.get(kt), WIDTH.get(vt)
    if kw is not None and vw is not None:  # the hot path: numbers to numbers
        end = start + n * (kw + vw)
        if n < 0 or end > r.end:
            raise _bad_count(r, start, n, "map", (kt, vt))
        _charge(r, 3 if r.numpy else 2 * n, start)  # a pair of arrays costs four objects
        if r.numpy or n > _STRUCTS_MAX_N:
            return _fixed_map(r, kt, vt, n, start), end
        unpack = _structs.get((kt, vt, n)) or _map_unpacker(kt, vt, n)
        it = iter(unpack(buf, start))
        return dict(zip(it, it)), end  # noqa: B905 (strict= takes zip's slower keyword path)
    ks, vs = MIN_SIZE.get(kt), MIN_SIZE.get(vt)
    if ks is None or vs is None or n < 0 or n * (ks + vs) > r.end - start:
        raise _bad_count(r, start, n, "map", (kt, vt))
    _charge(r, 2 * n, start)
    ksch = None if sch is None else element_schema(sch, kt, 1)
    vsch = None if sch is None else element_schema(sch, vt, 2)
    pos = start
    try:
        if kw is not None and vt == STRING and vsch is None and r.end < 1 << 31:
            # i64 -> string (a feature record's string features): key and length in one
            # call. The length is read unsigned, so it only moves forward; a length past
            # the end makes the next read fail, or the check after the loop.
            unpack = _KEY_ULEN[kt]
            head = kw + 4
            d = {}
            for _ in range(n):
                k, ln = unpack(buf, pos)
                pos += head + ln
                d[k] = buf[pos - ln : pos]
            if pos > r.end:
                raise truncated(pos, f"a string of the map at offset {start}")
            return d, pos
        rk, rv = _READ[kt], _READ[vt]
        keys, vals = [], []
        for _ in range(n):
            k, pos = rk(r, pos, depth - 1, ksch)
            v, pos = rv(r, pos, depth - 1, vsch)
            keys.append(k)
            vals.append(v)
    except (IndexError, struct.error):
        raise truncated(pos, f"a map<{NAME_OF[kt]}, {NAME_OF[vt]}> entry") from None
    return make_map(keys, vals, start), pos


def _fixed_map(r: _Reader, kt: int, vt: int, n: int, pos: int):
    """A map of fixed-width keys and values: (keys, values) arrays with numpy=True, else
    a dict (maps small enough for one cached Struct are read in _map)."""
    rec = np.frombuffer(r.buf, np.dtype([("k", _BE[kt]), ("v", _BE[vt])]), n, pos)
    keys, vals = rec["k"], rec["v"]
    keys = keys != 0 if kt == BOOL else keys.astype(NUMPY_DTYPE[kt])
    vals = vals != 0 if vt == BOOL else vals.astype(NUMPY_DTYPE[vt])
    if r.numpy:
        return keys, vals
    return dict(zip(keys.tolist(), vals.tolist()))  # noqa: B905 (strict= is slower)


_READ: tuple = tuple(
    {
        BOOL: _bool,
        BYTE: _byte,
        DOUBLE: _double,
        I16: _i16,
        I32: _i32,
        I64: _i64,
        STRING: _string,
        STRUCT: _struct,
        MAP: _map,
        SET: _list,
        LIST: _list,
        UUID: _uuid,
    }.get(t)
    for t in range(UUID + 1)
)
