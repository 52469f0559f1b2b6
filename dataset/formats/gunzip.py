"""gzip parts decompressed with a cap on their output (a decompression bomb raises)."""

from __future__ import annotations

import logging
import zlib

from ..options import DEFAULT_MAX_PART_BYTES  # a part decompresses to at most this (held whole)
from .damage import ReadStats

__all__ = ["TooLarge", "gunzip"]

log = logging.getLogger(__name__)


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
