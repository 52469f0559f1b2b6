"""How the nodes of a tree find each other: handlers that end in a plain `Roster`.

A handler knows where node 0 can be found and what the job's secret is:

- `Localhost`: every node on this host. Node 0 binds a Unix socket in the
  private runtime directory and writes its address (and a fresh random
  secret, unless a token was given) to a 0600 file there, named after the
  launch's key; the other nodes read it. Nothing listens on TCP at all.
- `Static`: node 0 at a known host and port; the secret is a token or a
  secret file (else a clear error, or `insecure=True`).
- `from_env()`: torchrun's (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT) or Slurm's variables, mapped to one of the two: all ranks on
  one host use `Localhost` with a key unique to the launch, several hosts
  `Static` (the secret from $IPC_TOKEN or $IPC_TOKEN_FILE); no launcher, a
  one-node `Localhost` (a single process).

Each handler's `rendezvous(listen, options, timeout)` asks `listen(secret,
specs)` to bind the node's own endpoint once it knows the secret (it returns
the addresses peers will dial), exchanges addresses over authenticated links
(see :mod:`ipc.transport.link`), and returns the Roster. Node 0 checks that every node
passes the same tree options. It knows nothing about trees or collectives.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import AuthError, IPCError, IPCTimeoutError, PeerError
from ..procs import pid_alive, running, start_ticks
from ..transport import (
    Endpoint,
    Kind,
    Limits,
    Link,
    Secret,
    WireError,
    fdlimit,
    given_secret,
    insecure_secret,
    missing_secret_error,
    random_secret,
    runtime,
    wire,
)
from .launches import (
    LAUNCH_WINDOW_S,
    environment_differs,
    environment_digests,
    same_command_line,
    twin_launch,
)

log = logging.getLogger(__name__)

KEY_ENV = "IPC_KEY"
# Node 0's rendezvous endpoint takes only small JSON messages.
RENDEZVOUS_LIMITS = Limits(max_frame=wire.MAX_CONTROL)
# The roster travels from node 0 as a frame of its own, JSON: in the control header
# (16 KiB) it capped a tree at some 250 nodes. A node's entry is at most a host and 8
# addresses of under 512 bytes each (what a JOIN may carry): each joining node's
# endpoint takes a frame of that much a node (`joiner_limits`).
_ROSTER_ENTRY = 5 << 10
WAIT_NOTE_S = 5.0  # say what we wait for after this long, then every WAIT_REPEAT_S
HANDSHAKE_S = 5.0  # how long a joiner gives a node 0 found in the runtime directory to answer
SILENT_RETRY_S = 30.0  # ... and how long it then tries the other candidates before that one
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
    """`accept=` of node 0's rendezvous endpoint: past node 0's files (the user's own,
    opened during the rendezvous, or `files_for_joins` found too few from the start), it
    refuses every node from then on, saying why; a refused node raises at once
    (`_joiner`). `gather` gives up UNABLE_S later, telling the joined nodes why."""

    def __init__(self, unable: str | None = None) -> None:
        self.refused = unable  # why, once it refuses
        self.since = time.monotonic() if unable else None

    def __call__(self, link: Link) -> str | None:
        if self.refused is None:
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
                f"node 0: nodes {missing} did not join within {timeout:g}s ({where}){refused}",
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

    Returns the ROSTER body; raises IPCError if refused, PeerError if node 0 left,
    IPCTimeoutError if the link is not up by `link_deadline` (default `deadline`)."""
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
                    err = PeerError(
                        f"node {join['node']}: node 0 (at {link.address}) left the rendezvous "
                        f"after taking our join ({link.dead or 'it said goodbye'})",
                        node=0,
                    )
                    err.after_join = True
                    # It finished its rendezvous without sending us a roster: it had its
                    # nodes (another launch's node 0), whether or not it still runs.
                    err.had_its_nodes = bool(link.bye and link.bye.get("done"))
                    raise err
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
            raise IPCError(f"node {join['node']}: refused by node 0: {body['refused']}", node=0)
        if "abort" in body:
            err = IPCError(
                f"node {join['node']}: node 0 gave up the rendezvous after taking our join: "
                f"{body['abort']}",
                node=0,
            )
            err.after_join = True  # ours, and gone: no other node 0 will come for us
            err.gave_up = True
            raise err
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


# ---- handlers ------------------------------------------------------------------


_swept = False  # once per process: a sweep reads the whole directory
_RECORD_NAME = re.compile(r"rv-[0-9a-f]{16}-([0-9]+)\.json")


def _read_record(directory: Path, name: str) -> object:
    """The JSON of a record in our private directory (None: missing, or not JSON)."""
    try:
        return json.loads(runtime.read_private(directory, name) or b"null")
    except ValueError:
        return None


def _unable_record(rec: object) -> bool:
    """Whether `rec` is the record of a node 0 without the files for the joins."""
    return isinstance(rec, dict) and isinstance(rec.get("unable"), str)


def _dead_record(rec: object) -> bool:
    """Whether the node 0 of record `rec` is gone: nobody listens at its address. (Its
    pid alone cannot say: a node 0 in another pid namespace that shares the directory
    looks dead from here.) One that never listened (`_unable_record`) is gone unless
    its process, started when the record says, still runs: a zombie or a pid given to
    another process is not it (in another pid namespace it may be swept early, which
    costs its nodes only the reason it gives)."""
    if _unable_record(rec):
        return not running(rec.get("pid"), rec.get("start"))
    address = rec.get("address") if isinstance(rec, dict) else None
    if not isinstance(address, str) or not address.startswith("ipc://"):
        return False  # not ours to judge
    return not runtime.listened_on(address[len("ipc://") :])


def sweep_dead_records(directory: Path) -> int:
    """Remove the rendezvous records of node 0s that were killed in their rendezvous (they
    hold a secret, and would pile up): a dead pid whose address nobody listens on, or a
    node 0 without the files for the joins whose process is gone (`_dead_record`)."""
    removed = 0
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            m = _RECORD_NAME.fullmatch(name)
            if not m:
                continue
            rec = _read_record(directory, name)
            if _dead_record(rec) and (not pid_alive(int(m.group(1))) or _unable_record(rec)):
                runtime.remove(directory, name)
                removed += 1
    return removed


def _publish_record(directory: Path, name: str, data: bytes) -> None:
    """Create node 0's record, named after its pid. One already there is a dead node 0's
    whose pid we were given again (it was killed before it could remove it), unless it
    is a live node 0's in another pid namespace: replaced in the first case only."""
    try:
        runtime.create_private(directory, name, data)
    except FileExistsError:
        if not _dead_record(_read_record(directory, name)):
            raise IPCError(
                f"node 0: the rendezvous record {name} in {directory} belongs to a live "
                "node 0 with our pid (another pid namespace?); set $IPC_KEY to tell the "
                "launches apart"
            ) from None
        runtime.replace_private(directory, name, data)


class Localhost:
    """Every node on this host; they meet through the private runtime directory.

    `key` names the launch: by default the parent pid, so processes started side
    by side by one shell script or Python parent find each other, while node 0
    also checks that a joining process started within LAUNCH_WINDOW_S of itself
    with the same command line (up to its node index), so a second launch from
    the same shell, or a stale node 0 of a failed one, is not joined by mistake.
    Where the parent runs more processes with such a command line than the launch
    has nodes (two launches of one script at once, a sweep told apart by
    environment variables), node 0 also asks for its environment and working
    directory: equal but for the variables that name the node (see ipc.rendezvous.launches).
    $IPC_KEY or `key=` names a launch explicitly (no such checks). `port` also lets
    node 0 accept joins on 127.0.0.1:port from nodes that know the token."""

    def __init__(
        self,
        node_index: int,
        num_nodes: int,
        *,
        key: str | int | None = None,
        port: int | None = None,
        token: str | None = None,
        token_file: str | None = None,
    ):
        check_index(node_index, num_nodes)
        self.node_index, self.num_nodes = node_index, num_nodes
        self.port = port
        self.explicit = key is not None or bool(os.environ.get(KEY_ENV))
        if key is None:
            key = os.environ.get(KEY_ENV) or (
                f"port{port}" if port is not None else f"ppid{os.getppid()}"
            )
        self.key = str(key)
        self.given = given_secret(token, token_file)
        digest = hashlib.sha256(f"{self.key}:{num_nodes}".encode()).hexdigest()[:16]
        self.prefix = f"rv-{digest}-"
        self.argv = [
            os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else "-",
            *sys.argv[1:],
        ]
        self.start = start_ticks()
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._twins: tuple[float, bool] = (float("-inf"), False)  # (when, whether) found

    def describe(self) -> str:
        return f"rendezvous key {self.key!r} in {runtime.runtime_dir()}"

    def rendezvous(self, listen: Listen, options: dict, timeout: float) -> Roster:
        host = host_identity()
        specs = ["tcp://127.0.0.1:*"] if self.port is not None else ["ipc"]
        if self.num_nodes == 1:
            secret = self.given or random_secret()
            addrs = listen(secret, specs)
            return roster(0, 1, secret, [host], [addrs], options, self.describe())
        global _swept
        if not _swept:
            _swept = True
            sweep_dead_records(runtime.runtime_dir())
        if self.node_index == 0:
            return self._root(listen, options, timeout, host, specs)
        return self._joiner(listen, options, timeout, host, specs)

    def _join_body(self, addrs: list[str], options: dict, host: str) -> dict:
        return {
            "node": self.node_index,
            "num_nodes": self.num_nodes,
            "host": host,
            "addresses": addrs,
            "options": options,
            "pid": os.getpid(),
            "start": self.start,
            "argv": self.argv,
            "env": environment_digests(self.node_index),
        }

    def _admit(self, msg: dict) -> str | None:
        if self.explicit:
            return None
        start, argv = msg.get("start"), msg.get("argv")
        if isinstance(start, int) and self.start is not None:
            apart = abs(start - self.start) / self.hz
            if apart > LAUNCH_WINDOW_S:
                return (
                    f"it started {apart:.0f} s apart from node 0: another launch from the same "
                    f"parent (set ${KEY_ENV} or key= to join processes started far apart)"
                )
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
            return "no command line"
        if not same_command_line(self.argv, argv, msg["node"]):
            return f"its command line {argv} is not node 0's {self.argv}: another launch"
        if self._twin_launch():
            reason = environment_differs(msg.get("env"))
            if reason is not None:
                return (
                    f"{reason}, and our parent runs more processes like us than this launch "
                    f"has nodes: another launch of the same command line (set ${KEY_ENV} or "
                    f"key= to tell launches apart)"
                )
        return None

    def _twin_launch(self) -> bool:
        """Whether our parent runs another launch like ours (`twin_launch`), looked up at
        most every 0.25 s: a joiner of the other launch has been running longer."""
        when, found = self._twins
        if not found and time.monotonic() - when > 0.25 and self.start is not None:
            found = twin_launch(self.start, self.hz, self.num_nodes)
            self._twins = (time.monotonic(), found)
        return found

    def _root(self, listen: Listen, options: dict, timeout: float, host: str, specs) -> Roster:
        secret = self.given or random_secret()
        addrs = listen(secret, specs)
        unable = files_for_joins(self.num_nodes)
        if unable is not None:
            self._say_unable(unable)
        rv_specs = ["ipc"] + ([f"tcp://127.0.0.1:{self.port}"] if self.port is not None else [])
        budget = FileBudget()
        rv = Endpoint(
            secret,
            "node 0",
            bind=rv_specs,
            limits=RENDEZVOUS_LIMITS,
            encrypt=options.get("encrypt", False),
            info={"name": "node 0"},
            accept=budget,
        )
        directory, name = runtime.runtime_dir(), self._record_name()
        record = self._record(rv.addresses[0], secret=None if self.given else secret.text)
        try:
            _publish_record(directory, name, record)
        except BaseException:
            rv.close(linger=0)
            raise
        try:
            join = self._join_body(addrs, options, host)
            # The record goes as soon as the nodes are in: a joiner of another launch
            # that read it while node 0 closes would retry a closed socket for seconds.
            hosts, addresses = serve(
                rv,
                self.num_nodes,
                join,
                timeout,
                self.describe(),
                self._admit,
                gathered=lambda: runtime.remove(directory, name),
                budget=budget,
            )
        finally:
            runtime.remove(directory, name)
        return roster(0, self.num_nodes, secret, hosts, addresses, options, self.describe())

    def _record_name(self) -> str:
        return f"{self.prefix}{os.getpid()}.json"

    def _record(self, address: str, **fields) -> bytes:
        """Node 0's runtime record: where it listens, and `fields` (its secret, or why
        it cannot take the tree)."""
        record = {"v": 2, "key": self.key, "pid": os.getpid(), "start": self.start,
                  "address": address, "num_nodes": self.num_nodes, **fields}  # fmt: skip
        return json.dumps(record).encode()

    def _say_unable(self, unable: str) -> None:
        """Node 0 without the files for the joins: a record that says so, for UNABLE_S
        (the nodes that find it raise with its reason), then raise. Not a listening
        socket: a burst of joins would abort it in libzmq before any could be refused."""
        directory, name = runtime.runtime_dir(), self._record_name()
        _publish_record(directory, name, self._record("", unable=unable))
        try:
            time.sleep(UNABLE_S)
        finally:
            runtime.remove(directory, name)
        raise IPCError(f"node 0: {unable}", node=0)

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
                encrypt=options.get("encrypt", False),
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
                if getattr(err, "closing", False) or getattr(err, "had_its_nodes", False):
                    refused.add(name)  # a node 0 that had its nodes as we came
                    continue
                if isinstance(err, AuthError) and self.given is not None:
                    raise  # our token is not node 0's: waiting will not change that
                if getattr(err, "after_join", False):
                    if getattr(err, "gave_up", False) or not running(
                        rec.get("pid"), rec.get("start")
                    ):
                        raise  # our node 0 died or froze mid-rendezvous: no other will come
                    # Alive and running, it closed its rendezvous without us: a node 0 of
                    # another launch that had its nodes a moment after taking our join.
                    refused.add(name)
                    continue
                if isinstance(err, IPCError) and "refused by the endpoint" in str(err):
                    # Past the handshake, so by a node 0 of our key and secret, and for
                    # what holds whoever comes (out of files, another version): final.
                    raise
                log.info("ipc node %d: %s", self.node_index, err)
                if isinstance(err, IPCError) and "refused by node 0" in str(err):
                    refused.add(name)
                    why_refused = str(err).split("refused by node 0: ", 1)[-1]
                elif isinstance(err, IPCTimeoutError):
                    # Its socket does not answer (gone, or frozen): try the others first,
                    # or we would knock on it forever while the real node 0 waits.
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


def _local_address_for(host: str, port: int) -> str:
    """The local address that routes to `host`: what this node should bind and advertise."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(host), port))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _is_local_address(addr: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def is_loopback(host: str) -> bool:
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


class Static:
    """Node 0 listens at `root_host:root_port`; the others dial it. The secret is `token`,
    `token_file`, $IPC_TOKEN or $IPC_TOKEN_FILE; without one, an IPCError that says how to
    set it (or `insecure=True`: a secret made of the public root address, loudly logged).

    `host` is the address this node binds and advertises (default: the local address
    that routes to the root). Node 0 binds only the address `root_host` names when it is
    one of this machine's, not every interface."""

    def __init__(
        self,
        node_index: int,
        num_nodes: int,
        root_host: str,
        root_port: int,
        *,
        host: str | None = None,
        token: str | None = None,
        token_file: str | None = None,
        insecure: bool = False,
        what: str = "StaticTree spans hosts",
    ):
        check_index(node_index, num_nodes)
        if not isinstance(root_port, int) or not 0 < root_port < 65536:
            raise ValueError(f"root_port must be a TCP port, got {root_port!r}")
        self.node_index, self.num_nodes = node_index, num_nodes
        self.root_host, self.root_port, self.host = root_host, root_port, host
        secret = given_secret(token, token_file)
        if secret is None:
            if not insecure:
                raise missing_secret_error(what)
            secret = insecure_secret(f"{root_host}:{root_port}", f"node {node_index}")
        self.secret = secret

    def describe(self) -> str:
        return f"node 0 at tcp://{self.root_host}:{self.root_port}"

    def rendezvous(self, listen: Listen, options: dict, timeout: float) -> Roster:
        host = host_identity()
        if self.node_index == 0:
            root_ip = socket.gethostbyname(self.root_host)
            bind_ip = self.host or (root_ip if _is_local_address(root_ip) else "0.0.0.0")
            advertise = self.host or root_ip if bind_ip == "0.0.0.0" else bind_ip
        else:
            bind_ip = advertise = self.host or _local_address_for(self.root_host, self.root_port)
        addrs = listen(self.secret, ["ipc", f"tcp://{bind_ip}:*"])
        addrs = [a.replace(f"tcp://{bind_ip}:", f"tcp://{advertise}:") for a in addrs]
        join = {
            "node": self.node_index,
            "num_nodes": self.num_nodes,
            "host": host,
            "addresses": addrs,
            "options": options,
            "pid": os.getpid(),
        }
        if self.num_nodes == 1:
            return roster(0, 1, self.secret, [host], [addrs], options, self.describe())
        encrypt = options.get("encrypt", False)
        if self.node_index == 0:
            # TCP only: libzmq's TCP listener survives running out of files, so node 0
            # listens even without the files for the joins, and refuses every node, saying
            # why, for UNABLE_S.
            budget = FileBudget(files_for_joins(self.num_nodes))
            rv = Endpoint(
                self.secret,
                "node 0",
                bind=[f"tcp://{bind_ip}:{self.root_port}"],
                limits=RENDEZVOUS_LIMITS,
                encrypt=encrypt,
                info={"name": "node 0"},
                accept=budget,
            )
            hosts, addresses = serve(
                rv, self.num_nodes, join, timeout, self.describe(), budget=budget
            )
            return roster(
                0, self.num_nodes, self.secret, hosts, addresses, options, self.describe()
            )
        deadline = time.monotonic() + timeout
        rv = Endpoint(
            self.secret,
            f"node {self.node_index}",
            limits=joiner_limits(self.num_nodes),
            encrypt=encrypt,
            info={"name": f"node {self.node_index}"},
        )
        try:
            link = rv.dial(f"tcp://{self.root_host}:{self.root_port}", tag=0)
            note = _Note()
            while link.state != "up":
                if link.failure is not None:
                    raise link.failure
                if time.monotonic() > deadline:
                    raise IPCTimeoutError(
                        f"node {self.node_index}: {self.describe()} did not answer within "
                        f"{timeout:g}s",
                        node=0,
                    )
                waited = note.due()
                if waited is not None:
                    log.warning(
                        "ipc node %d: waiting %.0f s for %s",
                        self.node_index,
                        waited,
                        self.describe(),
                    )
                rv.poll(0.2)
            body = join_root(rv, link, join, deadline)
            rv.close(linger=2.0)
        except BaseException:
            rv.close(linger=0)
            raise
        return roster(
            self.node_index,
            self.num_nodes,
            self.secret,
            body["hosts"],
            body["addresses"],
            options,
            self.describe(),
        )


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as `gpu[03-05,07],cpu1`."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_NODELIST {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def from_env(
    *, token: str | None = None, token_file: str | None = None, insecure: bool = False
) -> Localhost | Static:
    """The handler for a job started by torchrun (or anything that sets RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) or by Slurm (SLURM_PROCID, SLURM_NTASKS, ...).

    All ranks on one host (torchrun's LOCAL_WORLD_SIZE == WORLD_SIZE, a loopback
    MASTER_ADDR, or one Slurm node): `Localhost`, keyed by the launch (torchrun's
    store port and run id, or Slurm's job and step), so nothing listens on TCP and the
    secret is random unless $IPC_TOKEN is set. Across hosts: `Static` with node 0 at
    MASTER_ADDR:$IPC_PORT (default MASTER_PORT + 1, as torchrun's store holds
    MASTER_PORT; under Slurm without MASTER_ADDR, the first host of the node list and a
    port from the job id), and the secret from $IPC_TOKEN or $IPC_TOKEN_FILE. No launcher
    at all (plain `python`): a one-node `Localhost`, logged at INFO."""
    env = os.environ

    def num(name: str) -> int:
        try:
            return int(env[name])
        except ValueError:
            raise IPCError(f"Tree.from_env: ${name}={env[name]!r} is not an integer") from None

    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = num("RANK"), num("WORLD_SIZE")
        root = env.get("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env and "IPC_PORT" not in env:
            raise IPCError("Tree.from_env: set MASTER_PORT (or IPC_PORT) with RANK and WORLD_SIZE")
        port = num("IPC_PORT") if "IPC_PORT" in env else num("MASTER_PORT") + 1
        local = num("LOCAL_WORLD_SIZE") == world if "LOCAL_WORLD_SIZE" in env else is_loopback(root)
        key = ":".join(
            [
                "torchrun",
                root,
                env.get("MASTER_PORT", ""),
                env.get("TORCHELASTIC_RUN_ID", ""),
                env.get("TORCHELASTIC_RESTART_COUNT", ""),
            ]
        )
        lws = env.get("LOCAL_WORLD_SIZE", "unset")
        where = f"RANK={rank}, WORLD_SIZE={world}, LOCAL_WORLD_SIZE={lws}"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = num("SLURM_PROCID"), num("SLURM_NTASKS")
        nodes = (
            env.get("SLURM_STEP_NUM_NODES")
            or env.get("SLURM_JOB_NUM_NODES")
            or env.get("SLURM_NNODES")
        )
        local = nodes == "1"
        root = env.get("MASTER_ADDR") or _first_slurm_host(
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "localhost"
        )
        job = env.get("SLURM_JOB_ID", "0")
        port = num("IPC_PORT") if "IPC_PORT" in env else 20000 + int(job) % 20000
        key = f"slurm:{job}:{env.get('SLURM_STEP_ID', '')}"
        where = f"the Slurm job's {nodes or '?'} nodes"
    elif launched := [v for v in ("RANK", "WORLD_SIZE", "SLURM_PROCID") if v in env]:
        # Half a launcher's variables is a broken launch, not a single process: running
        # alone would silently train on 1/N of the job.
        raise IPCError(
            f"Tree.from_env: ${launched[0]} is set but not the rest: set RANK and WORLD_SIZE "
            "(torchrun) or run under Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_NODELIST)"
        )
    else:
        # `python train.py`: no launcher. One node, collectives are identities, nothing
        # listens on TCP (a one-node Localhost binds only its Unix socket).
        log.info(
            "Tree.from_env: no RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS "
            "(Slurm): running as a single process (rank 0 of 1)"
        )
        return Localhost(0, 1, key=f"single:{os.getpid()}", token=token, token_file=token_file)
    if local:
        return Localhost(
            rank, world, key=env.get(KEY_ENV) or key, token=token, token_file=token_file
        )
    return Static(
        rank,
        world,
        root,
        port,
        token=token,
        token_file=token_file,
        insecure=insecure,
        what=f"the ranks run on more than one host ({where})",
    )
