"""A tree of processes over ZeroMQ: rendezvous, all_reduce, scatter and barrier.

from distlearn import ipc
tree = ipc.LocalhostTree(node_index, num_nodes)
n = tree.all_reduce(tensors, op="sum")   # in place; n = nodes that contributed
"""

if __name__ != "distlearn.ipc":
    # The folder ipc/ of a distlearn checkout was found as a top-level module
    # (the checkout is on sys.path). Importing it under a second name would give
    # every module, and every registry in them, a second copy.
    raise ImportError(
        f"{__file__} is distlearn.ipc; import it as `from distlearn import ipc` "
        "(PyPI's `ipc` is another project)"
    )

from .errors import AuthError, IPCError, IPCTimeoutError, MismatchError, PeerError
from .rendezvous import LocalhostTree, StaticTree, from_env
from .tree import Tree

__all__ = [
    "AuthError",
    "IPCError",
    "IPCTimeoutError",
    "LocalhostTree",
    "MismatchError",
    "PeerError",
    "StaticTree",
    "Tree",
    "from_env",
]
