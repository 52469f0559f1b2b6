"""A real aiohttp file server that injects faults, for loader tests.

    python tests/faulty_server.py ROOT PLAN.json --port-file F [--stall 5]

PLAN maps a path (relative to ROOT, no leading slash; "" for the root) to the
list of what the server does on successive requests for it; the last entry
repeats forever: ``"ok"`` (serve the file, with Range support, or an HTML
listing of a folder), ``"500"``/``"503"``/``"404"``/``"403"`` (that status),
``"stall"`` (sleep --stall seconds, then serve), ``"throttle"`` (one answer at a time,
server-wide, each after --stall seconds: an origin that serves 1/stall requests a
second whatever the client's concurrency), ``"hold"`` (wait until the file
ROOT/../release exists, then serve: a stall the test ends, whatever the load),
``"cut"`` (announce the full length, send half the body, drop the connection),
``"norange"`` (ignore Range: the whole file, in 64 KiB writes), ``"shifted"`` (a
Range answered with as many bytes from one byte further, their Content-Range
saying so, as a broken cache might), ``"unranged"`` (the same bytes with no
Content-Range), ``"compress"`` (compressed on the way where the request's
Accept-Encoding allows it, as nginx's gzip and CDNs do), ``"ratelimit"`` (a 429
with "Retry-After: 1" to a request that comes within a second of the path's
last one, the first included), ``"endless"``
(a chunked body that never ends), ``"redirect:URL"`` (a 302 to URL; ``{port}``
is this server's port). Paths not in the plan follow the plan's ``"*"`` entry, or
are served normally. Request counts per path, and the
bytes written for ``norange``/``endless`` answers (key ``PATH#sent``), are
written to ROOT/../hits.json on SIGTERM so tests can check what happened.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
from collections import Counter
from pathlib import Path

from aiohttp import web


def make_app(root: Path, plan: dict[str, list[str]], stall: float, hits: Counter):
    one_at_a_time = asyncio.Lock()  # "throttle"

    async def handle(request: web.Request) -> web.StreamResponse:
        rel = request.match_info["path"]
        n = hits[rel]
        hits[rel] += 1
        steps = plan.get(rel, plan.get("*", ["ok"]))
        action = steps[min(n, len(steps) - 1)]
        path = (root / rel).resolve()
        if action == "ratelimit":
            now = asyncio.get_running_loop().time()
            last, hits[rel + "#at"] = hits.get(rel + "#at"), now
            if last is None or now - last < 1.0:
                return web.Response(status=429, headers={"Retry-After": "1"}, text="slow down\n")
        if action.isdigit():
            return web.Response(status=int(action), text=f"injected {action} for /{rel}\n")
        if action.startswith("redirect:"):
            target = action.split(":", 1)[1].replace("{port}", str(request.url.port))
            raise web.HTTPFound(target)
        if action == "endless":
            return await _stream(request, rel, hits, iter(lambda: bytes(65536), None))
        if path.is_dir():
            links = "".join(
                f'<a href="{e.name}{"/" if e.is_dir() else ""}">{e.name}</a>\n'
                for e in sorted(path.iterdir())
            )
            return web.Response(text=f"<html><body>{links}</body></html>", content_type="text/html")
        if not path.is_file():
            raise web.HTTPNotFound(text=f"not found: /{rel}\n")
        if action == "stall":
            await asyncio.sleep(stall)
        if action == "throttle":
            async with one_at_a_time:
                await asyncio.sleep(stall)
            return web.FileResponse(path)
        if action == "hold":
            release = root.parent / "release"
            for _ in range(2400):  # two minutes at most: a test that dies cannot hang us
                if release.exists():
                    break
                await asyncio.sleep(0.05)
        if action in ("ok", "ratelimit"):
            return web.FileResponse(path)
        body = path.read_bytes()
        if action in ("shifted", "unranged") and request.http_range.start is not None:
            want = request.http_range
            start = want.start + 1
            part = body[start : start + want.stop - want.start]
            resp = web.Response(status=206, body=part, content_type="application/octet-stream")
            if action == "shifted":
                resp.headers["Content-Range"] = f"bytes {start}-{start + len(part) - 1}/{len(body)}"
            return resp
        if action == "compress":
            resp = web.Response(body=body, content_type="text/csv")
            resp.enable_compression()  # (by the request's Accept-Encoding; none: identity)
            return resp
        if action == "norange":
            chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))
            return await _stream(request, rel, hits, chunks, len(body))
        if action == "cut":
            resp = web.StreamResponse(status=200)
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body[: len(body) // 2])
            assert request.transport is not None
            request.transport.close()  # the peer sees a body cut short
            return resp
        return web.Response(body=body, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/{path:.*}", handle)
    return app


async def _stream(request, rel: str, hits: Counter, chunks, length: int | None = None):
    """Write `chunks` until they end or the client hangs up (at most 1 GiB); count bytes."""
    resp = web.StreamResponse(status=200)
    if length is not None:
        resp.content_length = length
    await resp.prepare(request)
    sent = 0
    try:
        for chunk in chunks:
            if sent >= 1 << 30:
                break
            await resp.write(chunk)
            sent += len(chunk)
    except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
        pass
    finally:
        hits[rel + "#sent"] = sent
    return resp


async def serve(root: Path, plan: dict, stall: float, port_file: str, hits_file: Path) -> None:
    hits: Counter = Counter()
    runner = web.AppRunner(make_app(root, plan, stall, hits), access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    site = web.SockSite(runner, sock)
    await site.start()
    tmp = port_file + ".tmp"
    Path(tmp).write_text(f"{sock.getsockname()[1]}\n")
    os.replace(tmp, port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    hits_file.write_text(json.dumps(hits))
    await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("plan")
    p.add_argument("--port-file", required=True)
    p.add_argument("--stall", type=float, default=5.0)
    args = p.parse_args()
    root = Path(args.root).resolve()
    plan = json.loads(Path(args.plan).read_text())
    asyncio.run(serve(root, plan, args.stall, args.port_file, root.parent / "hits.json"))


if __name__ == "__main__":
    main()


def make_pngs(root: Path, n: int, labels: int = 3, size: int = 8, csv: str = "train.csv") -> Path:
    """`n` grey PNGs under ROOT/<label>/ whose pixels (0,0),(0,1) encode the item number,
    and a CSV index (filename,label) beside them; returns the index path."""
    import numpy as np
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    lines = ["filename,label"]
    for i in range(n):
        lab = f"c{i % labels}"
        (root / lab).mkdir(exist_ok=True)
        arr = np.full((size, size), 7, dtype=np.uint8)
        arr[0, 0], arr[0, 1] = i % 256, i // 256
        Image.fromarray(arr, "L").save(root / lab / f"{i:05d}.png")
        lines.append(f"{lab}/{i:05d}.png,{lab}")
    index = root / csv
    index.write_text("\n".join(lines) + "\n")
    return index


def item_ids(batch_input) -> list[int]:
    """The item numbers encoded by make_pngs, read back from a batch of decoded images."""
    px = (batch_input[:, 0, 0, :2] * 255).round().long()
    return (px[:, 0] + 256 * px[:, 1]).tolist()


@contextlib.contextmanager
def running(root: Path, plan: dict | None = None, stall: float = 5.0):
    """Run this server over `root` in a subprocess; yields (base URL, hits() -> Counter)."""
    import subprocess
    import sys
    import tempfile

    from tests.conftest import repo_env, wait_for_file

    with tempfile.TemporaryDirectory() as tmp:
        plan_file = Path(tmp) / "plan.json"
        plan_file.write_text(json.dumps(plan or {}))
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen(
            [sys.executable, __file__, str(root), str(plan_file),
             "--port-file", str(port_file), "--stall", str(stall)],
            env=repo_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

        def hits() -> Counter:
            proc.terminate()
            proc.wait(timeout=10)
            return Counter(json.loads((root.parent / "hits.json").read_text()))

        try:
            yield f"http://127.0.0.1:{wait_for_file(port_file, proc)}/", hits
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
