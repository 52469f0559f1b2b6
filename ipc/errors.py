"""Exceptions raised by the ipc tree; every one names the node at fault when it is known."""

from __future__ import annotations

__all__ = [
    "AuthError",
    "EndpointRefused",
    "IPCError",
    "IPCTimeoutError",
    "MismatchError",
    "PeerError",
]


class IPCError(RuntimeError):
    """Base of every error of `distlearn.ipc`: a collective or a service cannot complete.

    Args:
        message: What went wrong, naming the node or peer at fault.
        node: The node at fault, when it is known.
    """

    def __init__(self, message: str, node: int | None = None):
        super().__init__(message)
        self.node = node


class PeerError(IPCError):
    """A peer died, disconnected, or reported a failure of its own."""


class IPCTimeoutError(IPCError, TimeoutError):
    """A blocking receive waited longer than the tree's `timeout`."""


class AuthError(IPCError):
    """A connection did not present the job's token (or we were refused)."""


class EndpointRefused(AuthError):
    """The endpoint we dialed took our handshake and refused the link, saying why.

    Past the handshake, so by an endpoint of our secret: its reason holds for whoever
    comes (out of files, another version), except `closing` (it takes no more links, a
    moment before it goes away).

    Attributes:
        reason: What the endpoint said.
        closing: The endpoint is closing: another one (of the same key) may take us.
    """

    def __init__(self, message: str, reason: str, closing: bool = False, node: int | None = None):
        super().__init__(message, node)
        self.reason, self.closing = reason, closing


class MismatchError(IPCError):
    """Nodes entered different collectives, or with different shapes/dtypes."""
