"""ipc: real trees of spawned processes on 127.0.0.1, checked against reductions computed here."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import repo_env
from ipc_harness import (
    TRANSPORTS,
    WORKER,
    collect,
    local_reduce,
    netns_pair,  # noqa: F401 (a fixture)
    run_tree,
    start_worker,
    wait_all,
)
from ipc_workers import DTYPES, nested, node_tensor

from distlearn import ipc
from distlearn.ipc.collectives.topology import build_tree, depth
from distlearn.ipc.transport import runtime

OPS = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


@pytest.mark.parametrize("shm", TRANSPORTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_all_reduce_ops_dtypes_nested(n, shm, tmp_path):
    results, _ = run_tree("ops", n, tmp_path, timeout=120, shm=shm)
    for op, fn in OPS.items():
        for dt in DTYPES:
            want = local_reduce(fn, [node_tensor(i, (33,), dt) for i in range(n)])
            for i, r in enumerate(results):
                assert r[f"count-{op}-{dt}"] == n
                assert r[f"{op}-{dt}"].dtype == dt
                assert torch.equal(r[f"{op}-{dt}"], want), f"node {i} {op} {dt}"
    want = local_reduce(torch.mul, [node_tensor(i, (10,), torch.float32) for i in range(n)])
    for r in results:
        assert r["count-callable"] == n
        torch.testing.assert_close(r["callable"], want, rtol=1e-5, atol=0)
        # identical bits on every node, whatever the reduction order
        assert torch.equal(r["callable"], results[0]["callable"])
    structs = [nested(i) for i in range(n)]
    for r in results:
        got = r["nested"]
        assert torch.equal(got["w"][0], sum(s["w"][0] for s in structs))
        assert torch.equal(got["w"][1], sum(s["w"][1] for s in structs))
        assert torch.equal(got["b"][0], sum(s["b"][0] for s in structs))
        assert torch.equal(got["b"][1]["h"], sum(s["b"][1]["h"] for s in structs))
        assert got["b"][1]["h"].dtype == torch.float16
        assert torch.equal(got["scalar"], sum(s["scalar"] for s in structs))


def test_shell_script_default_key(tmp_path):
    """No key, no port: processes started side by side by one shell script find each other."""
    n = 3
    script = f"""
    for i in $(seq 0 {n - 1}); do
        "{sys.executable}" "{WORKER}" uneven $i {n} "{tmp_path}" > "{tmp_path}/log-$i.txt" 2>&1 &
    done
    wait
    """
    proc = subprocess.Popen(["bash", "-c", script], env=repo_env(), start_new_session=True)
    try:
        proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    results, _ = collect(tmp_path, [0] * n)
    assert all(r is not None for r in results)
    assert [len(r["counts"]) for r in results] == [n, n, n]


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_uneven_finished(shm, tmp_path):
    n = 4
    results, _ = run_tree("uneven", n, tmp_path, shm=shm)
    # node i runs i+1 steps; at step s the nodes with more than s steps contribute.
    want_counts = [n - s for s in range(n)]
    want_sums = [float(sum(i + 1 for i in range(n) if i + 1 > s)) for s in range(n)]
    for r in results:
        assert r["counts"] == want_counts
        assert r["sums"] == want_sums


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_scatter(shm, tmp_path):
    results, _ = run_tree("scatter", 5, tmp_path, shm=shm)
    for r in results:
        assert torch.equal(r["scattered"]["a"], node_tensor(0, (5000,), torch.float32))
        assert torch.equal(r["scattered"]["b"][0], node_tensor(0, (3,), torch.int64))
        assert torch.equal(r["param"], node_tensor(0, (7,), torch.float32))


def test_barrier(tmp_path):
    n = 3
    results, _ = run_tree("barrier", n, tmp_path)
    # node 2 sleeps 0.6 s before entering; nobody may leave before it arrived.
    after = [r["after"] for r in results]
    assert max(after) - min(after) < 0.25


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_non_contiguous(shm, tmp_path):
    n = 3
    results, _ = run_tree("noncontig", n, tmp_path, shm=shm)
    want = sum(node_tensor(i, (6, 8), torch.float32) for i in range(n))
    for r in results:
        assert torch.equal(r["base"], want)


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_an_empty_first_collective_and_lazily_conjugated_tensors(shm, tmp_path):
    n = 2
    results, _ = run_tree("empty_and_lazy", n, tmp_path, shm=shm)
    total = sum(k + 1 for k in range(n))
    want_conj = (torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64) * total).conj()
    for r in results:
        assert r["count-empty"] == n and r["count-conj"] == n and r["count-after"] == n
        assert torch.equal(r["conj"], want_conj.resolve_conj())
        assert torch.equal(r["neg"], -torch.arange(3.0) * total)
        assert torch.equal(r["after"], torch.full((2,), float(n)))


def test_a_slot_name_taken_in_dev_shm_sends_collectives_over_the_sockets(tmp_path):
    """Another user could create the name of a node's next segment first (O_EXCL then
    refuses it): the first large all_reduce raised FileExistsError on every node and the
    tree was broken. Now the group keeps going over the sockets, with a warning."""
    n = 2
    results, logs = run_tree("planted", n, tmp_path)
    for r in results:
        assert r["count"] == n and r["ok"]
    assert any("cannot create" in text and "File exists" in text for text in logs), logs


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_big_tensor_64mib(shm, tmp_path):
    n = 2
    results, _ = run_tree("big", n, tmp_path, timeout=120, shm=shm)
    for r in results:
        assert r["count"] == n
        assert r["ok"]
        want = torch.full((16,), float(sum(range(1, n + 1))))
        for i in range(n):
            want[i] = 100.0 + sum(j + 1 for j in range(n) if j != i)
        assert torch.equal(r["head"], want)


@pytest.mark.parametrize(
    "cma", [pytest.param("1", id="cross-memory"), pytest.param("0", id="slots")]
)
def test_sliced_shared_memory_reduction(cma, tmp_path):
    """Above 1 MiB each node reduces one slice: two dtypes, a finished node, max."""
    n = 3
    results, _ = run_tree("sliced", n, tmp_path, extra_env=[{"IPC_SHM_CMA": cma}] * n)
    if cma == "1" and not results[0]["shm"]["cma"]:
        pytest.skip("process_vm_readv is not permitted between processes on this host")
    want_a = sum(node_tensor(i, (1_200_000,), torch.float32, 7) for i in range(n))
    want_b = sum(node_tensor(i, (600_000,), torch.float64, 8) for i in range(n))
    want_f = sum(node_tensor(i, (400_000,), torch.float32, 9) for i in range(1, n))
    want_m = local_reduce(
        torch.maximum, [node_tensor(i, (400_000,), torch.float32, 10) for i in range(n)]
    )
    for r in results:
        assert r["shm"]["cma"] == (cma == "1")
        assert r["shm"]["direct"] == (3 if cma == "1" else 0)
        assert r["count"] == n and r["count-finished"] == n - 1
        assert torch.equal(r["big"]["a"], want_a) and torch.equal(r["big"]["b"], want_b)
        assert torch.equal(r["finished"], want_f)
        assert torch.equal(r["max"], want_m)


def test_stale_shared_memory_is_swept(tmp_path):
    """A segment left by a node killed during setup goes when the next tree starts."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    stale = Path("/dev/shm") / f"distlearn-ipc-{uuid.uuid4().hex[:14]}-ctl.{dead.pid}"
    fresh = Path("/dev/shm") / f"distlearn-ipc-{uuid.uuid4().hex[:14]}-ctl.{dead.pid}"
    alive = Path("/dev/shm") / f"distlearn-ipc-{uuid.uuid4().hex[:14]}-ctl.{os.getpid()}"
    for path in (stale, fresh, alive):
        path.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    os.utime(alive, (old, old))
    try:
        run_tree("uneven", 2, tmp_path)
        assert not stale.exists()
        assert fresh.exists(), "too young to judge: maybe another pid namespace's"
        assert alive.exists()
    finally:
        for path in (stale, fresh, alive):
            path.unlink(missing_ok=True)


def test_stale_rendezvous_records_are_replaced_and_swept(tmp_path):
    """A node 0 killed in its rendezvous leaves its record (named after its pid): a node 0
    given that pid again replaces it (it used to fail, the name taken), and the next
    rendezvous removes it, of any key. Not the record of a pid that looks dead but
    whose address is listened on (a node 0 in another pid namespace)."""
    key = f"test-{uuid.uuid4().hex[:8]}"
    digest = hashlib.sha256(f"{key}:2".encode()).hexdigest()[:16]
    directory = runtime.runtime_dir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"v": 2, "key": key, "pid": dead.pid, "start": 1, "address": "ipc:///nowhere",
             "num_nodes": 2, "secret": "s" * 32}  # fmt: skip
    other = f"rv-{'0' * 16}-{dead.pid}.json"  # another key's
    runtime.create_private(directory, other, json.dumps(stale).encode())
    elsewhere = runtime.socket_path("t")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(elsewhere)
    listener.listen(1)
    alive = f"rv-{digest}-{dead.pid}.json"  # of our key: our joiner must pass over it
    runtime.create_private(
        directory, alive, json.dumps({**stale, "address": f"ipc://{elsewhere}"}).encode()
    )

    def plant_own():  # in node 0 before it runs: a dead node 0's record under its pid
        record = {**stale, "pid": os.getpid()}
        runtime.create_private(
            directory, f"rv-{digest}-{os.getpid()}.json", json.dumps(record).encode()
        )

    procs = [
        start_worker("uneven", 0, 2, tmp_path, key=key, preexec_fn=plant_own),
        start_worker("uneven", 1, 2, tmp_path, key=key),
    ]
    try:
        results, _ = collect(tmp_path, wait_all(procs, timeout=120))
        assert all(r is not None for r in results)
        assert [n for n in os.listdir(directory) if n.startswith(f"rv-{digest}-")] == [alive]
        assert not os.path.exists(directory / other)
        assert os.path.exists(directory / alive)
    finally:
        listener.close()
        for name in (other, alive, os.path.basename(elsewhere)):
            runtime.remove(directory, name)


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_killed_peer_makes_others_raise(shm, tmp_path):
    n = 4
    results, texts = run_tree("kill", n, tmp_path, ipc_timeout=60, expect_rc={n - 1: 3}, shm=shm)
    for i, r in enumerate(results[:-1]):
        assert r["error"] == "PeerError", texts[i]
        assert f"node {n - 1}" in r["message"]
        assert r["peer"] == n - 1
        assert r["elapsed"] < 10, r  # detected by the socket, long before the 60 s timeout


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_mismatched_shapes_raise(shm, tmp_path):
    n = 3
    results, _ = run_tree("mismatch", n, tmp_path, shm=shm)
    kinds = {r["error"] for r in results}
    assert "MismatchError" in kinds
    assert kinds <= {"MismatchError", "PeerError"}


def test_wrong_token_refused(tmp_path):
    n = 3
    results, texts = run_tree("token", n, tmp_path, ipc_timeout=4)
    assert results[-1]["error"] == "AuthError"
    assert "refused" in results[-1]["message"]
    assert results[0]["error"] == "IPCTimeoutError"  # node 2 never joined
    assert "credentials are not this job's" in texts[0]


def test_topology_host_aware():
    hosts = ["a", "a", "b", "b", "a", "c", "b"]
    tree = build_tree(hosts, base=2)
    assert tree[0].parent is None
    # host leaders 0 (a), 2 (b), 5 (c): 2 and 5 hang off 0
    assert tree[2].parent == 0 and tree[5].parent == 0
    # within a host, a heap over that host's nodes
    assert tree[1].parent == 0 and tree[4].parent == 0
    assert tree[3].parent == 2 and tree[6].parent == 2
    cross = [i for i, p in enumerate(tree) if p.parent is not None and hosts[p.parent] != hosts[i]]
    assert sorted(cross) == [2, 5]
    assert depth(build_tree(["h"] * 8, base=2)) == 3
    assert depth(build_tree(["h"] * 8, base=7)) == 1


def test_single_node_in_process():
    tree = ipc.LocalhostTree(0, 1)
    x = torch.arange(5.0)
    assert tree.all_reduce(x) == 1
    assert torch.equal(x, torch.arange(5.0))
    assert tree.all_reduce(x, finished=True) == 0
    tree.barrier()
    tree.close()
    with pytest.raises(ipc.IPCError, match="closed"):
        tree.all_reduce(x)


def test_bad_arguments():
    with pytest.raises(ValueError, match="node_index"):
        ipc.LocalhostTree(3, 2)
    tree = ipc.LocalhostTree(0, 1)
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        tree.all_reduce([torch.ones(1), "x"])
    with pytest.raises(ValueError, match="op"):
        tree.all_reduce(torch.ones(1), op="mean")
    tree.close()


@pytest.mark.parametrize(
    "call, name, closest",
    [
        (lambda: ipc.LocalhostTree(0, 1, chunk_byte=1 << 20), "chunk_byte", "chunk_bytes"),
        (lambda: ipc.LocalhostTree(0, 1, kye="x"), "kye", "key"),
        (lambda: ipc.StaticTree(0, 1, "10.0.0.1", 1, tokne="t" * 40), "tokne", "token"),
        (lambda: ipc.Tree.from_env(heartbeats=None), "heartbeats", "heartbeat"),
        (lambda: ipc.Server(tokn="t" * 40), "tokn", "token"),
        (lambda: ipc.Client("127.0.0.1", 1, tiemout=1), "tiemout", "timeout"),
        (lambda: ipc.map(1, print, contxt="spawn"), "contxt", "context"),
        (lambda: ipc.WorkQueue("q", max_size=3), "max_size", "maxsize"),
    ],
)
def test_a_misspelt_keyword_names_the_closest(call, name, closest):
    """Python's own TypeError named the inner function (Tree.__init__ for LocalhostTree's
    options) and no valid name."""
    with pytest.raises(
        TypeError, match=f"unknown keyword argument '{name}'; did you mean '{closest}'"
    ):
        call()


def test_a_misspelt_keyword_of_a_collective_names_the_closest():
    tree = ipc.LocalhostTree(0, 1)
    try:
        with pytest.raises(TypeError, match="'async_'; did you mean 'async_op'"):
            tree.all_reduce(torch.ones(1), async_=True)
        with pytest.raises(TypeError, match="'asyncop'; did you mean 'async_op'"):
            tree.scatter(torch.ones(1), asyncop=True)
    finally:
        tree.close()


LAUNCHER_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "IPC_PORT", "IPC_KEY", "IPC_TOKEN", "IPC_TOKEN_FILE",
)  # fmt: skip

SINGLE = """
import logging, os, socket, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from distlearn import ipc
tree = ipc.Tree.from_env()
assert (tree.node_index, tree.num_nodes, tree.parent, tree.children) == (0, 1, None, [])
t = torch.arange(5, dtype=torch.float32)
assert tree.all_reduce(t) == 1 and t.tolist() == [0, 1, 2, 3, 4]
assert tree.all_reduce(t, op="max") == 1 and t.tolist() == [0, 1, 2, 3, 4]
assert tree.all_reduce(t, finished=True) == 0 and t.tolist() == [0] * 5
s = {"w": torch.ones(3)}
tree.scatter(s)
assert s["w"].tolist() == [1, 1, 1]
tree.barrier()
# nothing on TCP: every socket this process holds is a Unix socket
inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:  # the listing's own descriptor
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
tcp = [line.split()[9] for n in ("tcp", "tcp6") for line in list(open(f"/proc/self/net/{n}"))[1:]]
assert inodes, "the tree holds no socket at all?"
assert not inodes & set(tcp), "a TCP socket is open"
tree.close()
print("SINGLE-OK")
"""


def test_from_env_without_a_launcher_is_a_single_process(short_tmp):
    """Plain `python train.py` (no torchrun, no Slurm): a one-node tree whose collectives
    are identities, said at INFO, nothing on TCP."""
    env = repo_env(TMPDIR=str(short_tmp))
    for var in [*LAUNCHER_VARS, *(v for v in env if v.startswith("SLURM_"))]:
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", SINGLE], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and "SINGLE-OK" in proc.stdout, proc.stderr
    assert "INFO" in proc.stderr and "single process" in proc.stderr, proc.stderr


@pytest.mark.parametrize("var", ["RANK", "WORLD_SIZE", "SLURM_PROCID"])
def test_from_env_with_half_a_launch_is_an_error(var, monkeypatch):
    """Half a launcher's variables is a broken launch, not a single process (Slurm's
    inside an srun step: a batch script's shell sees SLURM_PROCID alone)."""
    from distlearn.common.launchers import LaunchError

    for v in [*LAUNCHER_VARS, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"]:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, "1")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    with pytest.raises(LaunchError, match=f"\\${var} is set without"):
        ipc.Tree.from_env()


def test_netns_over_tcp(netns_pair, tmp_path):  # noqa: F811
    """Node 0 in one namespace, nodes 1 and 2 in another: real TCP between them."""
    n = 3
    envs = [
        {"TEST_NETNS": netns_pair[0 if i == 0 else 1], "TEST_ROOT_HOST": "10.77.0.1",
         "TEST_ROOT_PORT": "29877"}
        for i in range(n)
    ]  # fmt: skip
    results, _ = run_tree("static", n, tmp_path, extra_env=envs)
    for r in results:
        assert r["count"] == n and r["ok"] and r["max"] == n - 1
    links0 = results[0]["stats"]["links"]
    # host-aware: node 1 leads the second namespace and hangs off node 0 over TCP;
    # node 2 shares node 1's namespace and talks to it over a Unix socket.
    assert results[1]["stats"]["links"][0]["address"].startswith("tcp://10.77.0.1:")
    assert links0[1]["address"] == "accepted from 10.77.0.2"
    assert 2 not in links0
    assert results[2]["stats"]["links"][1]["address"].startswith("ipc://")
    assert links0[1]["bytes_sent"] >= 4 << 20 and links0[1]["bytes_recv"] >= 4 << 20


@pytest.mark.parametrize(
    "var, value, says",
    [("IPC_TIMEOUT", "5min", ": must be a finite number >= 0"),
     ("IPC_STALL_WARNING", "nan", ": must be a finite number"),
     ("IPC_SHM_SPIN_US", "-1", ": must be a finite number >= 0")],
)  # fmt: skip
def test_a_bad_tuning_variable_is_named_when_ipc_is_imported(var, value, says):
    """float()'s bare "could not convert string to float: '5min'" named no variable, and
    IPC_TIMEOUT=nan was taken (a collective that never times out)."""
    env = {**repo_env(), var: value}
    run = subprocess.run([sys.executable, "-c", "from distlearn import ipc"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode != 0
    assert f"${var}={value!r}{says}" in run.stderr
