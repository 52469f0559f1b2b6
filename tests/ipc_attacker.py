"""An attacker on the network of an ipc job, for tests/test_ipc_attacks.py.

    python tests/ipc_attacker.py squat PORT OUT.json
    python tests/ipc_attacker.py frames HOST PORT CREDS.json FRAMES SIZE
    python tests/ipc_attacker.py hellos HOST PORT CREDS.json CONNECTIONS SECONDS
    python tests/ipc_attacker.py idle HOST PORT CONNECTIONS SECONDS
    python tests/ipc_attacker.py relay LISTEN_HOST UPSTREAM_HOST PORTS_FILE OUT.json

It knows what anyone on the path between two hosts knows: the ports, and whatever
crosses the wire. `squat` takes a port before the job does (node 0's port is
predictable: MASTER_PORT + 1) and records what the first dialer sends once ZeroMQ's
greeting is answered in the mechanism the dialer asked for: PLAIN credentials cross in
the clear, a CURVE HELLO is sealed. The others use what it recorded (CREDS.json: a
PLAIN username and password, or nothing) to get into a node's memory: an unfinished
multipart message (`frames`), a flood of our handshake's HELLO on hundreds of
connections (`hellos`), or connections that never say a word (`idle`). `relay` sits
between two hosts and rewrites what passes: a run of float 1.0s becomes 2.0s where the
bytes are in the clear, else one byte is flipped past the first 256 KiB.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import zmq

SIGNATURE = b"\xff" + b"\0" * 8 + b"\x7f"


def _publish(path: Path, text: str) -> None:
    """Write `path` whole: the test reads it while this process runs (or after a kill)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return out


def squat(port: int, out: Path) -> None:
    """Hold `port`, answer the first dialer's ZMTP greeting as a server of the mechanism it
    names, record its first command, hang up, and let the port go."""
    server = socket.create_server(("127.0.0.1", port))
    Path(str(out) + ".ready").write_text("1")
    server.settimeout(60)
    conn, _ = server.accept()
    conn.settimeout(30)
    record: dict = {}
    with conn:
        conn.sendall(SIGNATURE + b"\x03")  # signature and major version first, as libzmq
        greeting = _read(conn, 64)
        mechanism = greeting[12:32]
        record["mechanism"] = mechanism.rstrip(b"\0").decode()
        conn.sendall(b"\x00" + mechanism + b"\x01" + b"\0" * 31)  # minor, as-server
        flags = _read(conn, 1)[0]
        size = int.from_bytes(_read(conn, 8), "big") if flags & 0x02 else _read(conn, 1)[0]
        body = _read(conn, size)
        name = body[1 : 1 + body[0]]
        record["command"] = name.decode(errors="replace")
        if name == b"HELLO" and record["mechanism"] == "PLAIN":
            data = body[1 + body[0] :]
            user = data[1 : 1 + data[0]]
            rest = data[1 + data[0] :]
            record["plain"] = [user.decode(), rest[1 : 1 + rest[0]].decode()]
        record["bytes"] = body.hex()
    server.close()
    out.write_text(json.dumps(record))


def _credentials(sock: zmq.Socket, creds: dict) -> None:
    """Log in with what was recorded; with nothing, as a CURVE client of a made-up server
    key (what a stranger can do)."""
    if creds.get("plain"):
        sock.setsockopt(zmq.PLAIN_USERNAME, creds["plain"][0].encode())
        sock.setsockopt(zmq.PLAIN_PASSWORD, creds["plain"][1].encode())
    else:
        public, secret = zmq.curve_keypair()
        server_public, _ = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def _command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    return (b"\x04" + bytes([len(data)]) if len(data) < 256 else
            b"\x06" + len(data).to_bytes(8, "big")) + data  # fmt: skip


def frames(host: str, port: int, creds: dict, count: int, size: int) -> None:
    """One message of `count` frames of `size` bytes, never finished. Written as raw ZMTP
    after a PLAIN handshake with the recorded credentials (libzmq itself sends nothing of
    a message before its last frame; a stranger's own code does). Without credentials it
    can only try PLAIN with none."""
    user, password = (s.encode() for s in creds.get("plain") or ["", ""])
    sock = socket.create_connection((host, port), timeout=10)
    try:
        sock.sendall(SIGNATURE + b"\x03\x00" + b"PLAIN".ljust(20, b"\0") + b"\0" * 32)
        _read(sock, 64)  # the server's greeting
        sock.sendall(
            _command(b"HELLO", bytes([len(user)]) + user + bytes([len(password)]) + password)
        )
        flags = _read(sock, 1)[0]
        size_of = int.from_bytes(_read(sock, 8), "big") if flags & 0x02 else _read(sock, 1)[0]
        reply = _read(sock, size_of)
        if not reply.startswith(b"\x07WELCOME"):
            print(json.dumps({"refused": reply[:40].hex()}), flush=True)
            return
        meta = b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
        sock.sendall(_command(b"INITIATE", meta))
        header = b"\x03" + size.to_bytes(8, "big")  # MORE, long: never the last frame
        frame = header + os.urandom(size)
        for _ in range(count):
            sock.sendall(frame)
        print(json.dumps({"sent": count}), flush=True)
        time.sleep(3)  # held open while the listener takes it in
    except OSError as err:
        print(json.dumps({"error": str(err)}), flush=True)
    finally:
        sock.close()


def hellos(host: str, port: int, creds: dict, connections: int, seconds: float) -> None:
    """HELLOs of our handshake, on `connections` connections at once, for `seconds`: each
    keeps a backlog, so every round of the listener's fair queue reads one from each."""
    ctx = zmq.Context()
    socks = []
    for _ in range(connections):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        _credentials(sock, creds)
        sock.connect(f"tcp://{host}:{port}")
        socks.append(sock)
    end = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < end:
        for sock in socks:
            body = {"name": "n", "nonce": secrets.token_hex(16), "info": {"wire": 0}}
            hello = b"\x01" + json.dumps(body).encode()
            with contextlib.suppress(zmq.Again):
                for _ in range(4):
                    sock.send(hello, zmq.NOBLOCK)
                    sent += 1
        time.sleep(0.005)
    print(json.dumps({"sent": sent}), flush=True)
    ctx.destroy(linger=0)


def idle(host: str, port: int, connections: int, seconds: float) -> None:
    """`connections` TCP connections that never send a byte, held for `seconds`."""
    socks = []
    for _ in range(connections):
        s = socket.socket()
        s.settimeout(5)  # one at a time: none waits in a full backlog for the kernel's retry
        with contextlib.suppress(OSError):
            s.connect((host, port))
        socks.append(s)
    Path(os.environ.get("ATTACKER_READY", "/dev/null")).write_text("1")
    time.sleep(seconds)
    for s in socks:
        s.close()


class _Relay:
    """Forward LISTEN_HOST:port to UPSTREAM_HOST:port for every port named in PORTS_FILE,
    rewriting the dialer's bytes on their way (see the module docstring)."""

    ONES = struct.pack("<f", 1.0) * 16
    TWOS = struct.pack("<f", 2.0) * 16
    AFTER = 256 << 10

    def __init__(self, listen: str, upstream: str, out: Path):
        self.listen, self.upstream, self.out = listen, upstream, out
        self.counts = {"connections": 0, "rewrote_plain": 0, "flipped": 0}
        self.lock = threading.Lock()

    def serve(self, port: int) -> None:
        server = socket.create_server((self.listen, port))
        while True:
            client, _ = server.accept()
            upstream = socket.create_connection((self.upstream, port), timeout=10)
            upstream.settimeout(None)
            with self.lock:
                self.counts["connections"] += 1
            for src, dst, rewrite in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self.pump, args=(src, dst, rewrite), daemon=True).start()

    def pump(self, src: socket.socket, dst: socket.socket, rewrite: bool) -> None:
        seen, done = 0, False
        try:
            while data := src.recv(65536):
                if rewrite and not done:
                    at = data.find(self.ONES)
                    if at >= 0:
                        data = data[:at] + self.TWOS + data[at + len(self.TWOS) :]
                        done = self._count("rewrote_plain")
                    elif seen > self.AFTER and len(data) > 64:
                        mid = len(data) // 2
                        data = data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1 :]
                        done = self._count("flipped")
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _count(self, what: str) -> bool:
        with self.lock:
            self.counts[what] += 1
            _publish(self.out, json.dumps(self.counts))
        return True


def relay(listen: str, upstream: str, ports_file: Path, out: Path) -> None:
    r = _Relay(listen, upstream, out)
    _publish(out, json.dumps(r.counts))
    served: set[int] = set()
    while True:  # until killed: ports as the test names them
        with contextlib.suppress(OSError, ValueError):
            for port in json.loads(ports_file.read_text()):
                if port not in served:
                    served.add(port)
                    threading.Thread(target=r.serve, args=(port,), daemon=True).start()
            _publish(Path(str(ports_file) + ".served"), json.dumps(sorted(served)))
        select.select([], [], [], 0.05)


def main() -> None:
    what, args = sys.argv[1], sys.argv[2:]
    if what == "squat":
        squat(int(args[0]), Path(args[1]))
    elif what == "frames":
        creds = json.loads(Path(args[2]).read_text())
        frames(args[0], int(args[1]), creds, int(args[3]), int(args[4]))
    elif what == "hellos":
        creds = json.loads(Path(args[2]).read_text())
        hellos(args[0], int(args[1]), creds, int(args[3]), float(args[4]))
    elif what == "idle":
        idle(args[0], int(args[1]), int(args[2]), float(args[3]))
    elif what == "relay":
        relay(args[0], args[1], Path(args[2]), Path(args[3]))
    else:
        raise SystemExit(f"unknown attack {what!r}")


if __name__ == "__main__":
    main()
