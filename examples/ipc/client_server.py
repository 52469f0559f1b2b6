"""Client-server tensor ping-pong, as torch-ipc's examples/client-server.lua.

    python examples/ipc/client_server.py [--clients 2] [--size 1048576] [--rounds 50]

The server sends each client a float32 tensor of --size bytes; each client
adds one and sends it back into a buffer the server preallocated. The server
checks every value and prints the round trips per second and the throughput.
"""

from __future__ import annotations

import argparse
import multiprocessing
import secrets
import time

import torch

from distlearn import ipc


def client(port: int, token: str, rounds: int, numel: int) -> None:
    c = ipc.Client("127.0.0.1", port, token=token)
    buf = torch.empty(numel)
    for _ in range(rounds):
        x = c.recv(into=buf)  # received in place
        c.send(x.add_(1))
    c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--size", type=int, default=1 << 20, help="bytes per message")
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    numel = max(1, args.size // 4)
    token = secrets.token_hex(16)  # across hosts: the same $IPC_TOKEN on both sides
    server = ipc.Server("127.0.0.1", 0, token=token)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=client, args=(server.port, token, args.rounds, numel))
        for _ in range(args.clients)
    ]
    for p in procs:
        p.start()
    try:
        conns = server.clients(args.clients, timeout=60)
        x = torch.arange(numel, dtype=torch.float32)
        bufs = [torch.empty(numel) for _ in conns]
        start = time.perf_counter()
        for r in range(args.rounds):
            server.broadcast(x + r)
            for conn, buf in zip(conns, bufs, strict=True):
                back = conn.recv(into=buf, timeout=60)
                assert back[0].item() == r + 1 and back[-1].item() == numel - 1 + r + 1
        dt = time.perf_counter() - start
        trips = args.rounds * len(conns)
        stats = server.net_stats()
        print(
            f"client_server.py: {trips} round trips of {numel * 4} bytes with {len(conns)} "
            f"clients in {dt:.2f} s: {trips / dt:.0f} round trips/s, "
            f"{2 * trips * numel * 4 / dt / 1e6:.0f} MB/s "
            f"({stats['bytes_sent'] + stats['bytes_recv']} bytes on the wire)"
        )
    finally:
        server.close()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    main()
