"""WebDataset tar parts: members grouped into samples by their key (the name up to the
first dot of its last path part).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from typing import Any

from .damage import Damage

__all__ = ["key_ext", "read_tar"]

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


def _tar_members(data: bytes, damage: Damage) -> Iterator[tuple[int, str | None, Any]]:
    """(header offset, name, content) of regular members.

    content None: the member is cut off by the end of the file (name "" when
    its header is). name None: a damaged member, already counted; its content is
    then the name its header holds, as best read (None when there is none), so
    the reader can tell whose member was lost.
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
            yield off, None, _guess_name(data, off)  # tells read_tar a member was lost here
            off = first = _resync_tar(data, off + _BLOCK, damage)
            long_name = pax_path = None
            continue
        size = _tar_number(data[off + 124 : off + 136])
        kind = data[off + 156 : off + 157]
        start = off + _BLOCK
        stop = start + (size or 0)
        if size is None or stop > end:
            later = _resync_tar(data, off + _BLOCK, damage)
            if size is not None and later >= end:  # a member cut off by the end of the file
                yield first, long_name or pax_path or _cstr(data, off, off + 100), None
                return
            # a size that is not a size, or that runs past a header further on: drop
            # this member and go on from the next header
            damage.record(off, "bad tar size field" if size is None else "tar size past a header")
            yield off, None, _guess_name(data, off)
            off = first = later
            long_name = pax_path = None
            continue
        if kind == b"0" or kind == b"\0" or kind == b"7":
            name = long_name or pax_path or _member_name(data, off)
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


def _member_name(data: bytes, off: int) -> str:
    name = _cstr(data, off, off + 100)
    if data[off + 257 : off + 262] == b"ustar" and data[off + 345] != 0:
        name = _cstr(data, off + 345, off + 500) + "/" + name
    return name


def _guess_name(data: bytes, off: int) -> str | None:
    """The name in a damaged header, if it reads as one (a damaged name field may not)."""
    name = _member_name(data, off)
    return name if name and name.isprintable() and len(name) <= _MAX_NAME else None


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


def _resync_tar(data: bytes, off: int, damage: Damage) -> int:
    """The offset of the next 512-byte block that is a valid tar header (or the end);
    `damage` is asked every 4 MiB whether the part's time is up."""
    end = len(data)
    n = 0
    while off + _BLOCK <= end:
        if _header_ok(data, off) and not _zero_block(data, off):
            return off
        off += _BLOCK
        n += 1
        if not n & 8191:
            damage.check()
    return end


def read_tar(data: bytes | memoryview, damage: Damage) -> Iterator[tuple[int, dict[str, Any]]]:
    """WebDataset samples: consecutive members sharing a key form one dict ext -> bytes.

    Grouping matches webdataset (key = path up to the first dot of the file
    name, lower-cased extensions, ``__meta__`` members skipped). A sample with
    a cut-off or duplicated member is dropped whole.

    A damaged header loses its own sample only, whole: the one its name (as best
    read) belongs to, which is the sample before it or the one after. Where the
    name cannot be read, either may have lost a member, and both are dropped
    rather than one delivered without it.
    """
    data = bytes(data)
    sample: dict[str, Any] | None = None
    sample_off = 0
    bad = False
    lost_key = None  # the sample a damaged header hit: its other members are dropped too
    lost: list[str | None] | None = None  # a damaged member whose sample is not yet known
    for off, name, content in _tar_members(data, damage):
        if name is None:
            if lost is not None:  # two in a row: the first one's owner is decided now
                sample, lost_key = _owner(sample, lost[0], None, lost_key)
            guess = key_ext(content) if content else None
            lost = [guess[0] if guess else None]
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
        if lost is not None:  # now the member after the damage is known: whose was it?
            sample, lost_key = _owner(sample, lost[0], key, lost_key)
            lost = None
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
    if lost is not None:  # damage at the end: the last sample's, unless named otherwise
        sample, lost_key = _owner(sample, lost[0], None, lost_key)
    if sample is not None and not bad:
        yield sample_off, sample


def _owner(
    sample: dict[str, Any] | None, damaged: str | None, after: str | None, lost_key: str | None
) -> tuple[dict[str, Any] | None, str | None]:
    """(the sample to go on with, the key whose members are dropped) once a damaged
    member's neighbours are known: `sample` before it, key `after` after it (None at the
    end of the part), `damaged` the key its header names (None when unreadable).

    Members of one sample are consecutive, so the damaged one belongs to the sample
    before it or to the one after it: the sample before is dropped when it is the one
    (its key continues after the damage, or the header names it), the sample after
    when the header names that; an unreadable name drops both.
    """
    before = sample["__key__"] if sample is not None else None
    if before is not None and (after == before or damaged == before):
        return None, before  # the sample before lost a member
    if damaged is not None and (damaged == after or after is None):
        return sample, damaged  # the sample after (or one wholly lost): the one before is whole
    return None, after  # whose it was cannot be told: neither is delivered
