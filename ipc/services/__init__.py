"""The services layer, torch-ipc's other half, on the same authenticated links as the tree.

`Server` and `Client` (with a `Connection` per client), `map` (run a function in n
processes and gather the results), `WorkQueue` and `Channel` (queues between
processes). On one host, large tensors travel through shared memory (`bulk`) and a
client's messages over a direct Unix socket (`direct`).
"""

from .channel import Channel
from .client import Client
from .pool import Map, RemoteTraceback, WorkerError, map
from .server import Connection, Server
from .workqueue import WorkQueue

__all__ = [
    "Channel",
    "Client",
    "Connection",
    "Map",
    "RemoteTraceback",
    "Server",
    "WorkQueue",
    "WorkerError",
    "map",
]
