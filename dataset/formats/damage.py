"""What reading a part produced, and its damaged records: counted, logged, rate-limited."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

__all__ = ["Damage", "OutOfTime", "ReadStats"]

log = logging.getLogger(__name__)


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


class OutOfTime(TimeoutError):
    """Reading a part ran past its deadline (``part_timeout``)."""


class Damage:
    """Counts and logs corrupt records of one part file (rate-limited), and keeps its
    reading to a deadline: readers call :meth:`check` between records and scan windows."""

    def __init__(self, source: str, stats: ReadStats, deadline: float | None = None):
        self.source = source
        self.stats = stats
        self.logged = 0
        self.deadline = deadline

    def check(self) -> None:
        """OutOfTime once the deadline (a ``time.monotonic()`` value) has passed."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise OutOfTime(f"{self.source}: reading it ran past its deadline")

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
