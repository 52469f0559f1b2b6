"""`Channel`: a FIFO any process can write to and read from, torch-ipc's `ipc.channel`.

    ch = ipc.Channel()               # any number of writers and readers; pass it to map workers
    status = ch.write(x); status, x = ch.read(block=True); ch.close()

Its creator holds the items in a broker (broker.py, which says what is guaranteed);
another process gets its address and secret when the Channel is pickled or forked,
and goes through a `_Remote` (remote.py).
"""

from __future__ import annotations

import os
import weakref

from .broker import CLOSED, DRAINED, EMPTY, OPEN, _Broker
from .remote import _Remote, close_dropped

__all__ = ["Channel"]


class Channel:
    """A FIFO that any process can write to and read from, torch-ipc's `ipc.channel`.

    The creating process holds the items (keep the Channel alive there until the others
    are done); pass the Channel to other processes as an argument (`ipc.map`, or any
    multiprocessing start method: it pickles as its address and secret).

    Attributes:
        OPEN: A read's status: an item, the channel open.
        CLOSED: A read's status: an item of a closed channel.
        DRAINED: Closed and empty.
        EMPTY: A non-blocking read found nothing now.
    """

    OPEN = OPEN
    CLOSED = CLOSED
    DRAINED = DRAINED
    EMPTY = EMPTY

    def __init__(self):
        self._broker: _Broker | None = _Broker(("c",), "channel")
        self._creator = os.getpid()
        self._address = self._broker.address
        self._secret = self._broker.secret.text
        self._remote: _Remote | None = None
        self._finalizer = weakref.finalize(self, self._broker.stop)

    def __getstate__(self) -> dict:
        # Sent to processes of this user on this host only (pickled by multiprocessing).
        return {"address": self._address, "secret": self._secret, "creator": self._creator}

    def __setstate__(self, state: dict) -> None:
        self._broker = None
        self._creator = state["creator"]
        self._address = state["address"]
        self._secret = state["secret"]
        self._remote = None

    def _side(self) -> _Broker | _Remote:
        if os.getpid() == self._creator and self._broker is not None:
            return self._broker
        if self._remote is None or self._remote.pid != os.getpid():
            self._remote = _Remote(self._address, self._secret, "channel")
            # Dropped without the process ending (a worker's copy): its writes still go,
            # and if they cannot, close_remotes says so (see remote.close_dropped).
            weakref.finalize(self, close_dropped, self._remote)
        return self._remote

    def write(self, obj: object) -> str:
        """Append `obj`.

        From another process the write is sent without waiting: a write racing a close
        may be dropped, and once a read there has seen the close, writes say so.

        Args:
            obj: A tensor, or a nested list/tuple/dict of tensors, str, int, float,
                bool, None and bytes.

        Returns:
            `OPEN`, or `CLOSED`/`DRAINED` (and the item dropped) if the channel is closed.
        """
        return self._side().put("c", obj)

    def read(self, block: bool = True, timeout: float | None = None) -> tuple[str, object]:
        """The next item, with the channel's status.

        Args:
            block: Wait for an item; False returns `(EMPTY, None)` at once when there
                is none.
            timeout: Seconds to wait; None: without end.

        Returns:
            `(OPEN or CLOSED, item)`, `(DRAINED, None)` once closed and empty, or
            `(EMPTY, None)` for a non-blocking read that finds nothing now (an open,
            empty channel, or a closed one whose last items are still out with
            readers).
        """
        return self._side().get("c", bool(block), timeout)

    def close(self) -> None:
        """No more writes; readers get the remaining items, then DRAINED."""
        self._side().close_queue("c")
