"""What an `Engine` receives: data kept for its collective, progress, failures, goodbyes.

Between and during collectives the engine takes in what its endpoint collected
(`_absorb`): data messages go to a stash, in arrival order, until the collective they
belong to reads them (`_next`); progress reports go to the stall inspector; an ERROR
or a neighbour's death or goodbye becomes the failure raised once the data received
before it is used. Read ahead of its collective, data is kept up to STASH_BYTES;
beyond that the links' receive queues hold the rest (backpressure).
"""

from __future__ import annotations

import time

from ..errors import IPCError, PeerError
from ..transport import Kind, WireError, wire

__all__ = ["ReceivingMixin"]

# Messages read ahead of their collective (between collectives) are kept up to this
# many bytes; beyond it the links' receive queues hold the rest (backpressure).
STASH_BYTES = 256 << 20


class ReceivingMixin:
    """`Engine`'s receiving. It reads the engine's `ep`, `links`, `num_nodes`, `node`,
    `seq`, `busy`, `broken`, `entered_at` and `timeout`; it keeps the `stash` (and
    `_stash_bytes`), `_failure` and `_later` (failures to raise in this collective, or
    the next), and `left` (neighbours that said goodbye, and after how many
    collectives). It calls the stall inspector (`_report_progress`, `_log_stall`,
    `_progress`, with their `_next_progress` and `_next_stall`) and the failures
    (`_timeout_error`, `_left_error`, `_malformed`, `fail`)."""

    # ---- receiving ---------------------------------------------------------------

    def _next(self, waiting_on: list) -> tuple:
        """The next data message, in arrival order. Data already received comes first; then
        a failure that arrived is raised; otherwise wait, up to the collective's timeout."""
        stash = self.stash
        deadline = self.entered_at + self.timeout
        while True:
            if stash:
                msg = stash.popleft()
                self._stash_bytes -= msg[-2]
                return msg[:-2] + msg[-1:]
            if self._failure is not None:
                raise self._failure
            now = time.monotonic()
            if now >= self._next_progress:
                self._report_progress(now)
            if now >= self._next_stall:
                self._log_stall(now, waiting_on)
            if now >= deadline:
                raise self._timeout_error(waiting_on)
            wake = min(deadline, self._next_progress, self._next_stall)
            self.ep.poll(min(wake - now, 3600))
            self._absorb()

    def _pump(self, timeout: float) -> None:
        self.ep.poll(timeout)
        self._absorb()
        if self._failure is not None:
            raise self._failure

    def _absorb(self) -> None:
        """Take in what the endpoint collected: data into the stash, progress reports, and
        failures into `_failure` (raised once the data received before them is used).

        An ERROR from a neighbour already in a later collective waits for the next one:
        what it sent for this one has arrived."""
        ep = self.ep
        while ep.inbox:
            link, frames = ep.inbox.popleft()
            j = link.tag
            if j not in self.links:
                continue
            header = frames[0].bytes
            kind = header[0]
            try:
                if kind in (Kind.UP, Kind.DOWN):
                    _, seq, chunk, count, sig = wire.parse_data(header)
                    if len(frames) > 2:
                        raise WireError(f"{len(frames)} frames in a data message")
                    payload = frames[1] if len(frames) == 2 else None
                    size = len(payload.buffer) if payload is not None else 0
                    self.stash.append((j, kind, seq, chunk, count, sig, size, payload))
                    self._stash_bytes += size
                elif kind == Kind.ERROR:
                    body = wire.parse_control(header, {"seq": wire.small_int()})
                    origin = body.get("node")
                    if not (isinstance(origin, int) and 0 <= origin < self.num_nodes):
                        origin = j
                    exc = PeerError(
                        f"node {self.node}: {str(body.get('message'))[:2000]} "
                        f"(reported via node {j})",
                        node=origin,
                    )
                    exc.via = j  # no need to tell it back
                    if body["seq"] > self.seq or (body["seq"] == self.seq and not self.busy):
                        self._later = self._later or exc
                    else:
                        self._failure = self._failure or exc
                elif kind == Kind.PROGRESS:
                    self._progress(j, wire.parse_control(header))
            except WireError as err:
                self._failure = self._failure or self._malformed(j, f"a malformed message: {err}")
        while ep.events:
            what, link = ep.events.popleft()
            j = link.tag
            if j not in self.links or self.links[j] is not link:
                continue
            if what == "dead" and j not in self.left:
                exc = ep.dead_error(link)
                exc.node = j
                exc.via = j  # it cannot hear about it any more
                self._failure = self._failure or exc
            elif what == "bye":
                done = link.bye.get("seq") if isinstance(link.bye, dict) else None
                self.left[j] = done if isinstance(done, int) else -1
                if self.busy and self.left[j] < self.seq:
                    self._failure = self._failure or self._left_error(j, self.left[j])

    def wait_fd(self, fd: int, seconds: float) -> None:
        """Wait until `fd` is readable or `seconds` pass (shared memory's barrier), keeping
        the links answered; raises if a neighbour fails or dies."""
        self.ep.watch(fd)
        now = time.monotonic()
        if now >= self._next_progress:
            self._report_progress(now)
        self.ep.poll(seconds)
        self._absorb()
        if self._failure is not None:
            raise self._failure

    def service(self) -> None:
        """Between collectives: answer the links, keep early data, pass failures on. A
        failure found here breaks the tree; the next collective raises it."""
        if self.broken is not None:
            return
        try:
            now = time.monotonic()
            if now >= self._next_progress:
                self._report_progress(now)
            if self._stash_bytes < STASH_BYTES:
                self.ep.poll(0)
            self._absorb()
            failure = self._failure or self._later
            if failure is not None:
                raise failure
        except IPCError as exc:
            self.fail(exc)
