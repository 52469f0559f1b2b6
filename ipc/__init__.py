"""A tree of processes over ZeroMQ: rendezvous, all_reduce, scatter and barrier.

from distlearn import ipc
tree = ipc.LocalhostTree(node_index, num_nodes)
n = tree.all_reduce(tensors, op="sum")   # in place; n = nodes that contributed

Layers, each usable on its own: `ipc.rendezvous` (handlers that end in a
Roster), `ipc.link` (authenticated links: Endpoint, Link), `ipc.wire` (what
travels on them), `ipc.engine` and `ipc.shm` (the collectives), `ipc.tree`
(the public Tree). On the same links: `ipc.service` (Server, Client), `ipc.pool`
(`ipc.map`) and `ipc.queues` (WorkQueue, Channel), torch-ipc's other half,
with `ipc.bulk` (their large tensors through shared memory on one host).
"""

if __name__ != "distlearn.ipc":
    # The folder ipc/ of a distlearn checkout was found as a top-level module
    # (the checkout is on sys.path). Importing it under a second name would give
    # every module, and every registry in them, a second copy.
    raise ImportError(
        f"{__file__} is distlearn.ipc; import it as `from distlearn import ipc` "
        "(PyPI's `ipc` is another project)"
    )

from . import link, rendezvous, wire
from .errors import AuthError, IPCError, IPCTimeoutError, MismatchError, PeerError
from .link import Liveness
from .pool import Map, RemoteTraceback, WorkerError, map
from .queues import Channel, WorkQueue
from .service import Client, Connection, Server
from .tree import Handle, LocalhostTree, StaticTree, Tree, from_env

__all__ = [
    "AuthError",
    "Channel",
    "Client",
    "Connection",
    "Handle",
    "IPCError",
    "IPCTimeoutError",
    "Liveness",
    "LocalhostTree",
    "Map",
    "MismatchError",
    "PeerError",
    "RemoteTraceback",
    "Server",
    "StaticTree",
    "Tree",
    "WorkQueue",
    "WorkerError",
    "from_env",
    "link",
    "map",
    "rendezvous",
    "wire",
]
