"""Errors more than one layer raises or carries."""

from __future__ import annotations

__all__ = ["RemoteTraceback"]


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in another process.

    Set as the ``__cause__`` of the exception re-raised in this process, so the other
    process's frames print above this one's (as ``concurrent.futures`` does). Raised
    by ``distlearn.dataset``'s process workers and by ``distlearn.ipc.map``.

    Args:
        tb: The traceback, as ``traceback.format_exc()`` wrote it there.
    """

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'
