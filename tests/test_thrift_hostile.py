"""dataset.thrift.decode on hostile input: every byte is untrusted.

Records written by thrift's generated classes, cut at every offset, corrupted
at every offset and mutated at random, must give a result or a ThriftError
naming an offset, never another exception or a hang; crafted lengths, counts,
varints and nesting must fail at once, before anything large is allocated.
"""

from __future__ import annotations

import random
import re
import struct
import tracemalloc

import pytest
from test_thrift import IDL, load_generated
from test_thrift_features import FACTORIES, make_record
from thrift.TSerialization import serialize
from thrift_decoders import decoder  # noqa: F401 (an autouse fixture: C and Python)

from distlearn.dataset.formats.thrift import ThriftError, decode

PROTOCOLS = ["binary", "compact"]
OFFSET = re.compile(r"offset \d+")


@pytest.fixture(scope="module")
def records():
    """A full-size feature record and a small one with every type and nesting, per protocol."""
    m = load_generated(IDL / "gen", "feature")
    rng = random.Random(1)
    big = make_record(m, rng, 10)
    small = m.Example(
        features=m.FeatureRecord(
            binaryFeatures={1, -(2**40)},
            continuousFeatures={2**62: 0.5},
            discreteFeatures={-3: 2**33},
            stringFeatures={9: "x"},
            sparseContinuousFeatures={1: {"a": 1.0}},
        ),
        context=[m.FeatureRecord(binaryFeatures=set(range(20)))],
        label=1,
        weight=2.0,
        keep=False,
        source=-1,
        version=7,
        id="id",
        deep={"k": [{1: 1.0}]},
    )
    v2 = m.FeatureRecordV2(
        shape=list(range(-20, 20)),
        dense=[1.0] * 3,
        small=[1, 2],
        tiny=[3],
        flags=[True, False],
        counts={i: i for i in range(18)},
        continuousFeatures={i * 2**50: float(i) for i in range(20)},
        stringFeatures={i * 2**50: str(i) for i in range(20)},
    )
    return {
        p: {name: serialize(rec, f) for name, rec in (("big", big), ("small", small), ("v2", v2))}
        for p, f in FACTORIES.items()
    }


def outcome(data: bytes, protocol: str, **kw):
    """decode's result, or the ThriftError it raised (which must name an offset)."""
    try:
        return decode(data, protocol, **kw)
    except ThriftError as err:
        assert OFFSET.search(str(err)), str(err)
        return err


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_truncated_at_every_offset(records, protocol):
    for name, data in records[protocol].items():
        assert isinstance(outcome(data, protocol), dict)
        for cut in range(len(data)):
            for numpy in (False, True):
                got = outcome(data[:cut], protocol, numpy=numpy)
                assert isinstance(got, ThriftError), (name, cut)
        # and a record with bytes after its end is refused too
        assert "follow the end" in str(outcome(data + b"\x00", protocol))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_corrupted_at_every_offset(records, protocol):
    for name in ("small", "v2"):
        data = records[protocol][name]
        for i in range(len(data)):
            for new in {0x00, 0xFF, 0x80, 0x7F, data[i] ^ 0x01, data[i] ^ 0x80} - {data[i]}:
                bad = data[:i] + bytes([new]) + data[i + 1 :]
                for numpy in (False, True):
                    got = outcome(bad, protocol, numpy=numpy)
                    assert isinstance(got, (dict, ThriftError)), (name, i, new)


@pytest.mark.timeout(240)  # a hang fails here rather than stalling the suite
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_random_mutations(records, protocol):
    rng = random.Random(17)
    seeds = list(records[protocol].values())
    results = {"ok": 0, "error": 0}
    for _ in range(1500):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            i = rng.randrange(len(data))
            if op < 0.5:
                data[i] = rng.randrange(256)
            elif op < 0.65:
                del data[i : i + rng.randint(1, 16)]
            elif op < 0.8:
                data[i:i] = rng.randbytes(rng.randint(1, 16))
            elif op < 0.9:  # a plausible-looking huge length or count
                data[i : i + 4] = struct.pack(">i", rng.choice([2**31 - 1, -1, 2**24, 300]))
            else:
                data[i:i] = b"\xff" * rng.randint(1, 12)  # an over-long varint
        got = outcome(bytes(data), protocol, numpy=rng.random() < 0.5)
        results["ok" if isinstance(got, dict) else "error"] += 1
    assert results["error"] > 100 and results["ok"] > 10, results  # both paths reached


def test_crafted_binary_lengths_fail_before_allocating():
    tracemalloc.start()
    try:
        cases = {
            "string": struct.pack(">bhi", 11, 1, 2**31 - 1) + b"abc",
            "negative string": struct.pack(">bhi", 11, 1, -5) + b"abc\x00",
            "list of i64": struct.pack(">bhbi", 15, 1, 10, 2**31 - 1) + b"\x00" * 64,
            "list of structs": struct.pack(">bhbi", 15, 1, 12, 2**30) + b"\x00" * 64,
            "map": struct.pack(">bhbbi", 13, 1, 10, 11, 2**31 - 1) + b"\x00" * 64,
            "negative count": struct.pack(">bhbi", 15, 1, 8, -1) + b"\x00",
            "unknown element type": struct.pack(">bhbi", 15, 1, 99, 1) + b"\x00" * 8,
            "unknown field type": struct.pack(">bh", 7, 1) + b"\x00" * 8,
        }
        for name, data in cases.items():
            for numpy in (False, True):
                err = outcome(data, "binary", numpy=numpy)
                assert isinstance(err, ThriftError), name
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing near the 2**31 the lengths asked for


def uvarint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def test_crafted_compact_input_is_bounded():
    i64_field = b"\x16"  # field 1, delta 1, type i64
    cases = {
        "11-byte varint": i64_field + b"\xff" * 10 + b"\x01\x00",
        "varint over 64 bits": i64_field + b"\xff" * 9 + b"\x7f\x00",
        "endless varint": i64_field + b"\x80" * 100_000,
        "string length": b"\x18" + uvarint(2**31) + b"abc\x00",
        "list count": b"\x19" + b"\xf6" + uvarint(2**31 - 1) + b"\x00" * 20,
        "map count": b"\x1b" + uvarint(2**30) + b"\x67" + b"\x00" * 20,
        "double map": b"\x1b" + uvarint(100) + b"\x67" + b"\x01" * 500,
        "long keys in a double map": b"\x1b" + uvarint(20) + b"\x67" + b"\xff" * 400,
        "long keys in a string map": b"\x1b" + uvarint(20) + b"\x68" + b"\xff" * 400,
        "vector run of long varints": b"\x19\xf6" + uvarint(40) + b"\xff" * 400,
        "i32 too big": b"\x15" + uvarint(2**33) + b"\x00",
        "i16 out of range": b"\x14" + uvarint(2**17) + b"\x00",
        "field id out of range": b"\x05" + uvarint(2**20) + b"\x00\x00",
        "bool element": b"\x19\x21\x07\x00",
        "unknown type": b"\x1e\x00",
    }
    for name, data in cases.items():
        for numpy in (False, True):
            assert isinstance(outcome(data, "compact", numpy=numpy), ThriftError), name


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_nesting_is_limited(protocol):
    depth = 5000  # far beyond Python's recursion limit if nothing stopped it
    if protocol == "binary":
        data = struct.pack(">bh", 15, 1) + struct.pack(">bi", 15, 1) * depth + b"\x00" * 8
        structs = struct.pack(">bh", 12, 1) * depth + b"\x00" * (depth + 1)
    else:
        data = b"\x19" + b"\x19" * depth + b"\x00" * 8
        structs = b"\x1c" * depth + b"\x00" * (depth + 1)
    for d in (data, structs):
        err = outcome(d, protocol)
        assert isinstance(err, ThriftError) and "too deep" in str(err)
    # the limit is an option; a legitimately deep record decodes under a raised one
    ok = struct.pack(">bh", 12, 1) * 100 + b"\x00" * 101 if protocol == "binary" else None
    ok = ok or b"\x1c" * 100 + b"\x00" * 101
    with pytest.raises(ThriftError, match="too deep"):
        decode(ok, protocol)
    assert decode(ok, protocol, max_depth=101)[1][1][1] is not None
    # a limit raised past what Python's stack takes: still a ThriftError, in both decoders
    with pytest.raises(ThriftError, match="recursion limit"):
        decode(structs, protocol, max_depth=10 * depth)


def test_bad_arguments():
    with pytest.raises(ValueError, match="protocol must be"):
        decode(b"\x00", "json")
    with pytest.raises(ValueError, match="max_depth"):
        decode(b"\x00", max_depth=0)
    with pytest.raises(ValueError, match="struct schema"):
        decode(b"\x00", schema="i32")
    assert decode(bytearray(b"\x00")) == {} and decode(memoryview(b"\x00"), "compact") == {}


@pytest.mark.timeout(120)  # linear work takes seconds; work quadratic in the record, hours
def test_many_small_containers_take_linear_time():
    m = 40_000
    many = 4 * m * 16  # objects: more than the default budget allows
    maps = (uvarint(16) + b"\x68" + b"\x02\x01a" * 16) * m  # map<i64, binary>, 16 entries each
    data = b"\x19" + bytes([0xF0 | 11]) + uvarint(m) + maps + b"\x00"
    got = decode(data, "compact", max_objects=many)
    assert len(got[1]) == m and got[1][0] == {1: b"a"}
    runs = (b"\xf6" + uvarint(16) + b"\x02" * 16) * m  # list<i64>, 16 elements each
    data = b"\x19" + bytes([0xF0 | 9]) + uvarint(m) + runs + b"\x00"
    assert decode(data, "compact", numpy=True)[1][-1].tolist() == [1] * 16
    # structs whose container fields wait for the end of the walk: one pass for them all
    fields = b"\x19\xf6" + uvarint(16) + b"\x02" * 16  # list<i64>
    fields += b"\x1b" + uvarint(16) + b"\x67" + (b"\x02" + bytes(8)) * 16  # map<i64, double>
    data = b"\x19" + bytes([0xF0 | 12]) + uvarint(m) + (fields + b"\x00") * m + b"\x00"
    got = decode(data, "compact", max_objects=many)[1]
    assert len(got) == m and got[-1] == {1: [1] * 16, 2: {1: 0.0}}


@pytest.mark.parametrize("size", [0, 100, 5000])
def test_long_strings_in_a_compact_map(size):
    value = {k * 2**40: bytes([k]) * (size + k) for k in range(40)}
    data = b"\x1b" + uvarint(40) + b"\x68"
    data += b"".join(uvarint(2 * k) + uvarint(len(v)) + v for k, v in value.items()) + b"\x00"
    assert decode(data, "compact") == {1: value}


def zigzag(v: int) -> bytes:
    return uvarint((v << 1) ^ (v >> 63) if v < 0 else v << 1)


def test_compact_varint_errors_name_the_element():
    """The varints of a record's containers are decoded together once the record is walked;
    a bad one is still refused, naming where it starts."""
    elems = [zigzag(i * 2**40) for i in range(20)]
    ok = b"".join(elems)
    bad_at = 1 + 1 + 1 + len(b"".join(elems[:7]))  # field header, list header, count
    cases = {  # a list<i64> field whose 8th element is bad; then a fine second field
        "is longer than 10 bytes": b"\xff" * 10 + b"\x01",
        "overflows 64 bits": b"\xff" * 9 + b"\x02",
    }
    for why, elem in cases.items():
        body = b"".join(elems[:7]) + elem + b"".join(elems[8:])
        data = b"\x19\xf6" + uvarint(20) + body + b"\x19\xf6" + uvarint(20) + ok + b"\x00"
        for numpy in (False, True):
            err = outcome(data, "compact", numpy=numpy)
            assert isinstance(err, ThriftError), why
            assert f"varint at offset {bad_at} {why}" in str(err), (why, str(err))
    # an i32 past 32 bits in a list<i32>, and an i32 key past its range in a map<i32, i64>
    i32s = b"\x19\xf5" + uvarint(20) + zigzag(5) * 19 + uvarint(2**33) + b"\x00"
    assert "overflows 32 bits" in str(outcome(i32s, "compact"))
    i32_keys = b"\x1b" + uvarint(20) + b"\x56" + (zigzag(2**31) + zigzag(1)) * 20 + b"\x00"
    assert "i32 out of range" in str(outcome(i32_keys, "compact"))


def test_compact_fields_decoded_at_the_end_keep_their_place():
    """A container field's value is filled in after the walk: field order, a field id the
    record repeats (the later one wins, as in thrift's classes) and containers of
    structs in lists come out as if each were decoded where it stands."""
    i64s = list(range(-10, 30))
    run = b"\xf6" + uvarint(len(i64s)) + b"".join(zigzag(v) for v in i64s)
    field1_list = b"\x19" + run
    field1_again_i64 = b"\x06" + zigzag(1) + zigzag(-7)  # long form: same id, type i64
    data = field1_list + field1_again_i64 + b"\x00"
    assert decode(data, "compact") == {1: -7}
    data = b"\x16" + zigzag(-7) + b"\x09" + zigzag(1) + run + b"\x00"  # i64, then the list
    assert decode(data, "compact") == {1: i64s}
    # a list of structs, each with a map<i64, double> and a list<i64>; then an i32 field
    doubles = {k * 2**50: k / 4 for k in range(-9, 9)}
    m = uvarint(len(doubles)) + b"\x67"
    m += b"".join(zigzag(k) + struct.pack("<d", v) for k, v in doubles.items())
    elem = b"\x1b" + m + b"\x19" + run + b"\x00"
    data = b"\x19\xfc" + uvarint(3) + elem * 3 + b"\x15" + zigzag(5) + b"\x00"
    got = decode(data, "compact")
    assert list(got) == [1, 2] and got[2] == 5
    assert got[1] == [{1: doubles, 2: i64s}] * 3
    arrays = decode(data, "compact", numpy=True)[1][2]
    assert arrays[1][0].tolist() == list(doubles) and arrays[2].tolist() == i64s
