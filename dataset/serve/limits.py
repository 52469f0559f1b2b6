"""The server's limits and deadlines, the reasons it answers with, and `BadRequest`: the
status to answer when a request cannot be served."""

from __future__ import annotations

__all__ = [
    "CACHE_BYTES",
    "HEAD_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_HEAD",
    "MIN_SEND_RATE",
    "REASONS",
    "SEND_TIMEOUT_S",
    "SMALL_FILE",
    "BadRequest",
]

MAX_HEAD = 16 * 1024  # request line and headers together
SMALL_FILE = 256 * 1024  # files up to this size are answered from memory
CACHE_BYTES = 256 * 1024 * 1024  # total bytes of small files kept
HEAD_TIMEOUT_S = 20.0  # a request head must be whole within this of its first byte
IDLE_TIMEOUT_S = 75.0  # keep-alive connections with no request
SEND_TIMEOUT_S = 60.0  # an answer must be taken within this, plus the time below
MIN_SEND_RATE = 8 << 20  # bytes a second the slowest reader is given (loopback clients)
MAX_CONNECTIONS = 4096  # at most (fewer where the file limit is lower: max_connections())

REASONS = {
    200: "OK",
    206: "Partial Content",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    416: "Range Not Satisfiable",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}


class BadRequest(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
