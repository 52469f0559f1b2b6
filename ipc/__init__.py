"""A tree of processes over ZeroMQ: rendezvous, all_reduce, scatter and barrier.

from distlearn import ipc
tree = ipc.LocalhostTree(node_index, num_nodes)
n = tree.all_reduce(tensors, op="sum")   # in place; n = nodes that contributed

Layers, lowest first; each imports only from those below it:
- base: `errors` (IPCError and its kinds), `procs`; below them `distlearn.common`
  (environment variables, launchers, keyword checks, loopback, die-with-parent),
  shared with `distlearn.dataset`;
- `ipc.transport`: authenticated links (`Endpoint`, `Link`) and what travels on
  them (`ipc.wire`);
- `ipc.rendezvous`: how the nodes find each other (handlers that end in a Roster);
- `ipc.collectives`: the public `Tree`, its collectives over the links or through
  shared memory;
- `ipc.services`: torch-ipc's other half on the same links: `Server`/`Client`,
  `ipc.map`, `WorkQueue` and `Channel`.
"""

if __name__ != "distlearn.ipc":
    # The folder ipc/ of a distlearn checkout was found as a top-level module
    # (the checkout is on sys.path). Importing it under a second name would give
    # every module, and every registry in them, a second copy.
    raise ImportError(
        f"{__file__} is distlearn.ipc; import it as `from distlearn import ipc` "
        "(PyPI's `ipc` is another project)"
    )

from . import rendezvous
from .collectives import Handle, LocalhostTree, StaticTree, Tree, from_env
from .errors import AuthError, IPCError, IPCTimeoutError, MismatchError, PeerError
from .services import (
    Channel,
    Client,
    Connection,
    Map,
    RemoteTraceback,
    Server,
    WorkerError,
    WorkQueue,
    map,
)
from .transport import Liveness, link, wire

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
