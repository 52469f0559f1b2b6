"""Asynchronous collectives: handles in flight with real processes, against the sync results."""

from __future__ import annotations

import pytest
import torch
from ipc_harness import TRANSPORTS, local_reduce, run_tree
from ipc_workers import FUSED_JOBS, nested, node_tensor

from distlearn import ipc


@pytest.mark.parametrize("shm", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 4])
def test_several_handles_in_flight(n, shm, tmp_path):
    results, _ = run_tree("async_many", n, tmp_path, shm=shm)
    odd = [i for i in range(n) if i % 2 == 1]
    want_sum = sum(node_tensor(i, (3000,), torch.float32, 1) for i in range(n))
    want_max = local_reduce(
        torch.maximum, [node_tensor(i, (17,), torch.int64, 2) for i in range(n)]
    )
    want_fin = sum(node_tensor(i, (300_000,), torch.float64, 3) for i in range(n) if i not in odd)
    want_sync = sum(node_tensor(i, (10,), torch.float32, 5) for i in range(n))
    structs = [nested(i) for i in range(n)]
    for r in results:
        # all_reduce: contributors; scatter and barrier: None, as the synchronous calls
        assert r["counts"] == [n, n, n - len(odd), n, None, None]
        assert r["count_sync"] == n and all(r["done"])
        assert torch.equal(r["sum"], want_sum) and torch.equal(r["max"], want_max)
        assert torch.equal(r["fin"], want_fin)
        assert torch.equal(r["nest"]["w"][0], sum(s["w"][0] for s in structs))
        assert torch.equal(r["nest"]["b"][1]["h"], sum(s["b"][1]["h"] for s in structs))
        assert torch.equal(r["scattered"], node_tensor(0, (50,), torch.float32, 4))
        assert torch.equal(r["sync"], want_sync)


@pytest.mark.parametrize("shm", TRANSPORTS)
@pytest.mark.parametrize("n", [2, 3])
def test_queued_handles_fused_keep_their_results(n, shm, tmp_path):
    """Large all-reduces queued together run as one collective on shared memory (as a
    training step's buckets); a job another op, dtype or `finished` breaks the run there,
    and every job's values and count are those of its own call."""
    results, texts = run_tree("async_fused", n, tmp_path, shm=shm)
    want_counts, want = [], []
    for shape, dtype, op, finished, salt in FUSED_JOBS:
        ts = [node_tensor(i, shape, dtype, salt) for i in range(n)]
        if op == "transposed":
            ts = [t.t() for t in ts]
        contributing = [t for i, t in enumerate(ts) if not (finished and i == 1)]
        want_counts.append(len(contributing))
        want.append(local_reduce(torch.maximum, ts) if op == "max" else sum(contributing))
    alike = [
        sum(node_tensor(i, (300_000,), torch.float32, 20 + j) for i in range(n)) for j in range(12)
    ]
    for r, text in zip(results, texts, strict=True):
        assert r is not None, text
        assert r["counts"] == want_counts, text
        for got, w in zip(r["tensors"], want, strict=True):
            assert torch.equal(got, w)
        assert r["alike_counts"] == [[n] * 8, [n] * 12]
        for got, w in zip(r["alike"][0] + r["alike"][1], alike[:8] + alike, strict=True):
            assert torch.equal(got, w)
        x = sum(node_tensor(i, (300_000,), torch.float32, 40) for i in range(n))
        assert r["overlap_counts"] == [n] * 4 and torch.equal(r["x"], n * x)
        assert torch.equal(
            r["whole"], sum(node_tensor(i, (600_000,), torch.float32, 41) for i in range(n))
        )
        if shm and r["cma"]:
            # Jobs 0-2 run as one (node 1 finished job 3); the others alone (node 1's
            # `finished`, the max, a transposed view that is packed, small ones); 8 alike
            # as one collective; 12 alike as 8 and 4; x alone, then x with both halves.
            assert r["fused"] == 2, text
            assert r["fused_alike"] == 7 + 7 + 3, text
            assert r["overlap_fused"] == 2, text
        elif not shm:
            assert r["fused"] == 0 and r["fused_alike"] == 0 and r["overlap_fused"] == 0


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_sync_call_right_after_a_handle_runs_after_it(shm, tmp_path):
    """A synchronous all_reduce issued while the communication thread is taking the
    previous handle off its queue must not run first (a different collective on this
    node than on its peers: MismatchError, or wrong sums)."""
    results, texts = run_tree("async_then_sync", 2, tmp_path, shm=shm)
    for r, text in zip(results, texts, strict=True):
        assert r is not None and r["bad"] == 0, text


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_uneven_finished_in_flight(shm, tmp_path):
    n = 4
    results, _ = run_tree("async_uneven", n, tmp_path, shm=shm)
    want_counts = [n - s for s in range(n)]
    want_sums = [float(sum(i + 1 for i in range(n) if i + 1 > s)) for s in range(n)]
    for r in results:
        assert r["counts"] == want_counts
        assert r["sums"] == want_sums


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_peer_killed_with_handles_in_flight(shm, tmp_path):
    n = 3
    results, texts = run_tree("async_killed", n, tmp_path, shm=shm, expect_rc={n - 1: 3})
    for i, r in enumerate(results[:-1]):
        assert r["errors"] == ["PeerError"] * 4, texts[i]
        assert r["peers"] == [n - 1] * 4
        assert r["elapsed"] < 20


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_waiting_thread_runs_the_queue(shm, tmp_path):
    """wait() runs the queued collectives in the waiting thread (no hand-off per handle
    between threads); handles nobody waits for still finish; two waiting threads keep
    the order."""
    n = 3
    results, texts = run_tree("async_helpers", n, tmp_path, shm=shm)
    reducers = set()
    for r, text in zip(results, texts, strict=True):
        assert r is not None, text
        assert r["counts"] == [n] * 8 and r["queued_ok"], text
        assert r["walked"] == [True] * 4 and r["walked_ok"], text
        assert r["bad"] == 0, text
        reducers.update(r["ran"])
    # Over sockets only the nodes with children reduce; on shared memory every node does.
    assert "MainThread" in reducers, reducers


def test_handles_in_one_process():
    """A tree of one: handles complete with the synchronous results, errors surface in
    wait(), and a closed tree refuses new work."""
    tree = ipc.LocalhostTree(0, 1)
    x = torch.arange(4.0)
    h = tree.all_reduce(x, async_op=True)
    assert h.wait() == 1 and h.is_completed() and torch.equal(x, torch.arange(4.0))
    h = tree.all_reduce(x, finished=True, async_op=True)
    assert h.wait() == 0 and torch.equal(x, torch.zeros(4))
    h = tree.all_reduce(torch.ones(2), op=lambda a, b: 1 / 0, async_op=True)
    assert h.wait() == 1  # one node: the op is never called, as in the synchronous call
    with pytest.raises(TypeError):
        tree.all_reduce([torch.ones(1), "x"], async_op=True)  # checked where it is given
    tree.close()
    with pytest.raises(ipc.IPCError, match="closed"):
        tree.all_reduce(x, async_op=True)
