"""Schema-less decoder for TCompactProtocol: ``decode(buf, ...) -> dict keyed by field id``.

Integers are zigzag varints, so nothing has a fixed width. A container of
integers is one run of varints: one nonzero() over its bytes finds where each
ends (a byte below 0x80). A map from integers to doubles or strings interleaves
varint keys with values: one Python step per entry finds where its key ends
(``bytes.find`` over the record translated to T/C marks). Either way the
varints are then known by their offsets, and their values come from a handful
of numpy calls: an 8-byte word read at each, masked to its length, its 7-bit
groups packed together. The varint containers of a record's struct fields are
decoded together, once the record is walked, so those calls are paid once per
record rather than once per container. Everything else is a tight loop over the
bytes.

Hostile input stays bounded: varints end within 10 bytes (5 for lengths, i16
and i32) and must fit their type, counts are checked against the bytes that
remain before anything is allocated and against the record's budget of objects
(``_wire.MAX_OBJECTS``), every search moves forward, nesting is limited, and
every failure is a ThriftError naming the offset. ``_fast.c`` is this decoder
in C, with the same results and errors.
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
    over_budget,
    too_deep,
    truncated,
)

__all__ = ["MIN_SIZE", "VARINT_LIMIT", "VECTOR_MIN", "decode"]

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
_1, _2, _4, _32 = (np.uint64(k) for k in (1, 2, 4, 32))
_PAD = bytes(16)  # past the end, so a word read at a varint near the end stays in bounds
# bytes.translate table: "T" for a byte below 0x80 (a varint's last byte), "C" for the others
_MARKS = bytes(84 if b < 0x80 else 67 for b in range(256))
_T = 84


class _Reader:
    """One record being decoded: the bytes, the options every level needs, and views of the
    bytes that the vectorised paths share, made on first use."""

    __slots__ = ("_arr", "_marks", "_words", "buf", "end", "jobs", "left", "max_objects", "numpy")

    def __init__(self, buf: bytes, numpy: bool, max_objects: int):
        self.buf = buf
        self.end = len(buf)
        self.numpy = numpy
        self.max_objects = max_objects
        self.left = max_objects - 1  # the record's own dict
        self._arr = self._marks = self._words = None
        self.jobs: list[_Job] = []  # containers of varints still to decode

    @property
    def arr(self) -> np.ndarray:
        """The record as a uint8 array, followed by 16 zero bytes (not part of it)."""
        if self._arr is None:
            self._arr = np.frombuffer(self.buf + _PAD, _U8)
        return self._arr

    @property
    def marks(self) -> bytes:
        """The record with each byte replaced by T (below 0x80: a varint ends there) or C:
        ``marks.find(84, q)`` finds where a varint starting at q ends."""
        if self._marks is None:
            self._marks = self.buf.translate(_MARKS)
        return self._marks

    @property
    def words(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Unaligned little-endian views: element i of the first is the 8 bytes from i + 1
        (uint64), of the second the 2 bytes from i + 9 (uint16), of the third the double
        from i + 1. Indexed by the offset just before a varint or a double."""
        if self._words is None:
            a = self.arr
            k = len(a) - 10
            self._words = (
                np.ndarray((k,), "<u8", a, 1, (1,)),
                np.ndarray((k,), "<u2", a, 9, (1,)),
                np.ndarray((k,), "<f8", a, 1, (1,)),
            )
        return self._words


def decode(
    buf: bytes, schema: Mapping[int, Schema] | None, numpy: bool, max_depth: int, max_objects: int
) -> dict:
    r = _Reader(buf, numpy, max_objects)
    value, pos = _struct(r, 0, max_depth, schema)
    if pos != r.end:
        raise ThriftError(f"{r.end - pos} bytes follow the end of the struct at offset {pos}")
    if r.jobs:
        _finish(r)
    return value


# ---------------------------------------------------------------- errors


def _charge(r: _Reader, n: int, pos: int) -> None:
    """n more objects, made at ``pos``: refused past the record's budget."""
    if n > r.left:
        raise over_budget(r.max_objects, pos)
    r.left -= n


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


def _run(r: _Reader, pos: int, m: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The offsets just before each of m consecutive varints at pos starts, and where each ends.

    Each varint ends at a byte below 0x80: one nonzero() over a window of at most
    ``limit`` bytes per varint (and no more than remains) finds them all."""
    avail = min(limit * m, r.end - pos)
    if pos and r.buf[pos - 1] < 0x80:  # the byte before ends a varint too (a count): one array
        e = (r.arr[pos - 1 : pos + avail] < 0x80).nonzero()[0]
        if len(e) <= m:
            raise truncated(pos, f"a run of {m} varints")
        e += pos - 1
        return e[:m], e[1 : m + 1]
    e = (r.arr[pos : pos + avail] < 0x80).nonzero()[0]
    if len(e) < m:
        raise truncated(pos, f"a run of {m} varints")
    e += pos
    ends = e[:m]
    before = np.empty(m, np.intp)
    before[0] = pos - 1
    before[1:] = ends[:-1]
    return before, ends


# a varint of n bytes: the 7-bit groups of its first 8 bytes, and of its 9th and 10th
_MASK_LO = np.array([int.from_bytes(b"\x7f" * min(n, 8), "little") for n in range(11)], _U64)
_MASK_HI = np.array([0] * 9 + [0x7F, 0xFF7F], _U64)  # the 10th byte whole: it may only be 0 or 1
# the 9th and 10th bytes (masked, the 10th at most 1) -> their bits 56-63 of the value
_HIGH = np.array([(h & 0x7F) << 56 | (h >> 8) << 63 for h in range(0x200)], _U64)
_PACK1 = np.uint64(0x3F80_3F80_3F80_3F80)
_KEEP2, _PACK2 = np.uint64(0x0000_3FFF_0000_3FFF), np.uint64(0x0FFF_C000_0FFF_C000)
_KEEP4, _PACK4 = np.uint64(0x0000_0000_0FFF_FFFF), np.uint64(0x00FF_FFFF_F000_0000)


def _varints(r: _Reader, before: np.ndarray, ends: np.ndarray, limit: int) -> np.ndarray:
    """The varints that end at offsets ``ends`` and start after ``before`` (the offset of
    the byte before each), as uint64, not yet unzigzagged.

    Each is read as one 8-byte word (and a 2-byte one for a 9th and 10th byte, looked
    up in a table), the bytes past its end masked off by its length, and its 7-bit
    groups packed together: pairs, then fours, then eights, each step a shift and
    two masks. Lengths over ``limit`` bytes and values over 32 (limit 5) or 64 bits
    are refused, naming the offset where the varint starts."""
    lens = ends - before
    longest = int(lens.max())
    if longest > limit:
        i = int(np.argmax(lens > limit))
        raise ThriftError(f"varint at offset {int(before[i]) + 1} is longer than {limit} bytes")
    lo, hi, _ = r.words
    x = lo[before] & _MASK_LO[lens]
    x -= (x >> _1) & _PACK1  # each 16 bits: a + 256 b -> a + 128 b
    x = (x & _KEEP2) | ((x >> _2) & _PACK2)  # each 32 bits: two 14-bit groups -> 28 bits
    x = (x & _KEEP4) | ((x >> _4) & _PACK4)  # two 28-bit groups -> 56 bits
    if limit == 5:
        if int(x.max()) >> 32 == 0:
            return x
        bad = x >> _32
    elif longest > 8:
        h = hi[before] & _MASK_HI[lens]
        if int(h.max()) < len(_HIGH):  # a 10th byte over 1 would set bits past 63
            x |= _HIGH[h]
            return x
        bad = h >> np.uint64(9)
    else:
        return x
    i = int(np.argmax(bad != 0))
    bits = 32 if limit == 5 else 64
    raise ThriftError(f"varint at offset {int(before[i]) + 1} overflows {bits} bits")


def _unzigzag(v: np.ndarray) -> np.ndarray:
    """Zigzag-decoded uint64 varints as int64."""
    return (v >> _1).view(np.int64) ^ -(v & _1).view(np.int64)


def _narrow(x: np.ndarray, t: int, pos: int) -> np.ndarray:
    """Values of type t (i16, i32 or i64) as their own dtype; ThriftError if out of range."""
    if t == I64:
        return x
    lo = -(1 << (_INT_BITS[t] - 1))
    if ((x < lo) | (x >= -lo)).any():
        raise ThriftError(f"{NAME_OF[t]} out of range in the container at offset {pos}")
    return x.astype(NUMPY_DTYPE[t])


# ---------------------------------------------------------------- containers of varints
#
# A container of varints is found in two steps: while the record is walked, where
# its varints are (offsets before and after each, and the end of the container);
# once the walk is over, their values, with those of every other such container
# that is a struct field, in one pass of numpy calls (a handful of calls per record,
# not per container). A _Job holds the offsets and how to build the value from the
# decoded varints; it stands in the struct's dict until then. A container inside a
# list or a map is decoded at once (its _Job is finished where it was made).


class _Job:
    """A container whose varints are still to decode: their offsets, the limit on their length,
    and ``build``, which makes the value from them (int64, zigzag-decoded)."""

    __slots__ = ("before", "build", "ends", "fid", "home", "limit")

    def __init__(self, before: np.ndarray, ends: np.ndarray, limit: int, build) -> None:
        self.before, self.ends, self.limit, self.build = before, ends, limit, build
        self.home: dict | None = None
        self.fid = 0


def _job(r: _Reader, job: _Job, end: int, defer: bool) -> tuple[Any, int]:
    """The container's value (a _Job standing in for it when ``defer``), and its end."""
    if defer:
        r.jobs.append(job)
        return job, end
    return job.build(_unzigzag(_varints(r, job.before, job.ends, job.limit))), end


def _finish(r: _Reader) -> None:
    """Decode the varints of every deferred container (one pass per length limit) and put
    each container's value where its _Job stands, unless a later field took the place."""
    for limit in (5, 10):
        jobs = [j for j in r.jobs if j.limit == limit]
        if not jobs:
            continue
        if len(jobs) == 1:
            before, ends = jobs[0].before, jobs[0].ends
        else:
            before = np.concatenate([j.before for j in jobs])
            ends = np.concatenate([j.ends for j in jobs])
        x = _unzigzag(_varints(r, before, ends, limit))
        a = 0
        for j in jobs:
            b = a + len(j.ends)
            value = j.build(x[a:b])
            if j.home is not None and j.home.get(j.fid) is j:
                j.home[j.fid] = value
            a = b


def _ints(r: _Reader, t: int, n: int, pos: int, sch, defer: bool) -> tuple[Any, int]:
    """A list or set of n zigzag varints of type t at pos: a list (an array with
    numpy=True; a set if the schema says so), and the end."""
    start = pos
    if n >= VECTOR_MIN or r.numpy:
        if n == 0:
            return finish_list(np.empty(0, NUMPY_DTYPE[t]) if r.numpy else [], sch, pos), pos
        numpy = r.numpy

        def build(x):
            x = _narrow(x, t, pos)
            return finish_list(x if numpy else x.tolist(), sch, pos)

        before, ends = _run(r, pos, n, VARINT_LIMIT[t])
        return _job(r, _Job(before, ends, VARINT_LIMIT[t], build), int(ends[-1]) + 1, defer)
    read = _READ[t]
    out = []
    for _ in range(n):
        x, pos = read(r, pos, 0, None)
        out.append(x)
    return finish_list(out, sch, start), pos


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
                if r.left <= 0:
                    raise over_budget(r.max_objects, pos)
                r.left -= 1
                out[fid] = nib == 1
                pos = p
                continue
            t = _TYPE[nib]
            if t is None:
                raise ThriftError(f"unknown compact type {nib} of field {fid} at offset {pos}")
            if r.left <= 0:
                raise over_budget(r.max_objects, pos)
            r.left -= 1
            sub = None if sch is None else field_schema(sch, fid, t)
            v, pos = _READ[t](r, p, depth - 1, sub)
            out[fid] = v
            if v.__class__ is _Job:  # a container decoded at the end: the job is its placeholder
                v.home, v.fid = out, fid
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


def _list(r, pos, depth, sch, defer=False):
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
    _charge(r, 1 if r.numpy and et in NUMPY_DTYPE else n, p)  # an array costs two objects
    start = p
    try:
        if et in VARINT_LIMIT:
            return _ints(r, et, n, p, sch, defer)
        if et in (DOUBLE, BYTE, BOOL):
            a = np.frombuffer(buf, "<f8" if et == DOUBLE else _U8, n, p)
            end = p + n * (8 if et == DOUBLE else 1)
            if et == BOOL:
                if n and a.max() > 2:
                    raise ThriftError(f"a bool in the list at offset {pos} is not 0, 1 or 2")
                a = a == 1
            else:
                a = a.astype(np.float64 if et == DOUBLE else np.int8)
            return finish_list(a if r.numpy else a.tolist(), sch, start), end
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
    return finish_list(items, sch, start), p


def _map(r, pos, depth, sch, defer=False):
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
    # a pair of arrays costs four objects
    _charge(r, 3 if r.numpy and kt in NUMPY_DTYPE and vt in NUMPY_DTYPE else 2 * n, p)
    start = p
    ksch = None if sch is None else element_schema(sch, kt, 1)
    vsch = None if sch is None else element_schema(sch, vt, 2)
    try:
        if kt in VARINT_LIMIT and (n >= VECTOR_MIN or r.numpy):
            if vt in VARINT_LIMIT:
                return _int_int_map(r, kt, vt, n, p, defer)
            if vt == DOUBLE or (vt == STRING and vsch is None):
                return _int_keyed_map(r, kt, vt, n, p, defer)
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
    return make_map(keys, vals, start), p


def _int_int_map(r: _Reader, kt: int, vt: int, n: int, pos: int, defer: bool):
    """A map of integers to integers: one run of 2n varints, keys and values in turn."""
    numpy = r.numpy

    def build(x):
        keys, vals = _narrow(x[0::2], kt, pos), _narrow(x[1::2], vt, pos)
        if numpy:
            return np.ascontiguousarray(keys), np.ascontiguousarray(vals)
        return dict(zip(keys.tolist(), vals.tolist()))  # noqa: B905 (strict= is slower)

    kl, vl = VARINT_LIMIT[kt], VARINT_LIMIT[vt]
    limit = max(kl, vl)
    before, ends = _run(r, pos, 2 * n, limit)
    if kl != vl:  # an i16 or i32 beside i64s: its varints too end within 5 bytes
        narrow = 0 if kl < vl else 1
        long = (ends - before)[narrow::2] > 5
        if long.any():
            i = 2 * int(np.argmax(long)) + narrow
            raise ThriftError(f"varint at offset {int(before[i]) + 1} is longer than 5 bytes")
    return _job(r, _Job(before, ends, limit, build), int(ends[-1]) + 1, defer)


def _int_keyed_map(r: _Reader, kt: int, vt: int, n: int, pos: int, defer: bool):
    """A map from integers to doubles or strings: each entry a varint key, then the value.

    A key may be 1 to ``limit`` bytes, so where entry i+1 starts depends on entry i:
    one Python step per entry finds where its key ends (``marks.find``: the next byte
    below 0x80; each search starts where the last entry ended, so the work stays
    linear in the record whatever it holds) and slices its string. Then the keys
    are decoded as an array (which refuses the long ones), and so are the doubles."""
    what = f"a map<{NAME_OF[kt]}, {NAME_OF[vt]}> entry"
    find = r.marks.find
    end = r.end
    ends = [0] * n
    q = pos
    if vt == DOUBLE:
        for i in range(n):
            e = find(_T, q)
            if e < 0:
                raise truncated(q, what)
            ends[i] = e
            q = e + 9
        if q > end:
            raise truncated(ends[-1] + 1, what)
        e = np.fromiter(ends, np.intp, n)
        before = np.empty(n, np.intp)  # a key starts 9 bytes after the one before ends
        before[0] = pos - 1
        np.add(e[:-1], 8, out=before[1:])
        vals = None
    else:
        buf = r.buf
        starts = [0] * n
        vals = [b""] * n
        for i in range(n):
            e = find(_T, q)
            if e < 0:
                raise truncated(q, what)
            starts[i] = q
            ends[i] = e
            ln = buf[e + 1]  # the string's length, mostly one byte
            if ln < 0x80:
                s = e + 2
            else:
                ln, s = _uvarint(buf, e + 1, 5)
            q = s + ln
            if q > end:
                raise ThriftError(f"string length {ln} at offset {e + 1}; {end - s} bytes remain")
            vals[i] = buf[s:q]
        e = np.fromiter(ends, np.intp, n)
        before = np.fromiter(starts, np.intp, n)
        before -= 1
    numpy = r.numpy
    if vals is None:
        doubles = r.words[2][e]

        def build(x):
            keys = _narrow(x, kt, pos)
            if numpy:
                return keys, doubles
            return dict(zip(keys.tolist(), doubles.tolist()))  # noqa: B905 (strict= is slower)

    else:

        def build(x):
            return dict(zip(_narrow(x, kt, pos).tolist(), vals))  # noqa: B905 (as above)

    return _job(r, _Job(before, e, VARINT_LIMIT[kt], build), q, defer)


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
# a struct's fields read the same way (bar bools, handled in _struct), but their containers
# of varints are decoded once the record is walked, all together
_READ = tuple(
    (lambda r, pos, depth, sch, f=f: f(r, pos, depth, sch, True)) if f in (_list, _map) else f
    for f in _READ_ELEM
)
