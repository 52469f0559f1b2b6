"""The exchange every rendezvous handler ends in, and what the handlers share.

Node 0 collects every other node's JOIN on its rendezvous endpoint and sends each the
roster (`gather`, then `serve` closes the endpoint once every node has read it); nodes
1..n-1 send their JOIN over a link to node 0 and wait for the roster (`join_root`).
Node 0 refuses a node that does not fit the tree, that passes other tree options, that
its handler's `admit` refuses (another launch), or that comes once node 0 is out of
files (`FileBudget`), and tells every node that had joined when it gives up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import IPCError, IPCTimeoutError, PeerError
from ..transport import Endpoint, Kind, Limits, Link, Secret, WireError, fdlimit, wire

__all__ = [
    "JOIN_MARGIN",
    "KEY_ENV",
    "RENDEZVOUS_LIMITS",
    "UNABLE_S",
    "FileBudget",
    "JoinRefused",
    "Listen",
    "RootLeft",
    "Roster",
    "check_index",
    "files_for_joins",
    "gather",
    "host_identity",
    "join_root",
    "joiner_limits",
    "roster",
    "serve",
]

log = logging.getLogger(__name__)


class JoinRefused(IPCError):
    """Node 0 took our link and refused our JOIN (another launch, other tree options...).

    Attributes:
        reason: What node 0 said.
    """

    def __init__(self, message: str, reason: str, node: int | None = 0):
        super().__init__(message, node)
        self.reason = reason


class RootLeft(PeerError):
    """Node 0 left the rendezvous after it had taken our JOIN, with no roster for us.

    Attributes:
        had_its_nodes: It finished its rendezvous (its goodbye said so): it had its nodes
            before ours came, so it was another launch's node 0, whether or not it runs on.
        gave_up: It gave the rendezvous up, saying so to the nodes it had taken: ours,
            and gone; no other node 0 will come for us.
    """

    def __init__(self, message: str, had_its_nodes: bool = False, gave_up: bool = False,
                 node: int | None = 0):  # fmt: skip
        super().__init__(message, node)
        self.had_its_nodes, self.gave_up = had_its_nodes, gave_up


KEY_ENV = "IPC_KEY"
# Node 0's rendezvous endpoint takes only small JSON messages.
RENDEZVOUS_LIMITS = Limits(max_frame=wire.MAX_CONTROL)
# The roster travels from node 0 as a frame of its own, JSON: in the control header
# (16 KiB) it capped a tree at some 250 nodes. A node's entry is at most a host and 8
# addresses of under 512 bytes each (what a JOIN may carry): each joining node's
# endpoint takes a frame of that much a node (`joiner_limits`).
_ROSTER_ENTRY = 5 << 10
WAIT_NOTE_S = 5.0  # say what we wait for after this long, then every WAIT_REPEAT_S
WAIT_REPEAT_S = 30.0
# Node 0 holds a connection (a file) from every other node until all have joined, and
# libzmq aborts a process whose Unix-socket accept finds no file left. A node 0 that
# cannot hold them says so for this long (in its runtime record, or to every handshake)
# before it raises, so the nodes already waiting for it are told why.
UNABLE_S = 10.0
# Files node 0 keeps free beyond one a node: its rendezvous endpoint takes about 12
# (libzmq's own), and FileBudget refuses nodes once fewer than a quarter are left.
JOIN_MARGIN = 32

Listen = Callable[[Secret, list[str]], list[str]]


def joiner_limits(num_nodes: int) -> Limits:
    """The limits of a node's endpoint for the rendezvous: a roster of `num_nodes`."""
    return Limits(max_frame=max(wire.MAX_CONTROL, _ROSTER_ENTRY * num_nodes))


@dataclass(frozen=True)
class Roster:
    """What every node knows once the rendezvous is over."""

    node_index: int
    num_nodes: int
    secret: Secret
    hosts: tuple[str, ...]  # host identity of each node (host name and network namespace)
    addresses: tuple[tuple[str, ...], ...]  # where each node's endpoint listens
    options: dict  # the tree options every node agreed on
    where: str  # how the nodes met, for messages: a key or an address


def host_identity() -> str:
    """Host name plus network namespace: processes in different netns cannot share loopback."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{netns}"


def check_index(node_index: int, num_nodes: int) -> None:
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
    if not isinstance(node_index, int) or isinstance(node_index, bool):
        raise ValueError(f"node_index must be an int, got {node_index!r}")
    if not 0 <= node_index < num_nodes:
        raise ValueError(f"node_index must be in [0, {num_nodes}), got {node_index!r}")


def _options_match(mine: dict, theirs: object) -> str | None:
    if not isinstance(theirs, dict):
        return "no tree options"
    for name, value in mine.items():
        if theirs.get(name) != value:
            return f"{name}={theirs.get(name)!r}, while node 0 has {name}={value!r}"
    return None


def files_for_joins(num_nodes: int) -> str | None:
    """Why node 0 cannot hold a connection from every other node at once (None: it can).
    Checked before it listens: a burst of joins past its file limit aborts it inside
    libzmq, whatever it refuses afterwards."""
    open_now, limit = fdlimit.open_files(), fdlimit.limit()
    if open_now + num_nodes - 1 + JOIN_MARGIN <= limit:
        return None
    return (
        f"a tree of {num_nodes} nodes needs {num_nodes - 1 + JOIN_MARGIN} more open files "
        f"at node 0 (a connection from every node until all have joined, and "
        f"{JOIN_MARGIN} to spare), and node 0 has {open_now} open of its limit of {limit}: "
        f"raise `ulimit -n` where node 0 runs"
    )


class FileBudget:
    """`accept=` of node 0's rendezvous endpoint: past node 0's files (`files_for_joins`
    found too few from the start, or, with `watch`, the user's own opened during the
    rendezvous), it refuses every node from then on, saying why; a refused node raises at
    once (`_joiner`). `gather` gives up UNABLE_S later, telling the joined nodes why.

    `watch=False` for a rendezvous on TCP: files counted there may be strangers'
    connections that have not finished ZeroMQ's handshake (closed after
    `Limits.handshake_timeout`), and the node asking has its connection already; past
    its files libzmq's TCP listener leaves connections waiting in the backlog, it does
    not abort, as its Unix-socket listener does."""

    def __init__(self, unable: str | None = None, watch: bool = True) -> None:
        self.refused = unable  # why, once it refuses
        self.since = time.monotonic() if unable else None
        self.watch = watch

    def __call__(self, link: Link) -> str | None:
        if self.refused is None and self.watch:
            open_now, limit = fdlimit.open_files(), fdlimit.limit()
            if open_now + JOIN_MARGIN // 4 > limit:
                self.refused = (
                    f"node 0 is at its limit of open files ({open_now} open of {limit}): "
                    f"raise `ulimit -n` where node 0 runs"
                )
                self.since = time.monotonic()
        return self.refused

    def gave_up(self) -> bool:
        return self.since is not None and time.monotonic() - self.since > UNABLE_S


def _files_note() -> str:
    """What a timeout adds when node 0 is near its limit of open files (connections then
    wait in its backlog, unanswered)."""
    open_now, limit = fdlimit.open_files(), fdlimit.limit()
    if open_now + JOIN_MARGIN // 4 <= limit:
        return ""
    return f"; node 0 is at its limit of open files ({open_now} of {limit}): raise `ulimit -n`"


class _Note:
    """Says what a node waits for after WAIT_NOTE_S, then every WAIT_REPEAT_S."""

    def __init__(self):
        self.start = time.monotonic()
        self.next = self.start + WAIT_NOTE_S

    def due(self) -> float | None:
        now = time.monotonic()
        if now < self.next:
            return None
        self.next = now + WAIT_REPEAT_S
        return now - self.start


# ---- the exchange, common to every handler -------------------------------------


def gather(
    rv: Endpoint,
    num_nodes: int,
    join: dict,
    timeout: float,
    where: str,
    admit: Callable[[dict], str | None] | None = None,
    budget: FileBudget | None = None,
) -> tuple[list, list]:
    """Node 0: collect every other node's JOIN on the rendezvous endpoint `rv`, then send
    each the roster. `join` is node 0's own JOIN; `admit(join)` may refuse a node of
    another launch; `budget` is `rv`'s FileBudget, if it has one. Returns (hosts,
    addresses). If it fails (its timeout, an interrupt, out of files), the nodes that
    joined are told so before it raises."""
    joined: dict[int, tuple[Link, dict]] = {}
    try:
        return _gather(rv, num_nodes, join, timeout, where, admit, budget, joined)
    except BaseException as err:
        # Those that joined would take our silence for our death, or for another
        # launch's node 0 that had its nodes: tell them we gave up, and why.
        for link, _ in joined.values():
            with contextlib.suppress(IPCError, OSError):
                link.send_control(Kind.ROSTER, {"abort": f"{type(err).__name__}: {err}"[:2000]})
        raise


def _gather(
    rv: Endpoint,
    num_nodes: int,
    join: dict,
    timeout: float,
    where: str,
    admit: Callable[[dict], str | None] | None,
    budget: FileBudget | None,
    joined: dict[int, tuple[Link, dict]],
) -> tuple[list, list]:
    """`gather`'s loop; `joined` holds who has joined, by node index."""
    deadline = time.monotonic() + timeout
    note = _Note()
    refusals, last_refusal = 0, ""
    while len(joined) < num_nodes - 1:
        remaining = deadline - time.monotonic()
        missing = [i for i in range(1, num_nodes) if i not in joined]
        if remaining <= 0:
            refused = f"; refused {refusals} join(s), the last: {last_refusal}" if refusals else ""
            raise IPCTimeoutError(
                f"node 0: nodes {missing} did not join within {timeout:g}s ({where}){refused}"
                f"{_files_note()}",
                node=missing[0],
            )
        waited = note.due()
        if waited is not None:
            log.warning(
                "ipc node 0: %d of %d nodes have joined after %.0f s; waiting for nodes %s (%s)",
                len(joined) + 1,
                num_nodes,
                waited,
                missing,
                where,
            )
        got = rv.recv(time.monotonic() + min(remaining, 0.5))
        while rv.events:
            kind, link = rv.events.popleft()
            if kind in ("dead", "bye"):
                for i, (jl, _) in list(joined.items()):
                    if jl is link:  # it left before the roster: wait for a new one
                        log.warning(
                            "ipc node 0: node %d left the rendezvous; waiting for it again", i
                        )
                        del joined[i]
        if budget is not None and budget.gave_up():
            raise IPCError(
                f"node 0: {len(joined) + 1} of {num_nodes} nodes had joined: {budget.refused}",
                node=0,
            )
        if got is None:
            continue
        link, frames = got
        try:
            if frames[0].bytes[0] != Kind.JOIN:
                raise WireError("not a JOIN")
            msg = wire.parse_control(
                frames[0].bytes,
                {
                    "node": wire.small_int(),
                    "num_nodes": wire.small_int(),
                    "host": lambda v: isinstance(v, str) and len(v) < 512,
                    "addresses": lambda v: (
                        isinstance(v, list)
                        and len(v) <= 8
                        and all(isinstance(a, str) and len(a) < 512 for a in v)
                    ),
                    "options": dict,
                },
            )
        except (WireError, IndexError) as err:
            log.warning("ipc node 0: ignored a malformed JOIN from %s: %s", link.name, err)
            continue
        i = msg["node"]
        reason = None
        if msg["num_nodes"] != num_nodes or not 0 < i < num_nodes:
            reason = f"node {i} of {msg['num_nodes']} does not fit a tree of {num_nodes}"
        elif admit is not None:
            reason = admit(msg)
        if reason is None:
            reason = _options_match(join["options"], msg["options"])
            if reason is not None:
                reason = f"node {i} has {reason}: every node must pass the same"
        if reason is None and i in joined and joined[i][0].up:
            reason = (
                f"node {i} has joined already (pid {joined[i][1].get('pid')}): two launches "
                f"share {where}; give each launch its own key (${KEY_ENV}, or key=)"
            )
        if reason is not None:
            log.warning("ipc node 0: refused a join: %s", reason)
            refusals, last_refusal = refusals + 1, reason
            link.send_control(Kind.ROSTER, {"refused": reason})
            continue
        joined[i] = (link, msg)
    hosts = [join["host"]] + [joined[i][1]["host"] for i in range(1, num_nodes)]
    addresses = [join["addresses"]] + [joined[i][1]["addresses"] for i in range(1, num_nodes)]
    body = json.dumps({"hosts": hosts, "addresses": addresses}, separators=(",", ":")).encode()
    for link, _ in joined.values():
        link.send_frames([wire.control(Kind.ROSTER, {"nodes": num_nodes}), body])
    return hosts, addresses


def join_root(
    rv: Endpoint, link: Link, join: dict, deadline: float, link_deadline: float | None = None
) -> dict:
    """Nodes 1..n-1: send our JOIN on `link` (to node 0) and wait for the roster.

    Returns the ROSTER body; raises JoinRefused if refused, RootLeft if node 0 left after
    taking our JOIN, IPCTimeoutError if the link is not up by `link_deadline` (default
    `deadline`)."""
    rv.wait_up([link], min(deadline, link_deadline or deadline), "the link to node 0")
    link.send_control(Kind.JOIN, join)
    while True:
        got = rv.recv(min(deadline, time.monotonic() + 0.5))
        if got is None:
            # Only once every message it sent is read: its BYE follows the roster.
            for kind, ev_link in rv.events:
                if ev_link is link and kind in ("dead", "bye"):
                    # It had our JOIN: our node 0 gone (killed, or frozen past the
                    # heartbeats) in the middle of the rendezvous, or one of another launch
                    # that had its nodes as ours came (the caller tells them apart).
                    raise RootLeft(
                        f"node {join['node']}: node 0 (at {link.address}) left the rendezvous "
                        f"after taking our join ({link.dead or 'it said goodbye'})",
                        had_its_nodes=bool(link.bye and link.bye.get("done")),
                    )
            rv.events.clear()
            if time.monotonic() > deadline:
                raise IPCTimeoutError(
                    f"node {join['node']}: node 0 at {link.address} sent no roster in time", node=0
                )
            continue
        _, frames = got
        try:
            if frames[0].bytes[0] != Kind.ROSTER:
                raise WireError("not a ROSTER")
            body = wire.parse_control(frames[0].bytes)
        except (WireError, IndexError):
            continue
        if "refused" in body:
            reason = str(body["refused"])
            raise JoinRefused(f"node {join['node']}: refused by node 0: {reason}", reason)
        if "abort" in body:
            raise RootLeft(
                f"node {join['node']}: node 0 gave up the rendezvous after taking our join: "
                f"{body['abort']}",
                gave_up=True,
            )
        n = join["num_nodes"]
        body = _roster_of(frames, n)
        hosts, addresses = body.get("hosts"), body.get("addresses")
        if not (
            isinstance(hosts, list)
            and len(hosts) == n
            and all(isinstance(h, str) for h in hosts)
            and isinstance(addresses, list)
            and len(addresses) == n
            and all(isinstance(a, list) and all(isinstance(s, str) for s in a) for a in addresses)
        ):
            raise IPCError(f"node {join['node']}: node 0 sent a malformed roster", node=0)
        return body


def _roster_of(frames: list, num_nodes: int) -> dict:
    """The roster's JSON frame (see `_ROSTER_ENTRY`); {} where there is none."""
    if len(frames) != 2 or len(frames[1]) > _ROSTER_ENTRY * num_nodes:
        return {}
    try:
        body = json.loads(frames[1].bytes.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return {}
    return body if isinstance(body, dict) else {}


def serve(
    rv: Endpoint,
    num_nodes: int,
    join: dict,
    timeout: float,
    where: str,
    admit: Callable[[dict], str | None] | None = None,
    gathered: Callable[[], None] | None = None,
    budget: FileBudget | None = None,
) -> tuple[list, list]:
    """Node 0: `gather` on the rendezvous endpoint `rv`, then close it, waiting until every
    node has read its roster (at once, on failure). `gathered` runs between the two
    (Localhost: no longer advertise a node 0 that takes no more nodes)."""
    try:
        hosts, addresses = gather(rv, num_nodes, join, timeout, where, admit, budget)
        if gathered is not None:
            gathered()
    except BaseException:
        rv.close(linger=1.0)  # (long enough for the joined nodes' aborts to go out)
        raise
    rv.close(bye={"done": True}, linger=timeout)
    return hosts, addresses


def roster(
    node_index: int, num_nodes: int, secret: Secret, hosts, addresses, options: dict, where: str
) -> Roster:
    return Roster(
        node_index,
        num_nodes,
        secret,
        tuple(hosts),
        tuple(tuple(a) for a in addresses),
        options,
        where,
    )
