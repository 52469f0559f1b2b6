"""The lobby: a node of a running tree that died and was started again asks to come back.

Only trees that can take a node in mid-job open one (distlearn.survivors), and only on
one host (`Localhost`): the lobby is three kinds of 0600 files in the private runtime
directory, named after the launch's key (the key of generation 0, which a process
started again with the same launcher variables computes again):

- ``lobby-<digest>.json``, published by the running tree's node 0: its pid and start
  time, and the generation and size of the tree. A process that finds it, with its
  publisher running, is a returning node, not the first of a new launch.
- ``lobby-<digest>-knock-<pid>.json``, written by the returning process.
- ``lobby-<digest>-admit-<pid>.json``, written by node 0 when the tree takes the knock
  in: the key, index and size of the tree to join (the next generation).

Trust is the runtime directory's (this user's, verified 0700, files read back only if
they are private regular files of ours), as for the rendezvous records; a knock whose
process is gone is removed, never admitted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass

from ..errors import IPCError
from ..procs import running, start_ticks
from ..transport import runtime
from .records import _read_record

__all__ = ["ADMIT_S", "Admission", "Knock", "Lobby"]

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a returning node looks for its admission
LOOK_S = 0.25  # node 0 lists knocks at most this often (it asks at every step)
REPLACED_S = 10.0  # a lobby whose node 0 died: how long to wait for the survivors' new one
# How long a tree taking processes back in waits for them to join it (Tree.admit), and
# they for it: one that came back joins within a second or two of its admission.
ADMIT_S = 30.0


@dataclass(frozen=True)
class Knock:
    """A returning process waiting to be taken in."""

    pid: int
    start: int
    rank: int  # the node index it had at launch (for the logs)


@dataclass(frozen=True)
class Admission:
    """Where a returning process joins: node `index` of the `nodes`-node tree of
    rendezvous key `key`, generation `generation`."""

    key: str
    index: int
    nodes: int
    generation: int


class Lobby:
    """The lobby of the launch whose generation-0 key is `key` (see the module docstring)."""

    admit_s = ADMIT_S  # read where a tree grows (Tree.admit, Localhost); a test shortens it

    def __init__(self, key: str):
        self.key = key
        self.prefix = "lobby-" + hashlib.sha256(f"lobby:{key}".encode()).hexdigest()[:16]
        self._pattern = re.compile(re.escape(self.prefix) + r"-knock-([0-9]+)\.json")
        self._published = False
        self._looked = float("-inf")
        self._knocks: list[Knock] = []

    # -- node 0 of the running tree -------------------------------------------------------

    def publish(self, generation: int, nodes: int) -> None:
        """Say that this process is node 0 of the tree (generation, size) taking nodes in."""
        record = {"v": 1, "pid": os.getpid(), "start": start_ticks(), "generation": generation,
                  "nodes": nodes}  # fmt: skip
        runtime.replace_private(runtime.runtime_dir(), f"{self.prefix}.json",
                                json.dumps(record).encode())  # fmt: skip
        self._published = True

    def close(self) -> None:
        """Node 0 leaves: the lobby record goes, if it is still ours."""
        if not self._published:
            return
        self._published = False
        directory = runtime.runtime_dir()
        rec = _read_record(directory, f"{self.prefix}.json")
        if isinstance(rec, dict) and rec.get("pid") == os.getpid():
            runtime.remove(directory, f"{self.prefix}.json")

    def knocks(self, fresh: bool = False) -> list[Knock]:
        """The live processes knocking, oldest pid first; looked up at most every LOOK_S
        seconds unless `fresh`. A knock whose process is gone is removed."""
        now = time.monotonic()
        if not fresh and now - self._looked < LOOK_S:
            return self._knocks
        self._looked = now
        directory = runtime.runtime_dir()
        found = []
        with contextlib.suppress(OSError):
            names = [e.name for e in os.scandir(directory) if e.name.startswith(self.prefix)]
            for name in names:
                m = self._pattern.fullmatch(name)
                if m is None:
                    continue
                rec = _read_record(directory, name)
                pid, start = int(m.group(1)), rec.get("start") if isinstance(rec, dict) else None
                if not isinstance(rec, dict) or rec.get("pid") != pid or not running(pid, start):
                    runtime.remove(directory, name)
                    continue
                rank = rec.get("rank")
                found.append(Knock(pid, start, rank if isinstance(rank, int) else -1))
        self._knocks = sorted(found, key=lambda k: k.pid)
        return self._knocks

    def admit(self, knock: Knock, admission: Admission) -> None:
        """Tell `knock`'s process where to join; its knock is answered."""
        directory = runtime.runtime_dir()
        body = {"key": admission.key, "index": admission.index, "nodes": admission.nodes,
                "generation": admission.generation, "pid": knock.pid}  # fmt: skip
        runtime.remove(directory, f"{self.prefix}-admit-{knock.pid}.json")  # a stale answer
        runtime.create_private(directory, f"{self.prefix}-admit-{knock.pid}.json",
                               json.dumps(body).encode())  # fmt: skip
        runtime.remove(directory, f"{self.prefix}-knock-{knock.pid}.json")
        self._knocks = [k for k in self._knocks if k.pid != knock.pid]

    # -- the returning process ------------------------------------------------------------

    def running(self) -> bool:
        """Whether a tree of this launch is running and takes nodes in. A lobby whose node 0
        died is waited on for REPLACED_S (the survivors' new node 0 publishes it again),
        then removed."""
        directory = runtime.runtime_dir()
        name = f"{self.prefix}.json"
        deadline = None
        while True:
            rec = _read_record(directory, name)
            if rec is None:
                return False
            if isinstance(rec, dict) and running(rec.get("pid"), rec.get("start")):
                return True
            now = time.monotonic()
            if deadline is None:
                deadline = now + REPLACED_S
            elif now > deadline:
                runtime.remove(directory, name)
                return False
            time.sleep(POLL_S * 4)

    def knock(self, rank: int) -> Admission:
        """Knock, and wait until node 0 takes this process in: as long as the tree runs (it
        does so at its next step). IPCError once no tree of this launch runs any more."""
        directory = runtime.runtime_dir()
        pid = os.getpid()
        knock, answer = f"{self.prefix}-knock-{pid}.json", f"{self.prefix}-admit-{pid}.json"
        runtime.remove(directory, answer)
        runtime.remove(directory, knock)
        runtime.create_private(directory, knock, json.dumps(
            {"pid": pid, "start": start_ticks(), "rank": rank}).encode())  # fmt: skip
        log.warning("ipc: a tree of this launch is running: waiting to be taken back in "
                    "(at its next step)")  # fmt: skip
        try:
            checked = time.monotonic()
            while True:
                rec = _read_record(directory, answer)
                if isinstance(rec, dict) and rec.get("pid") == pid:
                    runtime.remove(directory, answer)
                    return _admission(rec, answer)
                if time.monotonic() - checked > 1.0:
                    checked = time.monotonic()
                    if not self.running() and _read_record(directory, answer) is None:
                        raise IPCError(f"ipc: the tree this node was coming back to ended "
                                       f"before taking it in (lobby {self.prefix})")  # fmt: skip
                time.sleep(POLL_S)
        finally:
            runtime.remove(directory, knock)


def _admission(rec: dict, where: str) -> Admission:
    """The admission record, checked field by field (it steers a rendezvous)."""
    key, index, nodes = rec.get("key"), rec.get("index"), rec.get("nodes")
    gen = rec.get("generation")
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (index, nodes, gen))
    if not (isinstance(key, str) and key and ints and 0 < index < nodes and gen > 0):
        raise IPCError(f"ipc: a malformed admission in {where}: {rec!r}")
    return Admission(key, index, nodes, gen)
