"""`Static`: node 0 at a known host and port, the others dial it.

The secret is a token or a secret file (else a clear error, or `insecure=True`: a
secret made of the public root address, loudly logged). Node 0 binds only the address
its host name names when that is one of this machine's, not every interface.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from ..errors import IPCTimeoutError
from ..transport import Endpoint, given_secret, insecure_secret, missing_secret_error
from .exchange import (
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

__all__ = ["Static"]

log = logging.getLogger(__name__)


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
        encrypt = options.get("encrypt")
        if self.node_index == 0:
            # TCP only: libzmq's TCP listener survives running out of files, so node 0
            # listens even without the files for the joins, and refuses every node, saying
            # why, for UNABLE_S. Files that run out meanwhile refuse nobody: strangers'
            # idle connections would make it refuse the real nodes (see FileBudget).
            budget = FileBudget(files_for_joins(self.num_nodes), watch=False)
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
                last = f"; the last try: {link.last_error}" if link.last_error else ""
                if time.monotonic() > deadline:
                    raise IPCTimeoutError(
                        f"node {self.node_index}: {self.describe()} did not answer within "
                        f"{timeout:g}s{last}",
                        node=0,
                    )
                waited = note.due()
                if waited is not None:
                    log.warning(
                        "ipc node %d: waiting %.0f s for %s%s",
                        self.node_index,
                        waited,
                        self.describe(),
                        last,
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
