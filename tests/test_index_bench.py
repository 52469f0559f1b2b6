"""bench/index.py end to end on small indexes: every row runs, pandas and pyarrow beside us."""

from __future__ import annotations

import pytest

from bench import index as bench_index


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_index_writes_every_row(tmp_path):
    argv = ["--rows", "20000", "--reps", "1", "--share-rows", "20000", "--world", "2",
            "--data", str(tmp_path / "data"), "--out-dir", str(tmp_path)]  # fmt: skip
    assert bench_index.main(argv) == 0
    text = (tmp_path / "RESULTS-index.md").read_text()
    for row in bench_index.ROW_LABELS.values():  # (some rows only beside a variant's name)
        assert f"| 20,000 | {row} " in text, row
    for variant in bench_index.VARIANTS.values():  # pandas beside each variant
        assert f"| 20,000 | `pandas.read_csv`{variant} |" in text, variant
        assert f"| 20,000 | `Dataset(path)`{variant} |" in text, variant
    assert "label-permutation" in text
    assert "| cached (memory-mapped, shared) |" in text


def test_the_generated_index_is_imagenet_like(tmp_path):
    path = tmp_path / "i.csv"
    bench_index.make_csv(path, 5000)
    lines = path.read_text().splitlines()
    assert lines[0] == "filename,label" and len(lines) == 5001
    assert lines[1:] == sorted(lines[1:])  # sorted by filename, as ImageNet's lists are
    labels = {line.split(",")[1] for line in lines[1:]}
    assert len(labels) == 1000 and all(
        line.startswith(line.split(",")[1] + "/") for line in lines[1:]
    )


@pytest.mark.parametrize("variant", ["quoted", "ragged"])
def test_the_variants_read_as_the_csv_module_reads_them(tmp_path, variant):
    import csv

    sorted_ = tmp_path / "s.csv"
    bench_index.make_csv(sorted_, 2000)
    path = tmp_path / "v.csv"
    bench_index.make_csv(path, 2000, variant)
    with open(sorted_, newline="") as f:
        want = list(csv.reader(f))
    with open(path, newline="") as f:
        got = list(csv.reader(f))
    if variant == "quoted":
        assert got == want and path.read_bytes().count(b'"') == 4 * 2001
        assert path.read_bytes().count(b"\r\n") == 2001
    else:
        assert got[0] == ["filename", "label1", "label2"]
        assert [r[:2] for r in got[1:]] == want[1:]
        assert [len(r) for r in got[1:5]] == [3, 2, 2, 2]  # ragged: a second label every 4th
