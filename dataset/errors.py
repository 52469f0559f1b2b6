"""The package's exceptions, below every module that raises them.

Every error a user may catch derives from :class:`DatasetError`, and keeps the
standard base a caller would also expect (``BadIndex`` is a ``ValueError``,
``AllFailed`` a ``RuntimeError``...). Messages name the file, line or URL at fault.
"""

from __future__ import annotations

# (one class for every layer: the worker processes here, ipc.map there)
from distlearn.common.errors import RemoteTraceback

__all__ = [
    "AllFailed",
    "BadIndex",
    "DatasetError",
    "FetchError",
    "IndexNotFound",
    "PartError",
    "RemoteTraceback",
    "WorkerDied",
]


class DatasetError(Exception):
    """Base of every error raised by ``distlearn.dataset``."""


class BadIndex(DatasetError, ValueError):
    """A malformed or unusable index; the message names the file and line at fault."""


class IndexNotFound(DatasetError, FileNotFoundError):
    """An index, meta or ``.pt`` file that does not exist (a missing file or HTTP 404/410)."""


class FetchError(DatasetError, OSError):
    """A read failed; ``url`` and ``cause`` say which and why (an ``OSError``, as I/O errors are).

    The fields carry the decisions (retry, give up, wait); code reads them, never the
    message.

    Args:
        url: What was read.
        cause: Why it failed, in a line.
        retryable: The fault may pass (a connection error, a 5xx).
        missing: The store says there is no such file (404/410, `FileNotFoundError`).
        wait: Seconds the server asked for before a retry (its Retry-After), or None.
        unanswered: No answer came (the connection was refused or could not be made,
            or the read timed out), as opposed to an answer that was an error.
        status: The HTTP status of the answer, where one came (counted by the metrics).
    """

    def __init__(self, url: str, cause: str, retryable: bool = False, missing: bool = False,
                 wait: float | None = None, unanswered: bool = False,
                 status: int | None = None):  # fmt: skip
        super().__init__(f"{url}: {cause}")
        self.url, self.cause = url, cause
        self.retryable, self.missing, self.wait = retryable, missing, wait
        self.unanswered, self.status = unanswered, status

    def __reduce__(self):
        # pickled from process workers to the main process: rebuild from the fields
        fields = (self.url, self.cause, self.retryable, self.missing, self.wait,
                  self.unanswered, self.status)  # fmt: skip
        return type(self), fields


class AllFailed(DatasetError, RuntimeError):
    """Every item of several consecutive batches failed: the source is down, not flaky."""


class WorkerDied(DatasetError, RuntimeError):
    """A process worker exited, or stopped answering, while batches were in flight."""


class PartError(DatasetError, ValueError):
    """A part-file dataset that cannot be read as asked (no parts, too few for the partitions)."""
