"""The joining side of `Localhost`: nodes 1..n-1 find their node 0's record and join it.

A joiner looks in the private runtime directory for the records of live node 0s of its
key (nearest start time first), dials one with the secret its record holds (or the
token), and sends its JOIN. A node 0 of another launch that refuses it, or finishes
its rendezvous as it comes, is passed over; one that does not answer is tried again
only after the others; a node 0 that cannot take the tree, or that died or gave up
after taking our join, ends the rendezvous with its reason.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import time
from collections.abc import Callable

from ..errors import AuthError, EndpointRefused, IPCError, IPCTimeoutError
from ..procs import pid_alive, running
from ..transport import Endpoint, Secret, runtime
from .exchange import (
    KEY_ENV,
    JoinRefused,
    Listen,
    RootLeft,
    Roster,
    _Note,
    join_root,
    joiner_limits,
    roster,
)
from .launches import LAUNCH_WINDOW_S
from .records import _unable_record

__all__ = ["JoinerMixin", "Next", "after_failed_join"]

log = logging.getLogger(__name__)

HANDSHAKE_S = 5.0  # how long a joiner gives a node 0 found in the runtime directory to answer
SILENT_RETRY_S = 30.0  # ... and how long it then tries the other candidates before that one


class Next(enum.Enum):
    """What a joiner does after a failed join of one node 0 it found."""

    RAISE = "end the rendezvous with the error"
    PASS_OVER = "pass this node 0 over for good (another launch's)"
    LATER = "try the others first, this one again later"
    AGAIN = "look again"


def after_failed_join(err: BaseException, given: bool, alive: Callable[[], bool]) -> Next:
    """The joiner's policy after a failed join, read from the error's type and fields
    alone: a message may be reworded without changing it.

    Args:
        err: What the join raised.
        given: We hold a token of our own (not the node 0's record's).
        alive: Whether that node 0's process still runs (asked only where it matters).
    """
    if (isinstance(err, EndpointRefused) and err.closing) or (
        isinstance(err, RootLeft) and err.had_its_nodes
    ):
        return Next.PASS_OVER  # a node 0 that had its nodes as we came
    if isinstance(err, AuthError) and given:
        return Next.RAISE  # our token is not node 0's: waiting will not change that
    if isinstance(err, RootLeft):
        if err.gave_up or not alive():
            return Next.RAISE  # our node 0 died or froze mid-rendezvous: no other will come
        # Alive and running, it closed its rendezvous without us: a node 0 of another
        # launch that had its nodes a moment after taking our join.
        return Next.PASS_OVER
    if isinstance(err, EndpointRefused):
        # Past the handshake, so by a node 0 of our key and secret, and for what holds
        # whoever comes (out of files, another version): final.
        return Next.RAISE
    if isinstance(err, JoinRefused):
        return Next.PASS_OVER  # (another launch's node 0, by its own check)
    if isinstance(err, IPCTimeoutError):
        # Its socket does not answer (gone, or frozen): try the others first, or we
        # would knock on it forever while the real node 0 waits.
        return Next.LATER
    return Next.AGAIN


class JoinerMixin:
    """`Localhost`'s nodes 1..n-1 (`_joiner`, from its `rendezvous`). It reads the
    handler's settings (node_index, num_nodes, key, prefix, explicit, given, port,
    start, hz) and calls its `describe()` and `_join_body()`; it writes nothing on it."""

    def _candidates(self, refused: set[str]) -> list[tuple[str, dict]]:
        """Live node 0s of our key, nearest start time first, each as (name, record).
        A name is the file's and the node 0's address: a file of a pid given again to
        a new node 0 names another node 0 than the one that refused us."""
        directory = runtime.runtime_dir()
        found = []
        try:
            names = [
                n
                for n in os.listdir(directory)
                if n.startswith(self.prefix) and n.endswith(".json")
            ]
        except OSError:
            return []
        for file in names:
            raw = runtime.read_private(directory, file)
            try:
                rec = json.loads(raw) if raw else None
            except ValueError:
                rec = None
            if not isinstance(rec, dict) or rec.get("num_nodes") != self.num_nodes:
                continue
            if rec.get("key") != self.key or not isinstance(rec.get("address"), str):
                continue
            name = f"{file} {rec['address']}"
            if name in refused or not pid_alive(rec.get("pid")):
                continue  # (a dead node 0's file: `sweep_dead_records` removes it)
            unable = _unable_record(rec)  # (no secret: it does not listen)
            if unable and not running(rec.get("pid"), rec.get("start")):
                continue  # killed in its wait: a zombie, or its pid given to another
            if self.given is None and not isinstance(rec.get("secret"), str) and not unable:
                continue  # it expects a token we do not have
            start = rec.get("start")
            apart = abs(start - self.start) if isinstance(start, int) and self.start else 0
            if not self.explicit and apart / self.hz > LAUNCH_WINDOW_S:
                continue
            found.append((apart, name, rec))
        found.sort(key=lambda t: t[0])
        return [(name, rec) for _, name, rec in found]

    def _joiner(self, listen: Listen, options: dict, timeout: float, host: str, specs) -> Roster:
        deadline = time.monotonic() + timeout
        note = _Note()
        refused: set[str] = set()
        why_refused = ""  # the last refusal, for the timeout's message
        silent: dict[str, float] = {}  # candidates that did not answer -> when to try again
        addrs: list[str] | None = None
        bound: Secret | None = None  # the secret our endpoint listens with
        direct = self.port is not None and self.given is not None
        while True:
            if time.monotonic() > deadline:
                why = f"; the last node 0 refused us: {why_refused}" if why_refused else ""
                raise IPCTimeoutError(
                    f"node {self.node_index}: no node 0 for {self.describe()} within "
                    f"{timeout:g}s{why}",
                    node=0,
                )
            waited = note.due()
            if waited is not None:
                log.warning(
                    "ipc node %d: waiting %.0f s for node 0 of %s%s. Processes of one job find "
                    "each other by this key: start them from one parent process, or set $%s "
                    "to the same value in each (LocalhostTree(key=...))",
                    self.node_index,
                    waited,
                    self.describe(),
                    f" ({len(refused)} node 0 of other launches refused us)" if refused else "",
                    KEY_ENV,
                )
            if direct:
                found = [("port", {"address": f"tcp://127.0.0.1:{self.port}", "secret": None})]
            else:
                now = time.monotonic()
                found = self._candidates(refused | {n for n, t in silent.items() if t > now})
            if not found:
                time.sleep(0.02)
                continue
            listening = [(n, r) for n, r in found if not _unable_record(r)]
            name, rec = (listening or found)[0]  # a node 0 that listens first
            if _unable_record(rec):
                raise IPCError(
                    f"node {self.node_index}: node 0 of {self.describe()} cannot take this "
                    f"tree: {rec['unable'][:500]}",
                    node=0,
                )
            secret = self.given or Secret(rec["secret"], "the runtime directory")
            if bound is None or bound.text != secret.text:
                # Our endpoint must answer with this node 0's secret (a node 0 of another
                # launch may have refused us with its own).
                addrs = listen(secret, specs)
                bound = secret
            rv = Endpoint(
                secret,
                f"node {self.node_index}",
                encrypt=options.get("encrypt"),
                limits=joiner_limits(self.num_nodes),
                info={"name": f"node {self.node_index}"},
            )
            try:
                link = rv.dial(rec["address"], tag=0)
                # A node 0 that is up answers the handshake in milliseconds; one that just
                # finished (another launch's, found a moment before it removed its file)
                # never will: look again instead of waiting for the whole timeout.
                body = join_root(
                    rv,
                    link,
                    self._join_body(addrs, options, host),
                    deadline,
                    link_deadline=time.monotonic() + HANDSHAKE_S,
                )
            except (IPCError, OSError) as err:
                rv.close(linger=0)
                alive = functools.partial(running, rec.get("pid"), rec.get("start"))
                step = after_failed_join(err, self.given is not None, alive)
                if step is Next.RAISE:
                    raise
                if step is not Next.PASS_OVER or isinstance(err, JoinRefused):
                    log.info("ipc node %d: %s", self.node_index, err)
                if step is Next.PASS_OVER:
                    refused.add(name)
                    if isinstance(err, JoinRefused):
                        why_refused = err.reason
                elif step is Next.LATER:
                    silent[name] = time.monotonic() + SILENT_RETRY_S
                continue
            rv.close(linger=2.0)
            return roster(
                self.node_index,
                self.num_nodes,
                secret,
                body["hosts"],
                body["addresses"],
                options,
                self.describe(),
            )
