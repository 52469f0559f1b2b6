"""What happens to an item that failed: dropped (counted, logged), or raised to the user.

Workers report each failed item as an :class:`ItemFailure` (which stage, the
exception, its traceback formatted where it was raised). The main process
applies the batcher's ``on_error`` policy to them, batch by batch:

- ``None`` (the default): fetch faults and data errors are dropped, counted in
  ``batcher.stats`` and logged (rate-limited). A bug in the processor is not
  data loss, so it is raised with the worker's traceback: an exception of a
  programming-error type (``NameError``, ``AttributeError``, ``TypeError``,
  ``ImportError``, ``SyntaxError``), or any exception that fails every item of
  a batch before any item has succeeded (a wrong ``input_dims``, a decoder
  that cannot work at all).
- ``"drop"``: every failure is dropped and counted.
- ``"raise"``: the first failure is raised (a processor returning False is a
  deliberate drop, never raised).
- a callable ``on_error(exc)``: called with each failure's exception (a
  :class:`FetchError`, or what the processor raised); returning drops the
  item, raising stops the batcher with that exception (webdataset's handlers).

Whatever the policy, ``max_failed_batches`` consecutive batches in which every
item failed raise :class:`AllFailed`: the source is down, not flaky. A batch
with no item left is never handed to the user.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import AllFailed, DatasetError, RemoteTraceback
from ..fetch.stats import RateLimitedLog

__all__ = ["BUG_TYPES", "POLICIES", "FailurePolicy", "ItemFailure", "check_policy"]

log = logging.getLogger("distlearn.dataset.batcher")

FETCH, PROCESS = "fetch", "process"
# Exceptions that are bugs in the processor, not properties of the item being decoded.
BUG_TYPES: tuple[type[BaseException], ...] = (
    NameError,
    AttributeError,
    TypeError,
    ImportError,
    SyntaxError,
    SystemExit,  # sys.exit() in a processor: not a property of the item either
)
POLICIES = (None, "drop", "raise")


@dataclass
class ItemFailure:
    """One failed item of a batch: small and picklable, it travels back from a worker.

    ``error`` is None when the processor returned False (a deliberate drop) or
    when the exception could not be pickled (``kind`` and ``traceback`` remain).
    """

    row: int
    stage: str  # FETCH or PROCESS
    cause: str  # one line, for logs
    kind: str = ""  # the exception's type name
    error: BaseException | None = None
    traceback: str = ""

    def exception(self, name: str) -> BaseException:
        """The exception to raise in the main process, with the worker's traceback."""
        err = self.error
        if err is None:
            err = DatasetError(f"{name}: {self.cause}")
        if err.__traceback__ is None and self.traceback:  # it crossed a process boundary
            err.__cause__ = RemoteTraceback(self.traceback)
        if hasattr(err, "add_note") and not getattr(err, "_dataset_noted", False):
            doing = "fetching" if self.stage == FETCH else "decoding"
            err.add_note(f"(raised while {doing} {name})")
            err._dataset_noted = True  # type: ignore[attr-defined]
        return err


def check_policy(on_error: Any) -> None:
    if on_error not in POLICIES and not callable(on_error):
        raise ValueError(f"on_error must be 'drop', 'raise', None or a callable, got {on_error!r}")


class FailurePolicy:
    """Applies ``on_error`` and ``max_failed_batches`` to each batch's failures."""

    def __init__(self, on_error: str | Callable | None = None, max_failed_batches: int = 3):
        check_policy(on_error)
        if max_failed_batches < 1:
            raise ValueError(f"max_failed_batches must be >= 1, got {max_failed_batches}")
        self.on_error, self.max_failed_batches = on_error, max_failed_batches
        self.failed_run = 0  # consecutive batches in which every item failed
        self.succeeded = False  # has any item succeeded yet
        self._log = RateLimitedLog(log)

    def check(
        self, failures: Sequence[ItemFailure], names: Sequence[str], size: int, stats: dict
    ) -> None:
        """Raise what the policy raises for this batch's failures; log and count the rest."""
        for f in failures:
            name = names[f.row]
            if self._raises(f):
                raise f.exception(name)
            if callable(self.on_error) and f.error is not None:
                self.on_error(f.exception(name))
            self._log.warning("dropped %s: %s", name, f.cause)
        if failures and len(failures) == size:
            self.failed_run += 1
            first = failures[0]
            if (
                self.on_error is None
                and not self.succeeded
                and first.stage == PROCESS
                and first.kind
                and all(f.stage == PROCESS and f.kind == first.kind for f in failures)
            ):
                raise first.exception(names[first.row])  # a processor that cannot work at all
            if self.failed_run >= self.max_failed_batches:
                causes = "; ".join(f"{names[f.row]}: {f.cause}" for f in failures[:3])
                err = AllFailed(
                    f"every item of {self.failed_run} consecutive batches failed "
                    f"(stats {dict(stats)}); last causes: {causes}"
                )
                raise err from (first.exception(names[first.row]) if first.error else None)
        elif size:
            self.failed_run = 0
            self.succeeded = True

    def _raises(self, f: ItemFailure) -> bool:
        if f.error is None and f.stage == PROCESS and not f.kind:
            return False  # the processor returned False: a deliberate drop
        if self.on_error == "raise":
            return True
        if self.on_error is None and f.stage == PROCESS:
            if f.error is not None:
                return isinstance(f.error, BUG_TYPES)
            return f.kind in _BUG_NAMES  # an exception that could not be pickled
        return False


_BUG_NAMES = frozenset(t.__name__ for base in BUG_TYPES for t in (base, *base.__subclasses__()))
