"""`Localhost`: every node on this host, meeting through the private runtime directory.

Node 0 binds a Unix socket in the private runtime directory and writes its address
(and a fresh random secret, unless a token was given) to a 0600 record there, named
after the launch's key (see `records`); the other nodes read it. Nothing listens on
TCP at all, unless `port=` asks node 0 to take joins on 127.0.0.1 too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time

from ..errors import AuthError, IPCError, IPCTimeoutError
from ..procs import pid_alive, running, start_ticks
from ..transport import Endpoint, Secret, given_secret, random_secret, runtime
from . import exchange
from .exchange import (
    KEY_ENV,
    RENDEZVOUS_LIMITS,
    FileBudget,
    Listen,
    Roster,
    _Note,
    check_index,
    files_for_joins,
    host_identity,
    join_root,
    joiner_limits,
    roster,
    serve,
)
from .launches import (
    LAUNCH_WINDOW_S,
    environment_differs,
    environment_digests,
    same_command_line,
    twin_launch,
)
from .records import _publish_record, _unable_record, sweep_dead_records

log = logging.getLogger(__name__)

HANDSHAKE_S = 5.0  # how long a joiner gives a node 0 found in the runtime directory to answer
SILENT_RETRY_S = 30.0  # ... and how long it then tries the other candidates before that one

_swept = False  # once per process: a sweep reads the whole directory


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
            time.sleep(exchange.UNABLE_S)  # (the one setting: FileBudget reads it there)
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
