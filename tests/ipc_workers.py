"""Workers for tests/test_ipc*.py: `python tests/ipc_workers.py SCENARIO NODE N OUTDIR [KEY]`.

Each scenario joins a real tree, runs collectives, and saves what it saw to
OUTDIR/result-NODE.pt (read back by the test process, which checks it against
the reduction computed locally).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
import torch

from distlearn import ipc
from distlearn.ipc.collectives import shm as shm_mod

DTYPES = [torch.float16, torch.float32, torch.float64, torch.int64]
# Tokens of 128 bits (32 hex digits), as ipc demands of every token it is given.
TEST_TOKEN = "5c0f9e2a71d84b36a9e0c4f7d2b1863e"
WRONG_TOKEN = "e1b7a0c95f3d28647a9c0e1f3b5d7092"


def node_tensor(
    node: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0
) -> torch.Tensor:
    """The same pseudo-random tensor for `node` in the worker and in the test."""
    g = torch.Generator().manual_seed(1000 * node + salt)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 4).round().to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def nested(node: int) -> dict:
    """A nested structure mixing dtypes, like a model's state."""
    return {
        "w": [
            node_tensor(node, (3, 5), torch.float32, 1),
            node_tensor(node, (7,), torch.float64, 2),
        ],
        "b": (
            node_tensor(node, (4,), torch.int64, 3),
            {"h": node_tensor(node, (2, 2), torch.float16, 4)},
        ),
        "scalar": node_tensor(node, (), torch.float32, 5),
    }


def tree_from_args(node: int, n: int, key: str, **kw) -> ipc.Tree:
    """A LocalhostTree; TEST_IPC_TIMEOUT=default leaves every timing option at its default."""
    timeout = os.environ.get("TEST_IPC_TIMEOUT", "30")
    if timeout != "default":
        kw.setdefault("timeout", float(timeout))
    kw.setdefault("shm", os.environ.get("TEST_IPC_SHM", "1") == "1")
    if os.environ.get("TEST_STALL_WARNING"):
        kw.setdefault("stall_warning", float(os.environ["TEST_STALL_WARNING"]))
    if key == "-":
        return ipc.LocalhostTree(node, n, **kw)
    return ipc.LocalhostTree(node, n, key=key, **kw)


SCENARIOS: dict[str, Callable[[int, int, str], dict]] = {}


def scenario(fn: Callable[[int, int, str], dict]) -> Callable[[int, int, str], dict]:
    SCENARIOS[fn.__name__] = fn
    return fn


def _failure(out: dict, exc: BaseException, start: float) -> None:
    """What a node saw when a collective failed: the error, whom it names, how soon."""
    out["error"] = type(exc).__name__
    out["message"] = str(exc)
    out["peer"] = getattr(exc, "node", None)
    out["elapsed"] = time.monotonic() - start
    out["traceback"] = traceback.format_exc()


@scenario
def scatter_once(node: int, n: int, key: str) -> dict:
    """One scatter of 4 MiB in 64 KiB chunks, then close: the last collective before close()
    must arrive (the old tree lost it 19 runs in 20 at this size)."""
    tree = tree_from_args(node, n, key, chunk_bytes=1 << 16)
    t = node_tensor(node, (1 << 20,), torch.float32)
    tree.scatter(t)
    tree.close()
    return {"ok": torch.equal(t, node_tensor(0, (1 << 20,), torch.float32))}


@scenario
def reform_acknowledged(node: int, n: int, key: str) -> dict:
    """Every node re-forms the tree with nobody dead (as `admit` does when a process comes
    back), then runs a collective on the new one; what the old tree's links saw."""
    tree = tree_from_args(node, n, key)
    tree.all_reduce(torch.ones(10))
    new = tree.reform([])
    old = list(tree._endpoint.links.values())
    said_bye = [link for link in old if link.bye_sent]
    x = torch.full((10,), float(node + 1))
    count = new.all_reduce(x)
    new.close()
    return {"said_bye": len(said_bye), "acked": sum(link.acked for link in said_bye),
            "heard_bye": sum(link.bye is not None for link in old),
            "count": count, "sum": float(x[0])}  # fmt: skip


@scenario
def stop_in_op(node: int, n: int, key: str) -> dict:
    """Node STOP_NODE freezes (SIGSTOP) inside a custom op of the second all_reduce."""
    stopper = int(os.environ.get("STOP_NODE", "1"))
    tree = tree_from_args(node, n, key)
    tree.all_reduce(torch.ones(1000))

    def op(a: torch.Tensor, b: torch.Tensor) -> None:
        if node == stopper:
            os.kill(os.getpid(), signal.SIGSTOP)
        a.add_(b)

    out: dict = {"error": None}
    start = time.monotonic()
    try:
        # Over shared memory the others may finish this one without node 1 (its slot
        # was written before it froze): then they wait for it in the next.
        tree.all_reduce(torch.ones(1000), op=op)
        tree.all_reduce(torch.ones(1000))
    except ipc.IPCError as exc:
        _failure(out, exc, start)
    tree.close()
    return out


@scenario
def killed_asleep(node: int, n: int, key: str) -> dict:
    """Node KILL_NODE is SIGKILLed while it sleeps in a shared-memory barrier: in a sliced
    all_reduce it reduced its slice and went to sleep waiting for node 0, whose custom
    op takes 3 s over its own slice; node 0 then arrives last, after the death."""
    victim = int(os.environ.get("KILL_NODE", "1"))
    tree = tree_from_args(node, n, key)
    tree.all_reduce(torch.ones(1000))

    slept = []

    def op(a: torch.Tensor, b: torch.Tensor) -> None:  # called once a chunk: sleep once
        if node != victim and not slept:
            slept.append(time.sleep(3.0))
        a.add_(b)

    if node == victim:  # asleep in the barrier by then
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    out: dict = {"error": None}
    start = time.monotonic()
    try:
        tree.all_reduce(torch.ones(1 << 20), op=op)  # 4 MiB: sliced, a slice each
        tree.all_reduce(torch.ones(1000))
    except ipc.IPCError as exc:
        _failure(out, exc, start)
    tree.close()
    return out


@scenario
def slow(node: int, n: int, key: str) -> dict:
    """Node SLOW_NODE sleeps SLOW_S seconds before the second all_reduce: waited for."""
    tree = tree_from_args(node, n, key)
    tree.all_reduce(torch.ones(10))
    if node == int(os.environ.get("SLOW_NODE", str(n - 1))):
        time.sleep(float(os.environ.get("SLOW_S", "5")))
    x = torch.full((10,), float(node + 1))
    out = {"count": tree.all_reduce(x), "sum": float(x[0])}
    tree.close()
    return out


@scenario
def op_raises(node: int, n: int, key: str) -> dict:
    """Node RAISE_NODE's custom op raises in the second all_reduce."""
    raiser = int(os.environ.get("RAISE_NODE", "1"))
    tree = tree_from_args(node, n, key)
    tree.all_reduce(torch.ones(1000))

    def op(a: torch.Tensor, b: torch.Tensor) -> None:
        if node == raiser:
            raise ValueError(f"boom from the custom op on node {node}")
        a.add_(b)

    out: dict = {"error": None}
    start = time.monotonic()
    try:
        # Over shared memory the others may finish this one on their own (node 1's slot
        # was written before its op raised): then they hear of it in the next.
        tree.all_reduce(torch.ones(1000), op=op)
        tree.all_reduce(torch.ones(1000))
    except Exception as exc:
        _failure(out, exc, start)
    try:
        tree.all_reduce(torch.ones(3))  # the tree stays broken, and says so
        out["after"] = None
    except ipc.IPCError as exc:
        out["after"] = type(exc).__name__
    tree.close()
    return out


@scenario
def interrupted(node: int, n: int, key: str) -> dict:
    """Ctrl-C (SIGINT) on node INT_NODE while it waits in the second all_reduce."""
    victim = int(os.environ.get("INT_NODE", "0"))
    mark = os.path.join(os.environ["TEST_OUTDIR"], "interrupted")
    tree = tree_from_args(node, n, key)
    tree.all_reduce(torch.ones(100))
    out: dict = {"error": None}
    if node == victim:
        # No timing: the signal comes once we are inside the second collective, which
        # cannot finish, as the others enter it only after we were interrupted.
        def interrupt() -> None:
            while not (tree._engine.busy and tree._engine.seq == 2):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(mark) and time.monotonic() < deadline:
            time.sleep(0.01)
    start = time.monotonic()
    try:
        tree.all_reduce(torch.ones(100))
    except (ipc.IPCError, KeyboardInterrupt) as exc:
        _failure(out, exc, start)
    if node == victim:
        open(mark, "w").close()
    tree.close()
    return out


@scenario
def forked(node: int, n: int, key: str) -> dict:
    """Node 1 forks a child that outlives it; the child cannot use the tree, and once
    node 1 dies the others hear of it at once (the child holds none of its sockets)."""
    tree = tree_from_args(node, n, key)
    tree.all_reduce(torch.ones(10))
    outdir = os.environ["TEST_OUTDIR"]
    if node == 1:
        pid = os.fork()
        if pid == 0:
            try:
                tree.all_reduce(torch.ones(10))
                msg = "no error"
            except ipc.IPCError as exc:
                msg = f"{type(exc).__name__}: {exc}"
            with open(os.path.join(outdir, "child.txt"), "w") as f:
                f.write(f"{os.getpid()}\n{msg}")
            time.sleep(60)
            os._exit(0)
        while not os.path.exists(os.path.join(outdir, "child.txt")):
            time.sleep(0.01)
        time.sleep(0.2)
        os._exit(3)  # dies without closing anything, its child alive
    out: dict = {"error": None}
    start = time.monotonic()
    try:
        tree.all_reduce(torch.ones(10))
    except ipc.IPCError as exc:
        _failure(out, exc, start)
    tree.close()
    return out


@scenario
def launch(node: int, n: int, key: str) -> dict:
    """For two launches from one shell: each node contributes its pid."""
    tree = tree_from_args(node, n, key)
    x = torch.tensor([float(os.getpid())], dtype=torch.float64)
    count = tree.all_reduce(x)
    tree.close()
    return {"pid": os.getpid(), "sum": float(x[0]), "count": count}


def _anonymous_threads() -> int:
    """Native threads of this process that are neither Python's nor ZeroMQ's (named
    ZMQbg/...): OpenMP's workers among them, which torch starts at its first op on its
    intra-op pool."""
    python = {t.native_id for t in threading.enumerate()}
    count = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        count += int(tid) not in python and not name.startswith("ZMQbg")
    return count


@scenario
def pool_free(node: int, n: int, key: str) -> dict:
    """Large all-reduces with 4 torch threads (sum and max, float32 and float16, sync
    and async): the anonymous threads before and after. The data is made by numpy, so
    nothing but the tree could start torch's intra-op pool."""
    torch.set_num_threads(4)
    tree = tree_from_args(node, n, key)
    before = _anonymous_threads()
    x = torch.from_numpy(np.full(1 << 22, node + 1, dtype=np.float32))  # 16 MiB: sliced
    h = torch.from_numpy(np.full(1 << 21, node + 1, dtype=np.float16))
    counts = [tree.all_reduce(x), tree.all_reduce(x, async_op=True).wait()]
    counts.append(tree.all_reduce(h, op="max"))
    after = _anonymous_threads()
    out = {
        "threads": (before, after),
        "counts": counts,
        "x": float(x[0]),
        "x_ok": bool((x.numpy() == x.numpy()[0]).all()),
        "h": float(h[0]),
        "h_ok": bool((h.numpy() == h.numpy()[0]).all()),
    }
    tree.close()
    return out


@scenario
def big_shm(node: int, n: int, key: str) -> dict:
    """64 MiB all_reduce over shared memory (on a small /dev/shm in the test)."""
    tree = tree_from_args(node, n, key, shm=True)
    small = torch.full((1 << 16,), float(node + 1))  # 256 KiB: fits in 64 MB
    tree.all_reduce(small)
    # 4 MiB buckets fit one at a time, but not 8 fused: each runs alone, in /dev/shm.
    buckets = [torch.full((1 << 20,), float(node + i)) for i in range(8)]
    tree.all_reduce(buckets[0])
    with tree._lock:  # queued together: whoever runs them offers all 8
        handles = [tree.all_reduce(b, async_op=True) for b in buckets]
    counts = [h.wait() for h in handles]
    fused_shm = dict(tree.net_stats()["shm"])
    t = torch.full((16 << 20,), float(node + 1))
    count = tree.all_reduce(t)
    want = n * (n + 1) / 2
    sums = [sum(j + i for j in range(n)) for i in range(8)]
    sums[0] *= n  # reduced twice
    out = {
        "count": count,
        "ok": bool((t == want).all()) and bool((small == want).all()),
        "shm": tree.net_stats()["shm"],
        "bucket_counts": counts,
        "buckets_ok": [bool((b == s).all()) for b, s in zip(buckets, sums, strict=True)],
        "fused_shm": fused_shm,
    }
    tree.close()
    return out


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _encrypt() -> bool | None:
    """TEST_ENCRYPT: 1 (every link), 0 (none: a trusted network), unset (the default)."""
    return {"1": True, "0": False}.get(os.environ.get("TEST_ENCRYPT", ""))


@scenario
def static_token(node: int, n: int, key: str) -> dict:
    """StaticTree at TEST_ROOT_HOST:TEST_ROOT_PORT with $IPC_TOKEN; node 0 reports how much
    its peak memory grew during the rendezvous (strangers may be flooding it)."""
    before = _peak_rss_mib()
    tree = ipc.StaticTree(
        node, n, os.environ["TEST_ROOT_HOST"], int(os.environ["TEST_ROOT_PORT"]),
        timeout=float(os.environ.get("TEST_IPC_TIMEOUT", "30")), shm=False,
        encrypt=_encrypt(),
    )  # fmt: skip
    grew = _peak_rss_mib() - before
    x = torch.full((1000,), float(node + 1))
    count = tree.all_reduce(x)
    p = torch.full((10,), float(node))
    tree.scatter(p)
    tree.close()
    return {"count": count, "sum": float(x[0]), "scattered": p, "rss_growth_mib": grew}


@scenario
def malformed(node: int, n: int, key: str) -> dict:
    """Node 1 (a child of node 0) corrupts its chunks on the wire, as a buggy or hostile peer
    that knows the secret might: MALFORM=twice sends every chunk twice, =short cuts each
    payload by 4 bytes. Node 0 must refuse them, naming node 1."""
    tree = tree_from_args(node, n, key, shm=False)
    tree.all_reduce(torch.ones(100))
    if node == 1:
        from distlearn.ipc.transport import Kind

        link = tree._links[0]
        send = link.send
        how = os.environ["MALFORM"]

        def mangled(header, payload=None, **kw):
            if header[0] != Kind.UP or payload is None:
                return send(header, payload, **kw)
            if how == "short":
                return send(header, bytes(payload)[:-4])
            send(header, payload, **kw)
            return send(header, payload, **kw)

        link.send = mangled
    if node == 2:
        time.sleep(1.0)  # node 1's chunks, all of them, reach node 0 first
    out: dict = {"error": None}
    start = time.monotonic()
    try:
        tree.all_reduce(torch.ones(100))
    except ipc.IPCError as exc:
        _failure(out, exc, start)
    tree.close()
    return out


@scenario
def async_many(node: int, n: int, key: str) -> dict:
    """Several collectives in flight at once (all_reduce with ops, finished and nesting,
    scatter, barrier), then a synchronous one that must queue behind them; handles are
    waited for in reverse order."""
    tree = tree_from_args(node, n, key)
    t_sum = node_tensor(node, (3000,), torch.float32, 1)
    t_max = node_tensor(node, (17,), torch.int64, 2)
    t_fin = node_tensor(node, (300_000,), torch.float64, 3)  # sliced over shared memory
    t_nest = nested(node)
    p = node_tensor(node, (50,), torch.float32, 4)
    handles = [
        tree.all_reduce(t_sum, async_op=True),
        tree.all_reduce(t_max, op="max", async_op=True),
        tree.all_reduce(t_fin, finished=node % 2 == 1, async_op=True),
        tree.all_reduce(t_nest, async_op=True),
        tree.scatter(p, async_op=True),
        tree.barrier(async_op=True),
    ]
    t_sync = node_tensor(node, (10,), torch.float32, 5)
    count_sync = tree.all_reduce(t_sync)
    results = [h.wait() for h in reversed(handles)][::-1]
    out = {
        "counts": results, "count_sync": count_sync, "done": [h.is_completed() for h in handles],
        "sum": t_sum, "max": t_max, "fin": t_fin, "nest": t_nest, "scattered": p, "sync": t_sync,
    }  # fmt: skip
    tree.close()
    return out


# Queued together by async_fused: (shape, dtype, op, finished on node 1, salt). Above
# ipc.collectives.shm.SMALL each, so shared memory may run them fused; the ones that cannot join a
# run (another op or dtype, a node that finished, a view that is not contiguous, a
# small one) break it where they stand.
FUSED_JOBS = [
    ((300_000,), torch.float32, "sum", False, 10),
    ((600, 500), torch.float32, "sum", False, 11),
    ((300_000,), torch.float64, "sum", False, 12),
    ((300_000,), torch.float32, "sum", True, 13),
    ((300_000,), torch.float32, "sum", False, 14),
    ((300_000,), torch.float32, "max", False, 15),
    ((500, 600), torch.float32, "transposed", False, 16),
    ((300_000,), torch.float32, "sum", False, 17),
    ((100,), torch.float32, "sum", False, 18),
    ((300_000,), torch.float32, "sum", False, 19),
]


@scenario
def async_fused(node: int, n: int, key: str) -> dict:
    """Large all-reduces queued together, as a training step's gradient buckets. The
    tree's engine lock is held while they are queued, so whoever runs them finds them
    all queued and, on shared memory, runs them fused; each one's values and count must
    still be those of its own call. Then 8 alike (one collective on shared memory) and 8
    more than fit one collective."""
    tree = tree_from_args(node, n, key)
    tensors, handles = [], []
    with tree._lock:
        for shape, dtype, op, finished, salt in FUSED_JOBS:
            t = node_tensor(node, shape, dtype, salt)
            if op == "transposed":
                t, op = t.t(), "sum"
            tensors.append(t)
            handles.append(
                tree.all_reduce(t, op=op, finished=finished and node == 1, async_op=True)
            )
    counts = [h.wait() for h in handles]
    stats = tree.net_stats()["shm"] or {}
    alike = [
        [node_tensor(node, (300_000,), torch.float32, 20 + i) for i in range(k)] for k in (8, 12)
    ]
    alike_counts = []
    for ts in alike:
        with tree._lock:
            hs = [tree.all_reduce(t, async_op=True) for t in ts]
        alike_counts.append([h.wait() for h in hs])
    fused = (tree.net_stats()["shm"] or {}).get("fused", 0)
    # One tensor twice in a row (the second must reduce the first's result), then the
    # two halves of one buffer (disjoint: they may run fused with it).
    x = node_tensor(node, (300_000,), torch.float32, 40)
    whole = node_tensor(node, (600_000,), torch.float32, 41)
    with tree._lock:
        hs = [tree.all_reduce(t, async_op=True) for t in (x, x, whole[:300_000], whole[300_000:])]
    overlap_counts = [h.wait() for h in hs]
    overlap_fused = (tree.net_stats()["shm"] or {}).get("fused", 0) - fused
    tree.close()
    return {
        "counts": counts, "tensors": tensors, "alike": alike, "alike_counts": alike_counts,
        "fused": stats.get("fused", 0), "fused_alike": fused - stats.get("fused", 0),
        "cma": bool(stats.get("cma")), "x": x, "whole": whole, "overlap_counts": overlap_counts,
        "overlap_fused": overlap_fused,
    }  # fmt: skip


@scenario
def async_then_sync(node: int, n: int, key: str) -> dict:
    """AllReduceSGD's step, many times over: a bucket started asynchronously, the last
    one synchronously right after it. The synchronous call must queue behind the handle
    even when the communication thread has just taken it off its queue. GIL switches
    every microsecond make that moment likely instead of rare."""
    sys.setswitchinterval(1e-6)
    tree = tree_from_args(node, n, key)
    bad = 0
    for step in range(1500):
        first = torch.full((700,), float(node + step))
        last = torch.full((3,), float(node - step))
        handle = tree.all_reduce(first, async_op=True)
        tree.all_reduce(last)
        handle.wait()
        want_first = sum(float(i + step) for i in range(n))
        want_last = sum(float(i - step) for i in range(n))
        bad += int(not (bool((first == want_first).all()) and bool((last == want_last).all())))
    tree.close()
    return {"bad": bad}


@scenario
def async_uneven(node: int, n: int, key: str) -> dict:
    """Uneven step counts, each step's all_reduce started asynchronously two at a time."""
    tree = tree_from_args(node, n, key)
    steps = node + 1
    counts, sums = [], []
    step = 0
    while True:
        xs = [torch.tensor([float(node + 1)]) for _ in range(2)]
        hs = [
            tree.all_reduce(x, finished=step + k >= steps, async_op=True) for k, x in enumerate(xs)
        ]
        cs = [h.wait() for h in hs]
        for c, x in zip(cs, xs, strict=True):
            if c:
                counts.append(c)
                sums.append(float(x))
        if cs[-1] == 0:
            break
        step += 2
    tree.close()
    return {"counts": counts, "sums": sums}


@scenario
def async_helpers(node: int, n: int, key: str) -> dict:
    """Who runs a queue of handles. A thread that waits runs the queued collectives
    itself (a custom op records which thread reduced); one that waits for the first
    handle only and walks away leaves the rest to the communication thread, which
    finishes them; two threads waiting on different handles at once keep the order."""
    tree = tree_from_args(node, n, key)
    ran: list[str] = []

    def op(acc: torch.Tensor, src: torch.Tensor) -> None:
        ran.append(threading.current_thread().name)
        acc.add_(src)

    def right(ts: list[torch.Tensor], base: int) -> bool:
        return all(bool((t == sum(i + base + k for i in range(n))).all()) for k, t in enumerate(ts))

    xs = [torch.full((1000,), float(node + k)) for k in range(8)]
    counts = [h.wait() for h in [tree.all_reduce(x, op=op, async_op=True) for x in xs]]
    queued_ok = right(xs, 0)
    ys = [torch.full((1000,), float(node + 10 + k)) for k in range(4)]
    handles = [tree.all_reduce(y, async_op=True) for y in ys]
    handles[0].wait()
    deadline = time.monotonic() + 60
    while not all(h.is_completed() for h in handles) and time.monotonic() < deadline:
        time.sleep(0.01)
    walked = [h.is_completed() for h in handles]
    walked_ok = right(ys, 10)
    sys.setswitchinterval(1e-6)  # thread switches at every moment of the hand-over
    bad = 0
    for step in range(150):
        zs = [torch.full((300,), float(node + step + k)) for k in range(4)]
        handles = [tree.all_reduce(z, async_op=True) for z in zs]
        other = threading.Thread(target=handles[3].wait)
        other.start()
        handles[1].wait()
        other.join()
        handles[0].wait()
        handles[2].wait()
        bad += int(not right(zs, step))
    tree.close()
    return {
        "counts": counts, "queued_ok": queued_ok, "ran": sorted(set(ran)), "walked": walked,
        "walked_ok": walked_ok, "bad": bad,
    }  # fmt: skip


@scenario
def async_killed(node: int, n: int, key: str) -> dict:
    """Node n-1 dies while the others have four handles in flight: every wait raises,
    naming it."""
    tree = tree_from_args(node, n, key)
    tree.all_reduce(torch.ones(10))
    if node == n - 1:
        time.sleep(0.5)
        os._exit(3)
    start = time.monotonic()
    handles = [tree.all_reduce(torch.ones(1000), async_op=True) for _ in range(4)]
    out: dict = {"errors": [], "peers": [], "elapsed": None}
    for h in handles:
        try:
            h.wait()
            out["errors"].append(None)
        except ipc.IPCError as exc:
            out["errors"].append(type(exc).__name__)
            out["peers"].append(exc.node)
    out["elapsed"] = time.monotonic() - start
    tree.close()
    return out


MARKER = b"DISTLEARN-PLAINTEXT-MARKER-"


@scenario
def marker(node: int, n: int, key: str) -> dict:
    """Node 0 scatters a tensor of recognisable bytes over TCP (TEST_ENCRYPT: see _encrypt)."""
    tree = ipc.StaticTree(
        node, n, os.environ["TEST_ROOT_HOST"], int(os.environ["TEST_ROOT_PORT"]),
        timeout=float(os.environ.get("TEST_IPC_TIMEOUT", "30")), shm=False,
        encrypt=_encrypt(),
    )  # fmt: skip
    want = torch.frombuffer(bytearray(MARKER * 4000), dtype=torch.uint8)
    t = want.clone() if node == 0 else torch.zeros_like(want)
    tree.scatter(t)
    x = torch.ones(1000)
    tree.all_reduce(x)
    out = {"ok": torch.equal(t, want) and bool((x == n).all()), "encrypt": tree.encrypt}
    tree.close()
    return out


@scenario
def relayed(node: int, n: int, key: str) -> dict:
    """A StaticTree whose links cross a relay (tests/ipc_attacker.py relay): 4 MiB of ones
    summed; what the sum came to, or the error that stopped it."""
    out: dict = {"error": None}
    try:
        tree = ipc.StaticTree(
            node, n, os.environ["TEST_ROOT_HOST"], int(os.environ["TEST_ROOT_PORT"]),
            timeout=float(os.environ.get("TEST_IPC_TIMEOUT", "30")), shm=False,
            encrypt=_encrypt(), heartbeat=ipc.Liveness(0.5, 3.0),
        )  # fmt: skip
    except ipc.IPCError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "stage": "rendezvous"}
    x = torch.ones(1 << 20)
    try:
        out["count"] = tree.all_reduce(x)
        out["wrong"] = int((x != n).sum())
    except ipc.IPCError as exc:
        out["error"], out["message"] = type(exc).__name__, str(exc)
    with contextlib.suppress(ipc.IPCError):
        tree.close()
    return out


@scenario
def env(node: int, n: int, key: str) -> dict:
    """Tree.from_env with whatever RANK/WORLD_SIZE/... the test set."""
    tree = ipc.Tree.from_env(timeout=float(os.environ.get("TEST_IPC_TIMEOUT", "30")))
    x = torch.full((100,), float(node + 1))
    count = tree.all_reduce(x)
    p = node_tensor(node, (10,), torch.float32)
    tree.scatter(p)
    tree.close()
    return {"count": count, "sum": float(x[0]), "scattered": p}


def run(scenario: str, node: int, n: int, key: str) -> dict:
    out: dict = {}
    if scenario in SCENARIOS:
        return SCENARIOS[scenario](node, n, key)
    if scenario == "ops":
        tree = tree_from_args(node, n, key)
        for op in ["sum", "max", "min"]:
            for dt in DTYPES:
                t = node_tensor(node, (33,), dt)
                out[f"count-{op}-{dt}"] = tree.all_reduce(t, op=op)
                out[f"{op}-{dt}"] = t
        t = node_tensor(node, (10,), torch.float32)
        out["callable"] = t
        out["count-callable"] = tree.all_reduce(t, op=lambda a, b: a.mul_(b))
        s = nested(node)
        out["count-nested"] = tree.all_reduce(s)
        out["nested"] = s
        out["barrier-net"] = tree.net_stats()["collectives"]
        tree.close()
    elif scenario == "planted":
        # Another process (any user: /dev/shm is everyone's) creates the name of this
        # node's next slot segment first: the group goes on over the sockets.
        tree = tree_from_args(node, n, key)
        group = tree._shm
        planted = None
        if node == 1 and group is not None:
            planted = shm_mod._segment(group.prefix, f"{node}-{group._gen + 1}", os.getpid())
            planted.write_bytes(b"not yours")
        t = torch.full((1 << 20,), float(node + 1))  # 4 MiB: the first slots are made
        out["count"] = tree.all_reduce(t)
        out["ok"] = bool((t == sum(range(1, n + 1))).all())
        out["shm"] = tree.net_stats()["shm"]
        tree.close()
        if planted is not None:
            planted.unlink()
    elif scenario == "empty_and_lazy":
        # An empty tensor as the tree's first collective (the shared-memory slots are
        # made lazily: copying into none broke the tree), then lazily conjugated and
        # negated views (x.conj(): their memory holds the values before conjugation).
        tree = tree_from_args(node, n, key)
        out["count-empty"] = tree.all_reduce(torch.zeros(0))
        tree.scatter(torch.zeros(0))
        z = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * (node + 1)
        conj = z.conj()
        out["count-conj"] = tree.all_reduce(conj)
        out["conj"] = conj.resolve_conj()
        neg = (torch.arange(3.0) * (node + 1))._neg_view()
        tree.all_reduce(neg)
        out["neg"] = neg.resolve_neg()
        ones = torch.ones(2)
        out["count-after"] = tree.all_reduce(ones)
        out["after"] = ones
        tree.close()
    elif scenario == "noncontig":
        tree = tree_from_args(node, n, key)
        base = node_tensor(node, (6, 8), torch.float32)
        view = base.t()  # non-contiguous
        tree.all_reduce(view)
        out["base"] = base
        tree.close()
    elif scenario == "big":
        tree = tree_from_args(node, n, key)
        t = torch.full((16 << 20,), float(node + 1))  # 64 MiB of float32
        t[node] = 100.0
        out["count"] = tree.all_reduce(t)
        out["head"] = t[:16].clone()
        out["ok"] = bool((t[16:] == sum(range(1, n + 1))).all())
        tree.close()
    elif scenario == "sliced":
        # Above ipc.collectives.shm.SMALL: the sliced reduction, through the peers'
        # tensors (ipc.collectives.cma) or through the slots (IPC_SHM_CMA=0); two groups
        # above ipc.collectives.shm.GATHER_BYTES each, so the first is gathered before
        # the second's reduction.
        tree = tree_from_args(node, n, key)
        big = {
            "a": node_tensor(node, (1_200_000,), torch.float32, 7),
            "b": node_tensor(node, (600_000,), torch.float64, 8),
        }
        out["count"] = tree.all_reduce(big)
        out["big"] = big
        t = node_tensor(node, (400_000,), torch.float32, 9)
        out["count-finished"] = tree.all_reduce(t, finished=node == 0)
        out["finished"] = t
        m = node_tensor(node, (400_000,), torch.float32, 10)
        tree.all_reduce(m, op="max")
        out["max"] = m
        out["shm"] = tree.net_stats()["shm"]
        tree.close()
    elif scenario == "uneven":
        tree = tree_from_args(node, n, key)
        steps = node + 1
        counts, sums = [], []
        step = 0
        while True:
            x = torch.tensor([float(node + 1)])
            c = tree.all_reduce(x, finished=step >= steps)
            if c == 0:
                break
            counts.append(c)
            sums.append(float(x))
            step += 1
        out["counts"], out["sums"] = counts, sums
        tree.close()
    elif scenario == "scatter":
        tree = tree_from_args(node, n, key, chunk_bytes=1 << 12)
        t = {
            "a": node_tensor(node, (5000,), torch.float32),
            "b": [node_tensor(node, (3,), torch.int64)],
        }
        tree.scatter(t)
        out["scattered"] = t
        # Model parameters are leaves that require grad: written in place all the same.
        param = torch.nn.Parameter(node_tensor(node, (7,), torch.float32))
        tree.scatter([param])
        out["param"] = param.detach()
        tree.close()
    elif scenario == "barrier":
        tree = tree_from_args(node, n, key)
        time.sleep(0.3 * node)
        tree.barrier()
        out["after"] = time.time()
        tree.close()
    elif scenario in ("kill", "mismatch"):
        tree = tree_from_args(node, n, key)
        x = torch.ones(1000)
        tree.all_reduce(x)
        start = time.monotonic()
        try:
            if scenario == "kill" and node == n - 1:
                os._exit(3)  # dies without closing anything, like a crash
            shape = (1001,) if scenario == "mismatch" and node == n - 1 else (1000,)
            tree.all_reduce(torch.ones(shape))
            out["error"] = None
        except ipc.IPCError as exc:
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
            out["peer"] = exc.node
        out["elapsed"] = time.monotonic() - start
        tree.close()
    elif scenario == "token":
        token = WRONG_TOKEN if node == n - 1 else TEST_TOKEN
        try:
            tree = tree_from_args(node, n, key, token=token)
            out["error"] = None
            tree.close()
        except ipc.IPCError as exc:
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
    elif scenario == "static":
        tree = ipc.StaticTree(
            node,
            n,
            os.environ["TEST_ROOT_HOST"],
            int(os.environ["TEST_ROOT_PORT"]),
            token=TEST_TOKEN,
            timeout=float(os.environ.get("TEST_IPC_TIMEOUT", "30")),
            chunk_bytes=1 << 18,
        )
        t = torch.full((1 << 20,), float(node + 1))  # 4 MiB: 16 pipelined chunks
        out["count"] = tree.all_reduce(t)
        out["ok"] = bool((t == n * (n + 1) / 2).all())
        m = torch.tensor([float(node)])
        tree.all_reduce(m, op="max")
        out["max"] = float(m)
        tree.barrier()
        out["stats"] = tree.net_stats()
        tree.close()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    return out


def enter_netns(name: str) -> None:
    """Move this process into network namespace `name` (before any socket exists)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns({name})")
    finally:
        os.close(fd)


def save(result: dict, outdir: str, node: int) -> None:
    tmp = os.path.join(outdir, f".result-{node}.pt")
    torch.save(result, tmp)
    os.replace(tmp, os.path.join(outdir, f"result-{node}.pt"))


def entry(
    scenario: str,
    node: int,
    n: int,
    outdir: str,
    key: str,
    ipc_timeout: float | str,
    shm: bool,
    extra_env: dict[str, str] | None = None,
) -> None:
    """Target for a forked worker: log to OUTDIR/log-NODE.txt, run, save the result."""
    os.environ.update(extra_env or {})
    if os.environ.get("TEST_NETNS"):
        enter_netns(os.environ["TEST_NETNS"])
    os.environ["TEST_IPC_TIMEOUT"] = str(ipc_timeout)
    os.environ["TEST_IPC_SHM"] = "1" if shm else "0"
    os.environ["TEST_OUTDIR"] = outdir
    handler = logging.FileHandler(os.path.join(outdir, f"log-{node}.txt"))
    handler.setFormatter(logging.Formatter(f"[node {node}] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # A hung worker leaves its stacks in its log before the test kills it.
    if isinstance(ipc_timeout, (int, float)):
        faulthandler.dump_traceback_later(ipc_timeout + 15, file=handler.stream)
    try:
        save(run(scenario, node, n, key), outdir, node)
    except BaseException:
        logging.exception("worker failed")
        raise


def main() -> None:
    scenario, node, n, outdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    key = sys.argv[5] if len(sys.argv) > 5 else "-"
    if os.environ.get("TEST_NETNS"):
        enter_netns(os.environ["TEST_NETNS"])
    logging.basicConfig(level=logging.INFO, format=f"[node {node}] %(levelname)s %(message)s")
    os.environ.setdefault("TEST_OUTDIR", outdir)
    save(run(scenario, node, n, key), outdir, node)


if __name__ == "__main__":
    main()
