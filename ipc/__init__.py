"""A tree of processes over ZeroMQ: rendezvous, all_reduce, scatter and barrier.

import ipc
tree = ipc.LocalhostTree(node_index, num_nodes)
n = tree.all_reduce(tensors, op="sum")   # in place; n = nodes that contributed
"""

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
