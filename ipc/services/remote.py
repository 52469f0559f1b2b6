"""Another process's side of a broker: one link, one request at a time.

A worker of a WorkQueue, or any process but a Channel's creator, reads and writes
through a `_Remote`: a write is sent without waiting for an answer, a read asks the
broker for one item and waits for it. Writes are flushed when the process closes its
links, at the latest at its exit (`close_remotes`), a multiprocessing child's too.

A write is confirmed once the broker has read it: when it answers a read asked after
it, or acknowledges our goodbye. `close()` raises PeerError when writes were left
unconfirmed (the broker's process died, or froze past the heartbeats): they may be
lost, and the caller is told so rather than returning as if they had arrived. A queue
dropped without close() (a function that returns) is closed by its finalizer, which
cannot raise: its PeerError waits for `close_remotes` (ipc.map's workers, the exit).

An item read lies in the broker's memory until we ask for the next one or leave; the
broker, not the reader, lets go of it then (see broker.py), so a reader killed at any
point leaves the item whole for the next reader.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import time
import weakref

from ..errors import IPCError, IPCTimeoutError, PeerError
from ..transport import Endpoint, Secret, wire
from . import bulk
from .broker import CLOSED, DRAINED, OPEN, _ctl, _decode

__all__ = ["close_dropped", "close_remotes"]

log = logging.getLogger(__name__)


class _Remote:
    """Another process's side of a broker: one link, one request at a time."""

    def __init__(self, address: str, secret_text: str, label: str):
        self.label = label
        self.bulk = bulk.Bulk()
        self.endpoint = Endpoint(
            Secret(secret_text, label),
            f"{label} user {os.getpid()}",
            info={"pid": os.getpid(), **self.bulk.info()},
        )
        self.pid = os.getpid()
        self.closed = False
        self.asked: str | None = None  # the queue of a read still unanswered
        self.closed_seen: dict[str, str] = {}  # queue -> CLOSED/DRAINED, once a read said so
        self.writes = 0  # writes sent on the link
        self.confirmed = 0  # of which the broker has read this many (see the docstring)
        self._asked_after = 0  # writes sent before the read still unanswered
        try:
            self.link = self.endpoint.dial(address, reconnect=False)
            self.endpoint.wait_up([self.link], time.monotonic() + 30, label)
            self.bulk.up(self.link)
        except BaseException:
            self.endpoint.close(linger=0)
            raise
        _REMOTES.add(self)
        _flush_at_exit()

    def put(self, name: str, obj: object) -> str:
        """Send a write without waiting for it (OPEN: the broker's answer is not awaited),
        or drop it and say so where this process has seen the queue closed already."""
        if name in self.closed_seen:
            return self.closed_seen[name]
        if self.asked is None and self.link not in self.bulk.readers:
            self._see_bulk_ok()
        frames = self.bulk.pack(obj, self.link)
        try:
            # Copied: the caller may change its tensors once write returns.
            self.link.send_frames([_ctl({"op": "put", "q": name}), *frames], copy=True)
        except BaseException:
            self.bulk.drop(frames, self.bulk.arena)
            raise
        self.writes += 1
        return OPEN

    def _see_bulk_ok(self) -> None:
        """Take the broker's BULK_OK ("I mapped your arena") if it has come. It arrives as
        a message, which only a read would otherwise take: a process that only writes
        would send every large item over the link. With no read asked, nothing else is
        on the way (the broker answers reads only)."""
        ep = self.endpoint
        ep.poll(0)
        while ep.inbox and self.bulk.control(*ep.inbox[0]):
            ep.inbox.popleft()

    def close_queue(self, name: str) -> None:
        self.link.send_frames([_ctl({"op": "close", "q": name})])

    def get(self, name: str, block: bool, timeout: float | None = None) -> tuple[str, object]:
        ep, link = self.endpoint, self.link
        if self._drained_at_goodbye(name):
            return DRAINED, None
        if self.asked is None:
            # The broker lets go of the last item it sent us when it reads this (never we:
            # killed before this request left, the item must still be whole for another).
            link.send_frames([_ctl({"op": "get", "q": name, "block": block})])
            self.asked = name
            self._asked_after = self.writes
        elif self.asked != name:
            raise IPCError(f"ipc {self.label}: a read of {self.asked!r} timed out; read it again")
        # else: the answer to a read that timed out is still to come; it is this read's
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # In slices of a second: a dead owner is noticed within one, not at the deadline.
            step = time.monotonic() + 1.0
            item = ep.recv(step if deadline is None else min(step, deadline))
            if item is not None and self.bulk.control(*item):
                continue
            if item is not None:
                self.asked = None
                self.confirmed = max(self.confirmed, self._asked_after)
                _, frames = item
                try:
                    body = wire.parse_control(frames[0].bytes, {"op": str, "state": str})
                except wire.WireError as err:
                    raise IPCError(f"ipc {self.label}: a malformed reply: {err}") from None
                if body["state"] in (CLOSED, DRAINED):
                    self.closed_seen[name] = body["state"]
                if body["op"] == "item":
                    # Its shared memory stays taken until we ask again: if we die before
                    # that, the broker gives the item to another reader, bytes intact.
                    held = (frames[1:], self.bulk.memory_of(link))
                    return body["state"], _decode(self.bulk, held, self.label, release=False)
                return body["state"], None
            if self._drained_at_goodbye(name):
                return DRAINED, None
            if link.dead is not None or link.bye is not None:
                # (Why, in the link layer's words: also when this process was the one
                # frozen past the heartbeats.)
                raise PeerError(
                    f"ipc {self.label}: its owner (the process that made it) is gone: "
                    f"{ep.dead_error(link)}"
                )
            if deadline is not None and time.monotonic() >= deadline:
                # The request stays queued at the broker; the next read takes its answer.
                raise IPCTimeoutError(f"ipc {self.label}: no item within {timeout} s")

    def _drained_at_goodbye(self, name: str) -> bool:
        """Whether the broker said goodbye naming queue `name` drained (closed by its
        owner, every item read): a read then ends as the broker would have answered it.
        A worker that connected as the owner's close() ended gets this, not an error."""
        bye = self.link.bye
        drained = bye.get("drained") if isinstance(bye, dict) else None
        if isinstance(drained, list) and name in drained:
            self.asked = None
            self.closed_seen[name] = DRAINED
            return True
        return False

    def close(self) -> None:
        """Say goodbye: returns once the broker has read every write; PeerError if writes
        were left unconfirmed (the broker is gone, or frozen: they may be lost)."""
        if self.closed or self.pid != os.getpid():
            return
        self.closed = True
        _REMOTES.discard(self)
        # A read still unanswered: an item the broker sent for it is not ours, give it back.
        self.endpoint.close({"unread": True} if self.asked else None, linger=5.0)
        if self.link.acked:
            self.confirmed = self.writes  # it read our BYE, so everything before it
        lost = self.writes - self.confirmed
        if lost:
            why = self.link.dead or "it did not acknowledge our goodbye in time"
            raise PeerError(
                f"ipc {self.label}: could not deliver {lost} write(s) of {self.writes}: its "
                f"owner (pid {self.link.info.get('pid', '?')}) did not confirm them before "
                f"the link ended ({why}: gone, or frozen past the heartbeats' timeout of "
                f"{self.endpoint.liveness.timeout:g} s); they may be lost"
            )


# Writes from another process are sent without waiting: closing its links flushes them, at
# the latest when the process ends (multiprocessing's children skip atexit, so `ipc.map`
# workers call close_remotes themselves).
_REMOTES: weakref.WeakSet[_Remote] = weakref.WeakSet()
# (pid, PeerError) of writes a finalizer found unconfirmed (close_dropped): a finalizer's
# exception is printed and dropped, so close_remotes raises it instead. The pid: a
# forked child inherits the list, not the writes.
_unreported: list[tuple[int, PeerError]] = []


def close_dropped(remote: _Remote) -> None:
    """The finalizer of a queue or channel dropped without close(): close its link, and
    keep a PeerError for `close_remotes` rather than lose it in the finalizer."""
    try:
        remote.close()
    except PeerError as err:
        _unreported.append((os.getpid(), err))


def close_remotes() -> None:
    """Close this process's links to brokers of other processes (flushing its writes);
    PeerError naming every queue whose writes were left unconfirmed, those of queues
    dropped without close() included."""
    errors = [err for pid, err in _unreported if pid == os.getpid()]
    _unreported.clear()
    for remote in list(_REMOTES):
        try:
            remote.close()
        except PeerError as err:
            errors.append(err)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise PeerError("; ".join(str(e) for e in errors))


def _close_remotes_at_exit() -> None:
    """At exit nobody is left to raise to: writes that may be lost are logged."""
    try:
        close_remotes()
    except PeerError as err:
        log.error("%s", err)


atexit.register(_close_remotes_at_exit)
_flushing_in: list[int] = []  # the process that registered the hook below


def _flush_at_exit() -> None:
    """A multiprocessing child ends with os._exit, skipping atexit: its writes would be
    lost. Its own exit hook (the finalizers it runs after the target returns) flushes
    them instead; registered in the process that writes (a fork's copy is cleared)."""
    if _flushing_in != [os.getpid()]:
        _flushing_in[:] = [os.getpid()]
        multiprocessing.util.Finalize(None, _close_remotes_at_exit, exitpriority=100)
