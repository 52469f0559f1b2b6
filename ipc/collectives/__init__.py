"""The collectives layer: the process tree and its all_reduce, scatter and barrier.

`Tree` (made by `LocalhostTree`, `StaticTree` or `Tree.from_env`) takes a roster
from a rendezvous handler, links every node to its parent and children, and runs
the collectives over those links (`engine`) or, when every node is on one host,
through shared memory (`shm`); asynchronous calls return a `Handle`.
"""

from .factories import LocalhostTree, StaticTree, from_env
from .handles import Handle
from .tree import Tree

__all__ = ["Handle", "LocalhostTree", "StaticTree", "Tree", "from_env"]
