"""What the fetch stage counts (:class:`Stats`), and a log that cannot flood
(:class:`RateLimitedLog`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

__all__ = ["RateLimitedLog", "Stats", "count_status"]


class Stats(dict):
    """Counters: fetched, retried, failed, bytes, dropped (by the processor).

    Keys that appear once they count something: ``http_429``, ``http_4xx`` (other 4xx),
    ``http_5xx`` (error answers, each attempt counted, retried or not), ``cache_hits``
    and ``cache_misses`` (items looked up in the item cache).
    """

    KEYS = ("fetched", "retried", "failed", "bytes", "dropped")

    def __init__(self, **kw: int):
        super().__init__({k: 0 for k in self.KEYS})
        self.update(kw)

    def add(self, other: dict) -> None:
        for k, v in other.items():
            self[k] = self.get(k, 0) + v


class RateLimitedLog:
    """Log at most one line per `interval` seconds; says how many were suppressed."""

    def __init__(self, logger: logging.Logger, interval: float = 5.0):
        self.logger, self.interval = logger, interval
        self._last = -float("inf")
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval:
                self._suppressed += 1
                return
            n, self._suppressed, self._last = self._suppressed, 0, now
        if n:
            msg += f" (and {n} similar since the last message)"
        self.logger.warning(msg, *args)


def count_status(stats: dict, status: int) -> None:
    """Count an HTTP error answer into `stats` (``http_429``, ``http_4xx`` or ``http_5xx``)."""
    key = "http_429" if status == 429 else "http_4xx" if status < 500 else "http_5xx"
    stats[key] = stats.get(key, 0) + 1
