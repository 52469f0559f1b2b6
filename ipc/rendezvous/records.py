"""Node 0's rendezvous records in the private runtime directory (`Localhost`).

Node 0 of a launch on this host publishes where it listens, and its secret unless a
token was given, in a 0600 file named after the launch's key and its pid
(`rv-<key digest>-<pid>.json`); the other nodes read it. A node 0 killed in its
rendezvous cannot remove its record: `sweep_dead_records` does, once nobody listens at
its address (or, for a node 0 that never listened, once its process is gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from ..errors import IPCError
from ..procs import pid_alive, running
from ..transport import runtime

__all__ = ["sweep_dead_records"]

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
