"""The C decoder (dataset/formats/thrift/_fast.c) against the pure-Python one, record by record.

For every record, random or mutated: both give the same value (same types, same
dtypes, the same bits), or both raise ThriftError; the C one never crashes. The
records: values of random schemas written by ``encode`` (every type, nesting,
containers either side of the compact decoder's vector threshold), feature records
written by thrift's generated classes, then each cut, corrupted and mutated, and
random bytes; decoded with and without a schema, ``numpy=True`` and a small
``max_objects`` now and then, so the budget runs out at every kind of place.

Under a memory checker (the run of this module's records reported in the notes was
built with -fsanitize=address,undefined):

    python tests/test_thrift_native.py 20000      # records per protocol
"""

from __future__ import annotations

import math
import random
import struct
import sys
import uuid

import numpy as np
import pytest
from test_thrift import IDL, load_generated
from thrift.TSerialization import serialize

from distlearn.dataset.formats.thrift import (
    ThriftError,
    _binary,
    _compact,
    _native,
    encode,
)

pytestmark = pytest.mark.skipif(_native.decode is None, reason="the C decoder is not built")
PROTOCOLS = ["binary", "compact"]
SCALARS = ["bool", "byte", "i16", "i32", "i64", "double", "string", "binary", "uuid"]
KEYS = ["byte", "i16", "i32", "i64", "double", "string", "binary", "uuid", "bool"]
EDGES = {
    "byte": [0, 1, -1, 127, -128],
    "i16": [0, -1, 63, -64, 64, 32767, -32768],
    "i32": [0, -1, 2**31 - 1, -(2**31), 8191, -8192],
    "i64": [0, -1, 2**63 - 1, -(2**63), 2**31, 2**56, -(2**56) - 1],
    "double": [0.0, -0.0, math.inf, -math.inf, 1e-310, 5e-324, 1.5],
}


# ---------------------------------------------------------------- comparing results


def same(a, b) -> bool:
    """Equal as decode results: the same types all the way down (bool is not int), arrays
    of the same dtype and shape, floats and arrays bit for bit (NaN payloads included)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, dict):  # insertion order too: both keep the wire's order
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, set):  # of scalars of one type; NaNs compared by their bits
        return sorted(map(canonical, a)) == sorted(map(canonical, b))
    return a == b


def canonical(x):
    return struct.pack("<d", x) if isinstance(x, float) else x


def outcome(dec, data: bytes, schema, numpy: bool, max_objects: int):
    try:
        return dec(data, schema, numpy, 64, max_objects)
    except ThriftError as err:
        return err


def check(data: bytes, protocol: str, schema=None, numpy=False, max_objects=1_000_000):
    """C and Python agree on ``data``; returns "ok" or "error"."""
    py = _binary.decode if protocol == "binary" else _compact.decode

    def c(data, schema, numpy, depth, budget):
        return _native.decode(data, protocol == "compact", schema, numpy, depth, budget)

    got = outcome(c, data, schema, numpy, max_objects)
    want = outcome(py, data, schema, numpy, max_objects)
    if isinstance(want, ThriftError) or isinstance(got, ThriftError):
        assert isinstance(got, ThriftError) and isinstance(want, ThriftError), (
            protocol,
            numpy,
            max_objects,
            data.hex(),
            got,
            want,
        )
        if "max_objects" in str(want) and "max_objects" in str(got):
            assert str(got) == str(want)  # charged at the same places, in the same order
        return "error"
    assert same(got, want), (protocol, numpy, max_objects, data.hex(), got, want)
    return "ok"


# ---------------------------------------------------------------- random records


def random_schema(rng: random.Random, depth: int = 3):
    r = rng.random()
    if depth == 0 or r < 0.45:
        return rng.choice(SCALARS)
    if r < 0.62:
        return ("list", random_schema(rng, depth - 1))
    if r < 0.7:
        return ("set", rng.choice(KEYS))
    if r < 0.85:
        key = rng.choice(KEYS) if rng.random() < 0.9 else random_schema(rng, depth - 1)
        return ("map", key, random_schema(rng, depth - 1))
    return random_struct(rng, depth - 1)


def random_struct(rng: random.Random, depth: int = 3) -> dict:
    fids = rng.sample([*range(1, 20), 100, 300, -5, 32767], rng.randint(0, 5))
    return {f: random_schema(rng, depth) for f in fids}


def random_value(rng: random.Random, sch):
    if isinstance(sch, dict):
        return {f: random_value(rng, s) for f, s in sch.items() if rng.random() < 0.85}
    if isinstance(sch, tuple):
        n = rng.choice([0, 1, 2, 5, 15, 16, 17, 40])
        if sch[0] == "list":
            return [random_value(rng, sch[1]) for _ in range(n)]
        if sch[0] == "set":
            return {random_value(rng, sch[1]) for _ in range(n)}
        keys = [random_value(rng, sch[1]) for _ in range(n)]
        return [(k, random_value(rng, sch[2])) for k in keys]  # pairs: any key type
    if sch in EDGES and rng.random() < 0.3:
        return rng.choice(EDGES[sch])
    if sch == "bool":
        return rng.random() < 0.5
    if sch in ("byte", "i16", "i32", "i64"):
        bits = {"byte": 8, "i16": 16, "i32": 32, "i64": 64}[sch]
        return rng.randrange(-(1 << (bits - 1)), 1 << (bits - 1)) >> rng.randrange(bits)
    if sch == "double":
        return rng.choice([rng.gauss(0, 1e3), struct.unpack("<d", rng.randbytes(8))[0]])
    if sch == "string":
        return "".join(rng.choice("ab é€😀") for _ in range(rng.randrange(6)))
    if sch == "binary":
        return rng.randbytes(rng.randrange(20))
    return uuid.UUID(bytes=rng.randbytes(16))


def random_records(rng: random.Random, protocol: str, n: int) -> list[tuple[bytes, dict]]:
    out = []
    while len(out) < n:
        sch = random_struct(rng)
        try:
            out.append((encode(random_value(rng, sch), sch, protocol), sch))
        except (ThriftError, TypeError):  # e.g. a set of NaN-free floats that encode refuses
            continue
    return out


def feature_records(protocol: str) -> list[bytes]:
    from test_thrift_features import FACTORIES, make_record

    m = load_generated(IDL / "gen", "feature")
    rng = random.Random(3)
    recs = [make_record(m, rng, scale) for scale in (1, 3)]
    recs.append(m.Example(features=recs[0], context=[recs[0], m.FeatureRecord()], label=-3))
    return [serialize(r, FACTORIES[protocol]) for r in recs]


def mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        i = rng.randrange(len(out) + 1)
        op = rng.random()
        if op < 0.45 and out:
            out[min(i, len(out) - 1)] = rng.randrange(256)
        elif op < 0.6:
            del out[i : i + rng.randint(1, 12)]
        elif op < 0.75:
            out[i:i] = rng.randbytes(rng.randint(1, 12))
        elif op < 0.85:
            out[i : i + 4] = struct.pack(">i", rng.choice([2**31 - 1, -1, 2**20, 17, 0]))
        elif op < 0.93:
            out[i:i] = b"\xff" * rng.randint(1, 11)
        else:
            out = out[:i]
    return bytes(out)


def options(rng: random.Random, schema):
    return {
        "schema": schema if rng.random() < 0.5 else None,
        "numpy": rng.random() < 0.5,
        "max_objects": rng.choice([1, 2, 5, 20, 60, 200, 1000]) if rng.random() < 0.25 else 10**6,
    }


def run(protocol: str, count: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(f"{seed}-{protocol}")
    seeds = [(d, None) for d in feature_records(protocol)]
    seeds += random_records(rng, protocol, 200)
    results = {"ok": 0, "error": 0}
    for data, sch in seeds:  # every seed as written, with each option
        for numpy in (False, True):
            results[check(data, protocol, sch, numpy)] += 1
            results[check(data, protocol, None, numpy)] += 1
    for _ in range(count):
        data, sch = rng.choice(seeds)
        r = rng.random()
        if r < 0.15:  # cut short
            data = data[: rng.randrange(len(data) + 1)]
        elif r < 0.9:
            data = mutate(rng, data)
        else:
            data = rng.randbytes(rng.randrange(64))
        results[check(data, protocol, **options(rng, sch))] += 1
    return results


# ---------------------------------------------------------------- tests


@pytest.mark.timeout(600)
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_c_and_python_agree_on_random_and_mutated_records(protocol):
    results = run(protocol, 6000)
    assert results["ok"] > 1000 and results["error"] > 1000, results  # both paths reached


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_c_and_python_agree_on_every_cut_and_every_corrupted_byte(protocol):
    rng = random.Random(5)
    recs = random_records(rng, protocol, 6) + [(d, None) for d in feature_records(protocol)[:1]]
    for data, sch in recs:
        for cut in range(len(data)):
            check(data[:cut], protocol, sch, numpy=cut % 2 == 0)
        for i in range(0, len(data), max(1, len(data) // 300)):
            for new in (0x00, 0xFF, 0x80, data[i] ^ 0x01):
                bad = data[:i] + bytes([new]) + data[i + 1 :]
                check(bad, protocol, None, numpy=new & 1 == 0)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_budget_runs_out_at_the_same_place(protocol):
    """For every budget from 1 up to what the record needs, both decoders refuse (with the
    same message) or both decode it: the charges are the same, in the same order."""
    rng = random.Random(9)
    for data, sch in random_records(rng, protocol, 40):
        for numpy in (False, True):
            for budget in range(1, 120):
                if check(data, protocol, sch, numpy, budget) == "ok":
                    break


def test_the_c_decoder_is_what_decode_uses():
    from distlearn.dataset.formats import thrift

    assert thrift.built()
    assert thrift._native.decode is thrift._native._fast.decode


if __name__ == "__main__":  # under a memory checker: python tests/test_thrift_native.py N
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    for p in PROTOCOLS:
        print(p, run(p, n, seed=int(sys.argv[2]) if len(sys.argv) > 2 else 1), flush=True)
