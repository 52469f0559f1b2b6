"""bench/thrift.py end to end on a few records: every row runs, against thrift's C extension."""

from __future__ import annotations

from bench import thrift as bench_thrift


def test_bench_thrift_writes_every_row(tmp_path):
    assert bench_thrift.main(["--records", "6", "--passes", "1", "--out-dir", str(tmp_path)]) == 0
    text = (tmp_path / "RESULTS-thrift.md").read_text()
    assert "fastbinary" in text  # the C rows ran thrift's C extension
    for protocol in ("binary", "compact"):
        for row in ("decode", "decode numpy", "FeatureRecord dense", "FeatureRecord sparse",
                    "decode, Python", "decode numpy, Python", "C decoder", "deserialize()",
                    "pure Python"):  # fmt: skip
            assert f"| {protocol} | {row} |" in text


def test_records_are_shaped_as_stated():
    recs = bench_thrift.make_records(200, seed=1)
    for name, mean in bench_thrift.SIZES.items():
        sizes = [len(getattr(r, name)) for r in recs]
        assert abs(sum(sizes) / len(sizes) - mean) < mean * 0.05, name
