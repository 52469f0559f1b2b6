"""Record readers: WebDataset tar (checked against webdataset's reader), TFRecord, lines, gzip."""

from __future__ import annotations

import gzip
import io
import logging
import random
import struct
import tarfile

import pytest
import webdataset as wds

from distlearn.dataset.formats import (
    ReadStats,
    TooLarge,
    damage,
    masked_crc32c,
    part_format,
    read_part,
    tfrecord,
    write_tfrecord,
)
from distlearn.dataset.formats import tar as tar_format


def write_shard(path, n, start=0, long_keys=False):
    """A WebDataset shard of n samples written by webdataset's own TarWriter."""
    rng = random.Random(start)
    with wds.TarWriter(str(path)) as sink:
        for i in range(start, start + n):
            key = f"s{i:06d}" + ("/" + "x" * 120 if long_keys else "")
            sink.write(
                {
                    "__key__": key,
                    "png": rng.randbytes(rng.randrange(0, 3000)),
                    "cls": str(i % 10).encode(),
                    "json": {"i": i},
                }
            )


def ours(path, **kw):
    stats = ReadStats()
    out = list(read_part(path.read_bytes(), str(path), stats=stats, **kw))
    return out, stats


def test_tar_matches_webdataset_reader(tmp_path):
    path = tmp_path / "shard-000.tar"
    write_shard(path, 57)
    got, stats = ours(path)
    theirs = list(wds.WebDataset(str(path), shardshuffle=False))
    assert len(got) == len(theirs) == 57
    assert stats.records == 57 and stats.corrupt == 0
    for (_off, a), b in zip(got, theirs, strict=True):
        assert a["__key__"] == b["__key__"]
        assert {k for k in a if not k.startswith("__")} == {"png", "cls", "json"}
        for ext in ("png", "cls", "json"):
            assert a[ext] == b[ext]


def test_tar_long_names_gnu_and_pax(tmp_path):
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT):
        path = tmp_path / f"long-{fmt}.tar"
        names = [f"{'d' * 60}/{'e' * 60}/sample{i}.{ext}" for i in range(3) for ext in ("a", "b")]
        if fmt == tarfile.USTAR_FORMAT:  # ustar splits long paths into prefix + name
            names = [n.replace("d" * 60, "d" * 20).replace("e" * 60, "e" * 20) for n in names]
        with tarfile.open(path, "w", format=fmt) as tar:
            tar.addfile(tarfile.TarInfo("somedir"))  # a non-file member is skipped
            for n in names:
                info = tarfile.TarInfo(n)
                info.size = len(n)
                tar.addfile(info, io.BytesIO(n.encode()))
        got, stats = ours(path)
        assert stats.corrupt == 0
        assert [len(s) for _, s in got] == [3, 3, 3]
        for _, s in got:
            assert s["a"].decode().endswith(".a") and s["a"].decode()[:-2] == s["__key__"]


def test_tar_keys_with_directories_and_uppercase_ext(tmp_path):
    path = tmp_path / "x.tar"
    with tarfile.open(path, "w") as tar:
        for n, body in [("a/b.c.JPG", b"1"), ("a/b.c.Txt", b"2"), ("noext", b"3"), ("k.x", b"4")]:
            info = tarfile.TarInfo(n)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    got, _ = ours(path)
    assert [s for _, s in got] == [
        {"__key__": "a/b", "c.jpg": b"1", "c.txt": b"2"},
        {"__key__": "k", "x": b"4"},
    ]


@pytest.mark.parametrize("cut", [1, 100, 511, 512, 700, 5000])
def test_tar_cut_off_keeps_complete_samples(tmp_path, cut, caplog):
    path = tmp_path / "cut.tar"
    write_shard(path, 20)
    full, _ = ours(path)
    with tarfile.open(path) as tar:  # where each sample's member data really ends
        ends: dict[str, int] = {}
        for m in tar.getmembers():
            key = m.name.split(".", 1)[0]
            ends[key] = max(ends.get(key, 0), m.offset_data + m.size)
    cut_at = full[13][0] - cut  # `cut` bytes before sample 13's first header
    part = tmp_path / "cut-part.tar"
    part.write_bytes(path.read_bytes()[:cut_at])
    with caplog.at_level(logging.WARNING, logger="distlearn.dataset.formats"):
        got, stats = ours(part)
    complete = [s["__key__"] for _, s in full if ends[s["__key__"]] <= cut_at]
    # every delivered sample is whole; at most the last complete one is held back,
    # when the cut falls in a header whose owner cannot be known
    assert [s for _, s in got] == [s for _, s in full[: len(got)]]
    assert len(complete) - 1 <= len(got) <= len(complete)
    only_padding_cut = ends[full[12][1]["__key__"]] <= cut_at
    assert stats.corrupt == (0 if only_padding_cut else 1)
    if not only_padding_cut:
        assert str(part) in caplog.text and "byte" in caplog.text


def test_tar_bad_header_checksum_drops_the_sample_and_resyncs(tmp_path, caplog):
    path = tmp_path / "bad.tar"
    write_shard(path, 10)
    full, _ = ours(path)
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("s000004.")]
    victim = members[1].offset_data - 512  # the regular header of sample 4's 2nd member
    data = bytearray(path.read_bytes())
    data[victim + 10] ^= 0xFF
    bad = tmp_path / "bad2.tar"
    bad.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="distlearn.dataset.formats"):
        got, stats = ours(bad)
    assert [s for _, s in got] == [s for i, (_, s) in enumerate(full) if i != 4]
    assert stats.corrupt == 1 and f"byte {victim}" in caplog.text


@pytest.mark.parametrize(
    "sample, member, name, dropped",
    [(4, 0, "intact", {4}), (4, 2, "intact", {4}), (9, 0, "intact", {9}),
     (9, 2, "intact", {9}), (0, 0, "intact", {0}), (4, 0, "unreadable", {3, 4})],
)  # fmt: skip
def test_a_damaged_tar_header_loses_its_own_sample_only(tmp_path, sample, member, name, dropped):
    """A damaged header of a sample's first member dropped the sample *before* it, and
    delivered its own sample without that member (its label, say). Now the name in the
    header tells whose member was lost; an unreadable one drops both neighbours, never
    delivering a sample without a member."""
    path = tmp_path / "s.tar"
    write_shard(path, 10)
    full, _ = ours(path)
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"s{sample:06d}.")]
    header = members[member].offset_data - 512
    data = bytearray(path.read_bytes())
    if name == "intact":
        data[header + 136] ^= 0x01  # (its mtime: the checksum fails, the name reads)
    else:
        data[header : header + 100] = b"\x01" * 100
    bad = tmp_path / "bad.tar"
    bad.write_bytes(bytes(data))
    got, stats = ours(bad)
    assert [s for _, s in got] == [s for i, (_, s) in enumerate(full) if i not in dropped]
    assert all(set(s) == {"__key__", "png", "cls", "json"} for _, s in got)
    assert stats.corrupt == 1


def test_tar_gz_transparent_and_cut_off(tmp_path):
    path = tmp_path / "s.tar"
    write_shard(path, 30)
    full, _ = ours(path)
    gz = tmp_path / "s.tar.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    got, stats = ours(gz)
    assert got == full and stats.corrupt == 0
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(gz.read_bytes()[: len(gz.read_bytes()) // 2])
    got, stats = ours(cut)
    assert 0 < len(got) < 30 and stats.truncated_files == 1 and stats.corrupt == 1
    assert [s for _, s in got] == [s for _, s in full[: len(got)]]


def test_record_format_override_and_names():
    assert part_format("a/part-00001") == ("lines", False)
    assert part_format("x.tfrecord.gz") == ("tfrecord", True)
    assert part_format("x.tar?sig=1") == ("tar", False)
    assert part_format("part-1.gz", "tar") == ("tar", True)
    with pytest.raises(ValueError, match="record_format"):
        part_format("x", "parquet")


# ---------------------------------------------------------------- TFRecord


def test_crc32c_known_vectors():
    # RFC 3720 / iSCSI check value; both implementations agree
    assert tfrecord.crc32c(b"123456789") == 0xE3069283
    assert tfrecord._crc32c_py(b"123456789") == 0xE3069283
    data = random.Random(1).randbytes(1000)
    assert tfrecord._crc32c_py(data) == tfrecord.crc32c(data)
    # TensorFlow's masked CRC of an 8-byte zero length (a known constant in tf's tests)
    assert masked_crc32c(struct.pack("<Q", 0)) == masked_crc32c(bytes(8))


def tfrecords(n, seed=0):
    rng = random.Random(seed)
    return [rng.randbytes(rng.randrange(0, 500)) for _ in range(n)]


def test_tfrecord_roundtrip(tmp_path):
    recs = tfrecords(50)
    path = tmp_path / "a.tfrecord"
    path.write_bytes(b"".join(write_tfrecord(r) for r in recs))
    got, stats = ours(path)
    assert [r for _, r in got] == recs and stats.corrupt == 0
    gz = tmp_path / "a.tfrecord.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert [r for _, r in ours(gz)[0]] == recs


def test_tfrecord_bad_data_crc_dropped(tmp_path, caplog):
    recs = tfrecords(10)
    frames = [write_tfrecord(r) for r in recs]
    frames[3] = frames[3][:12] + bytes([frames[3][12] ^ 1]) + frames[3][13:]
    assert len(recs[3]) > 0
    path = tmp_path / "b.tfrecord"
    path.write_bytes(b"".join(frames))
    with caplog.at_level(logging.WARNING, logger="distlearn.dataset.formats"):
        got, stats = ours(path)
    assert [r for _, r in got] == recs[:3] + recs[4:]
    assert stats.corrupt == 1 and stats.reasons == {"bad data CRC": 1}
    assert "b.tfrecord" in caplog.text and f"byte {sum(map(len, frames[:3]))}" in caplog.text
    # without CRC checks the damaged payload comes through
    assert len(ours(path, check_crc=False)[0]) == 10


def test_tfrecord_bad_length_crc_resyncs(tmp_path):
    recs = tfrecords(10, seed=2)
    frames = [write_tfrecord(r) for r in recs]
    frames[5] = frames[5][:2] + bytes([frames[5][2] ^ 0x40]) + frames[5][3:]
    path = tmp_path / "c.tfrecord"
    path.write_bytes(b"".join(frames))
    got, stats = ours(path)
    assert [r for _, r in got] == recs[:5] + recs[6:]
    assert stats.reasons == {"bad length CRC": 1}


@pytest.mark.parametrize("cut", [1, 4, 11, 12, 20])
def test_tfrecord_cut_off(tmp_path, cut):
    recs = tfrecords(5, seed=3)
    recs[-1] = b"z" * 30
    data = b"".join(write_tfrecord(r) for r in recs)
    path = tmp_path / "d.tfrecord"
    path.write_bytes(data[:-cut])
    got, stats = ours(path)
    assert [r for _, r in got] == recs[:4] and stats.corrupt == 1


# ---------------------------------------------------------------- lines


def test_lines(tmp_path):
    path = tmp_path / "part-r-00000"
    path.write_bytes(b"a,1\r\nb,2\n\nc,3")
    got, stats = ours(path)
    assert got == [(0, b"a,1"), (5, b"b,2"), (10, b"c,3")]
    assert stats.records == 3


def test_lines_gz_multi_member_and_truncated(tmp_path, caplog):
    lines = [f"record {i}".encode() for i in range(2000)]
    body = b"\n".join(lines) + b"\n"
    gz = tmp_path / "part-00000.gz"
    gz.write_bytes(gzip.compress(body[:7000]) + gzip.compress(body[7000:]))
    assert [r for _, r in ours(gz)[0]] == lines
    cut = tmp_path / "part-00001.gz"
    whole = gzip.compress(body)
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    with caplog.at_level(logging.WARNING, logger="distlearn.dataset.formats"):
        got, stats = ours(cut)
    assert 0 < len(got) < 2000 and [r for _, r in got] == lines[: len(got)]
    assert stats.truncated_files == 1 and stats.corrupt == 1
    assert "part-00001.gz" in caplog.text


def test_logging_is_rate_limited(tmp_path, caplog):
    frames = [write_tfrecord(b"x" * 10) for _ in range(50)]
    frames = [f[:-1] + bytes([f[-1] ^ 1]) for f in frames]  # every data CRC bad
    path = tmp_path / "e.tfrecord"
    path.write_bytes(b"".join(frames))
    with caplog.at_level(logging.WARNING, logger="distlearn.dataset.formats"):
        got, stats = ours(path)
    assert got == [] and stats.corrupt == 50
    assert len(caplog.records) == damage._LOG_PER_PART + 1
    assert "45 more corrupt records" in caplog.text


# ----------------------------------------------------------------------------- hostile input


def _patch_size(data: bytearray, header: int, field: bytes) -> None:
    """Give the tar header at `header` this size field, with a checksum that matches."""
    data[header + 124 : header + 136] = field.ljust(12, b"\0")
    data[header + 148 : header + 156] = b" " * 8
    data[header + 148 : header + 156] = f"{sum(data[header : header + 512]):06o}\0 ".encode()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "field, reason",
    [
        (b"1234567x123", "bad tar size field"),  # not octal: used to raise out of the reader
        (b"\xff" * 12, "bad tar size field"),  # GNU base-256, negative
        (b"77777777777", "tar size past a header"),  # 8 GiB: used to end the part there
    ],
)
def test_tar_crafted_size_drops_that_sample_and_reads_on(tmp_path, field, reason):
    path = tmp_path / "s.tar"
    write_shard(path, 10)
    full, _ = ours(path)
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("s000004.")]
    data = bytearray(path.read_bytes())
    _patch_size(data, members[1].offset_data - 512, field)
    bad = tmp_path / "bad.tar"
    bad.write_bytes(bytes(data))
    got, stats = ours(bad)
    assert [s for _, s in got] == [s for i, (_, s) in enumerate(full) if i != 4]
    assert stats.reasons == {reason: 1}


@pytest.mark.timeout(60)
def test_member_names_split_in_linear_time_as_webdataset_does(tmp_path):
    import re

    theirs = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
    rng = random.Random(0)
    for _ in range(20_000):
        name = "".join(rng.choice("ab./") for _ in range(rng.randrange(0, 9)))
        m = theirs.match(name)
        assert tar_format.key_ext(name) == (m.groups() if m else None), name
    # the regex backtracks quadratically here (minutes); the split takes microseconds
    assert tar_format.key_ext("a/" * 500_000 + "x.png") == ("a/" * 500_000 + "x", "png")
    # in a tar, a 100,000-character pax name is damage, not a sample
    path = tmp_path / "long.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in ["s0.bin", "a/" * 50_000 + "s1.bin", "s2.bin"]:
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    got, stats = ours(path)
    assert [s["__key__"] for _, s in got] == ["s0", "s2"] and stats.corrupt == 1


def test_gzip_bomb_is_refused(tmp_path):
    bomb = tmp_path / "part-00000.gz"
    bomb.write_bytes(gzip.compress(bytes(64 << 20)))  # 64 MiB of zeros in ~64 KiB
    assert bomb.stat().st_size < 200_000
    with pytest.raises(TooLarge, match=r"more than 1048576 bytes"):
        ours(bomb, max_bytes=1 << 20)


@pytest.mark.timeout(60)
def test_gzip_of_many_tiny_members_reads_in_linear_time(tmp_path):
    # each member used to copy the rest of the file: 100,000 members, ~115 GB of copies
    path = tmp_path / "part-00000.gz"
    member = gzip.compress(b"x\n")
    path.write_bytes(member * 100_000)
    got, stats = ours(path)
    assert len(got) == 100_000 and stats.truncated_files == 0


def test_a_bomb_part_is_skipped_by_the_dataset(tmp_path, caplog):
    from distlearn.dataset import Dataset

    (tmp_path / "part-00000.gz").write_bytes(gzip.compress(bytes(8 << 20)))
    (tmp_path / "part-00001.gz").write_bytes(gzip.compress(b"1\n2\n3\n"))
    ds = Dataset(str(tmp_path), max_part_bytes=1 << 20)

    def number(data, opt, out):
        out.fill_(int(data))
        return True

    with ds.sampled_batcher(batch_size=4, input_dims=(1,), processor=number,
                            workers="thread") as b:  # fmt: skip
        got = [int(v) for batch in b for v in batch.input.view(-1).tolist()]
        stats = b.stats
    assert got == [1, 2, 3] and stats["failed_parts"] == 1
    assert "part-00000.gz: skipping this part file" in caplog.text
