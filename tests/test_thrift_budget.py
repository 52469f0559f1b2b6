"""dataset.thrift's budget: what one record may cost, in memory and time, whatever it holds.

A record decodes into at most ``max_objects`` objects (default MAX_OBJECTS,
1,000,000): a struct field, a list or set element, a map key or value is one, an
array two, a (keys, values) pair of arrays four; each costs at most about 150
bytes. The attack that issue 54 found (a 16 MiB list of empty structs took 72x its
size, 1.2 GB, and 9 s) is refused at its count, before anything is made. Memory is
watched with tracemalloc, which sees what both decoders allocate (the C one too).
Every test runs on the C decoder and on the pure-Python one.
"""

from __future__ import annotations

import gc
import random
import struct
import tracemalloc
import uuid

import pytest
from test_thrift import IDL, load_generated
from thrift.protocol import TBinaryProtocol, TCompactProtocol
from thrift.TSerialization import serialize
from thrift_decoders import decoder  # noqa: F401 (an autouse fixture: C and Python)

from distlearn.dataset.formats.thrift import MAX_OBJECTS, ThriftError, _native, decode

PROTOCOLS = ["binary", "compact"]
MiB = 1 << 20
PER_OBJECT = 150  # bytes: the most one object costs (the costliest shape below: 148)
ACCELERATED = {  # thrift's own encoder, in C
    "binary": TBinaryProtocol.TBinaryProtocolAcceleratedFactory(),
    "compact": TCompactProtocol.TCompactProtocolAcceleratedFactory(),
}


def uvarint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def zigzag(v: int) -> bytes:
    return uvarint((v << 1) ^ (v >> 63))


def list_field(protocol: str, elem_type: str, n: int, body: bytes) -> bytes:
    """A struct of one field 1: list<elem_type> of n elements written as ``body``."""
    binary = {"struct": 12, "list": 15, "map": 13, "bool": 2, "i64": 10, "binary": 11}
    compact = {"struct": 12, "list": 9, "map": 11, "bool": 1, "i64": 6, "binary": 8}
    if protocol == "binary":
        return struct.pack(">bhbi", 15, 1, binary[elem_type], n) + body + b"\x00"
    return b"\x19" + bytes([0xF0 | compact[elem_type]]) + uvarint(n) + body + b"\x00"


def measured(fn):
    """True (or the ThriftError fn() raised, still held), the peak of the memory fn() took,
    and what is still taken once its result is dropped."""
    gc.collect()
    tracemalloc.start()
    try:
        try:
            result = fn()
        except ThriftError as err:
            result = err
        _, peak = tracemalloc.get_traced_memory()
        outcome = result if isinstance(result, ThriftError) else True
        del result
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return outcome, peak, held


@pytest.mark.timeout(60)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_16_mib_list_of_empty_structs_is_refused_at_its_count(protocol):
    n = 16 * MiB
    data = list_field(protocol, "struct", n, b"\x00" * n)
    err, peak, _ = measured(lambda: decode(data, protocol))
    assert isinstance(err, ThriftError)
    assert f"more than {MAX_OBJECTS} objects" in str(err) and "(limit max_objects)" in str(err)
    assert peak < MiB  # nothing was made: the count alone exceeds the budget


BUDGETS = [100_000, pytest.param(MAX_OBJECTS, marks=pytest.mark.slow)]  # the default: ~10 s


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_empty_structs_written_by_thrift_itself_stop_at_the_budget(protocol, budget):
    """Example(context=[FeatureRecord()] * n), written by thrift's C encoder: the record's dict,
    its field and n structs are n + 2 objects, so budget - 2 structs decode (in at most
    PER_OBJECT bytes each) and one more is refused."""
    m = load_generated(IDL / "gen", "feature")
    n = budget - 2
    empty = m.FeatureRecord()
    data = serialize(m.Example(context=[empty] * n), ACCELERATED[protocol])
    ok, peak, held = measured(lambda: decode(data, protocol, max_objects=budget))
    assert ok is True and peak < PER_OBJECT * budget and held < MiB
    data = serialize(m.Example(context=[empty] * (n + 1)), ACCELERATED[protocol])
    err, peak, held = measured(lambda: decode(data, protocol, max_objects=budget))
    assert isinstance(err, ThriftError) and "max_objects" in str(err)
    assert peak < MiB and held < MiB


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_record_refused_half_way_costs_at_most_the_budget_and_leaves_nothing(protocol, budget):
    """16 MiB of lists of 1000 empty structs each: every count fits the budget, so the decoder
    makes objects until the budget runs out; what it made is bounded by the budget and freed."""
    field = list_field(protocol, "struct", 1000, b"\x00" * 1000)
    inner = field[3 if protocol == "binary" else 1 : -1]  # the list alone, as an element
    k = 16 * MiB // len(inner)
    data = list_field(protocol, "list", k, inner * k)
    err, peak, held = measured(lambda: decode(data, protocol, max_objects=budget))
    assert isinstance(err, ThriftError) and f"more than {budget} objects" in str(err)
    assert peak < PER_OBJECT * budget and held < MiB, (peak, held)


def shapes(protocol: str, n: int) -> dict[str, tuple[bytes, int, int]]:
    """Records of n elements of one costly shape: (bytes, objects, objects with numpy=True)."""
    b = protocol == "binary"
    one_bool = struct.pack(">bhb", 2, 1, 1) + b"\x00" if b else b"\x11\x00"
    one_empty = struct.pack(">bh", 12, 1) + b"\x00\x00" if b else b"\x1c\x00\x00"
    empty_i64s = struct.pack(">bi", 10, 0) if b else b"\x06"
    one_i64 = struct.pack(">biq", 10, 1, 5) if b else b"\x16" + zigzag(5)
    empty_map = struct.pack(">bbi", 10, 10, 0) if b else b"\x00"
    i64s = [1000 + i for i in range(n)]
    big = b"".join(struct.pack(">q", v) if b else zigzag(v) for v in i64s)
    pairs = b"".join(struct.pack(">qq", v, v) if b else zigzag(v) * 2 for v in i64s[: n // 2])
    i64_map = (
        struct.pack(">bhbbi", 13, 1, 10, 10, n // 2) + pairs + b"\x00"
        if b
        else b"\x1b" + uvarint(n // 2) + b"\x66" + pairs + b"\x00"
    )
    strings = b"".join(
        (struct.pack(">i", 1) if b else b"\x01") + bytes([i % 128]) for i in range(n)
    )
    return {  # the record's dict and its field are 2 objects; an array 2, a pair 4
        "empty structs": (list_field(protocol, "struct", n, b"\x00" * n), n + 2, n + 2),
        "structs of one bool": (list_field(protocol, "struct", n, one_bool * n), 2 * n + 2,
                                2 * n + 2),
        "structs of one empty struct": (list_field(protocol, "struct", n, one_empty * n),
                                        2 * n + 2, 2 * n + 2),
        "empty lists of i64": (list_field(protocol, "list", n, empty_i64s * n), n + 2, 2 * n + 2),
        "lists of one i64": (list_field(protocol, "list", n, one_i64 * n), 2 * n + 2, 2 * n + 2),
        "empty maps": (list_field(protocol, "map", n, empty_map * n), n + 2,
                       (4 if b else 1) * n + 2),
        "1-byte strings": (list_field(protocol, "binary", n, strings), n + 2, n + 2),
        "i64s": (list_field(protocol, "i64", n, big), n + 2, 3),
        "a map of i64 to i64": (i64_map, n + 2, 5),
    }  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_each_costly_shape_stays_within_its_stated_bound(protocol):
    """For each shape: a budget of exactly its objects decodes it, one fewer refuses it, and it
    costs at most PER_OBJECT bytes an object beside the record's own bytes (arrays: at most 8
    bytes per byte of the record; the pure-Python compact decoder's vectorised varints take up
    to 48 while they are decoded: 41 measured, for one-byte varints)."""
    n = 10_000
    python = _native.decode is None
    per_byte = 48 if python and protocol == "compact" else 8
    for name, (data, objects, as_arrays) in shapes(protocol, n).items():
        for numpy, count in ((False, objects), (True, as_arrays)):
            ok, peak, held = measured(
                lambda d=data, c=count, np=numpy: decode(d, protocol, numpy=np, max_objects=c)
            )
            assert ok is True, (name, numpy, ok)
            assert peak < PER_OBJECT * count + per_byte * len(data), (name, numpy, peak / count)
            assert held < MiB
            with pytest.raises(ThriftError, match=f"more than {count - 1} objects"):
                decode(data, protocol, numpy=numpy, max_objects=count - 1)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_arrays_do_not_count_their_elements(protocol):
    n = 2 * MAX_OBJECTS  # far more numbers than the budget has objects
    body = b"".join(struct.pack(">q", i) if protocol == "binary" else zigzag(i) for i in range(n))
    data = list_field(protocol, "i64", n, body)
    assert decode(data, protocol, numpy=True)[1][-1] == n - 1
    with pytest.raises(ThriftError, match="max_objects"):
        decode(data, protocol)  # as Python ints they are over it


def uuid_map(protocol: str, keys: list[uuid.UUID]) -> bytes:
    """A struct of one field 1: map<uuid, i32> of the keys, each to 1."""
    if protocol == "binary":
        head = struct.pack(">bhbbi", 13, 1, 16, 8, len(keys))
        return head + b"".join(k.bytes + struct.pack(">i", 1) for k in keys) + b"\x00"
    head = b"\x1b" + uvarint(len(keys)) + b"\xd5"  # key type uuid (13), value i32 (5)
    return head + b"".join(k.bytes + zigzag(1) for k in keys) + b"\x00"


@pytest.mark.timeout(60)  # a dict of 20,000 such keys would take about 30 minutes
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_uuid_keys_crafted_to_share_a_hash_are_refused(protocol):
    """uuid.UUID hashes as its int, mod 2**61 - 1: keys that differ by multiples of it share
    one hash, and each insert into a dict compares with all before it (in Python code)."""
    p = (1 << 61) - 1
    crafted = [uuid.UUID(int=5 + i * p) for i in range(20_000)]
    with pytest.raises(ThriftError, match="on one hash"):
        decode(uuid_map(protocol, crafted), protocol)
    # as a set, when a schema asks for one
    if protocol == "binary":
        data = struct.pack(">bhbi", 14, 1, 16, len(crafted)) + b"".join(
            k.bytes for k in crafted
        ) + b"\x00"  # fmt: skip
    else:
        data = b"\x1a\xfd" + uvarint(len(crafted)) + b"".join(k.bytes for k in crafted) + b"\x00"
    assert len(decode(data, protocol)[1]) == len(crafted)  # a list: nothing hashed
    with pytest.raises(ThriftError, match="on one hash"):
        decode(data, protocol, {1: ("set", "uuid")})
    # random uuids, and a few repeated ones, are fine
    rng = random.Random(4)
    keys = [uuid.UUID(bytes=rng.randbytes(16)) for _ in range(5000)] + crafted[:3] * 100
    assert len(decode(uuid_map(protocol, keys), protocol)[1]) == 5003


def test_max_objects_is_checked():
    for bad in (0, -1, 1.5, "10", None):
        with pytest.raises(ValueError, match="max_objects"):
            decode(b"\x00", max_objects=bad)
    assert decode(b"\x00", max_objects=1) == {}  # the record's own dict is its one object
    with pytest.raises(ThriftError, match="more than 1 objects"):
        decode(b"\x08\x00\x01\x00\x00\x00\x07\x00", max_objects=1)  # one i32 field
