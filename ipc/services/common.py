"""What Server and Client share: the loopback server's record, timeouts, received values.

A server on a loopback address leaves a private record in the runtime directory
(`_local_name`: its Unix socket, its direct socket, its random token) for clients of
the same user on the same host, checked against the process that wrote it
(`_still_serving`). Received messages are decoded the same way on both sides
(`recv_value`), and both count their traffic the same way (`_traffic`).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time

from ..errors import IPCError
from ..procs import start_ticks
from ..transport import Link, runtime, wire
from . import bulk, direct

__all__ = ["recv_value"]

log = logging.getLogger(__name__)


def _local_name(host: str, port: int) -> str:
    """The private file where a loopback server on `host`:`port` leaves its Unix socket
    address (and its random token, when it made one) for clients of the same user. Keyed
    by the address too: 127.0.0.1:P and 127.0.0.2:P are two servers (by port alone, a
    client of one reached the other, and the second server's start removed the first's
    record)."""
    try:
        where = "127.0.0.1" if host == "localhost" else str(ipaddress.ip_address(host))
    except ValueError:
        where = host
    return f"server-{where.replace(':', '_')}-{port}.json"


def _local_record(host: str, port: int) -> dict:
    """What a loopback server of ours on `host`:`port` left for our clients: {} where there is
    nothing, nothing well-formed, or its server is gone (a killed server cannot remove
    its file). Its token and Unix socket then mean nothing: a client without a token is
    told so, and one with a token reaches whoever listens on the port now over TCP."""
    raw = runtime.read_private(runtime.runtime_dir(), _local_name(host, port))
    try:
        record = json.loads(raw) if raw is not None else {}
    except ValueError:
        return {}
    if not isinstance(record, dict):
        return {}
    keep = ("unix", "token", "direct")
    kept = {k: v for k, v in record.items() if k in keep and isinstance(v, str)}
    if kept and not _still_serving(record):
        log.info("ipc: the server that left %s (pid %s) is gone; using TCP",
                 _local_name(host, port), record.get("pid"))  # fmt: skip
        return {}
    return kept


def _still_serving(record: dict) -> bool:
    """Whether the server that wrote `record` runs: its pid, with the start time it wrote
    (pids are reused). A pid not seen from here (another pid namespace sharing this
    directory) counts while something listens on its Unix socket."""
    pid, start = record.get("pid"), record.get("start")
    if isinstance(pid, int) and isinstance(start, int) and start_ticks(pid) == start:
        return True
    unix = record.get("unix")
    return (
        isinstance(unix, str)
        and unix.startswith("ipc://")
        and runtime.listened_on(unix.removeprefix("ipc://"))
    )


def _check_timeout(timeout: float | None, what: str) -> float | None:
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"{what}: timeout must be None or >= 0, not {timeout!r}")
    return timeout


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def recv_value(shared: bulk.Bulk, link: Link, frames: list | tuple, into: object) -> object:
    """The value of a received message: frames of ipc.transport.wire, or a direct TENSOR."""
    try:
        if isinstance(frames, tuple):
            return direct.tensor_of(frames, into)
        return shared.unpack(frames, shared.memory_of(link), into=into)
    except wire.WireError as err:
        raise IPCError(f"ipc: a malformed message from {link.name}: {err}") from None


_TRAFFIC = (
    "bytes_sent", "bytes_recv", "msgs_sent", "msgs_recv", "shm_bytes_sent", "shm_msgs_sent",
)  # fmt: skip


def _traffic(link: Link, d: direct.Direct | None, shared: bulk.Bulk) -> dict:
    """A link's traffic counts plus its direct socket's, and what went through shared
    memory (`_TRAFFIC`'s last two, and whether the peer reads it)."""
    stats = dict(vars(link.stats))
    if d is not None:
        for key in ("bytes_sent", "bytes_recv", "msgs_sent", "msgs_recv"):
            stats[key] += getattr(d, key)
    return {**stats, **shared.stats(link)}
