"""TFRecord parts: length, masked CRC32C of the length, payload, masked CRC32C of it."""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator

from .damage import Damage

__all__ = ["masked_crc32c", "read_tfrecord", "write_tfrecord"]

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
    data: bytes | memoryview, damage: Damage, check_crc: bool = True
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
            off = _resync_tfrecord(data, off + 1, damage)
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


def _resync_tfrecord(data: bytes, off: int, damage: Damage | None = None) -> int:
    """The next offset whose 8 length bytes carry a valid masked CRC (or the end).

    Scanned a window at a time with numpy, not a byte at a time in Python (about 2 us
    a byte: hours for a part of junk). A header's length is smaller than the part, so
    its high bytes are zero: only offsets where they are need their CRC computed, all
    at once, from tables (CRC-32C is affine in its input: the CRC of the 8 bytes is the
    XOR of one entry per pair of bytes). Random junk or zeros cost about 1 ns a byte;
    junk made to be worst (zeros wherever a length's high bytes would be, but never 12
    in a row) about 30. `damage` is asked between windows whether the part's time is up.
    """
    import numpy as np

    end = len(data) - 12
    if off > end:
        return len(data)
    low = max(4, (len(data).bit_length() + 7) // 8)  # length bytes that may be non-zero
    pairs, singles, zero = _length_tables()
    buf = np.frombuffer(data, dtype=np.uint8)
    mask, k15, k17 = np.uint32(_MASK_DELTA), np.uint32(15), np.uint32(17)
    for start in range(off, end + 1, _WINDOW):
        if damage is not None:
            damage.check()
        n = min(_WINDOW, end + 1 - start)  # candidate offsets start .. start + n - 1
        win = buf[start : start + n + 12]
        if not win.any():  # all zeros: never a header (see below)
            continue
        ok = win[7 : 7 + n] == 0
        for i in range(low, 7):  # the high length bytes: zero
            ok &= win[i : i + n] == 0
        cand = np.flatnonzero(ok)
        if len(cand) * 8 > n:  # dense: zeros, mostly. 12 zero bytes are never a header
            # (the CRC of a zero length is not zero): only the edges of runs are left
            runs = np.zeros(len(win) + 1, dtype=np.int32)
            np.cumsum(win == 0, dtype=np.int32, out=runs[1:])  # zeros before each offset
            ok &= (runs[12 : n + 12] - runs[:n]) != 12
            cand = np.flatnonzero(ok)
        if not len(cand):
            continue
        w16 = win[:-1].astype(np.uint16)  # the little-endian 16-bit word at each offset
        w16 |= win[1:].astype(np.uint16) << np.uint16(8)
        if len(cand) * 8 > n:  # dense (zeros, mostly): every offset, by slices
            at = slice(None)
            words = [w16[i : i + n] for i in (0, 2, 8, 10)]
            extra = [win[i : i + n] for i in range(4, low)]
        else:
            at = cand
            words = [w16[cand + i] for i in (0, 2, 8, 10)]
            extra = [win[cand + i] for i in range(4, low)]
        crc = pairs[0][words[0]] ^ pairs[1][words[1]] ^ np.uint32(zero)
        for i, byte in enumerate(extra):
            crc ^= singles[4 + i][byte]
        rot = (words[2].astype(np.uint32) | (words[3].astype(np.uint32) << np.uint32(16))) - mask
        good = ((rot >> k17) | (rot << k15)) == crc  # (unmasked: rotated back)
        hit = np.flatnonzero(good & ok if at is not cand else good)
        if len(hit):
            return start + int(hit[0] if at is not cand else cand[hit[0]])
    return len(data)


_WINDOW = 1 << 20  # offsets scanned at once (about 30 MiB of temporaries)


@functools.cache
def _length_tables() -> tuple[list, list, int]:
    """The XOR contributions to the CRC-32C of an 8-byte length: per 16-bit word of
    bytes (0, 1) and (2, 3), per byte for each of the 8 bytes, and the CRC of zeros."""
    import numpy as np

    zero = crc32c(bytes(8))
    assert masked_crc32c(bytes(8)) != 0  # (what the scan's skipping of zeros relies on)
    singles = []
    for i in range(8):
        row = [crc32c(bytes(i) + bytes([b]) + bytes(7 - i)) ^ zero for b in range(256)]
        singles.append(np.asarray(row, dtype=np.uint32))
    word = np.arange(65536)
    pairs = [singles[i][word & 255] ^ singles[i + 1][word >> 8] for i in (0, 2)]
    return pairs, singles, zero
