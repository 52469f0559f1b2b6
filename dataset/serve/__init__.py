"""A static HTTP/1.1 file server on loopback, standing in for a CDN.

    python -m distlearn.dataset.serve DIR [--host 127.0.0.1] [--port 0] [--port-file F]
                                          [--workers 1]
    distlearn-serve DIR ...                       (the same, as a console script)

Serves the regular files below DIR to GET and HEAD, with keep-alive, pipelining
and single byte ranges (`Range: bytes=a-b`, `a-`, `-n`), so examples, tests and
benchmarks fetch real bytes over real sockets. Port 0 (the default) takes a free
port; a port given explicitly that is busy is an error. The bound port is
written to --port-file once the socket listens.

Why not a web framework: 4 training processes on 2 cores read thousands of
small files a second from it, and aiohttp's FileResponse spent about 660 us of
CPU per request (nginx: 46 us), taking the cores from training. This is one
asyncio.Protocol with a total, size-bounded request parser, an in-memory cache
of small files and sendfile for large ones.

One process answered 23,000 small files a second on a 16-core host, 4 processes
40,000 (bench/RESULTS-serving.md). `--workers N` (Linux) serves from N processes,
each with its own socket on the same port (SO_REUSEPORT: the kernel spreads
connections over them, and only sockets of this user can join the port) and its
own cache, under a process that supervises them: a worker that dies stops the
server with an error, SIGINT or SIGTERM stops them all, and the workers die with
the supervisor.

What it refuses: anything not below DIR and any symbolic link on the way
(opened with openat2's RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS, or a component
walk with O_NOFOLLOW where the kernel lacks openat2), directories (no
listings), request bodies, headers over 16 KiB, and clients that stall. Every
phase of a connection has a deadline that trickling bytes cannot move: a
request head must be whole within 20 s of its first byte (or of the
connection), an answer must be taken by the client within 60 s plus a second
for every 8 MiB of it, and an idle keep-alive connection closes after 75 s.

What it never does: hold a file past its request (every path closes it, an
error's included), or answer 404 for want of resources. It raises its soft
limit on open files to the hard one (as ipc's servers do: the default 1024
exists for select(), not used here), takes at most as many connections as its
files allow (beyond, a 503 and a close), and answers 503 when it cannot open a
file for want of files or memory: a client retries a 503, but takes a 404 for
"no such file".

The parts, in the order a request meets them: `limits` (every size and deadline, and
`BadRequest`, the status to answer with), `server` (the sockets, the processes, `main`),
`protocol` (one connection), `requests` (its head and Range, parsed), `files` (the
path opened below the root, small files cached).
"""

from __future__ import annotations

from .files import Files
from .limits import (
    CACHE_BYTES,
    HEAD_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_HEAD,
    MIN_SEND_RATE,
    REASONS,
    SEND_TIMEOUT_S,
    SMALL_FILE,
    BadRequest,
)
from .protocol import HttpConnection
from .requests import parse_head, parse_range
from .server import (
    Server,
    bind,
    bind_group,
    main,
    max_connections,
    raise_file_limit,
    serve_in_processes,
    write_port_file,
)

__all__ = [
    "CACHE_BYTES",
    "HEAD_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "MAX_CONNECTIONS",
    "MAX_HEAD",
    "MIN_SEND_RATE",
    "REASONS",
    "SEND_TIMEOUT_S",
    "SMALL_FILE",
    "BadRequest",
    "Files",
    "HttpConnection",
    "Server",
    "bind",
    "bind_group",
    "main",
    "max_connections",
    "parse_head",
    "parse_range",
    "raise_file_limit",
    "serve_in_processes",
    "write_port_file",
]
