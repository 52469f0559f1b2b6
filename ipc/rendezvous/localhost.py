"""`Localhost`: every node on this host, meeting through the private runtime directory.

Node 0 binds a Unix socket in the private runtime directory and writes its address
(and a fresh random secret, unless a token was given) to a 0600 record there, named
after the launch's key (see `records`); the other nodes read it. Nothing listens on
TCP at all, unless `port=` asks node 0 to take joins on 127.0.0.1 too.
Node 0's side is here; the joining side is `JoinerMixin` (localhost_joiner.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time

from distlearn.common.envvars import env_str

from ..errors import IPCError
from ..procs import start_ticks
from ..transport import Endpoint, given_secret, random_secret, runtime
from . import exchange
from .exchange import (
    KEY_ENV,
    RENDEZVOUS_LIMITS,
    FileBudget,
    Listen,
    Roster,
    check_index,
    files_for_joins,
    host_identity,
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
from .lobby import Lobby
from .localhost_joiner import JoinerMixin
from .records import _publish_record, sweep_dead_records

__all__ = ["Localhost"]

log = logging.getLogger(__name__)

_swept = False  # once per process: a sweep reads the whole directory


class Localhost(JoinerMixin):
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
        lobby_key: str | None = None,
    ):
        check_index(node_index, num_nodes)
        self.node_index, self.num_nodes = node_index, num_nodes
        self.port = port
        self.explicit = key is not None or env_str(KEY_ENV) is not None
        if key is None:
            key = env_str(KEY_ENV) or (f"port{port}" if port is not None else f"ppid{os.getppid()}")
        self.key = str(key)
        # The launch's first key, which names its lobby in every generation (lobby.py).
        self.lobby_key = self.key if lobby_key is None else lobby_key
        self.returned = False  # taken back into a running tree (come_back)
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

    def come_back(self) -> Localhost | None:
        """For a process started again into a launch whose tree still runs and takes
        nodes back in (its lobby is open: distlearn.survivors): knock, wait until the tree
        takes it in (at its next step), and return the handler of the tree to join, the
        next generation, in which this process is the last node. None when no tree of
        this launch takes nodes in: this is a launch of its own."""
        if self.num_nodes == 1:
            return None
        lobby = Lobby(self.lobby_key)
        if not lobby.running():
            return None
        where = lobby.knock(self.node_index)
        token = self.given.text if self.given is not None else None
        handler = Localhost(where.index, where.nodes, key=where.key, token=token,
                            lobby_key=self.lobby_key)  # fmt: skip
        handler.generation = where.generation
        handler.returned = True
        handler.meet_within = Lobby.admit_s  # as the others wait for it (Tree.admit)
        log.warning("ipc: node %d of the launch comes back as node %d of %d (generation %d)",
                    self.node_index, where.index, where.nodes, where.generation)  # fmt: skip
        return handler

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
            encrypt=options.get("encrypt"),
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
