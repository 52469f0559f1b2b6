"""Indexes: CSV/TSV parsing, URL resolution, meta files, folders, tensors, partitions, errors."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from distlearn.dataset import BadIndex, Dataset, open_index
from distlearn.dataset.processors import Raw


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_csv_relative_absolute_quoted_and_multilabel(tmp_path):
    idx = write(
        tmp_path / "data" / "index.csv",
        "filename,label,label2\n"
        'a.png,cat,\n"b, with comma.png",dog,cat\n'
        "sub/c.png,,\n"
        "/abs/d.png,dog,\n"
        "http://cdn.example/e.png,bird,\n",
    )
    ix = open_index(str(idx))
    base = str(tmp_path / "data")
    a, b, c = (os.path.join(base, n) for n in ("a.png", "b, with comma.png", "sub/c.png"))
    # rows, in file order
    assert [ix.row_source(r) for r in range(ix.num_rows)] == [
        a, b, c, "/abs/d.png", "http://cdn.example/e.png"
    ]  # fmt: skip
    assert ix.labels == ["bird", "cat", "dog"]
    # examples: one per label of each row, by label then filename; the unlabeled last
    assert ix.sources == ["http://cdn.example/e.png", a, b, "/abs/d.png", b, c]
    assert ix.targets.tolist() == [0, 1, 1, 2, 2, -1]
    assert ix.rows.tolist() == [4, 0, 1, 3, 1, 2]
    assert [ix.item_labels(i) for i in range(6)] == [(0,), (1,), (2, 1), (2,), (2, 1), ()]
    assert [len(m) for m in ix.by_label()] == [1, 2, 2]  # the two-label item is in both


@pytest.mark.parametrize("width", [3, 10])  # a few labels a row, and more than 8
def test_a_label_repeated_in_a_row_counts_once(tmp_path, width):
    head = ",".join(["filename"] + [f"label{k}" for k in range(width)])
    rows = ["a.png,cat,cat,dog", "b.png,dog,dog", "c.png,cat,dog,cat", "d.png"]
    if width == 10:
        rows.append("e.png," + ",".join(["dog", "cat"] * 5))
    ix = open_index(str(write(tmp_path / "i.csv", head + "\n" + "\n".join(rows) + "\n")))
    assert ix.labels == ["cat", "dog"]
    names = [os.path.basename(ix.row_source(int(r))) for r in ix.rows]
    want = ["a.png", "c.png", "e.png", "a.png", "b.png", "c.png", "e.png", "d.png"]
    assert names == [n for n in want if width == 10 or n != "e.png"]
    assert ix.row_labels.of(0) == (0, 1) and ix.row_labels.of(1) == (1,)
    assert ix.row_labels.of(2) == (0, 1) and ix.row_labels.of(3) == ()
    if width == 10:
        assert ix.row_labels.of(4) == (1, 0)  # first occurrences, in column order


@pytest.mark.parametrize("sep", [",", "\t"])
def test_every_row_labelled_some_twice(tmp_path, sep):
    """Rows that all have a label, some two (ragged): an example per label of each row,
    by label then name; a label repeated in a row is one example."""
    rows = ["b.png,dog,cat", "a.png,cat", "c.png,dog,dog", "d.png,ant,dog"]
    text = "filename,label1,label2\n" + "\n".join(rows) + "\n"
    ix = open_index(str(write(tmp_path / ("i.tsv" if sep == "\t" else "i.csv"),
                              text.replace(",", sep))))  # fmt: skip
    assert ix.labels == ["ant", "cat", "dog"]
    assert ix.rows.tolist() == [3, 1, 0, 0, 2, 3]
    assert ix.targets.tolist() == [0, 1, 1, 2, 2, 2]
    assert [ix.row_labels.of(r) for r in range(4)] == [(2, 1), (1,), (2,), (0, 2)]


@pytest.mark.parametrize("text", ["b.png,dog\na.png,cat\n", "b.png,dog,dog\na.png,cat\n"])
def test_one_label_a_row_holds_no_pointers_until_asked(tmp_path, text):
    """Rows of one label each (a label repeated in a row is one) keep only their ids;
    the pointers, asked for, are those of one label a row, and the cache keeps none."""
    head = "filename,label\n" if text.count(",") == 2 else "filename,label1,label2\n"
    path = str(write(tmp_path / "i.csv", head + text))
    ix = open_index(path)
    assert ix.row_labels.one_a_row
    held = ix.table.nbytes + ix.rows.nbytes + ix.targets.nbytes + ix.row_labels.ids.nbytes
    assert ix.nbytes == held
    assert [ix.row_labels.of(r) for r in range(2)] == [(1,), (0,)]
    assert ix.row_labels.ptr.tolist() == [0, 1, 2] and len(ix.row_labels) == 2
    cached = Dataset(path, cache_index=True, cache_dir=str(tmp_path / "cache")).index
    again = Dataset(path, cache_index=True, cache_dir=str(tmp_path / "cache")).index
    assert again.row_labels.one_a_row and [again.row_labels.of(r) for r in range(2)] == [(1,), (0,)]
    assert again.targets.tolist() == cached.targets.tolist() == [0, 1]


def test_tsv_offset_length_and_numeric_label_order(tmp_path):
    idx = write(
        tmp_path / "i.tsv",
        "filename\tlabel\toffset\tlength\nshard.bin\t10\t0\t5\nshard.bin\t9\t5\t7\nshard.bin\t2\t12\t1\n",
    )
    ix = open_index(str(idx))
    shard = str(tmp_path / "shard.bin")
    assert ix.labels == ["2", "9", "10"]  # integers sort numerically
    assert ix.sources == [(shard, 12, 1), (shard, 5, 7), (shard, 0, 5)]  # by label
    assert ix.targets.tolist() == [0, 1, 2]


def test_http_index_resolves_against_its_url_and_meta_prefix(tmp_path, serve_dir):
    write(tmp_path / "d" / "train.csv", "filename,label\nx/1.png,a\nhttp://other/2.png,b\n")
    base = serve_dir(tmp_path)
    ix = open_index(base + "d/train.csv")
    assert ix.sources == [base + "d/x/1.png", "http://other/2.png"]
    ix = open_index(base + "d/train.csv", url_params="token=abc")
    assert ix.sources[0] == base + "d/x/1.png?token=abc"
    write(tmp_path / "d" / "index-meta.csv", "url_prefix,url_params\nhttp://cdn.test/root,sig=1\n")
    ix = open_index(base + "d/train.csv")
    assert ix.sources == ["http://cdn.test/root/x/1.png?sig=1", "http://other/2.png?sig=1"]


@pytest.mark.parametrize(
    "name",
    ["a.png", "x/1.png", "x y/é.png", "a.png?v=1", "", "./a.png", "../up/a.png", "x/../b.png",
     "x/./c.png", ".hidden/a.png", "/img/1.png", "//cdn.other/x.png"],
)  # fmt: skip
def test_http_resolution_matches_urljoin(name):
    import urllib.parse

    from distlearn.dataset.fetch import sources

    base = "http://cdn.test/data/set/"
    assert sources.resolve(base, name) == urllib.parse.urljoin(base, name)


def test_http_index_row_with_leading_slash_is_on_the_index_host(tmp_path, serve_dir):
    write(tmp_path / "data" / "index.csv", "filename\n/img/1.png\n")
    write(tmp_path / "img" / "1.png", "root-relative")
    base = serve_dir(tmp_path)
    ds = Dataset(base + "data/index.csv")
    assert ds.index.sources == [base + "img/1.png"]
    seen = []

    def keep(fetched, opt, out):
        seen.append(fetched)
        return True

    with ds.sampled_batcher(batch_size=1, processor=keep, workers="thread") as b:
        b.next_batch()
    assert seen == [b"root-relative"]
    # a local index keeps a leading-slash row as an absolute path
    local = write(tmp_path / "local.csv", "filename\n/img/1.png\n")
    assert open_index(str(local)).sources == ["/img/1.png"]


def test_stem_meta_file_is_found_before_index_meta(tmp_path):
    # torch-dataset names the meta file after the index: train.csv -> train-meta.csv
    idx = write(tmp_path / "train.csv", "filename\na.png\n")
    write(tmp_path / "index-meta.csv", "url_prefix\nhttp://generic/\n")
    assert open_index(str(idx)).sources == ["http://generic/a.png"]
    write(tmp_path / "train-meta.csv", "url_prefix\nhttp://specific/\n")
    assert open_index(str(idx)).sources == ["http://specific/a.png"]


def test_meta_option_local(tmp_path):
    write(tmp_path / "m.csv", "url_prefix\nhttp://h/p/\n")
    idx = write(tmp_path / "i.csv", "filename\na.png\n")
    assert open_index(str(idx), meta=str(tmp_path / "m.csv")).sources == ["http://h/p/a.png"]
    with pytest.raises(FileNotFoundError):
        open_index(str(idx), meta=str(tmp_path / "missing.csv"))


def test_directory_index(tmp_path):
    for rel in ["b/2.png", "a/1.png", "a/deep/3.png", "top.png", ".hidden", "a/.x.png", ".git/c"]:
        write(tmp_path / rel, "x")
    ix = open_index(str(tmp_path))
    names = [os.path.relpath(s, tmp_path) for s in ix.sources]
    assert names == ["a/1.png", "a/deep/3.png", "b/2.png", "top.png"]
    assert ix.labels == ["a", "b"]
    assert ix.targets.tolist() == [0, 0, 1, -1]


def test_directory_index_follows_links_but_not_round_a_loop(tmp_path, caplog):
    """Links are followed as ImageFolder follows them (a class that is a link; two
    classes sharing a folder), but a link back up the tree is not walked:
    os.walk(followlinks=True) went round it until the path was too long, the same
    files again at every level (165 items for 4 files), labelled by the top folder."""
    for rel in ["a/1.png", "b/2.png", "shared/3.png"]:
        write(tmp_path / "data" / rel, "x")
    os.symlink(tmp_path / "data", tmp_path / "data" / "b" / "loop")  # a loop
    os.symlink(tmp_path / "data" / "b", tmp_path / "data" / "b" / "again")  # to itself
    os.symlink(tmp_path / "data" / "shared", tmp_path / "data" / "c")  # a class that is a link
    with caplog.at_level("WARNING", logger="distlearn.dataset.index.table"):
        ix = open_index(str(tmp_path / "data"))
    names = [os.path.relpath(s, tmp_path / "data") for s in ix.sources]
    assert names == ["a/1.png", "b/2.png", "c/3.png", "shared/3.png"]
    assert ix.labels == ["a", "b", "c", "shared"]
    assert "b/loop: a link to a folder above it (a loop)" in caplog.text
    assert "b/again: a link to a folder above it (a loop)" in caplog.text


# In the child below: root gives up the capabilities that let it read any folder
# (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), after its imports, so it is held to the
# folders' modes as any user is. No other user is needed (a machine may have no
# `nobody`), nor read access to the checkout for one (a private 0700 clone).
_DROP_DAC = """
import ctypes, os
class Head(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Caps(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]
libc = ctypes.CDLL(None, use_errno=True)
head, caps = Head(0x20080522, 0), (Caps * 2)()  # _LINUX_CAPABILITY_VERSION_3
if libc.capget(ctypes.byref(head), caps) != 0:
    raise OSError(ctypes.get_errno(), "capget")
keep = ~((1 << 1) | (1 << 2)) & 0xFFFFFFFF  # all but CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
for field in ("effective", "permitted", "inheritable"):
    setattr(caps[0], field, getattr(caps[0], field) & keep)
if libc.capset(ctypes.byref(head), caps) != 0:  # (this thread's: the one that walks)
    raise OSError(ctypes.get_errno(), "capset")
"""


def test_directory_index_refuses_a_folder_it_cannot_list(tmp_path):
    """os.walk passes over a folder it cannot list: a whole label vanished from the
    index, silently, and the label ids after it shifted. Where this test runs as root
    (root lists any folder), its child drops root's power over folder modes first."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="unlistable-", dir="/tmp")
    warm = tmp_path / "warm"
    write(warm / "a" / "1.png", "x")
    try:
        for label in ("cat", "dog"):
            os.makedirs(os.path.join(root, label))
            write(Path(root, label, "1.png"), "x")
        os.chmod(root, 0o755)
        os.chmod(os.path.join(root, "cat"), 0o755)
        os.chmod(os.path.join(root, "dog"), 0o300)  # may enter, may not list
        code = (
            "import os\n"
            "from distlearn.dataset import Dataset\n"
            f"Dataset({str(warm)!r})  # (every module the walk needs, imported now)\n"
            + (_DROP_DAC if os.geteuid() == 0 else "")
            + f"try:\n    os.listdir({os.path.join(root, 'dog')!r})\n"
            "except PermissionError:\n    print('cannot list dog', flush=True)\n"
            f"Dataset({root!r})\n"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert run.stdout == "cannot list dog\n", run.stdout + run.stderr  # (the case is real)
        assert run.returncode != 0, run.stdout
        assert f"BadIndex: {root}/dog: cannot list this folder of the index" in run.stderr
    finally:
        os.chmod(os.path.join(root, "dog"), 0o700)
        shutil.rmtree(root)


def test_directory_index_keeps_names_that_are_not_utf8(tmp_path):
    """A file named in Latin-1 (b'caf\\xe9.png') is in the index and read, as os.walk
    and open() find it; it made the index fail with UnicodeEncodeError."""
    folder = os.fsencode(tmp_path / "cat")
    os.makedirs(folder)
    for name, data in [(b"caf\xe9.png", b"abcd"), (b"plain.png", b"wxyz")]:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    ds = Dataset(str(tmp_path))
    names = [os.path.basename(os.fsencode(s)) for s in ds.index.sources]
    assert names == [b"caf\xe9.png", b"plain.png"]

    with ds.sampled_batcher(batch_size=2, input_dims=(4,), processor=Raw(),
                            sampler="linear") as b:  # fmt: skip
        assert b.next_batch().input.tolist() == [[97, 98, 99, 100], [119, 120, 121, 122]]
    ds = Dataset(str(tmp_path), cache_items=True, cache_dir=str(tmp_path / ".cache"))
    for _ in range(2):  # (stored in the cache, then read from it)
        with ds.sampled_batcher(batch_size=2, input_dims=(4,), processor=Raw(),
                                sampler="linear") as b:  # fmt: skip
            assert b.next_batch().input.tolist() == [[97, 98, 99, 100], [119, 120, 121, 122]]


def test_tensor_dict_and_pt(tmp_path):
    x = torch.arange(12.0).view(6, 2)
    y = torch.tensor([3, 1, 3, 10, 1, 3])
    ix = open_index({"x": x, "y": y})
    assert ix.labels == ["1", "3", "10"] and ix.targets.tolist() == [1, 0, 1, 2, 0, 1]
    torch.save({"x": x, "y": y}, tmp_path / "d.pt")
    ds = Dataset(str(tmp_path / "d.pt"), partition=1, partitions=2)
    with ds.sampled_batcher(batch_size=4, input_dims=(2,)) as b:
        batch = b.next_batch()
    assert len(ds.index) == 3
    # tensors partition by row (torch-dataset's IndexTensor): rows 1, 3, 5 for partition 1
    assert batch.input.tolist() == [[2.0, 3.0], [6.0, 7.0], [10.0, 11.0]]
    assert batch.labels == [("1",), ("10",), ("3",)]
    assert open_index(x).labels == []


def test_list_of_indexes_joins_item_by_item(tmp_path):
    a = write(tmp_path / "a.csv", "filename,label\n1.bin,x\n2.bin,y\n")
    b = write(tmp_path / "b.csv", "filename\n1.json\n2.json\n")
    for f in ["1.bin", "2.bin", "1.json", "2.json"]:
        (tmp_path / f).write_bytes(f.encode())
    seen = []

    def both(fetched, opt, out):
        seen.append(fetched)
        out.fill_(len(fetched))
        return True

    ds = Dataset([str(a), str(b)])
    with ds.sampled_batcher(batch_size=2, input_dims=(1,), processor=both, workers="thread") as bt:
        batch = bt.next_batch()
    assert sorted(seen) == [[b"1.bin", b"1.json"], [b"2.bin", b"2.json"]]
    assert batch.labels == [("x",), ("y",)]
    c = write(tmp_path / "c.csv", "filename\n1.json\n")
    ds = Dataset([str(a), str(c)])  # a different length is fine to open: it may be drawn
    with pytest.raises(BadIndex, match="differ in length"):
        ds.sampled_batcher(processor=both, workers="thread")  # but not left aligned


def test_partitions_cover_index_once_per_label(tmp_path):
    rows = ["filename,label"] + [f"{i}.png,{'abc'[i % 3] if i % 5 else ''}" for i in range(101)]
    idx = write(tmp_path / "i.csv", "\n".join(rows) + "\n")
    whole = open_index(str(idx))
    for parts in (1, 2, 3, 7):
        union: Counter = Counter()
        for r in range(parts):
            p = whole.partition(r, parts)
            union.update(p.sources)
            # per label (and for the unlabeled), sizes differ by at most one across partitions
            assert p.labels == whole.labels
        assert union == Counter(whole.sources), "every item in exactly one partition"
        for key in (-1, 0, 1, 2):
            sizes = [int((whole.partition(r, parts).targets == key).sum()) for r in range(parts)]
            assert max(sizes) - min(sizes) <= 1
    # the rule itself: within a label, the k-th example (from 1) goes to partition k % partitions
    p1 = whole.partition(1, 3)
    label_a = [s for s, t in zip(whole.sources, whole.targets, strict=True) if t == 0]
    assert label_a == sorted(label_a), "a label's examples are in filename order"
    assert [s for s, t in zip(p1.sources, p1.targets, strict=True) if t == 0] == label_a[0::3]


def test_partition_auto_reads_env(tmp_path, monkeypatch):
    idx = write(tmp_path / "i.csv", "filename\n" + "".join(f"{i}\n" for i in range(10)))
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    ds = Dataset(str(idx), partition="auto")
    assert (ds.partition, ds.partitions, len(ds.index)) == (2, 4, 3)  # examples 2, 6, 10


def test_partition_auto_reads_slurm_and_refuses_half_an_environment(tmp_path, monkeypatch):
    idx = write(tmp_path / "i.csv", "filename\n" + "".join(f"{i}\n" for i in range(10)))
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    # outside an srun step (a batch script's shell sees the allocation's), no launch at all
    assert (Dataset(str(idx), partition="auto").partitions, Dataset(str(idx)).partitions) == (1, 1)
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # srun, as ipc.Tree.from_env reads it
    assert (Dataset(str(idx), partition="auto").partition, Dataset(str(idx)).partitions) == (1, 4)
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun's win; without RANK every rank
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE is set without \$RANK"):  # reads 0
        Dataset(str(idx), partition="auto")
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE is set without \$RANK"):
        Dataset(str(idx))
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match=r"\$RANK=4 is not in \[0, \$WORLD_SIZE=4\)"):
        Dataset(str(idx), partition="auto")
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="leave out partitions=2"):
        Dataset(str(idx), partition="auto", partitions=2)
    assert Dataset(str(idx), partition=0, partitions=1).partitions == 1  # explicit wins


@pytest.mark.parametrize(
    "text, match",
    [
        ("", r"i\.csv: empty index \(no header"),
        ("filename,label\n", r"i\.csv: empty index \(a header but no items"),
        ("name,label\na,b\n", r"i\.csv:1: no 'filename' column"),
        ("filename,label\na,b\nc,d,e\n", r"i\.csv:3: 3 fields for a header of 2"),
        ("filename,offset,length\na,1\n", r"i\.csv:2: missing fields \['length'\]"),
        ("filename,filename\na,b\n", r"i\.csv:1: more than one 'filename' column"),
        ("filename,label\n,b\n", r"i\.csv:2: empty filename"),
        ("filename,offset,length\na,x,1\n", r"i\.csv:2: offset/length must be integers"),
        ("filename,offset\na,1\n", r"i\.csv:1: 'offset' and 'length' columns go together"),
        ('filename\n"a\n', r"i\.csv:\d+: .*"),
    ],
)
def test_bad_csv_names_file_and_line(tmp_path, text, match):
    idx = write(tmp_path / "i.csv", text)
    with pytest.raises(BadIndex, match=match):
        open_index(str(idx))


def test_a_byte_that_is_not_utf8_is_named_by_its_line(tmp_path):
    """It was named by its byte offset ("position 85018"), of no use in a large index."""
    rows = "".join(f"{i}.png,cat\n" for i in range(5000))
    path = tmp_path / "i.csv"
    path.write_bytes(b"filename,label\n" + rows.encode() + b"caf\xe9.png,cat\n")
    with pytest.raises(BadIndex, match=r"i\.csv:5002: not UTF-8 text"):
        open_index(str(path))


def test_bad_arguments(tmp_path):
    idx = write(tmp_path / "i.csv", "filename\na\nb\n")
    with pytest.raises(ValueError, match="partition 2 out of range for 2"):
        Dataset(str(idx), partition=2, partitions=2)
    with pytest.raises(ValueError, match="partition -1 out of range"):
        Dataset(str(idx), partition=-1, partitions=2)
    with pytest.raises(BadIndex, match="partition 0 of 3 is empty"):  # a, b: partitions 1, 2
        Dataset(str(idx), partition=0, partitions=3)
    with pytest.raises(FileNotFoundError, match=r"index not found: .*nope\.csv"):
        Dataset(str(tmp_path / "nope.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadIndex, match=r"empty directory index"):
        Dataset(str(tmp_path / "empty"))
    with pytest.raises(TypeError, match="unsupported index"):
        Dataset(42)
    with pytest.raises(BadIndex, match="'y' must be 1-D"):
        Dataset({"x": torch.zeros(3, 2), "y": torch.zeros(2, dtype=torch.long)})


def test_an_unsorted_file_gives_the_sorted_files_index(tmp_path):
    import random

    rows = [f"d{i % 7}/{'é' if i % 5 == 0 else ''}img_{i}.jpg,c{i % 11}\n" for i in range(3000)]
    rows += [f"d9/multi_{i}.jpg,c{i % 3},c{(i + 1) % 4}\n" for i in range(200)]
    rng = random.Random(0)
    shuffled = rows[:]
    rng.shuffle(shuffled)
    a = open_index(
        write(tmp_path / "sorted.csv", "filename,label,label2\n" + "".join(sorted(rows)))
    )
    b = open_index(write(tmp_path / "shuffled.csv", "filename,label,label2\n" + "".join(shuffled)))
    assert a.labels == b.labels
    got = [(b.source(i), b.target(i), b.item_labels(i)) for i in range(len(b))]
    assert got == [(a.source(i), a.target(i), a.item_labels(i))
                   for i in range(len(a))]  # fmt: skip


@pytest.mark.parametrize("multi_hot", [False, True])
@pytest.mark.parametrize("shuffled", [False, True])
def test_partition_by_label_runs_matches_torch_dataset_rule(tmp_path, multi_hot, shuffled):
    """A CSV index's partition finds each label's run by binary search (label_order):
    the same examples as the k-th-of-each-label rule on the targets, mapped or not."""
    import numpy as np

    from distlearn.dataset.index.table import partition_positions

    rng = np.random.default_rng(7)
    lines = []
    for i in range(500):
        first = f"l{rng.integers(0, 9)}" if rng.random() > 0.1 else ""
        second = f"l{rng.integers(0, 9)}" if first and rng.random() < 0.2 else ""
        lines.append(f"f{i:04d}.png,{first},{second}\n")
    if shuffled:
        rng.shuffle(lines)
    path = write(tmp_path / "i.csv", "filename,label,label2\n" + "".join(lines))
    cache = str(tmp_path / "cache")
    for opts in (
        {},
        {"cache_index": True, "cache_dir": cache},
        {"cache_index": True, "cache_dir": cache},
    ):
        whole = Dataset(str(path), multi_hot=multi_hot, **opts).index
        assert whole.label_order  # (the binary-search path is the one tested)
        for n in (1, 3, 8):
            seen = []
            for p in range(n):
                part = whole.partition(p, n)
                want = partition_positions(whole.targets, p, n, whole.split)
                assert part.rows.tolist() == whole.rows[want].tolist()
                assert part.targets.tolist() == whole.targets[want].tolist()
                assert not part.label_order or n == 1
                seen += want.tolist()
            assert sorted(seen) == list(range(len(whole)))
    # by hand: the k-th example of a label (k from 1) goes to partition k % n
    small = write(tmp_path / "s.csv", "filename,label\na,x\nb,x\nc,y\nd,x\ne,\nf,y\ng,\n")
    got = [Dataset(str(small), partition=p, partitions=2).index.rows.tolist() for p in (0, 1)]
    assert got == [[1, 5, 6], [0, 3, 2, 4]]


def test_picks_are_torch_dataset_s_k_mod_partitions_in_every_run():
    """``_picks`` against a plain reading of the rule: within each label's run, the k-th
    example (from 1) goes to partition k % partitions; runs empty, of one example
    each (picks far more than the positions / partitions), or long."""
    from distlearn.dataset.index.table import _picks

    rng = random.Random(0)
    cases = [[rng.randrange(0, 20) for _ in range(rng.randrange(0, 12))] for _ in range(2000)]
    cases += [[1] * 30_000, [0, 40_000], [33_000, 1, 1]]
    for sizes in cases:
        edges = np.cumsum([0, *sizes])
        for partitions in (1, 3, 8, 64):
            for p in {0, 1 % partitions, partitions - 1}:
                want = [lo + k - 1 for lo, hi in itertools.pairwise(edges)
                        for k in range(1, hi - lo + 1) if k % partitions == p]  # fmt: skip
                got = _picks(edges[:-1], edges[1:], p, partitions)
                assert got.tolist() == want, (sizes[:5], partitions, p)


def test_labels_of_one_number_have_one_order_whatever_the_hash_seed(tmp_path):
    """Labels "5", "05", "+5" are one number: they sort by their text after it, so every
    rank (each its own hash seed) gives them the same ids."""
    path = tmp_path / "i.csv"
    labels = ["05", "10", "5", "+5", "005", "9"]
    path.write_text("filename,label\n" + "".join(f"{i}.png,{x}\n" for i, x in enumerate(labels)))
    script = ("import sys; from distlearn.dataset import open_index; "
              "print(open_index(sys.argv[1]).labels)")  # fmt: skip
    procs = [  # side by side: each spends seconds importing torch
        subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONHASHSEED": str(seed)})
        for seed in range(4)
    ]  # fmt: skip
    seen = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0] * 4
    assert seen == {"['+5', '005', '05', '5', '9', '10']"}


def test_an_index_in_file_order_makes_its_rows_only_when_asked(tmp_path):
    """A file in label-then-name order: example i is row i, and no array of every row
    is made to take a partition (10M rows: 40 MB); asked for, the rows are 0..n-1, and
    a partition's rows are the same either way."""
    path = tmp_path / "i.csv"
    path.write_text(
        "filename,label\n" + "".join(f"{c}/{i:03d}.png,{c}\n" for c in "abc" for i in range(50))
    )
    whole = open_index(str(path))
    assert whole._rows is None and len(whole) == 150
    part = whole.partition(1, 4)
    assert whole._rows is None
    again = open_index(str(path))
    assert again.rows.tolist() == list(range(150))  # (made now)
    assert part.rows.tolist() == again.partition(1, 4).rows.tolist()
    assert [part.source(i) for i in range(len(part))] == [again.source(int(r)) for r in part.rows]
