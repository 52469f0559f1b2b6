"""Ways into a tree: node 0 binds and collects every node's address, then tells all of them.

`LocalhostTree` finds its peers through a 0600 file keyed by the parent pid,
`StaticTree` through a known root host and port, `from_env` through torchrun's
or Slurm's variables. Every join carries an HMAC of the job's secret; a
stranger is refused and logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import socket
import time

import zmq

from .errors import AuthError, IPCError, IPCTimeoutError
from .tree import DEFAULT_CHUNK, DEFAULT_TIMEOUT, Tree, runtime_dir

log = logging.getLogger(__name__)

TOKEN_ENV = "IPC_TOKEN"


def _mac(secret: bytes, body: dict) -> str:
    text = json.dumps(body, sort_keys=True).encode()
    return hmac.new(secret, text, hashlib.sha256).hexdigest()


def _signed(secret: bytes, body: dict) -> bytes:
    return json.dumps({**body, "mac": _mac(secret, body)}).encode()


def _verify(secret: bytes, raw: bytes) -> dict | None:
    """The message if its MAC matches the secret, else None. Never unpickles anything."""
    try:
        msg = json.loads(raw)
        mac = msg.pop("mac")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return msg if hmac.compare_digest(str(mac), _mac(secret, msg)) else None


def host_identity() -> str:
    """Host name plus network namespace: processes in different netns cannot share loopback."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/{netns}"


def _bind_node(
    ctx: zmq.Context,
    bind_host: str,
    with_ipc: bool,
    tag: str,
    port: int | None = None,
    advertise: str | None = None,
):
    """This node's ROUTER, on TCP (`port`, or a random one) and a Unix socket for
    same-host peers; returns it, the addresses peers dial (TCP on `advertise`, by
    default `bind_host`), the files to remove, and the TCP port."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 0)
    router.setsockopt(zmq.LINGER, 0)
    if port is None:
        port = router.bind_to_random_port(f"tcp://{bind_host}")
    else:
        router.bind(f"tcp://{bind_host}:{port}")
    addrs = {"tcp": f"tcp://{advertise or bind_host}:{port}"}
    cleanup = []
    if with_ipc:
        path = runtime_dir() / f"{tag}-{secrets.token_hex(4)}.sock"
        router.bind(f"ipc://{path}")
        addrs["ipc"] = f"ipc://{path}"
        cleanup.append(str(path))
    return router, addrs, cleanup, port


def _advertised_host(root_host: str, root_port: int) -> str:
    """The local address that routes to the root: what the other nodes should dial."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(root_host), root_port))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _root_gather(
    ctx: zmq.Context,
    router: zmq.Socket,
    secret: bytes,
    num_nodes: int,
    my_addrs: dict,
    timeout: float,
    on_complete=None,
) -> tuple[list[str], list[dict]]:
    """Node 0: wait for every other node's signed join, then send each the whole roster."""
    hosts: list[str | None] = [host_identity()] + [None] * (num_nodes - 1)
    addrs: list[dict | None] = [my_addrs] + [None] * (num_nodes - 1)
    reply_to: dict[int, tuple[bytes, str]] = {}
    deadline = time.monotonic() + timeout
    while len(reply_to) < num_nodes - 1:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not router.poll(int(remaining * 1000) + 1):
            missing = [i for i in range(1, num_nodes) if i not in reply_to]
            raise IPCTimeoutError(
                f"node 0: nodes {missing} did not join within {timeout}s", node=missing[0]
            )
        frames = router.recv_multipart()
        ident, raw = frames[0], frames[-1]
        msg = _verify(secret, raw)
        if msg is None or msg.get("type") != "join":
            log.warning("ipc node 0: refused a join with a bad token (peer %s)", ident.hex()[:16])
            router.send_multipart([ident, json.dumps({"type": "refused"}).encode()])
            continue
        i = msg.get("node")
        if not isinstance(i, int) or not 0 < i < num_nodes or msg.get("num_nodes") != num_nodes:
            reason = (
                f"node {i} of {msg.get('num_nodes')} does not fit a tree of {num_nodes} "
                f"rooted at node 0"
            )
            log.warning("ipc node 0: refused a join: %s", reason)
            router.send_multipart([ident, _signed(secret, {"type": "refused", "reason": reason})])
            continue
        if i in reply_to and reply_to[i][0] != ident:
            log.warning("ipc node 0: node %d joined twice; keeping the latest", i)
        hosts[i], addrs[i] = msg["host"], msg["addrs"]
        reply_to[i] = (ident, msg["nonce"])
    if on_complete is not None:
        on_complete()
    for ident, nonce in reply_to.values():
        body = {"type": "welcome", "nonce": nonce, "hosts": hosts, "addrs": addrs}
        router.send_multipart([ident, _signed(secret, body)])
    return hosts, addrs  # type: ignore[return-value]


def _join(
    ctx: zmq.Context,
    secret: bytes,
    node_index: int,
    num_nodes: int,
    my_addrs: dict,
    timeout: float,
    root_address,
) -> tuple[list[str], list[dict]]:
    """Nodes 1..n-1: send a signed join to the root, wait for the roster.

    `root_address()` returns the root's address (it may change while we wait,
    when a rendezvous file is rewritten by a fresh root) or None if not known yet.
    """
    deadline = time.monotonic() + timeout
    nonce = secrets.token_hex(8)
    body = {
        "type": "join",
        "node": node_index,
        "num_nodes": num_nodes,
        "host": host_identity(),
        "addrs": my_addrs,
        "nonce": nonce,
        "pid": os.getpid(),
    }
    sock = None
    current = None
    try:
        while True:
            if time.monotonic() > deadline:
                raise IPCTimeoutError(
                    f"node {node_index}: root (node 0) at {current or 'unknown address'} "
                    f"did not answer within {timeout}s",
                    node=0,
                )
            # The root removes its rendezvous file once everyone has joined: keep the
            # address we have unless a different live root shows up.
            addr = root_address() or current
            if addr is None:
                time.sleep(0.02)
                continue
            if addr != current:
                if sock is not None:
                    sock.close(linger=0)
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(addr)
                sock.send(_signed(secret, body))
                current = addr
            if not sock.poll(200):
                continue
            raw = sock.recv()
            msg = _verify(secret, raw)
            if msg is None:
                try:
                    refused = json.loads(raw).get("type") == "refused"
                except (ValueError, AttributeError):
                    refused = False
                if refused:
                    raise AuthError(
                        f"node {node_index}: the root at {addr} refused our token", node=0
                    )
                log.warning("ipc node %d: ignored an unsigned reply from %s", node_index, addr)
                continue
            if msg.get("type") == "refused":
                raise IPCError(f"node {node_index}: refused by root: {msg.get('reason')}", node=0)
            if msg.get("type") == "welcome" and msg.get("nonce") == nonce:
                return msg["hosts"], msg["addrs"]
    finally:
        if sock is not None:
            sock.close(linger=0)


def _abandon(router: zmq.Socket, paths: list[str]) -> None:
    """Rendezvous failed: close our sockets (and their context) and remove the Unix socket file."""
    router.context.destroy(linger=0)
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _check_index(node_index: int, num_nodes: int) -> None:
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
    if not isinstance(node_index, int) or not 0 <= node_index < num_nodes:
        raise ValueError(f"node_index must be in [0, {num_nodes}), got {node_index!r}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def LocalhostTree(
    node_index: int,
    num_nodes: int,
    *,
    key: str | int | None = None,
    port: int | None = None,
    token: str | None = None,
    base: int = 2,
    timeout: float = DEFAULT_TIMEOUT,
    chunk_bytes: int = DEFAULT_CHUNK,
    shm: bool = True,
) -> Tree:
    """A tree of processes on this host, bound to loopback only.

    Processes started side by side (by one shell script or one Python parent)
    share a parent pid, which keys a rendezvous file in a private temp dir;
    node 0 writes its port and a fresh secret there. Pass `key=` to group
    processes with different parents, `port=` to fix node 0's port, and
    `token=` (or $IPC_TOKEN) to set the secret yourself. `shm=False` keeps
    every collective on the ZeroMQ tree instead of shared memory.
    """
    _check_index(node_index, num_nodes)
    if key is None:
        key = f"port{port}" if port is not None else f"ppid{os.getppid()}"
    key = re.sub(r"[^A-Za-z0-9_.-]", "_", str(key))
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    rv_file = runtime_dir() / f"{key}.json"
    ctx = zmq.Context()  # the tree's own: close() terminates it, which flushes
    if num_nodes == 1:
        router, _, cleanup, _ = _bind_node(ctx, "127.0.0.1", False, f"{key}-0")
        return Tree(0, 1, context=ctx, router=router, cleanup=cleanup, secret=b"",
                    hosts=[host_identity()], addresses=[{}], base=base, timeout=timeout,
                    chunk_bytes=chunk_bytes, shm=shm)  # fmt: skip
    if node_index == 0:
        secret_text = token if token is not None else secrets.token_hex(16)
        secret = secret_text.encode()
        router, my_addrs, cleanup, bound = _bind_node(ctx, "127.0.0.1", True, f"{key}-0", port)
        info = {"port": bound, "pid": os.getpid(), "secret": None if token else secret_text}
        tmp = rv_file.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        os.replace(tmp, rv_file)

        def remove_file() -> None:
            try:
                if json.loads(rv_file.read_text()).get("pid") == os.getpid():
                    rv_file.unlink()
            except (OSError, ValueError):
                pass

        try:
            hosts, addrs = _root_gather(
                ctx, router, secret, num_nodes, my_addrs, timeout, on_complete=remove_file
            )
        except BaseException:
            remove_file()
            _abandon(router, cleanup)
            raise
    else:
        router, my_addrs, cleanup, _ = _bind_node(ctx, "127.0.0.1", True, f"{key}-{node_index}")
        secret_box: list[bytes] = [token.encode()] if token is not None else []

        def root_address() -> str | None:
            if port is not None and token is not None:
                return f"tcp://127.0.0.1:{port}"
            try:
                info = json.loads(rv_file.read_text())
            except (OSError, ValueError):
                return None
            if not _pid_alive(int(info.get("pid", 0))):
                return None  # a stale file from a run that died during rendezvous
            if token is None:
                secret_box[:] = [str(info["secret"]).encode()]
            return f"tcp://127.0.0.1:{info['port']}"

        addr = None
        deadline = time.monotonic() + timeout
        while addr is None:
            addr = root_address()
            if addr is None:
                if time.monotonic() > deadline:
                    _abandon(router, cleanup)
                    raise IPCTimeoutError(
                        f"node {node_index}: node 0 did not appear within {timeout}s "
                        f"(rendezvous file {rv_file})",
                        node=0,
                    )
                time.sleep(0.02)
        secret = secret_box[0]
        try:
            hosts, addrs = _join(
                ctx, secret, node_index, num_nodes, my_addrs, timeout, root_address
            )
        except BaseException:
            _abandon(router, cleanup)
            raise
    return Tree(node_index, num_nodes, context=ctx, router=router, cleanup=cleanup,
                secret=secret, hosts=hosts, addresses=addrs, base=base, timeout=timeout,
                chunk_bytes=chunk_bytes, shm=shm)  # fmt: skip


def StaticTree(
    node_index: int,
    num_nodes: int,
    root_host: str,
    root_port: int,
    *,
    host: str | None = None,
    token: str | None = None,
    base: int = 2,
    timeout: float = DEFAULT_TIMEOUT,
    chunk_bytes: int = DEFAULT_CHUNK,
    shm: bool = True,
) -> Tree:
    """A tree across machines: node 0 listens on `root_host:root_port`, the others dial it.

    `host` is the address this node binds and advertises (default: the local
    address that routes to the root). The secret is `token` or $IPC_TOKEN.
    Nodes that share a host (and network namespace) use shared memory when
    all of them do (`shm=True`), else the ZeroMQ tree.
    """
    _check_index(node_index, num_nodes)
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    if token is None:
        log.warning(
            "ipc: no token given (token= or $%s); using one derived from the root address, "
            "which only keeps out processes that do not know it",
            TOKEN_ENV,
        )
        token = f"distlearn-ipc:{root_host}:{root_port}"
    secret = token.encode()
    ctx = zmq.Context()  # the tree's own: close() terminates it, which flushes
    tag = f"static{root_port}-{node_index}"
    if node_index == 0:
        router, my_addrs, cleanup, _ = _bind_node(
            ctx, host or "0.0.0.0", True, tag, port=root_port, advertise=host or root_host
        )
        if num_nodes == 1:
            hosts, addrs = [host_identity()], [my_addrs]
        else:
            try:
                hosts, addrs = _root_gather(ctx, router, secret, num_nodes, my_addrs, timeout)
            except BaseException:
                _abandon(router, cleanup)
                raise
    else:
        bind_host = host or _advertised_host(root_host, root_port)
        router, my_addrs, cleanup, _ = _bind_node(ctx, bind_host, True, tag)
        root = f"tcp://{root_host}:{root_port}"
        try:
            hosts, addrs = _join(
                ctx, secret, node_index, num_nodes, my_addrs, timeout, lambda: root
            )
        except BaseException:
            _abandon(router, cleanup)
            raise
    return Tree(node_index, num_nodes, context=ctx, router=router, cleanup=cleanup,
                secret=secret, hosts=hosts, addresses=addrs, base=base, timeout=timeout,
                chunk_bytes=chunk_bytes, shm=shm)  # fmt: skip


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as `gpu[03-05,07],cpu1`."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_NODELIST {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def from_env(**kwargs) -> Tree:
    """A `StaticTree` configured by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or Slurm.

    The tree listens on $IPC_PORT, else MASTER_PORT + 1 (torchrun's own store
    holds MASTER_PORT), else a port derived from SLURM_JOB_ID.
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        root_host = env.get("MASTER_ADDR", "127.0.0.1")
        port = int(env["IPC_PORT"]) if "IPC_PORT" in env else int(env["MASTER_PORT"]) + 1
        run_id = env.get("TORCHELASTIC_RUN_ID")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        root_host = env.get("MASTER_ADDR") or _first_slurm_host(
            env.get("SLURM_STEP_NODELIST") or env["SLURM_NODELIST"]
        )
        job = int(env.get("SLURM_JOB_ID", "0"))
        port = int(env["IPC_PORT"]) if "IPC_PORT" in env else 20000 + job % 20000
        run_id = f"slurm-{job}" if "SLURM_JOB_ID" in env else None
    else:
        raise IPCError(
            "Tree.from_env: set RANK and WORLD_SIZE (torchrun) or run under Slurm "
            "(SLURM_PROCID, SLURM_NTASKS, SLURM_NODELIST)"
        )
    if "token" not in kwargs and TOKEN_ENV not in env and run_id:
        kwargs["token"] = f"distlearn-ipc:{run_id}:{root_host}:{port}"
    return StaticTree(rank, world, root_host, port, **kwargs)
