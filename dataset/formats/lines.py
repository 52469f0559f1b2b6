"""Newline-delimited parts: a record a line."""

from __future__ import annotations

from collections.abc import Iterator

from .damage import Damage

__all__ = ["read_lines"]


def read_lines(
    data: bytes | memoryview, damage: Damage, truncated: bool = False
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
