"""Host-aware k-ary tree: nodes on one host form a subtree, host subtrees are linked over TCP."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Placement", "build_tree", "depth"]


@dataclass
class Placement:
    """Where one node sits in the tree."""

    parent: int | None
    children: list[int] = field(default_factory=list)


def build_tree(hosts: list[str], base: int = 2) -> list[Placement]:
    """Tree over len(hosts) nodes; `hosts[i]` is node i's host name.

    Within a host the nodes form a `base`-ary heap rooted at the host's
    smallest index; the host roots form a `base`-ary heap in order of first
    appearance, so node 0 is the global root and as few links as possible
    cross hosts.
    """
    if base < 1:
        raise ValueError(f"tree base must be >= 1, got {base}")
    n = len(hosts)
    if n == 0:
        return []
    groups: dict[str, list[int]] = {}
    for i, h in enumerate(hosts):
        groups.setdefault(h, []).append(i)
    if groups[hosts[0]][0] != 0:
        raise AssertionError("node 0 must lead its host")
    out = [Placement(parent=None) for _ in range(n)]

    def heap(members: list[int]) -> None:
        for pos in range(1, len(members)):
            parent = members[(pos - 1) // base]
            out[members[pos]].parent = parent
            out[parent].children.append(members[pos])

    leaders = [members[0] for members in groups.values()]
    heap(leaders)
    for members in groups.values():
        heap(members)
    for p in out:
        p.children.sort()
    return out


def depth(tree: list[Placement]) -> int:
    """Number of links on the longest root-to-leaf path."""
    best = 0
    for i in range(len(tree)):
        d, j = 0, i
        while tree[j].parent is not None:
            j = tree[j].parent
            d += 1
        best = max(best, d)
    return best
