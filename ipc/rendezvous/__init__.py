"""The rendezvous layer: how the nodes of a tree find each other, ending in a plain `Roster`.

A handler knows where node 0 is and what the job's secret is: `Localhost` (every
node on this host, meeting in the private runtime directory), `Static` (node 0 at
a known host and port) or the one `from_env()` picks for torchrun or Slurm. Its
`rendezvous(listen, options, timeout)` exchanges the nodes' addresses over
authenticated links (the transport layer) and returns the Roster. It knows nothing
of trees or collectives.
"""

from .exchange import Localhost, Roster, Static, check_index, from_env, is_loopback

__all__ = ["Localhost", "Roster", "Static", "check_index", "from_env", "is_loopback"]
