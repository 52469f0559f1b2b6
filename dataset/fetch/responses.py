"""Reading an HTTP response within bounds: its declared size, its Content-Range, its
Retry-After, and a body read with a cap (a server is not trusted).
"""

from __future__ import annotations

import email.utils
import re
import time
from typing import Any

import aiohttp

__all__ = ["content_range", "payload_size", "read_capped", "retry_after", "too_big"]


def retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for (a number of seconds, or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - time.time())


def content_range(value: str | None) -> tuple[int, int] | None:
    """``(first, last)`` byte of a Content-Range ``bytes FIRST-LAST/SIZE`` (SIZE or *)."""
    m = re.fullmatch(r"bytes ([0-9]{1,18})-([0-9]{1,18})/(?:[0-9]{1,18}|\*)", value or "")
    if m is None or int(m[2]) < int(m[1]):
        return None
    return int(m[1]), int(m[2])


def too_big(size: int, cap: int, whole: bool) -> str:
    if whole:
        return f"body of {size} bytes exceeds max_item_bytes={cap}"
    return f"range answer of {size} bytes for a {cap}-byte record"


async def read_capped(resp: aiohttp.ClientResponse, cap: int, exact: bool = False) -> bytes:
    """At most ``cap + 1`` bytes of the body (``cap`` with ``exact``), in chunks."""
    limit = cap if exact else cap + 1
    buf = bytearray()
    while len(buf) < limit:
        chunk = await resp.content.read(min(1 << 20, limit - len(buf)))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def payload_size(payload: Any) -> int:
    if isinstance(payload, bytes | bytearray | memoryview):
        return len(payload)
    if isinstance(payload, dict):  # a tar sample: member extension -> bytes
        return sum(len(v) for v in payload.values() if isinstance(v, bytes | bytearray))
    nbytes = getattr(payload, "nbytes", None)  # a tensor row
    return int(nbytes) if isinstance(nbytes, int) else 0
