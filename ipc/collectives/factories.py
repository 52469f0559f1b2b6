"""The factories users call: `LocalhostTree`, `StaticTree` and `from_env`.

Each picks a rendezvous handler for the launch it describes and returns a `Tree` on it.
"""

from __future__ import annotations

from distlearn.common.envvars import env_str
from distlearn.common.keywords import check, keyword_names
from distlearn.common.net import is_loopback

from ..rendezvous import Localhost, Static, check_index
from ..transport import TOKEN_ENV, TOKEN_FILE_ENV
from .tree import Tree

__all__ = ["LocalhostTree", "StaticTree", "from_env"]


def LocalhostTree(
    node_index: int,
    num_nodes: int,
    *,
    key: str | int | None = None,
    port: int | None = None,
    token: str | None = None,
    token_file: str | None = None,
    **options,
) -> Tree:
    """A tree of processes on this host: Unix sockets in the private runtime directory,
    nothing on TCP, and a random secret that node 0 shares through that directory.

    Processes started side by side by one shell script or one Python parent find each
    other (the parent pid keys the rendezvous, checked against start time and command
    line); pass `key=` (or set $IPC_KEY) to group processes with different parents.
    `token=` / `token_file=` (or $IPC_TOKEN / $IPC_TOKEN_FILE) set the secret yourself;
    with `port=` node 0 also accepts joins on 127.0.0.1:port from nodes that have it.

    Args:
        node_index: This node, 0-based.
        num_nodes: How many nodes.
        key: Names the launch, for processes started from different parents.
        port: Node 0 also accepts joins on 127.0.0.1 at this port.
        token: The secret, instead of a random one.
        token_file: A private file holding the secret.
        **options (Any): As for `Tree` (`shm=False` keeps every collective on the
            sockets).

    Returns:
        This process's node of the tree.

    Raises:
        TypeError: A misspelt option, naming the closest.
        IPCError: The rendezvous failed, saying why.
        IPCTimeoutError: Not every node arrived within the `timeout`.
    """
    check("LocalhostTree()", options, keyword_names(Tree.__init__), keyword_names(LocalhostTree))
    handler = Localhost(
        node_index, num_nodes, key=key, port=port, token=token, token_file=token_file
    )
    return Tree(handler, **options)


def StaticTree(
    node_index: int,
    num_nodes: int,
    root_host: str,
    root_port: int,
    *,
    host: str | None = None,
    token: str | None = None,
    token_file: str | None = None,
    insecure: bool = False,
    **options,
) -> Tree:
    """A tree across machines: node 0 listens on `root_host:root_port`, the others dial it.

    The secret is `token`, `token_file`, $IPC_TOKEN or $IPC_TOKEN_FILE; without one an
    IPCError says how to set it (`insecure=True` derives it from the root address, for a
    trusted cluster, loudly logged). A loopback `root_host` without a secret means every
    node is on this host: they meet as LocalhostTree does, keyed by the port.

    Args:
        node_index: This node, 0-based.
        num_nodes: How many nodes.
        root_host: Node 0's address, which it binds.
        root_port: Node 0's port.
        host: The address this node binds and advertises.
        token: The job's secret, the same on every node.
        token_file: A private file holding it.
        insecure: Derive the secret from the root's address (a trusted cluster only).
        **options (Any): As for `Tree`.

    Returns:
        This process's node of the tree.

    Raises:
        TypeError: A misspelt option, naming the closest.
        ValueError: `node_index` out of range for `num_nodes`.
        IPCError: No secret across hosts (saying how to set one), or the rendezvous
            failed.
        IPCTimeoutError: Not every node arrived within the `timeout`.
    """
    check("StaticTree()", options, keyword_names(Tree.__init__), keyword_names(StaticTree))
    check_index(node_index, num_nodes)
    if is_loopback(root_host) and not (token or token_file or insecure or _env_secret()):
        handler = Localhost(node_index, num_nodes, key=f"static:{root_host}:{root_port}")
        return Tree(handler, **options)
    handler = Static(
        node_index,
        num_nodes,
        root_host,
        root_port,
        host=host,
        token=token,
        token_file=token_file,
        insecure=insecure,
    )
    return Tree(handler, **options)


def _env_secret() -> bool:
    return env_str(TOKEN_ENV) is not None or env_str(TOKEN_FILE_ENV) is not None


def from_env(**kwargs) -> Tree:
    """`Tree.from_env`: a tree configured by torchrun or Slurm.

    Args:
        **kwargs (Any): As for `Tree.from_env`.

    Returns:
        This process's node of the tree.
    """
    return Tree.from_env(**kwargs)
