"""dataset.thrift on feature records, against the thrift package's own generated classes
(tests/thrift_idl/feature.thrift) and its C decoder (thrift.protocol.fastbinary)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_thrift import IDL, load_generated
from thrift.protocol import TBinaryProtocol, TCompactProtocol, fastbinary
from thrift.transport.TTransport import TMemoryBuffer
from thrift.TSerialization import deserialize, serialize
from thrift_decoders import decoder  # noqa: F401 (an autouse fixture: C and Python)

from distlearn.dataset.formats.thrift import FeatureRecord, ThriftError, decode, encode

PROTOCOLS = ["binary", "compact"]
FACTORIES = {
    "binary": TBinaryProtocol.TBinaryProtocolFactory(),
    "compact": TCompactProtocol.TCompactProtocolFactory(),
}
RECORD_SCHEMA = {
    1: ("set", "i64"),
    2: ("map", "i64", "double"),
    3: ("map", "i64", "i64"),
    4: ("map", "i64", "string"),
    5: ("map", "i64", ("set", "string")),
    6: ("map", "i64", ("map", "string", "double")),
    7: ("map", "i64", "binary"),
}
V2_SCHEMA = {
    **RECORD_SCHEMA,
    8: ("list", "i32"),
    9: ("list", "double"),
    10: ("list", "i16"),
    11: ("list", "i8"),
    12: ("list", "bool"),
    13: ("map", "i32", "i16"),
}
EXAMPLE_SCHEMA = {
    1: RECORD_SCHEMA,
    2: ("list", RECORD_SCHEMA),
    3: "i32",
    4: "double",
    5: "bool",
    6: "i8",
    7: "i16",
    8: "string",
    9: ("map", "string", ("list", ("map", "i64", "double"))),
}
EDGE_I64 = [0, 1, -1, 63, -64, 64, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63)]


@pytest.fixture(scope="module")
def feature():
    return load_generated(IDL / "gen", "feature")


def ids(rng: random.Random, n: int) -> list[int]:
    """Feature ids as Twitter's are: 64-bit hashes, plus the edge values of a varint."""
    out = [rng.getrandbits(64) - (1 << 63) for _ in range(n)]
    return out + EDGE_I64[: min(n, len(EDGE_I64))]


def make_record(m, rng: random.Random, scale: int = 1):
    """A feature record like the bench's: sizes about 221/138/64/40 at scale=1."""
    words = [b"a", b"bc", "é-ß".encode(), b"x" * 300, b"\x00\xff"]
    return m.FeatureRecord(
        binaryFeatures=set(ids(rng, 22 * scale)),
        continuousFeatures={k: rng.gauss(0, 10) for k in ids(rng, 14 * scale)}
        | {7: float("inf"), 8: -0.0, 9: 1e-310},
        discreteFeatures={k: rng.choice(EDGE_I64) for k in ids(rng, 6 * scale)},
        stringFeatures={
            k: rng.choice(["", "cat", "naïve", "x" * 200]) for k in ids(rng, 4 * scale)
        },
        sparseBinaryFeatures={1: {"a", "b"}, 2: set()},
        sparseContinuousFeatures={5: {"w": 0.5, "": -2.0}, 6: {}},
        blobFeatures={k: rng.choice(words) for k in ids(rng, 3)},
    )


def as_ids(rec) -> dict:
    """A generated FeatureRecord as the schema-less value decode() returns (sets as lists)."""
    out = {}
    if rec.binaryFeatures is not None:
        out[1] = list(rec.binaryFeatures)
    if rec.continuousFeatures is not None:
        out[2] = dict(rec.continuousFeatures)
    if rec.discreteFeatures is not None:
        out[3] = dict(rec.discreteFeatures)
    if rec.stringFeatures is not None:
        out[4] = {k: v.encode() for k, v in rec.stringFeatures.items()}
    if rec.sparseBinaryFeatures is not None:
        out[5] = {k: [s.encode() for s in v] for k, v in rec.sparseBinaryFeatures.items()}
    if rec.sparseContinuousFeatures is not None:
        out[6] = {
            k: {s.encode(): x for s, x in v.items()}
            for k, v in rec.sparseContinuousFeatures.items()
        }
    if rec.blobFeatures is not None:
        out[7] = dict(rec.blobFeatures)
    return out


def same(got: dict, want: dict) -> None:
    """Equal, with sets compared as sets (decode keeps the wire's order, a set has none)."""
    assert got.keys() == want.keys()
    for fid, w in want.items():
        g = got[fid]
        if fid == 1:
            assert sorted(g) == sorted(w) and len(g) == len(w)
        elif fid == 5:
            assert {k: sorted(v) for k, v in g.items()} == {k: sorted(v) for k, v in w.items()}
        else:
            assert g == w, fid


def c_decode(cls, data: bytes, protocol: str):
    """The thrift package's C extension decoding `data` with the generated class's spec."""
    if protocol == "binary":
        proto = TBinaryProtocol.TBinaryProtocolAccelerated(TMemoryBuffer(data))
        fast = fastbinary.decode_binary
    else:
        proto = TCompactProtocol.TCompactProtocolAccelerated(TMemoryBuffer(data))
        fast = fastbinary.decode_compact
    obj = cls()
    fast(obj, proto, [cls, cls.thrift_spec])
    return obj


def test_the_c_extension_is_there():
    # the comparisons below (and the bench) are against thrift's C decoder, not its Python one
    assert fastbinary.decode_binary and fastbinary.decode_compact


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("scale", [1, 10])
def test_decode_matches_the_c_decoder(feature, protocol, scale):
    rng = random.Random(scale)
    for _ in range(5):
        rec = make_record(feature, rng, scale)
        data = serialize(rec, FACTORIES[protocol])
        c = c_decode(feature.FeatureRecord, data, protocol)
        assert c == rec
        got = decode(data, protocol)
        same(got, as_ids(c))
        # with the schema, strings are str and sets are sets, as the generated class has them
        typed = decode(data, protocol, RECORD_SCHEMA)
        assert typed[1] == rec.binaryFeatures and typed[4] == rec.stringFeatures
        assert typed[5] == rec.sparseBinaryFeatures
        assert typed[6] == rec.sparseContinuousFeatures


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_numpy_form_matches(feature, protocol):
    rec = make_record(feature, random.Random(3), 10)
    data = serialize(rec, FACTORIES[protocol])
    plain, arrays = decode(data, protocol), decode(data, protocol, numpy=True)
    assert arrays[1].dtype == np.int64 and arrays[1].tolist() == plain[1]
    for fid in (2, 3):
        keys, vals = arrays[fid]
        assert keys.dtype == np.int64 and vals.dtype == (np.float64 if fid == 2 else np.int64)
        assert dict(zip(keys.tolist(), vals.tolist(), strict=False)) == plain[fid]
        assert keys.flags.writeable and vals.flags.writeable  # copies, not views of the record
    assert arrays[4] == plain[4]  # strings are not numbers: still a dict


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_every_element_type(feature, protocol):
    rec = feature.FeatureRecordV2(
        shape=[0, 1, -1, 2**31 - 1, -(2**31)] * 5,
        dense=[0.0, -1.5, float("inf"), 1e300] * 5,
        small=[0, -1, 2**15 - 1, -(2**15)] * 5,
        tiny=[0, 1, -1, 127, -128] * 4,
        flags=[True, False, True] * 7,
        counts={i * 7919 - 2**30: (-1) ** i * i for i in range(40)},
    )
    data = serialize(rec, FACTORIES[protocol])
    got = decode(data, protocol)
    assert got == {
        8: rec.shape, 9: rec.dense, 10: rec.small, 11: rec.tiny, 12: rec.flags, 13: rec.counts
    }  # fmt: skip
    arr = decode(data, protocol, numpy=True)
    dtypes = {8: np.int32, 9: np.float64, 10: np.int16, 11: np.int8, 12: np.bool_}
    for fid, dtype in dtypes.items():
        assert arr[fid].dtype == dtype and arr[fid].tolist() == got[fid]
    assert arr[13][0].dtype == np.int32 and arr[13][1].dtype == np.int16
    # and short containers (decoded element by element) agree too
    short = feature.FeatureRecordV2(shape=[5, -5], small=[1], flags=[False], counts={1: 2})
    data = serialize(short, FACTORIES[protocol])
    assert decode(data, protocol) == {8: [5, -5], 10: [1], 12: [False], 13: {1: 2}}
    assert decode(data, protocol, numpy=True)[8].dtype == np.int32


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_empty_containers(feature, protocol):
    rec = feature.FeatureRecordV2(
        binaryFeatures=set(),
        continuousFeatures={},
        discreteFeatures={},
        stringFeatures={},
        sparseBinaryFeatures={},
        shape=[],
        dense=[],
        flags=[],
    )
    data = serialize(rec, FACTORIES[protocol])
    assert decode(data, protocol) == {1: [], 2: {}, 3: {}, 4: {}, 5: {}, 8: [], 9: [], 12: []}
    arr = decode(data, protocol, numpy=True)
    assert arr[1].dtype == np.int64 and arr[1].size == 0 and arr[8].dtype == np.int32
    assert encode(decode(data, protocol), V2_SCHEMA, protocol) == data
    assert decode(serialize(feature.FeatureRecord(), FACTORIES[protocol]), protocol) == {}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_unknown_fields_are_kept(feature, protocol):
    rng = random.Random(5)
    v2 = feature.FeatureRecordV2(**vars(make_record(feature, rng)), shape=[3], flags=[True])
    data = serialize(v2, FACTORIES[protocol])
    # the older generated class skips what it does not know
    old = c_decode(feature.FeatureRecord, data, protocol)
    assert old.continuousFeatures == v2.continuousFeatures
    # schema-less decode keeps everything; an older schema types what it knows
    got = decode(data, protocol, RECORD_SCHEMA)
    assert got[8] == [3] and got[12] == [True] and got[1] == v2.binaryFeatures


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_nested_structs(feature, protocol):
    rng = random.Random(7)
    ex = feature.Example(
        features=make_record(feature, rng),
        context=[make_record(feature, rng), feature.FeatureRecord(), make_record(feature, rng)],
        label=-3,
        weight=0.25,
        keep=True,
        source=-7,
        version=300,
        id="ex-1",
        deep={"a": [{1: 0.5}, {}], "": []},
    )
    data = serialize(ex, FACTORIES[protocol])
    got = decode(data, protocol)
    same(got[1], as_ids(ex.features))
    assert len(got[2]) == 3 and got[2][1] == {}
    same(got[2][2], as_ids(ex.context[2]))
    assert (got[3], got[4], got[5], got[6], got[7], got[8]) == (-3, 0.25, True, -7, 300, b"ex-1")
    assert got[9] == {b"a": [{1: 0.5}, {}], b"": []}
    # round trip through our encoder, read back by the generated class, byte for byte
    again = encode(got, EXAMPLE_SCHEMA, protocol)
    assert again == data
    assert deserialize(feature.Example(), again, FACTORIES[protocol]) == ex


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("form", ["plain", "numpy", "typed"])
def test_encode_round_trips(feature, protocol, form):
    rec = feature.FeatureRecordV2(
        **vars(make_record(feature, random.Random(11), 10)),
        shape=[1, -2, 3] * 9,
        dense=[0.5] * 20,
        small=[-3] * 17,
        tiny=[1, -1],
        flags=[True, False] * 9,
        counts={-5: 7, 2**31 - 1: -(2**15)},
    )
    data = serialize(rec, FACTORIES[protocol])
    if form == "typed":
        value = decode(data, protocol, V2_SCHEMA)
    else:
        value = decode(data, protocol, numpy=form == "numpy")
    again = encode(value, V2_SCHEMA, protocol)
    if form != "typed":  # a set from the schema loses the wire's order; otherwise byte for byte
        assert again == data
    assert deserialize(feature.FeatureRecordV2(), again, FACTORIES[protocol]) == rec
    back = c_decode(feature.FeatureRecordV2, again, protocol)
    assert back == rec


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_encode_checks_arrays(protocol):
    schema = {1: ("list", "i32"), 2: ("map", "i64", "double"), 3: ("list", "double")}
    with pytest.raises(ThriftError, match="outside i32"):
        encode({1: np.array([2**31])}, schema, protocol)
    with pytest.raises(ThriftError, match="integer array"):
        encode({1: np.array([1.5])}, schema, protocol)
    with pytest.raises(ThriftError, match="2 keys but 1 values"):
        encode({2: (np.array([1, 2]), np.array([0.5]))}, schema, protocol)
    with pytest.raises(ThriftError, match="1-D"):
        encode({3: np.zeros((2, 2))}, schema, protocol)
    data = encode({1: np.arange(20, dtype=np.int16), 3: np.arange(3)}, schema, protocol)
    assert decode(data, protocol) == {1: list(range(20)), 3: [0.0, 1.0, 2.0]}


# ---------------------------------------------------------------- the processor


def feature_bytes(feature, protocol, binary, cont, disc, strings=None):
    rec = feature.FeatureRecord(
        binaryFeatures=set(binary),
        continuousFeatures=cont,
        discreteFeatures=disc,
        stringFeatures=strings,
    )
    return serialize(rec, FACTORIES[protocol])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_processor_dense_vocab(feature, protocol):
    vocab = [2**62, -5, 17, 3, 99]
    proc = FeatureRecord(protocol, vocab=vocab)
    data = feature_bytes(feature, protocol, {17, 1234}, {-5: 0.5, 99: 2.0, 777: 1.0}, {3: 4},
                         {1: "ignored"})  # fmt: skip
    out = torch.full((5,), 9.0)
    ok, extra = proc(data, None, out)
    assert ok and extra == {"features": 4, "skipped": 2}  # 1234 and 777 are not in the vocab
    assert out.tolist() == [0.0, 0.5, 1.0, 4.0, 2.0]


@pytest.mark.parametrize("dim", [97, 128])  # a power of two takes a mask, not a division
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_processor_dense_hashing_matches_python(feature, protocol, dim):
    rng = random.Random(2)
    rec = make_record(feature, rng, 10)
    data = serialize(rec, FACTORIES[protocol])
    want = [0.0] * dim
    for k in rec.binaryFeatures:
        want[k % dim] += 1.0
    for k, v in list(rec.continuousFeatures.items()) + list(rec.discreteFeatures.items()):
        want[k % dim] += v
    out = torch.empty(1, dim)
    ok, extra = FeatureRecord(protocol, dim=dim)(data, None, out)
    n = len(rec.binaryFeatures) + len(rec.continuousFeatures) + len(rec.discreteFeatures)
    assert ok and extra == {"features": n, "skipped": 0}
    finite = [i for i, w in enumerate(want) if abs(w) < 1e30]
    np.testing.assert_allclose(out[0, finite].numpy(), np.float32([want[i] for i in finite]),
                               rtol=1e-5, atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_processor_sparse(feature, protocol):
    proc = FeatureRecord(protocol, dim=1000, layout="sparse", fields=(2, 1))
    data = feature_bytes(feature, protocol, [1005], {7: 0.25, 2007: -1.0}, {})
    out = torch.empty(2, 5)
    ok, extra = proc(data, None, out)
    assert ok and extra == {"features": 3, "skipped": 0}
    # in the order of `fields`, each in wire order
    assert out[:, :3].tolist() == [[7.0, 7.0, 5.0], [0.25, -1.0, 1.0]]
    assert out[0, 3:].tolist() == [-1, -1] and out[1, 3:].tolist() == [0, 0]
    small = torch.empty(2, 2)
    with pytest.raises(ThriftError, match="3 features; the sparse row holds 2"):
        proc(data, None, small)
    ok, extra = FeatureRecord(protocol, dim=1000, layout="sparse", overflow="truncate")(
        data, None, small
    )
    assert ok and extra == {"features": 2, "skipped": 1}


def test_processor_options_are_checked(feature):
    with pytest.raises(ValueError, match="exactly one of dim"):
        FeatureRecord()
    with pytest.raises(ValueError, match="exactly one of dim"):
        FeatureRecord(dim=3, vocab=[1])
    with pytest.raises(ValueError, match="layout"):
        FeatureRecord(dim=3, layout="csr")
    with pytest.raises(ValueError, match="repeated"):
        FeatureRecord(vocab=[1, 2, 1])
    with pytest.raises(ValueError, match="protocol"):
        FeatureRecord("json", dim=3)
    proc = FeatureRecord(dim=4, fields=(4,))
    data = feature_bytes(feature, "binary", [], {}, {}, {1: "x"})
    with pytest.raises(ThriftError, match="feature field 4"):
        proc(data, None, torch.empty(4))
    with pytest.raises(ValueError, match="dense row needs input_dims of 4"):
        FeatureRecord(dim=4)(data, None, torch.empty(5))


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_processor_in_a_batcher(feature, tmp_path, workers):
    from distlearn.dataset import Dataset
    from distlearn.dataset.formats import write_tfrecord

    (tmp_path / "parts").mkdir()
    want = []
    for p in range(2):
        frames = []
        for i in range(5):
            n = p * 5 + i
            data = feature_bytes(feature, "compact", [n], {100 + n: n / 2}, {200: -n})
            frames.append(write_tfrecord(data))
            row = [0.0] * 8
            row[n % 8] += 1
            row[(100 + n) % 8] += n / 2
            row[200 % 8] -= n
            want.append(row)
        (tmp_path / "parts" / f"part-{p:05d}.tfrecord").write_bytes(b"".join(frames))
    ds = Dataset(tmp_path / "parts")
    batcher = ds.sampled_batcher(
        batch_size=4,
        input_dims=(8,),
        processor=FeatureRecord("compact", dim=8),
        workers=workers,
        pool_size=2,
    )
    try:
        rows, extras = [], []
        for batch in batcher:
            rows += batch.input.tolist()
            extras += batch.extra
    finally:
        batcher.close()
    assert rows == want
    assert extras[0] == {"features": 3, "skipped": 0}
