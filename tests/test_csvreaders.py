"""The CSV readers' one contract and their selector (dataset/index/csv/reader.py): a test
chooses readers through the ``readers=`` seam (or ``$DISTLEARN_CSV_READERS`` in a process
that opens through Dataset), never by switching a module's globals off."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_csvarrow import opened, same

from distlearn.dataset import BadIndex, Dataset
from distlearn.dataset.index.csv import reader
from distlearn.dataset.index.csv.contract import Source
from distlearn.dataset.index.csv.lines import built

FIX = Path(__file__).parent / "torch_dataset"
# every reader (the C one first where it was built), pyarrow then the csv module, the csv
# module alone
WAYS = [None, ("arrow", "csv"), ("csv",)]


def reader_of(path, readers=None, sep=",") -> str:
    """Which reader gives the rows of the local file `path`."""
    return reader.read(Source(str(path), sep, str(path)), readers).reader


@pytest.mark.parametrize(
    "name", sorted(p.name for p in FIX.glob("*.csv") if not p.name.endswith("-meta.csv"))
)
def test_torch_dataset_s_indexes_read_alike_every_way(name):
    """torch-dataset's own fixtures (ragged rows, no labels, a meta file beside one)."""
    got = opened(FIX / name, WAYS)
    assert not isinstance(got[0], str), got[0]
    same(got)


def test_the_readers_are_asked_in_their_declared_order():
    assert [r.name for r in reader.READERS] == ["lines", "arrow", "csv"]
    assert [r.name for r in reader.choose(["csv", "arrow"])] == ["arrow", "csv"]
    assert [r.name for r in reader.choose()] == (["lines"] if built() else []) + ["arrow", "csv"]


def test_each_kind_of_file_goes_to_the_first_reader_that_takes_it(tmp_path):
    files = {
        "plain": (b"filename,label\na.png,x\nb.png,y\n", "lines" if built() else "arrow"),
        "quoted": (b'"filename","label"\r\n"a,b.png","x"\r\n', "arrow"),
        "ranges": (b"filename,offset,length\na.bin,10,2\nb.bin, 3 ,4\n", "arrow"),
        "odd quote": (b'filename,label\na.png,x\nab"c.png,y\n', "csv"),
    }
    for name, (data, want) in files.items():
        path = tmp_path / f"{name}.csv"
        path.write_bytes(data)
        assert reader_of(path) == want, name
        assert reader_of(path, ("arrow", "csv")) == ("csv" if want == "csv" else "arrow"), name
        assert reader_of(path, ("csv",)) == "csv"


@pytest.mark.parametrize(
    "values, want, by",
    [
        ("10,2", [("a.bin", 10, 2)], "arrow"),
        (" 10 ,\t2", [("a.bin", 10, 2)], "arrow"),  # ASCII spaces: pyarrow trims, int() strips
        ("+10,2", [("a.bin", 10, 2)], "csv"),  # pyarrow's cast refuses the sign
        ("0x10,2", "offset/length must be integers", "csv"),  # pyarrow's cast reads hex
        ("1_0,2", [("a.bin", 10, 2)], "csv"),  # int() reads the underscore
        ("-1,2", "negative offset/length", "csv"),
        (",2", "offset/length must be integers", "csv"),
        ("99999999999999999999,2", r"offset/length past 2\*\*63 - 1", "csv"),
        ("1e3,2", "offset/length must be integers", "csv"),
    ],
)
def test_offset_and_length_columns_read_as_the_csv_module_reads_them(tmp_path, values, want, by):
    """pyarrow learnt offset/length columns (the numpy route read them): its cast reads
    some values int() refuses and refuses some it reads; those files are declined."""
    path = tmp_path / "r.csv"
    path.write_bytes(b"filename,offset,length\n" + f"a.bin,{values}\n".encode())
    got = opened(path, WAYS)
    same(got)
    if isinstance(want, str):
        assert isinstance(got[0], str), got[0]
        with pytest.raises(BadIndex, match=want):
            reader.from_csv(str(path))
        with pytest.raises(BadIndex, match=r"none of the CSV readers asked \(arrow\)"):
            reader.from_csv(str(path), readers=("arrow",))  # (pyarrow declines it)
    else:
        url, offset, length = got[0].source(0)
        assert [(url.rsplit("/", 1)[1], offset, length)] == want
        assert reader_of(path, ("arrow", "csv")) == by


def test_rows_of_one_name_are_in_offset_order_every_way(tmp_path):
    """Examples go by label, name, then offset and length: rows of one name whose
    offsets descend are sorted, though their names never descend (pyarrow's reader gave
    the names' descents, and the file was taken for one in order)."""
    path = tmp_path / "r.csv"
    rows = ["a.bin,10,1", "a.bin,5,1", "b.bin,30,2", "b.bin,30,1", "c.bin,0,1"]
    path.write_text("filename,offset,length\n" + "\n".join(rows) + "\n")
    got = opened(path, WAYS)
    same(got)
    spans = [got[0].source(i)[1:] for i in range(len(got[0]))]
    assert spans == [(5, 1), (10, 1), (30, 1), (30, 2), (0, 1)]
    assert reader_of(path) == "arrow"


def test_generated_offset_length_indexes_read_alike_every_way(tmp_path):
    """Whole rows (the mutated indexes of test_csvarrow cut some short, which sends
    nearly every offset/length file to the csv module): names repeated with offsets in
    any order, labels or none, sorted or not, quoted or not."""
    import csv
    import random

    from test_csvtext import write_rows

    taken = set()
    for seed in range(30):
        rng = random.Random(seed)
        header = ["filename", "offset", "length"] + ["label"] * (seed % 2)
        rows = [
            [
                f"n{rng.randrange(8)}.bin",
                str(rng.randrange(50)),
                str(rng.randrange(1, 9)),
                rng.choice(["a", "b", ""]),
            ][: len(header)]
            for _ in range(rng.randrange(1, 200))
        ]
        if seed % 3 == 0:
            rows.sort()
        quoting = csv.QUOTE_ALL if seed % 4 == 1 else csv.QUOTE_MINIMAL
        path = tmp_path / f"g{seed}.csv"
        path.write_bytes(write_rows([header, *rows], quoting, "\n"))
        got = opened(path, WAYS)
        assert not isinstance(got[0], str), got[0]
        same(got)
        taken.add(reader_of(path))
    assert taken == {"arrow"}


def test_a_reader_name_is_checked_naming_the_closest(tmp_path):
    with pytest.raises(ValueError, match=r"no CSV reader 'arow'; did you mean 'arrow'\?"):
        reader.choose(["arow"])
    with pytest.raises(ValueError, match="no CSV reader named"):
        reader.choose([])
    with pytest.raises(TypeError, match="a list of reader names"):
        reader.choose("csv")


def test_a_file_no_chosen_reader_takes_is_an_error_naming_them(tmp_path):
    path = tmp_path / "q.csv"
    path.write_bytes(b'filename,label\na.png,x\nab"c.png,y\n')
    with pytest.raises(BadIndex, match=r"none of the CSV readers asked \(arrow\) reads it"):
        reader.from_csv(str(path), readers=("arrow",))


def test_the_environment_chooses_for_a_process_that_opens_through_dataset(tmp_path, monkeypatch):
    path = tmp_path / "i.csv"
    path.write_bytes(b"filename,label\na.png,x\nb.png,y\n")
    monkeypatch.setenv(reader.READERS_ENV, "csv")
    assert [r.name for r in reader.choose()] == ["csv"]
    assert reader_of(path) == "csv"
    assert len(Dataset(str(path))) == 2
    monkeypatch.setenv(reader.READERS_ENV, "lines,arow")
    with pytest.raises(ValueError, match="did you mean 'arrow'"):
        Dataset(str(path))
