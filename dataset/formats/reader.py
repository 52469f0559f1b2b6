"""Record readers for part files: WebDataset tar, TFRecord, newline-delimited; gzip.

    from distlearn.dataset.formats import read_part

    stats = ReadStats()
    for offset, record in read_part(data, "s3://bucket/train-0001.tar.gz", stats=stats):
        ...   # tar: {"__key__": "0001/img", "png": b"...", "cls": b"3"}; others: bytes

A part file is read whole from memory (it was downloaded whole), so readers
are plain loops over a buffer with no per-record I/O. The format comes from
the name (``.tar``, ``.tfrecord``, anything else is newline-delimited; a
trailing ``.gz`` is decompressed first) unless ``record_format`` says
otherwise. A corrupt record (bad header checksum or CRC, a member or record
cut off by the end of the file) is dropped, counted in :class:`ReadStats`,
logged with the part file and byte offset, and reading goes on with the next
record that can be found.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..options import DEFAULT_MAX_PART_BYTES  # a part decompresses to at most this (held whole)
from .damage import Damage, ReadStats
from .gunzip import gunzip
from .lines import read_lines
from .tar import read_tar
from .tfrecord import read_tfrecord

__all__ = ["FORMATS", "part_format", "read_part"]

FORMATS = ("tar", "tfrecord", "lines")


def part_format(name: str, record_format: str | None = None) -> tuple[str, bool]:
    """(format, gzipped) for a part file name; ``record_format`` overrides the extension."""
    base = name.rsplit("?", 1)[0].rstrip("/")
    gz = base.endswith(".gz")
    if gz:
        base = base[:-3]
    if record_format is not None:
        if record_format not in FORMATS:
            raise ValueError(f"record_format must be one of {FORMATS}, got {record_format!r}")
        return record_format, gz
    if base.endswith(".tar"):
        return "tar", gz
    if base.endswith((".tfrecord", ".tfrecords")):
        return "tfrecord", gz
    return "lines", gz


def read_part(
    data: bytes | bytearray | memoryview,
    name: str,
    *,
    record_format: str | None = None,
    stats: ReadStats | None = None,
    check_crc: bool = True,
    max_bytes: int = DEFAULT_MAX_PART_BYTES,
    deadline: float | None = None,
) -> Iterator[tuple[int, Any]]:
    """Yield ``(offset, record)`` for every intact record of the part file ``name``.

    A ``.gz`` part that decompresses to more than ``max_bytes`` raises
    :class:`TooLarge` before any record is yielded.

    ``deadline`` (a ``time.monotonic()`` value): past it, reading raises
    :class:`OutOfTime` (checked between records and between scan windows).

    ``offset`` is the record's byte offset in the (decompressed) file. Tar
    records are WebDataset samples: a dict of lower-cased extension to bytes
    plus ``"__key__"``; TFRecord and line records are bytes.
    """
    stats = stats if stats is not None else ReadStats()
    fmt, gz = part_format(name, record_format)
    damage = Damage(name, stats, deadline)
    stats.parts += 1
    truncated = False
    if gz:
        data, truncated = gunzip(data, name, stats, max_bytes)
    stats.bytes += len(data)
    try:
        if fmt == "tar":
            yield from _count(read_tar(data, damage), stats, damage)
        elif fmt == "tfrecord":
            yield from _count(read_tfrecord(data, damage, check_crc=check_crc), stats, damage)
        else:
            yield from _count(read_lines(data, damage, truncated=truncated), stats, damage)
    finally:
        damage.close()


def _count(
    records: Iterator[tuple[int, Any]], stats: ReadStats, damage: Damage
) -> Iterator[tuple[int, Any]]:
    for rec in records:
        stats.records += 1
        yield rec
        if damage.deadline is not None and not stats.records & 255:
            damage.check()
