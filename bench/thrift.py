"""`python -m bench.thrift`: dataset.thrift.decode against thrift's own decoders, same run.

    python -m bench.thrift                    # 500 records, 7 passes -> bench/RESULTS-thrift.md
    python -m bench.thrift --quick            # 100 records, 3 passes -> bench/out/

Data: synthetic feature records shaped like Twitter's DataRecord (the
FeatureRecord struct of tests/thrift_idl/feature.thrift), seeded. Per record,
each size drawn from a normal law with a 15% spread around: 221 ids in
set<i64> binaryFeatures, 138 entries in map<i64, double> continuousFeatures
(values N(0, 10)), 64 in map<i64, i64> discreteFeatures (values uniform in
[-1000, 100000)), 40 in map<i64, string> stringFeatures (4-43 characters of
[a-z0-9_]). Feature ids are uniform 64-bit hashes, as real ones are. About
6.4 KB a record in the binary protocol, 6.6 KB in the compact one (a 64-bit
hash is a 9- or 10-byte varint).

Rows, per protocol, every one in this process on the same bytes:
- ``decode``: ``dataset.thrift.decode(data, protocol)``, no schema, Python objects,
  by the compiled decoder (dataset/formats/thrift/_fast.c) where it was built;
- ``decode numpy``: the same with ``numpy=True`` (numeric containers as arrays);
- ``FeatureRecord dense`` / ``sparse``: the processor filling a batch row, dense
  (2**12 hashed columns) or sparse (1024 slots of column, value; 2**20 columns);
- ``decode, Python`` / ``decode numpy, Python``: ``decode`` by the pure-Python
  decoders (_binary.py, _compact.py), what runs where the C could not be built,
  and what ran before it was: the before and after of the same run;
- ``C decoder``: the thrift package's C extension (``fastbinary.decode_binary``
  or ``decode_compact``) with the spec of the generated class, called directly:
  the fastest way the thrift package decodes;
- ``deserialize()``: ``thrift.TSerialization.deserialize`` with the accelerated
  protocol factory, what code using generated classes usually calls;
- ``pure Python``: the generated class's ``read()`` over ``TBinaryProtocol`` /
  ``TCompactProtocol`` (the C extension unused), on a fifth of the records.

A pass decodes every record once with each row: the rows take turns on chunks
of 25 records, in a rotating order, so a slower moment of a shared machine
slows every row alike. Time is this thread's CPU time, not the wall clock:
records/s is what one core decodes, and time spent waiting for a core that
other processes hold is not counted. Each row's figure is the median over the
passes (min-max), and its ratio to the C decoder the median of the per-pass
ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
GEN = REPO / "tests" / "thrift_idl" / "gen"
SIZES = {"binaryFeatures": 221, "continuousFeatures": 138, "discreteFeatures": 64,
         "stringFeatures": 40}  # fmt: skip
DENSE_COLUMNS = 1 << 12
SPARSE_SLOTS = 1024
CHUNK = 25  # records each row decodes in a turn


def make_records(n: int, seed: int = 0) -> list:
    """n generated FeatureRecord objects as described above."""
    sys.path.insert(0, str(GEN))
    from feature.ttypes import FeatureRecord

    rng = random.Random(seed)
    chars = string.ascii_lowercase + string.digits + "_"

    def size(name: str) -> int:
        return max(0, round(rng.gauss(SIZES[name], SIZES[name] * 0.15)))

    def ids(k: int) -> list[int]:
        return [rng.getrandbits(64) - (1 << 63) for _ in range(k)]

    return [
        FeatureRecord(
            binaryFeatures=set(ids(size("binaryFeatures"))),
            continuousFeatures={k: rng.gauss(0, 10) for k in ids(size("continuousFeatures"))},
            discreteFeatures={
                k: rng.randrange(-1000, 100000) for k in ids(size("discreteFeatures"))
            },
            stringFeatures={
                k: "".join(rng.choices(chars, k=rng.randrange(4, 44)))
                for k in ids(size("stringFeatures"))
            },
        )
        for _ in range(n)
    ]


def c_extension() -> str:
    """Proof that thrift's C extension is what the C rows run, or SystemExit saying why not."""
    try:
        from thrift.protocol import TBinaryProtocol, TCompactProtocol, fastbinary
        from thrift.transport.TTransport import TMemoryBuffer
    except ImportError as err:
        raise SystemExit(
            f"thrift's C extension (thrift.protocol.fastbinary) is missing: {err}"
        ) from None
    b = TBinaryProtocol.TBinaryProtocolAccelerated(TMemoryBuffer(b""))
    c = TCompactProtocol.TCompactProtocolAccelerated(TMemoryBuffer(b""))
    if b._fast_decode is not fastbinary.decode_binary or c._fast_decode is None:
        raise SystemExit("thrift's accelerated protocols do not use fastbinary here")
    return fastbinary.__file__


def rows(protocol: str) -> dict[str, Callable[[list[bytes]], int]]:
    """Each row: a function decoding a chunk of records once, returning how many it did."""
    import torch
    from feature.ttypes import FeatureRecord as Generated
    from thrift.protocol import TBinaryProtocol, TCompactProtocol, fastbinary
    from thrift.transport.TTransport import TMemoryBuffer
    from thrift.TSerialization import deserialize

    from distlearn.dataset.formats.thrift import FeatureRecord, _native, decode

    if protocol == "binary":
        accel, fast = TBinaryProtocol.TBinaryProtocolAccelerated, fastbinary.decode_binary
        factory = TBinaryProtocol.TBinaryProtocolAcceleratedFactory()
        plain = TBinaryProtocol.TBinaryProtocol
    else:
        accel, fast = TCompactProtocol.TCompactProtocolAccelerated, fastbinary.decode_compact
        factory = TCompactProtocol.TCompactProtocolAcceleratedFactory()
        plain = TCompactProtocol.TCompactProtocol
    spec = [Generated, Generated.thrift_spec]
    proto = accel(TMemoryBuffer(b""))
    dense = FeatureRecord(protocol, dim=DENSE_COLUMNS)
    dense_row = torch.empty(DENSE_COLUMNS)
    sparse = FeatureRecord(protocol, dim=1 << 20, layout="sparse")
    sparse_row = torch.empty(2, SPARSE_SLOTS)

    def ours(chunk):
        for d in chunk:
            decode(d, protocol)
        return len(chunk)

    def ours_numpy(chunk):
        for d in chunk:
            decode(d, protocol, numpy=True)
        return len(chunk)

    def ours_dense(chunk):
        for d in chunk:
            dense(d, None, dense_row)
        return len(chunk)

    def ours_sparse(chunk):
        for d in chunk:
            sparse(d, None, sparse_row)
        return len(chunk)

    def python(numpy: bool):
        def row(chunk):
            native, _native.decode = _native.decode, None  # the pure-Python decoders
            try:
                for d in chunk:
                    decode(d, protocol, numpy=numpy)
            finally:
                _native.decode = native
            return len(chunk)

        return row

    def c_decoder(chunk):
        for d in chunk:
            proto.trans = TMemoryBuffer(d)
            fast(Generated(), proto, spec)
        return len(chunk)

    def c_deserialize(chunk):
        for d in chunk:
            deserialize(Generated(), d, factory)
        return len(chunk)

    def pure_python(chunk):
        few = chunk[: max(1, len(chunk) // 5)]  # a fifth: it is that slow
        for d in few:
            Generated().read(plain(TMemoryBuffer(d)))
        return len(few)

    return {
        "decode": ours,
        "decode numpy": ours_numpy,
        "FeatureRecord dense": ours_dense,
        "FeatureRecord sparse": ours_sparse,
        "decode, Python": python(False),
        "decode numpy, Python": python(True),
        "C decoder": c_decoder,
        "deserialize()": c_deserialize,
        "pure Python": pure_python,
    }


def check_agreement(protocol: str, recs: list, datas: list[bytes]) -> None:
    """Our decode gives what the generated class holds, for the first records."""
    from distlearn.dataset.formats.thrift import decode

    for rec, d in list(zip(recs, datas, strict=True))[:20]:
        got = decode(d, protocol)
        ok = (
            sorted(got[1]) == sorted(rec.binaryFeatures)
            and got[2] == rec.continuousFeatures
            and got[3] == rec.discreteFeatures
            and got[4] == {k: v.encode() for k, v in rec.stringFeatures.items()}
        )
        if not ok:
            raise SystemExit(f"decode disagrees with the generated class ({protocol})")


def measure(protocol: str, recs: list, passes: int) -> list[dict]:
    from thrift.protocol import TBinaryProtocol, TCompactProtocol
    from thrift.TSerialization import serialize

    factory = (
        TBinaryProtocol.TBinaryProtocolFactory()
        if protocol == "binary"
        else TCompactProtocol.TCompactProtocolFactory()
    )
    datas = [serialize(r, factory) for r in recs]
    check_agreement(protocol, recs, datas)
    table = rows(protocol)
    names = list(table)
    chunks = [datas[i : i + CHUNK] for i in range(0, len(datas), CHUNK)]
    for fn in table.values():  # warm-up: caches, first-call costs
        fn(datas)
    rates: dict[str, list[float]] = {name: [] for name in names}
    counts: dict[str, int] = {}
    for p in range(passes):
        spent = dict.fromkeys(names, 0.0)
        counts = dict.fromkeys(names, 0)
        # each row decodes each chunk in turn, in a rotating order: a slower moment of
        # a shared machine lands on every row alike
        for i, chunk in enumerate(chunks):
            k = (p + i) % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.thread_time()
                counts[name] += table[name](chunk)
                spent[name] += time.thread_time() - t0
        for name in names:
            rates[name].append(counts[name] / spent[name])
    c = rates["C decoder"]
    nbytes = sum(len(d) for d in datas) / len(datas)
    return [
        {
            "kind": "thrift",
            "protocol": protocol,
            "row": name,
            "records": counts[name],
            "bytes_per_record": nbytes,
            "rates": rates[name],
            "median": statistics.median(rates[name]),
            "min": min(rates[name]),
            "max": max(rates[name]),
            "vs_c": statistics.median(r / b for r, b in zip(rates[name], c, strict=True)),
        }
        for name in names
    ]


def markdown(results: list[dict], cmd: str, ext: str, passes: int, n: int) -> str:
    from bench.report import machine
    from distlearn.dataset.formats.thrift import _native

    ours = (
        f"`{_native._fast.__file__}`"
        if _native.decode is not None
        else "not built (every decode row is the pure-Python decoders)"
    )
    m = machine()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        "# dataset.thrift decode vs thrift's decoders",
        "",
        f"`{cmd}`, {when}, commit `{m.get('commit', '?')}`, {n} records, {passes} passes.",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} usable cores, "
        f"Python {m.get('python', '?')}, load average at start {m['loadavg_start'][0]:.2f}. "
        f"thrift's C extension: `{ext}`. dataset.thrift's C decoder: {ours}.",
        "",
        "Data: synthetic feature records (bench/thrift.py says how they are drawn): "
        "set<i64> of ~221 ids, map<i64, double> of ~138, map<i64, i64> of ~64, "
        "map<i64, string> of ~40, ids uniform 64-bit hashes. records/s: records per second "
        "of CPU time of the decoding thread, median over the passes (min-max); vs C: "
        "median of the per-pass ratios to the C decoder. The `, Python` rows are `decode` "
        "by the pure-Python decoders (where the C is not built; what decode ran before it "
        "was), in the same run.",
        "",
        "| protocol | decoder | bytes/record | records/s | vs C decoder |",
        "|---|---|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['protocol']} | {r['row']} | {r['bytes_per_record']:,.0f} | "
            f"{r['median']:,.0f} ({r['min']:,.0f}-{r['max']:,.0f}) | {r['vs_c']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.thrift", description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, help="records in the set (default 500; quick 100)")
    p.add_argument("--passes", type=int, help="timed passes over the set (default 7; quick 3)")
    p.add_argument("--protocols", nargs="+", choices=("binary", "compact"),
                   default=["binary", "compact"])  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--out-dir", help="RESULTS-thrift.md goes here (default bench/; quick bench/out)"
    )
    args = p.parse_args(argv)
    n = args.records or (100 if args.quick else 500)
    passes = args.passes or (3 if args.quick else 7)
    out_dir = Path(args.out_dir or (BENCH / "out" if args.quick else BENCH))
    ext = c_extension()
    recs = make_records(n, args.seed)
    results = []
    for protocol in args.protocols:
        results += measure(protocol, recs, passes)
    cmd = "python -m bench.thrift" + ("".join(f" {a}" for a in (argv or sys.argv[1:])))
    text = markdown(results, cmd, ext, passes, n)
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "RESULTS-thrift.md").write_text(text)
    jsonl = BENCH / "out" / "thrift.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
