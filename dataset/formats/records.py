"""Record readers for part files: WebDataset tar, TFRecord, newline-delimited; gzip.

    from distlearn.dataset.records import read_part

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

import logging
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..options import DEFAULT_MAX_PART_BYTES  # a part decompresses to at most this (held whole)

log = logging.getLogger(__name__)

FORMATS = ("tar", "tfrecord", "lines")

# Log the first few corrupt records of a part file one by one; the rest are
# summed up once the part is done, so a badly damaged file cannot flood logs.
_LOG_PER_PART = 5


@dataclass
class ReadStats:
    """What reading part files produced: records, dropped corrupt records, bytes."""

    parts: int = 0
    records: int = 0
    corrupt: int = 0
    bytes: int = 0
    truncated_files: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, other: ReadStats) -> None:
        """Fold another part's counts into these."""
        self.parts += other.parts
        self.records += other.records
        self.corrupt += other.corrupt
        self.bytes += other.bytes
        self.truncated_files += other.truncated_files
        for k, v in other.reasons.items():
            self.reasons[k] = self.reasons.get(k, 0) + v


class _Damage:
    """Counts and logs corrupt records of one part file (rate-limited)."""

    def __init__(self, source: str, stats: ReadStats):
        self.source = source
        self.stats = stats
        self.logged = 0

    def record(self, offset: int, reason: str) -> None:
        self.stats.corrupt += 1
        self.stats.reasons[reason] = self.stats.reasons.get(reason, 0) + 1
        if self.logged < _LOG_PER_PART:
            log.warning("%s: dropped a corrupt record at byte %d: %s", self.source, offset, reason)
        self.logged += 1

    def close(self) -> None:
        if self.logged > _LOG_PER_PART:
            log.warning(
                "%s: %d more corrupt records dropped (not logged one by one)",
                self.source,
                self.logged - _LOG_PER_PART,
            )


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
) -> Iterator[tuple[int, Any]]:
    """Yield ``(offset, record)`` for every intact record of the part file ``name``.

    A ``.gz`` part that decompresses to more than ``max_bytes`` raises
    :class:`TooLarge` before any record is yielded.

    ``offset`` is the record's byte offset in the (decompressed) file. Tar
    records are WebDataset samples: a dict of lower-cased extension to bytes
    plus ``"__key__"``; TFRecord and line records are bytes.
    """
    stats = stats if stats is not None else ReadStats()
    fmt, gz = part_format(name, record_format)
    damage = _Damage(name, stats)
    stats.parts += 1
    truncated = False
    if gz:
        data, truncated = gunzip(data, name, stats, max_bytes)
    stats.bytes += len(data)
    try:
        if fmt == "tar":
            yield from _count(read_tar(data, damage), stats)
        elif fmt == "tfrecord":
            yield from _count(read_tfrecord(data, damage, check_crc=check_crc), stats)
        else:
            yield from _count(read_lines(data, damage, truncated=truncated), stats)
    finally:
        damage.close()


def _count(records: Iterator[tuple[int, Any]], stats: ReadStats) -> Iterator[tuple[int, Any]]:
    for rec in records:
        stats.records += 1
        yield rec


class TooLarge(ValueError):
    """A part file that decompresses to more than its size limit."""


def gunzip(
    data: bytes | memoryview, name: str, stats: ReadStats, limit: int = DEFAULT_MAX_PART_BYTES
) -> tuple[bytes, bool]:
    """Decompress (possibly multi-member) gzip; a cut-off stream keeps what was readable.

    Returns ``(data, truncated)``. More than `limit` bytes of output raises
    :class:`TooLarge` (a decompression bomb). Each member is fed in pieces that
    start small and double, so the cost is linear in the input whatever the
    number of members (a stream of a million tiny members included).
    """
    view = memoryview(data)
    end = len(view)
    out: list[bytes] = []
    total = 0
    pos = _skip_zeros(view, 0)  # some writers pad members with zeros
    while pos < end:
        dec = zlib.decompressobj(wbits=31)
        step = 256
        while not dec.eof:
            if pos >= end:
                log.warning("%s: gzip stream cut off; keeping the complete records before it", name)
                stats.truncated_files += 1
                return b"".join(out), True
            piece = view[pos : pos + step]
            pos += len(piece)
            step = min(step * 2, 1 << 20)
            try:
                chunk = dec.decompress(piece, limit - total + 1)
            except zlib.error as err:
                log.warning("%s: corrupt gzip stream, keeping what came before it: %s", name, err)
                stats.truncated_files += 1
                return b"".join(out), True
            total += len(chunk)
            if total > limit or dec.unconsumed_tail:
                raise TooLarge(f"{name}: decompresses to more than {limit} bytes (max_part_bytes)")
            out.append(chunk)
        pos = _skip_zeros(view, pos - len(dec.unused_data))
    return b"".join(out), False


def _skip_zeros(view: memoryview, pos: int) -> int:
    """The first offset at or after `pos` that is not a zero byte (or the end)."""
    while pos < len(view):
        block = bytes(view[pos : pos + 65536])
        rest = block.lstrip(b"\0")
        if rest:
            return pos + len(block) - len(rest)
        pos += len(block)
    return pos


# ---------------------------------------------------------------- lines


def read_lines(
    data: bytes | memoryview, damage: _Damage, truncated: bool = False
) -> Iterator[tuple[int, bytes]]:
    """Newline-delimited records (``\\r\\n`` too); empty lines are skipped."""
    data = bytes(data)
    lines = data.split(b"\n")
    cut = truncated and not data.endswith(b"\n")
    last = len(lines) - 1
    offset = 0
    for i, line in enumerate(lines):
        start = offset
        offset += len(line) + 1
        if i == last and cut:
            if line:
                damage.record(start, "line cut off by the end of a truncated file")
            break
        if line.endswith(b"\r"):
            line = line[:-1]
        if line:
            yield start, line


# ---------------------------------------------------------------- tfrecord

_MASK_DELTA = 0xA282EAD8


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


def _crc32c_py(data: bytes | memoryview, _table: list[int] = _crc32c_table()) -> int:
    crc = 0xFFFFFFFF
    for b in bytes(data):
        crc = _table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


try:  # the C implementation is ~1000x faster; the pure-Python one is the fallback
    from google_crc32c import value as _crc32c_c

    def crc32c(data: bytes | memoryview) -> int:
        """CRC-32C (Castagnoli) of ``data``."""
        return _crc32c_c(bytes(data) if isinstance(data, memoryview) else data)

except ImportError:  # pragma: no cover - depends on the environment
    crc32c = _crc32c_py


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC-32C (rotated right by 15 bits plus a constant)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def write_tfrecord(payload: bytes) -> bytes:
    """One TFRecord frame: length, masked CRC of the length, payload, masked CRC of it."""
    head = struct.pack("<Q", len(payload))
    return (
        head
        + struct.pack("<I", masked_crc32c(head))
        + payload
        + struct.pack("<I", masked_crc32c(payload))
    )


def read_tfrecord(
    data: bytes | memoryview, damage: _Damage, check_crc: bool = True
) -> Iterator[tuple[int, bytes]]:
    """TFRecord frames; a bad length CRC resynchronises on the next valid header."""
    data = bytes(data)
    end = len(data)
    off = 0
    unpack_q = struct.Struct("<Q").unpack_from
    unpack_i = struct.Struct("<I").unpack_from
    while off < end:
        if end - off < 12:
            damage.record(off, f"record header cut off ({end - off} of 12 bytes)")
            return
        (length,) = unpack_q(data, off)
        if check_crc and masked_crc32c(data[off : off + 8]) != unpack_i(data, off + 8)[0]:
            damage.record(off, "bad length CRC")
            off = _resync_tfrecord(data, off + 1)
            continue
        stop = off + 12 + length
        if stop + 4 > end:
            damage.record(off, f"record cut off ({end - off - 12} of {length + 4} bytes)")
            return
        payload = data[off + 12 : stop]
        if check_crc and masked_crc32c(payload) != unpack_i(data, stop)[0]:
            damage.record(off, "bad data CRC")
        else:
            yield off, payload
        off = stop + 4


def _resync_tfrecord(data: bytes, off: int) -> int:
    """The next offset whose 8 length bytes carry a valid masked CRC (or the end)."""
    unpack_i = struct.Struct("<I").unpack_from
    end = len(data) - 12
    while off <= end:
        if masked_crc32c(data[off : off + 8]) == unpack_i(data, off + 8)[0]:
            return off
        off += 1
    return len(data)


# ---------------------------------------------------------------- tar

_MAX_NAME = 4096  # PATH_MAX: a longer member name is damage, not a sample
_SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset skips __meta__ members
_BLOCK = 512
_ADLER_MOD = 65521


def _tar_number(field: bytes) -> int | None:
    """A size field: octal text, or GNU base-256 (first byte 0x80) for sizes >= 8 GiB.

    None for anything else (not octal; base-256 with the sign bit set, 0xff, is
    negative): the header is damaged or crafted, and its member cannot be read.
    """
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if text.strip(b"01234567"):
        return None
    return int(text, 8)


def _header_ok(data: bytes, off: int) -> bool:
    """The header at ``off`` matches its checksum field (the field itself counted as spaces).

    The byte sum comes from adler32 (its low half is 1 + sum mod 65521), which
    runs in C: the check holds modulo 65521, so only a damage that shifts the
    sum by exactly 65521 could pass, and a header costs ~1 us instead of ~10.
    """
    field = data[off + 148 : off + 156]
    try:
        want = int(field.split(b"\0", 1)[0].strip(b" ") or b"-1", 8)
    except ValueError:
        return False
    low = (zlib.adler32(data[off : off + _BLOCK]) & 0xFFFF) - 1
    return (want + sum(field) - 256 - low) % _ADLER_MOD == 0


def _zero_block(data: bytes, off: int) -> bool:
    return data.count(0, off, off + _BLOCK) == _BLOCK


def _cstr(data: bytes, start: int, stop: int) -> str:
    """A NUL-terminated name field as text."""
    field = data[start:stop]
    nul = field.find(b"\0")
    return (field if nul < 0 else field[:nul]).decode("utf-8", "replace")


def _tar_members(data: bytes, damage: _Damage) -> Iterator[tuple[int, str | None, bytes | None]]:
    """(header offset, name, content) of regular members.

    content None: the member is cut off by the end of the file (name "" when
    its header is); name None too: a damaged header, already counted.
    """
    end = len(data)
    off = 0
    long_name: str | None = None
    pax_path: str | None = None
    first = 0  # where this member's headers start (pax / GNU long-name headers first)
    while off + _BLOCK <= end:
        if not _header_ok(data, off):
            if _zero_block(data, off):
                return  # the end-of-archive marker
            damage.record(off, "bad tar header checksum")
            yield off, None, None  # tells read_tar that a member was lost here
            off = first = _resync_tar(data, off + _BLOCK)
            long_name = pax_path = None
            continue
        size = _tar_number(data[off + 124 : off + 136])
        kind = data[off + 156 : off + 157]
        start = off + _BLOCK
        stop = start + (size or 0)
        if size is None or stop > end:
            later = _resync_tar(data, off + _BLOCK)
            if size is not None and later >= end:  # a member cut off by the end of the file
                yield first, long_name or pax_path or _cstr(data, off, off + 100), None
                return
            # a size that is not a size, or that runs past a header further on: drop
            # this member and go on from the next header
            damage.record(off, "bad tar size field" if size is None else "tar size past a header")
            yield off, None, None
            off = first = later
            long_name = pax_path = None
            continue
        if kind == b"0" or kind == b"\0" or kind == b"7":
            name = long_name or pax_path
            if name is None:
                name = _cstr(data, off, off + 100)
                if data[off + 257 : off + 262] == b"ustar" and data[off + 345] != 0:
                    name = _cstr(data, off + 345, off + 500) + "/" + name
            yield first, name, data[start:stop]
            long_name = pax_path = None
        elif kind == b"L":  # GNU long name for the next member
            long_name = _cstr(data, start, stop)
        elif kind == b"x":  # pax extended header: only `path` matters here
            pax = data[start:stop]
            if b" path=" in pax:
                pax_path = _pax_path(pax) or pax_path
        else:  # directories, links, global pax headers: nothing to read
            long_name = pax_path = None
        off = start + (size + _BLOCK - 1) // _BLOCK * _BLOCK
        if kind != b"L" and kind != b"x":
            first = off
    if off < end and data[off:].strip(b"\0"):
        yield first, "", None  # a header cut off: whose member it was is unknown


def key_ext(name: str) -> tuple[str, str] | None:
    """webdataset's ``base_plus_ext``: (path up to the first dot of the file name, the rest).

    The same answer as the regex ``^((?:.*/|)[^.]+)[.]([^/]*)$`` (None where it
    does not match), in linear time on any name: the regex backtracks
    quadratically on a long name with many slashes.
    """
    last = name.rfind("/")
    dot = name.find(".", last + 1)
    if dot < 0:
        return None
    if dot > last + 1:
        return name[:dot], name[dot + 1 :]
    # The file name starts with a dot: the regex's key reaches back over the last
    # slash, through the previous folder name if that has no dot.
    if last < 0 or "." in name[name.rfind("/", 0, last) + 1 : last]:
        return None
    return name[:dot], name[dot + 1 :]


def _pax_path(block: bytes) -> str | None:
    pos = 0
    path = None
    while pos < len(block):
        sp = block.find(b" ", pos)
        if sp < 0:
            break
        try:
            n = int(block[pos:sp])
        except ValueError:
            break
        if n <= 0:
            break
        key, _, value = block[sp + 1 : pos + n - 1].partition(b"=")
        if key == b"path":
            path = value.decode("utf-8", "replace")
        pos += n
    return path


def _resync_tar(data: bytes, off: int) -> int:
    """The offset of the next 512-byte block that is a valid tar header (or the end)."""
    end = len(data)
    while off + _BLOCK <= end:
        if _header_ok(data, off) and not _zero_block(data, off):
            return off
        off += _BLOCK
    return end


def read_tar(data: bytes | memoryview, damage: _Damage) -> Iterator[tuple[int, dict[str, Any]]]:
    """WebDataset samples: consecutive members sharing a key form one dict ext -> bytes.

    Grouping matches webdataset (key = path up to the first dot of the file
    name, lower-cased extensions, ``__meta__`` members skipped). A sample with
    a cut-off or duplicated member is dropped whole.
    """
    data = bytes(data)
    sample: dict[str, Any] | None = None
    sample_off = 0
    bad = False
    lost_key = None  # the sample a damaged header hit: its other members are dropped too
    for off, name, content in _tar_members(data, damage):
        if name is None:
            if sample is not None:
                lost_key, sample = sample["__key__"], None
            continue
        if content is None:
            # The sample this member belongs to is incomplete: drop it (one count).
            damage.record(off, f"tar member {name[:200] or '(header)'!r} cut off by the end")
            ke = key_ext(name)
            if sample is not None and (ke is None or ke[0] == sample["__key__"]):
                sample = None  # it may have lost members: never deliver it half
            break
        if len(name) > _MAX_NAME:
            damage.record(off, f"tar member name of {len(name)} characters")
            continue
        if "__" in name and (
            ("/" not in name and name.startswith("__") and name.endswith("__"))
            or _SKIP_META.match(name)
        ):
            continue
        ke = key_ext(name)
        if ke is None:
            continue
        key, ext = ke[0], ke[1].lower()
        if key == lost_key:
            continue
        if sample is None or key != sample["__key__"]:
            if sample is not None and not bad:
                yield sample_off, sample
            sample = {"__key__": key}
            sample_off = off
            bad = False
        if ext in sample:
            if not bad:
                damage.record(off, f"duplicate member {name!r} in sample {key!r}")
            bad = True
            continue
        sample[ext] = content
    if sample is not None and not bad:
        yield sample_off, sample
