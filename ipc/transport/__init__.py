"""The transport layer: authenticated links between processes, and what travels on them.

`Endpoint` is one process's side (it listens and dials), `Link` one authenticated
connection to a peer; `Limits` bounds what a stranger can make us hold, `Liveness`
how soon a dead or frozen peer is named. `wire` is the message format (nothing
received is unpickled), `auth` the job's secret, `runtime` the private runtime
directory, `fdlimit` a process's budget of open files. It knows nothing of trees,
rendezvous or services; every layer above builds on it.
"""

from . import auth, fdlimit, runtime, wire
from .auth import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    Secret,
    given_secret,
    insecure_secret,
    missing_secret_error,
    random_secret,
)
from .link import Endpoint, Limits, Link
from .liveness import Liveness
from .runtime import runtime_dir
from .wire import Kind, WireError

__all__ = [
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "Endpoint",
    "Kind",
    "Limits",
    "Link",
    "Liveness",
    "Secret",
    "WireError",
    "auth",
    "fdlimit",
    "given_secret",
    "insecure_secret",
    "missing_secret_error",
    "random_secret",
    "runtime",
    "runtime_dir",
    "wire",
]
