"""The request head and its Range header, parsed totally, with size limits."""

from __future__ import annotations

from .limits import BadRequest

__all__ = ["parse_head", "parse_range"]


def parse_head(head: bytes) -> tuple[bytes, bytes, bool, dict[bytes, bytes]]:
    """(method, path, keep_alive, headers) of one request head, or BadRequest.

    Total over any bytes: every malformed line is refused, never guessed at.
    Header names are lower-cased; repeated headers we act on are refused.
    """
    lines = head.split(b"\r\n")
    request = lines[0].split(b" ")
    if len(request) != 3 or not request[0].isalpha() or not request[1]:
        raise BadRequest(400, "malformed request line")
    method, target, version = request
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        if not version.startswith(b"HTTP/"):
            raise BadRequest(400, "malformed request line")
        raise BadRequest(505, "only HTTP/1.0 and HTTP/1.1")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or b" " in name or b"\t" in name:
            raise BadRequest(400, "malformed header line")  # incl. obsolete line folding
        name = name.lower()
        if name in headers and name in (b"content-length", b"transfer-encoding", b"range"):
            raise BadRequest(400, f"repeated {name.decode('latin-1')} header")
        headers[name] = value.strip()
    if b"transfer-encoding" in headers or headers.get(b"content-length", b"0") != b"0":
        raise BadRequest(413, "request bodies are not accepted")
    connection = headers.get(b"connection", b"").lower()
    if version == b"HTTP/1.1":
        keep_alive = b"close" not in connection
    else:
        keep_alive = b"keep-alive" in connection
    if target.startswith((b"http://", b"https://")):  # absolute form: drop scheme and host
        target = b"/" + target.split(b"/", 3)[3] if target.count(b"/") >= 3 else b"/"
    if not target.startswith(b"/"):
        raise BadRequest(400, "request target is not a path")
    path = target.split(b"?", 1)[0].split(b"#", 1)[0]
    return method.upper(), path, keep_alive, headers


_HUGE = 1 << 63  # any position past every file


def _position(digits: bytes) -> int:
    """A byte position of a Range header: ASCII digits, any number of them (more than
    18 is past any file; int() would refuse over 4300, and cost time before that)."""
    digits = digits.lstrip(b"0") or b"0"
    return int(digits) if len(digits) <= 18 else _HUGE


def parse_range(value: bytes, size: int) -> tuple[int, int] | bool | None:
    """(start, end exclusive) of a single `bytes=` range; None to send the whole
    file (no range, several ranges, or a syntax we ignore, as RFC 9110 allows);
    False when the range cannot be satisfied. Total: it never raises."""
    if not value.startswith(b"bytes=") or b"," in value:
        return None
    first, dash, last = value[6:].strip().partition(b"-")
    if not dash or not _digits(first) or not _digits(last):
        return None
    if not first:  # suffix: the last n bytes
        if not last:
            return None
        n = _position(last)
        return (max(0, size - n), size) if n > 0 and size > 0 else False
    start = _position(first)
    end = min(size, _position(last) + 1) if last else size
    if last and _position(last) < start:
        return None
    return (start, end) if start < size else False


def _digits(field: bytes) -> bool:
    """Empty, or ASCII digits only (bytes.isdigit() is ASCII-only; str's is not)."""
    return not field or field.isdigit()
