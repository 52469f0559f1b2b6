"""TFRecord parts: length, masked CRC32C of the length, payload, masked CRC32C of it."""

from __future__ import annotations

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
