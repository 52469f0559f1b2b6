"""The rendezvous layer: how the nodes of a tree find each other, ending in a plain `Roster`.

A handler knows where node 0 can be found and what the job's secret is:

- `Localhost` (localhost.py): every node on this host. Node 0 binds a Unix socket in
  the private runtime directory and writes its address (and a fresh random secret,
  unless a token was given) to a 0600 record there (records.py), named after the
  launch's key; the other nodes read it. Nothing listens on TCP at all.
- `Static` (static.py): node 0 at a known host and port; the secret is a token or a
  secret file (else a clear error, or `insecure=True`).
- `from_env()` (env.py): torchrun's (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT) or Slurm's variables, mapped to one of the two: all ranks on one host
  use `Localhost` with a key unique to the launch, several hosts `Static` (the secret
  from $IPC_TOKEN or $IPC_TOKEN_FILE); no launcher, a one-node `Localhost` (a single
  process).

- `Lobby` (lobby.py): on one host, where a process started again into a launch whose
  tree still runs (distlearn.survivors) knocks, and node 0 answers with where to join.

Each handler's `rendezvous(listen, options, timeout)` asks `listen(secret, specs)` to
bind the node's own endpoint once it knows the secret (it returns the addresses peers
will dial), exchanges addresses over authenticated links (the transport layer), and
returns the Roster (exchange.py). Node 0 checks that every node passes the same tree
options, and (launches.py) that a node without a key of its own belongs to its launch.
It knows nothing about trees or collectives.
"""

from .env import from_env
from .exchange import Roster, check_index
from .localhost import Localhost
from .static import Static

__all__ = ["Localhost", "Roster", "Static", "check_index", "from_env"]
