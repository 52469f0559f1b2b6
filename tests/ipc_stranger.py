"""A stranger on the job's host that knows only public values, trying to join its tree.

    python tests/ipc_stranger.py SECONDS OUT.json [UID]

With UID (started as root) it becomes that user once its modules are loaded.

It reads what any process of the host can see: MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RUN_ID (from its own environment, as a co-tenant would guess
them), the TCP ports listening on the host, and the runtime directory. For
SECONDS it tries every way in it knows: the signed join of the old wire
protocol with the token that protocol derived from those values, and this
protocol's authenticated dial with the same token on every listening port
and every Unix socket it can reach. OUT.json says whether any attempt was
admitted ("joined") and what each attempt met.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sys
import time
from pathlib import Path

import zmq


def listening_tcp_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 3 and parts[3] == "0A":  # LISTEN
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def old_protocol_join(ctx: zmq.Context, addr: str, token: str, node: int, n: int) -> bool:
    """The join that the old wire accepted: JSON signed with HMAC-SHA256 of the token."""
    body = {
        "type": "join", "node": node, "num_nodes": n, "host": "stranger/0",
        "addrs": {"tcp": "tcp://127.0.0.1:1"}, "nonce": secrets.token_hex(8), "pid": os.getpid(),
    }  # fmt: skip
    mac = hmac.new(token.encode(), json.dumps(body, sort_keys=True).encode(), hashlib.sha256)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(addr)
        sock.send(json.dumps({**body, "mac": mac.hexdigest()}).encode(), zmq.NOBLOCK)
        if sock.poll(500):
            reply = json.loads(sock.recv())
            return reply.get("type") == "welcome"
    except (zmq.ZMQError, ValueError):
        pass
    finally:
        sock.close(linger=0)
    return False


try:  # this protocol, if the checkout has it (the old one does not)
    from distlearn.ipc.errors import IPCError
    from distlearn.ipc.transport import Endpoint, Secret
except ImportError:
    Endpoint = None


def new_protocol_join(addr: str, token: str) -> str:
    """This protocol's authenticated dial, with a token made of public values."""
    if Endpoint is None:
        return "no such protocol here"
    ep = Endpoint(Secret(token, "guessed"), "stranger")
    try:
        link = ep.dial(addr)
        ep.wait_up([link], time.monotonic() + 0.5, "stranger")
        return "joined"
    except IPCError as err:
        return f"refused: {type(err).__name__}"
    finally:
        ep.close(linger=0)


def main() -> None:
    seconds, out = float(sys.argv[1]), Path(sys.argv[2])
    if len(sys.argv) > 3:  # become the other user now that every module is loaded
        uid = int(sys.argv[3])
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    env = os.environ
    master = env.get("MASTER_ADDR", "127.0.0.1")
    mport = int(env.get("MASTER_PORT", "29500"))
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    n = int(env.get("WORLD_SIZE", "2"))
    ctx = zmq.Context()
    attempts: list[str] = []
    joined = False
    deadline = time.monotonic() + seconds
    runtime = Path(env.get("VICTIM_RUNTIME_DIR", "/tmp/distlearn-ipc-0"))
    while time.monotonic() < deadline and not joined:
        ports = sorted(listening_tcp_ports())
        for port in {mport + 1, *[p for p in ports if p != mport]}:
            if time.monotonic() > deadline:
                break
            for p_token in (mport + 1, port):
                token = f"distlearn-ipc:{run_id}:{master}:{p_token}"
                addr = f"tcp://{master}:{port}"
                if old_protocol_join(ctx, addr, token, 1, n):
                    joined = True
                    attempts.append(f"old join admitted at {addr}")
                verdict = new_protocol_join(addr, token)
                attempts.append(f"{addr}: {verdict}")
                joined = joined or verdict == "joined"
        try:
            socks = [p for p in runtime.iterdir() if p.suffix == ".sock"]
            attempts.append(f"listed {runtime}: {len(socks)} sockets")
        except OSError as err:
            socks = []
            attempts.append(f"cannot list {runtime}: {err.strerror}")
        for sock in socks:
            verdict = new_protocol_join(f"ipc://{sock}", f"distlearn-ipc:{run_id}")
            attempts.append(f"{sock}: {verdict}")
            joined = joined or verdict == "joined"
        time.sleep(0.5)
    ctx.destroy(linger=0)
    out.write_text(json.dumps({"joined": joined, "attempts": attempts[-50:]}))


if __name__ == "__main__":
    main()
