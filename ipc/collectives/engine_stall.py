"""The stall inspector of an `Engine` (Horovod's): who a slow collective waits for.

Every node reports, about once a second (with the heartbeats), the lowest collective
its subtree has reached up the tree; the root's view comes back down. Once a
collective has waited `stall_warning` seconds the engine logs which nodes have not
reached it, and a timeout names them.
"""

from __future__ import annotations

import contextlib
import logging

import zmq

from ..errors import IPCError
from ..transport import Kind, wire

__all__ = ["StallInspectorMixin"]

log = logging.getLogger(__name__)


MAX_LAGGARDS = 16  # node indices carried in a progress report


class StallInspectorMixin:
    """`Engine`'s progress reports and stall warnings. It reads the engine's `node`,
    `num_nodes`, `parent`, `children`, `links`, `left`, `seq`, `kind`, `entered_at`,
    `timeout` and `stall_warning`; it keeps each child's subtree minimum (`_sub`), the
    root's view (`_root_view`), and when to report (`_next_progress`, every
    `_progress_every`) and warn (`_next_stall`) next."""

    # ---- progress and the stall inspector ---------------------------------------------

    def _subtree_min(self) -> tuple[int, list[int]]:
        best, nodes = self.seq, [self.node]
        for c in self.children:
            m, who = self._sub.get(c, (0, [c]))
            if m < best:
                best, nodes = m, list(who)
            elif m == best:
                nodes.extend(who)
        return best, sorted(nodes)[:MAX_LAGGARDS]

    def _report_progress(self, now: float) -> None:
        """Once a second: our subtree's progress to the parent, the root's view down."""
        self._next_progress = now + self._progress_every
        sub = self._subtree_min()
        if self.parent is None:
            self._root_view = sub
        else:
            self._tell(self.parent, wire.control(Kind.PROGRESS, {"sub": list(sub)}))
        if self._root_view is not None and self.children:
            down = wire.control(Kind.PROGRESS, {"root": list(self._root_view)})
            for c in self.children:
                self._tell(c, down)

    def _tell(self, j: int, header: bytes) -> None:
        link = self.links.get(j)
        if link is not None and link.up and j not in self.left:
            with contextlib.suppress(IPCError, zmq.ZMQError):
                link.send(header)

    def _progress(self, j: int, body: dict) -> None:
        for name in ("sub", "root"):
            v = body.get(name)
            if (
                isinstance(v, list)
                and len(v) == 2
                and isinstance(v[0], int)
                and isinstance(v[1], list)
                and all(isinstance(x, int) for x in v[1][:MAX_LAGGARDS])
            ):
                value = (v[0], [x for x in v[1][:MAX_LAGGARDS] if 0 <= x < self.num_nodes])
                if name == "sub" and j in self.children:
                    self._sub[j] = value
                elif name == "root" and j == self.parent:
                    self._root_view = value

    def _laggards(self) -> tuple[int, list[int]] | None:
        """(collective, nodes) of the nodes furthest behind, if any is behind us."""
        # The root's view as reported down the tree (a second or so old per level), and
        # our own subtree's, fresh; the root has only the latter.
        views = [self._subtree_min()]
        if self.parent is not None and self._root_view is not None:
            views.insert(0, self._root_view)
        for m, nodes in views:
            if m < self.seq and nodes:
                return m, nodes
        return None

    def _log_stall(self, now: float, waiting_on: list) -> None:
        waited = now - self.entered_at
        self._next_stall = now + max(self.stall_warning, 60.0)
        late = self._laggards()
        self.log_stall(waited, late[1] if late else None, waiting_on, late[0] if late else None)

    def log_stall(
        self, waited: float, late: list[int] | None, waiting_on: list = (), at: int | None = None
    ) -> None:
        if late:
            detail = f"nodes {late} have not reached it" + (f" (they are at #{at})" if at else "")
        else:
            detail = f"waiting on node(s) {list(waiting_on)}"
        log.warning(
            "ipc node %d: %s #%d has waited %.0f s; %s. They are alive (their links answer "
            "heartbeats); the collective times out after %g s",
            self.node,
            self.kind,
            self.seq,
            waited,
            detail,
            self.timeout,
        )
