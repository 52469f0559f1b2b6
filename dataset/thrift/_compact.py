"""Schema-less decoder for TCompactProtocol: ``decode(buf, ...) -> dict keyed by field id``.

Integers are zigzag varints, so nothing has a fixed width; a container of
integers is still one run of varints, which numpy decodes in a handful of
calls: the bytes below 0x80 end each varint, and an or-reduction over each
varint's 7-bit groups gives the values. A map from integers to doubles
interleaves varints with 8-byte doubles (or strings): one Python step per entry finds where
each key ends (from a table of "bytes to the next terminator"), then keys and
doubles are decoded as arrays. Everything else is a tight loop over the bytes.

Hostile input stays bounded: varints end within 10 bytes (5 for lengths, i16
and i32) and must fit their type, counts are checked against the bytes that
remain before anything is allocated, nesting is limited, and every failure is
a ThriftError naming the offset.
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
    too_deep,
    truncated,
)

# compact type nibble -> type id (1 and 2 are a bool field's value, or a bool element type)
_TYPE: tuple = (None, BOOL, BOOL, BYTE, I16, I32, I64, DOUBLE, STRING, LIST, SET, MAP, STRUCT, UUID)
_TYPE += (None,) * (16 - len(_TYPE))
# The fewest bytes one element of each type takes: what a count is checked against.
MIN_SIZE = {BOOL: 1, BYTE: 1, I16: 1, I32: 1, I64: 1, DOUBLE: 8, STRING: 1, STRUCT: 1,
            MAP: 1, SET: 1, LIST: 1, UUID: 16}  # fmt: skip
VARINT_LIMIT = {I16: 5, I32: 5, I64: 10}  # most bytes a varint of the type may take
_INT_BITS = {I16: 16, I32: 32, I64: 64}
VECTOR_MIN = 16  # runs at least this long are decoded with numpy, shorter ones in Python

_DBL = struct.Struct("<d").unpack_from
_U8 = np.dtype(np.uint8)
_U64 = np.dtype(np.uint64)
_1, _7, _32 = np.uint64(1), np.uint64(7), np.uint64(32)


class _Reader:
    """One record being decoded: the bytes and the options every level needs."""

    __slots__ = ("_arr", "buf", "end", "numpy")

    def __init__(self, buf: bytes, numpy: bool):
        self.buf = buf
        self.end = len(buf)
        self.numpy = numpy
        self._arr = None

    @property
    def arr(self) -> np.ndarray:
        """The record as a uint8 array, made on first use."""
        if self._arr is None:
            self._arr = np.frombuffer(self.buf, _U8)
        return self._arr


def decode(buf: bytes, schema: Mapping[int, Schema] | None, numpy: bool, max_depth: int) -> dict:
    r = _Reader(buf, numpy)
    value, pos = _struct(r, 0, max_depth, schema)
    if pos != r.end:
        raise ThriftError(f"{r.end - pos} bytes follow the end of the struct at offset {pos}")
    return value


# ---------------------------------------------------------------- errors


def _check_count(r: _Reader, pos: int, n: int, size: int, what: str) -> None:
    if n * size > r.end - pos:
        raise ThriftError(
            f"a {what} of {n} elements at offset {pos} needs at least {n * size} bytes; "
            f"{max(r.end - pos, 0)} remain"
        )


def _elem_type(nibble: int, pos: int) -> int:
    t = _TYPE[nibble]
    if t is None:
        raise ThriftError(f"unknown compact element type {nibble} at offset {pos}")
    return t


# ---------------------------------------------------------------- varints, one at a time


def _uvarint(buf: bytes, pos: int, limit: int) -> tuple[int, int]:
    """An unsigned varint of at most ``limit`` bytes (5: 32 bits, 10: 64 bits) at pos."""
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    v = b & 0x7F
    shift = 7
    p = pos + 1
    while True:
        b = buf[p]
        p += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
        if shift >= 7 * limit:
            raise ThriftError(f"varint at offset {pos} is longer than {limit} bytes")
    if v >> (32 if limit == 5 else 64):
        raise ThriftError(f"varint at offset {pos} overflows {32 if limit == 5 else 64} bits")
    return v, p


def _int(t: int):
    limit = VARINT_LIMIT[t]
    lo = -(1 << (_INT_BITS[t] - 1))

    def read(r, pos, depth, sch):
        v, p = _uvarint(r.buf, pos, limit)
        v = (v >> 1) ^ -(v & 1)
        if not lo <= v < -lo:
            raise ThriftError(f"{NAME_OF[t]} {v} at offset {pos} is out of range")
        return v, p

    return read


# ---------------------------------------------------------------- varints, as arrays


def _varint_run(r: _Reader, pos: int, m: int, limit: int) -> tuple[np.ndarray, int]:
    """m consecutive varints at pos as uint64 (not yet unzigzagged), and the offset after them."""
    avail = min(limit * m, r.end - pos)
    b = r.arr[pos : pos + avail]
    ends = (b < 0x80).nonzero()[0]
    if len(ends) < m:
        raise truncated(pos, f"a run of {m} varints")
    ends = ends[:m]
    starts = np.empty(m, np.intp)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    return _varints(b, starts, ends, limit, lambda i: pos + int(starts[i])), pos + int(ends[-1]) + 1


def _varints(b: np.ndarray, starts: np.ndarray, ends: np.ndarray, limit: int, where):
    """Varints that tile ``b[:ends[-1]+1]`` (each from starts[i] to ends[i] inclusive) as uint64.

    Lengths over ``limit`` bytes and values over 32 (limit 5) or 64 bits are refused;
    the error names ``where(i)``, the record offset where varint i starts."""
    lens = ends - starts + 1
    longest = int(lens.max())
    if longest > limit:
        i = int(np.argmax(lens > limit))
        raise ThriftError(f"varint at offset {where(i)} is longer than {limit} bytes")
    stop = int(ends[-1]) + 1
    groups = (b[:stop] & 0x7F).astype(_U64)
    # each byte's 7-bit group goes 7 * (its index within its varint) bits up
    groups <<= (_arange(stop) - np.repeat(starts, lens)).astype(_U64) * _7
    v = np.bitwise_or.reduceat(groups, starts)
    if limit == 5:
        bad = (v >> _32) != 0
    elif longest == 10:  # the tenth byte may only carry bit 63
        bad = (lens == 10) & (b[ends] > 1)
    else:
        return v
    if bad.any():
        i = int(np.argmax(bad))
        bits = 32 if limit == 5 else 64
        raise ThriftError(f"varint at offset {where(i)} overflows {bits} bits")
    return v


def _unzigzag(v: np.ndarray, t: int, pos: int) -> np.ndarray:
    """Zigzag-decoded values of type t (int16/int32/int64 array); range-checked."""
    x = (v >> _1).view(np.int64) ^ -(v & _1).view(np.int64)
    if t == I64:
        return x
    lo = -(1 << (_INT_BITS[t] - 1))
    if t == I16 and ((x < lo) | (x >= -lo)).any():
        raise ThriftError(f"i16 out of range in the container at offset {pos}")
    return x.astype(NUMPY_DTYPE[t])


def _ints(r: _Reader, t: int, n: int, pos: int) -> tuple[Any, int]:
    """n zigzag varints of type t at pos: a list (an array with numpy=True), and the end."""
    if n >= VECTOR_MIN or r.numpy:
        if n == 0:
            return (np.empty(0, NUMPY_DTYPE[t]) if r.numpy else []), pos
        v, end = _varint_run(r, pos, n, VARINT_LIMIT[t])
        x = _unzigzag(v, t, pos)
        return (x if r.numpy else x.tolist()), end
    read = _READ[t]
    out = []
    for _ in range(n):
        x, pos = read(r, pos, 0, None)
        out.append(x)
    return out, pos


# ---------------------------------------------------------------- values


def _struct(r: _Reader, pos: int, depth: int, sch) -> tuple[dict, int]:
    if depth <= 0:
        raise too_deep(pos)
    buf = r.buf
    out: dict[int, Any] = {}
    last = 0
    try:
        while True:
            h = buf[pos]
            if h == 0:
                return out, pos + 1
            nib = h & 0x0F
            if h >> 4:
                fid = last + (h >> 4)
                p = pos + 1
            else:
                v, p = _uvarint(buf, pos + 1, 5)
                fid = (v >> 1) ^ -(v & 1)
            if not -32768 <= fid < 32768:
                raise ThriftError(f"field id {fid} at offset {pos} is not an i16")
            last = fid
            if nib == 1 or nib == 2:  # a bool field carries its value in the type nibble
                out[fid] = nib == 1
                pos = p
                continue
            t = _TYPE[nib]
            if t is None:
                raise ThriftError(f"unknown compact type {nib} of field {fid} at offset {pos}")
            sub = None if sch is None else field_schema(sch, fid, t)
            out[fid], pos = _READ[t](r, p, depth - 1, sub)
    except (IndexError, struct.error):
        raise truncated(pos, "a struct field") from None


def _bool_elem(r, pos, depth, sch):
    b = r.buf[pos]
    if b > 2:
        raise ThriftError(f"bool element {b} at offset {pos} is not 0, 1 or 2")
    return b == 1, pos + 1


def _byte(r, pos, depth, sch):
    return (r.buf[pos] ^ 0x80) - 0x80, pos + 1


def _double(r, pos, depth, sch):
    return _DBL(r.buf, pos)[0], pos + 8


def _string(r, pos, depth, sch):
    n, start = _uvarint(r.buf, pos, 5)
    if n > r.end - start:
        raise ThriftError(f"string length {n} at offset {pos}; {r.end - start} bytes remain")
    raw = r.buf[start : start + n]
    return (as_string(raw, pos) if sch == "string" else raw), start + n


def _uuid(r, pos, depth, sch):
    if pos + 16 > r.end:
        raise truncated(pos, "a uuid")
    return uuid.UUID(bytes=r.buf[pos : pos + 16]), pos + 16


def _list(r, pos, depth, sch):
    if depth <= 0:
        raise too_deep(pos)
    buf = r.buf
    h = buf[pos]
    n = h >> 4
    p = pos + 1
    if n == 15:
        n, p = _uvarint(buf, p, 5)
    et = _elem_type(h & 0x0F, pos)
    _check_count(r, p, n, MIN_SIZE[et], f"list<{NAME_OF[et]}>")
    try:
        if et in VARINT_LIMIT:
            items, p = _ints(r, et, n, p)
            return finish_list(items, sch), p
        if et in (DOUBLE, BYTE, BOOL):
            a = np.frombuffer(buf, "<f8" if et == DOUBLE else _U8, n, p)
            end = p + n * (8 if et == DOUBLE else 1)
            if et == BOOL:
                if n and a.max() > 2:
                    raise ThriftError(f"a bool in the list at offset {pos} is not 0, 1 or 2")
                a = a == 1
            else:
                a = a.astype(np.float64 if et == DOUBLE else np.int8)
            return finish_list(a if r.numpy else a.tolist(), sch), end
        esch = None if sch is None else element_schema(sch, et, 1)
        items = []
        append = items.append
        if et == STRING and esch is None:
            end = r.end
            for _ in range(n):
                b = buf[p]
                if b < 0x80:
                    ln, s = b, p + 1
                else:
                    ln, s = _uvarint(buf, p, 5)
                if ln > end - s:
                    raise ThriftError(f"string length {ln} at offset {p}; {end - s} remain")
                append(buf[s : s + ln])
                p = s + ln
        else:
            fn = _READ_ELEM[et]
            for _ in range(n):
                v, p = fn(r, p, depth - 1, esch)
                append(v)
    except (IndexError, struct.error):
        raise truncated(p, f"a list<{NAME_OF[et]}> element") from None
    return finish_list(items, sch), p


def _map(r, pos, depth, sch):
    if depth <= 0:
        raise too_deep(pos)
    buf = r.buf
    n, p = _uvarint(buf, pos, 5)
    if n == 0:  # an empty map carries no types
        return {}, p
    kv = buf[p]
    kt, vt = _elem_type(kv >> 4, p), _elem_type(kv & 0x0F, p)
    p += 1
    what = f"map<{NAME_OF[kt]}, {NAME_OF[vt]}>"
    _check_count(r, p, n, MIN_SIZE[kt] + MIN_SIZE[vt], what)
    ksch = None if sch is None else element_schema(sch, kt, 1)
    vsch = None if sch is None else element_schema(sch, vt, 2)
    try:
        if kt in VARINT_LIMIT and (n >= VECTOR_MIN or r.numpy):
            if vt in VARINT_LIMIT:
                return _int_int_map(r, kt, vt, n, p)
            if vt == DOUBLE or (vt == STRING and vsch is None):
                return _int_keyed_map(r, kt, vt, n, p)
        keys: list = []
        vals: list = []
        rk, rv = _READ_ELEM[kt], _READ_ELEM[vt]
        for _ in range(n):
            k, p = rk(r, p, depth - 1, ksch)
            v, p = rv(r, p, depth - 1, vsch)
            keys.append(k)
            vals.append(v)
    except (IndexError, struct.error):
        raise truncated(p, f"a {what} entry") from None
    if r.numpy and kt in NUMPY_DTYPE and vt in NUMPY_DTYPE:
        return (np.array(keys, NUMPY_DTYPE[kt]), np.array(vals, NUMPY_DTYPE[vt])), p
    return make_map(keys, vals), p


def _int_int_map(r: _Reader, kt: int, vt: int, n: int, pos: int):
    """A map of integers to integers: one run of 2n varints."""
    v, end = _varint_run(r, pos, 2 * n, max(VARINT_LIMIT[kt], VARINT_LIMIT[vt]))
    keys, vals = v[0::2], v[1::2]
    for col, t in ((keys, kt), (vals, vt)):
        if t != I64 and (col >> _32).any():
            raise ThriftError(f"a {NAME_OF[t]} in the map at offset {pos} overflows 32 bits")
    keys, vals = _unzigzag(keys, kt, pos), _unzigzag(vals, vt, pos)
    if r.numpy:
        return (keys, vals), end
    return dict(zip(keys.tolist(), vals.tolist(), strict=False)), end


def _next_terminators(b: np.ndarray) -> np.ndarray:
    """For every byte of b, the index of the first byte < 0x80 at or after it (len(b) if none):
    where a varint starting there ends."""
    idx = np.where(b < 0x80, _arange(len(b)), len(b))
    return np.minimum.accumulate(idx[::-1])[::-1]


_AR = np.arange(1 << 16)


def _arange(n: int) -> np.ndarray:
    global _AR
    if n > len(_AR):
        _AR = np.arange(max(n, 2 * len(_AR)))
    return _AR[:n]


def _key_table(r: _Reader, pos: int, win: int) -> tuple[np.ndarray, np.ndarray, bytes]:
    """The window of win bytes at pos, where each byte's varint ends, and how far it runs
    (capped at 255: anything over a varint's limit is refused by the caller)."""
    b = r.arr[pos : pos + win]
    nxt = _next_terminators(b)
    return b, nxt, np.minimum(nxt - _arange(win), 255).astype(_U8).tobytes()


def _int_keyed_map(r: _Reader, kt: int, vt: int, n: int, pos: int):
    """A map from integers to doubles or strings: each entry a varint key, then the value.

    A key may be 1 to 10 bytes, so where entry i+1 starts depends on entry i.
    A table gives, for every byte, how far the varint starting there runs; one
    Python step per entry walks it (and slices the strings). Then the keys are
    gathered into one run of varints and decoded as an array, and so are the
    doubles."""
    limit = VARINT_LIMIT[kt]
    rem = r.end - pos
    # The table covers a window from pos: all a map of doubles can take, and for strings a
    # guess that doubles when a key would not fit, so the work stays linear in the bytes
    # read, whatever a crafted record claims (a table of all that remains, made for each
    # of many small maps, would be quadratic).
    win = min((limit + 8) * n if vt == DOUBLE else 32 * n + 64, rem)
    b, nxt, run = _key_table(r, pos, win)
    starts = [0] * n
    q = 0
    try:
        if vt == DOUBLE:
            for i in range(n):
                starts[i] = q
                q += run[q] + 9
            vals = None
        else:
            buf = r.buf
            vals = [b""] * n
            for i in range(n):
                if q + limit > win and win < rem:
                    win = min(2 * (q + limit) + 64, rem)
                    b, nxt, run = _key_table(r, pos, win)
                starts[i] = q
                e = pos + q + run[q] + 1  # the string's length varint
                ln = buf[e]
                if ln < 0x80:
                    e += 1
                else:
                    ln, e = _uvarint(buf, e, 5)
                q = e + ln - pos
                vals[i] = buf[e : e + ln]
    except IndexError:
        raise truncated(pos + q, f"a map<{NAME_OF[kt]}, {NAME_OF[vt]}> entry") from None
    if q > (win if vt == DOUBLE else rem):
        raise truncated(pos + starts[-1], f"a map<{NAME_OF[kt]}, {NAME_OF[vt]}> entry")
    st = np.array(starts, np.intp)
    ends = nxt[st]
    lens = ends - st + 1
    if lens.max() > limit:
        i = int(np.argmax(lens > limit))
        raise ThriftError(f"varint at offset {pos + starts[i]} is longer than {limit} bytes")
    # the keys' bytes as one contiguous run of varints
    offs = np.cumsum(lens) - lens
    keyb = b[_arange(int(offs[-1] + lens[-1])) + np.repeat(st - offs, lens)]
    v = _varints(keyb, offs, offs + lens - 1, limit, lambda i: pos + starts[i])
    if kt != I64 and (v >> _32).any():
        raise ThriftError(f"a {NAME_OF[kt]} key in the map at offset {pos} overflows 32 bits")
    keys = _unzigzag(v, kt, pos)
    if vals is None:
        vals = np.ndarray((win - 7,), "<f8", b, 0, (1,))[ends + 1].astype(np.float64)
        if r.numpy:
            return (keys, vals), pos + q
        vals = vals.tolist()
    return dict(zip(keys.tolist(), vals, strict=False)), pos + q


_READ_ELEM: tuple = tuple(
    {
        BOOL: _bool_elem,
        BYTE: _byte,
        DOUBLE: _double,
        I16: _int(I16),
        I32: _int(I32),
        I64: _int(I64),
        STRING: _string,
        STRUCT: _struct,
        MAP: _map,
        SET: _list,
        LIST: _list,
        UUID: _uuid,
    }.get(t)
    for t in range(UUID + 1)
)
_READ = _READ_ELEM  # a struct's fields read the same way, bar bools (handled in _struct)
