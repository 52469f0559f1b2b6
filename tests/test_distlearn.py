"""AllReduceSGD / AllReduceEA on real communicators, against single-process references.

Each (communicator, node count) launches its worker processes once and runs every
scenario in them (tests/distlearn_workers.py); the tests below check the results.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.procs import free_port
from bench.step_time import rank_env
from tests.conftest import repo_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distlearn_sim as sim

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distlearn_workers.py"
NODES = [1, 2, 3, 4]
# Seconds for one launch. Generous: on a 2-core machine shared with other test runs,
# four processes importing torch have taken over 120 s; pytest's own limit is 300 s.
TIMEOUT = 240.0


def _has_ipc_tree() -> bool:
    if importlib.util.find_spec("ipc") is None:
        return False
    from distlearn import ipc

    return hasattr(ipc, "LocalhostTree")


COMMS = [
    "gloo",
    pytest.param(
        "ipc",
        marks=pytest.mark.skipif(
            not _has_ipc_tree(), reason="the ipc tree is not on this branch yet"
        ),
    ),
]
# The scenarios run once per (communicator, nodes) also run on gloo without the small
# all-reduce at the root, so the process group's own all-reduce carries every step too
# (as it does for every bucket past the root's bound in the gloo runs); that, and every
# scenario at 4 nodes, in the slow tier only (a launch each, 13-32 s: the suite keeps
# under 15 minutes). 1, 2 and 3 nodes on gloo and the tree run in every run.
RUN_COMMS = [*COMMS, pytest.param("gloo-ring", marks=pytest.mark.slow)]


def _run_cases() -> list:
    """(communicator, nodes) for every communicator and node count: gloo-ring and
    everything at 4 nodes in the slow tier."""
    cases = []
    for n in NODES:
        for comm in RUN_COMMS:
            # a pytest.param's value and marks (ipc: skipped without the tree; gloo-ring: slow)
            name, marks = getattr(comm, "values", (comm,))[0], list(getattr(comm, "marks", ()))
            if n == 4:
                marks = [pytest.mark.slow]
            cases.append(pytest.param(name, n, marks=marks, id=f"{n}-{name}"))
    return cases


RUN_CASES = _run_cases()


def uneven_steps(num_nodes: int, epochs: int, seed: int, low: int, high: int) -> list[list[int]]:
    """Random step counts per node per epoch, with a tie and (for N > 1) an idle node."""
    rng = random.Random(seed * 31 + num_nodes)
    table = [[rng.randint(low, high) for _ in range(num_nodes)] for _ in range(epochs)]
    if num_nodes > 1:
        table[1][num_nodes - 1] = 0  # a node with no data this epoch
        table[2][0] = table[2][1] = max(table[2])  # two nodes tie for the most steps
    return table


# Parameters of sim.Coefficients that do not train, per epoch of sgd_coefficients.
FROZEN = [[], [1], [0, 4], []]
# Parameters of sim.make_deep_model that stop training at a step of sgd_overlap's "frozen".
DEEP_FROZEN = {1: [0, 1], 3: [6]}


def config(num_nodes: int) -> dict:
    cfg = {
        "protocol": {},
        "reduce_at_root": {},
        "sgd_equivalence": {"steps": 4, "batch": 12},
        "sgd_uneven": {"steps": uneven_steps(num_nodes, 5, seed=1, low=0, high=13)},
        "easgd": {
            "steps": uneven_steps(num_nodes, 4, seed=2, low=2, high=17),
            "tau": 3,
            "alphas": [0.4, 0.0],
        },
    }
    cfg["sgd_overlap"] = {
        "steps": 4,
        "batch": 12,
        "bucket_bytes": 256,
        "first_bucket_bytes": 64,
        "frozen": DEEP_FROZEN,
    }
    cfg["sgd_coefficients"] = {
        "steps": uneven_steps(num_nodes, 4, seed=3, low=0, high=9),
        "frozen": FROZEN,
        "bucket_bytes": 64,
        "first_bucket_bytes": 16,
    }
    cfg["sgd_beside_ddp"] = {"steps": 4, "batch": 12, "bucket_bytes": 256, "first_bucket_bytes": 64}
    cfg["sgd_complex"] = {"steps": 3, "batch": 12}
    if num_nodes == 3:
        # torch.optim costs every process seconds of imports (torch._dynamo) on first
        # use: the optimizer-state scenarios run with 3 nodes only.
        cfg["state"] = {}
        # the most steps at node 1, then 0, then a tie; node 2 sits out epoch 0 whole
        # (its optimizer state still empty)
        cfg["sgd_uneven_momentum"] = {"steps": [[2, 5, 0], [4, 1, 3], [3, 3, 1]]}
    return cfg


def launch(
    comm: str,
    num_nodes: int,
    tmp: Path,
    cfg: dict,
    killed: tuple[int, ...] = (),
    torchrun_env: dict[str, str] | None = None,
    gpus: int = 0,
) -> list[dict]:
    """Run `num_nodes` workers to completion; kill them all on failure or timeout.
    Ranks in `killed` are expected to die by SIGKILL (their own, or this function's once
    the others have ended: one that stopped itself); the others' results are returned.
    With `torchrun_env` (extra variables) the workers meet as under torchrun (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT: the communicators' `from_env`), not through
    a shared directory. `gpus` is how many CUDA GPUs the ranks share: NCCL on fewer GPUs
    than ranks gives each rank a host id of its own (bench.step_time.rank_env)."""
    out = tmp / "out"
    rendezvous = tmp / "rendezvous"
    out.mkdir()
    rendezvous.mkdir()
    (tmp / "config.json").write_text(json.dumps(cfg))
    procs, logs = [], []
    try:
        for rank in range(num_nodes):
            log = open(tmp / f"rank-{rank}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(log)
            meet = [f"--rank={rank}", f"--world={num_nodes}", f"--rendezvous={rendezvous}"]
            env = {**repo_env(), **rank_env(comm, rank, num_nodes, gpus)}
            if torchrun_env is not None:
                meet = []
                env.update(torchrun_env, RANK=str(rank), WORLD_SIZE=str(num_nodes))
                env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(num_nodes))
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        f"--comm={comm}",
                        *meet,
                        f"--out={out}",
                        f"--config={tmp / 'config.json'}",
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + TIMEOUT
        for rank, proc in enumerate(procs):
            if rank not in killed:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
        for log in logs:
            log.close()
    failed = [
        (rank, p.returncode)
        for rank, p in enumerate(procs)
        if p.returncode != (-signal.SIGKILL if rank in killed else 0)
    ]
    if failed:
        tails = "\n".join(
            f"--- rank {rank} (exit {code}) ---\n{(tmp / f'rank-{rank}.log').read_text()[-3000:]}"
            for rank, code in failed
        )
        raise AssertionError(f"{comm} with {num_nodes} nodes failed:\n{tails}")
    return [
        torch.load(out / f"rank-{rank}.pt", weights_only=False)
        for rank in range(num_nodes)
        if rank not in killed
    ]


_RUNS: dict[tuple[str, int], list[dict] | AssertionError] = {}


@pytest.fixture
def run(tmp_path_factory):
    """Results of every scenario for (communicator, node count), launched once; a failed
    launch is reported by every test that needs it, not launched again."""

    def get(comm: str, num_nodes: int) -> list[dict]:
        key = (comm, num_nodes)
        if key not in _RUNS:
            tmp = tmp_path_factory.mktemp(f"{comm}-{num_nodes}")
            cfg = config(num_nodes)
            cfg["sgd_beside_ddp"]["store"] = str(tmp / "ddp-store")  # DDP's gloo group
            try:
                _RUNS[key] = launch(comm, num_nodes, tmp, cfg)
            except AssertionError as exc:
                _RUNS[key] = exc
        if isinstance(_RUNS[key], AssertionError):
            raise _RUNS[key]
        return _RUNS[key]

    return get


def assert_same(a, b, atol=0.0, rtol=0.0, what=""):
    """Nested equality (or closeness) of tensors, lists, dicts and numbers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), what
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        if atol == rtol == 0.0:
            assert torch.equal(a, b), f"{what}: {a} != {b}"
        else:
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_same(a[k], b[k], atol, rtol, f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, atol, rtol, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


# -- the communicator protocol ---------------------------------------------------------


@pytest.mark.parametrize("comm, num_nodes", RUN_CASES)
def test_protocol(run, comm, num_nodes):
    results = run(comm, num_nodes)
    n = num_nodes
    ranks = list(range(n))
    even = [r for r in ranks if r % 2 == 0]

    def expected(op, nodes):
        fold = {"sum": sum, "max": max, "min": min}[op]
        k = fold(r + 1 for r in nodes)
        return {
            "a": torch.full((3,), float(k), dtype=torch.float64),
            "b": [torch.arange(4) * k, torch.tensor([float(fold(nodes))])],
        }

    for res in results:
        res = res["protocol"]
        for op in ("sum", "max", "min"):
            assert res[f"{op}.count"] == n
            assert_same(res[f"{op}.value"], expected(op, ranks), what=op)
            assert res[f"{op}.finished.count"] == len(even)
            assert_same(res[f"{op}.finished.value"], expected(op, even), what=f"{op} finished")
        # The product of (r + 1) over the nodes: a callable op folds over contributors.
        k = 1
        for r in ranks:
            k *= r + 1
        assert res["callable.count"] == n
        assert_same(res["callable.value"]["a"], torch.full((3,), float(k), dtype=torch.float64))
        assert_same(res["scatter"], torch.zeros(5))
        total = sum(r + 1 for r in ranks)
        assert_same(
            res["noncontiguous"], torch.arange(12, dtype=torch.float32).reshape(3, 4) * total
        )
        if comm.startswith("gloo"):  # the flat backends' count in the caller's last slot
            for dtype in (torch.float32, torch.bfloat16):
                assert res[f"counted.{dtype}.count"] == len(even)
                want = torch.full((5,), float(sum(r + 1 for r in even)), dtype=dtype)
                assert_same(res[f"counted.{dtype}.value"], want, what=f"counted {dtype}")
            assert res["counted.bool.in_slot"] is (n == 1)
            assert res["counted.bool.count"] == len(even)
            assert res["counted.bool.value"].tolist() == [True, False, False]  # node 0's
            assert res["counted.sync.count"] == n
            assert_same(
                res["counted.sync.value"], torch.full((2,), float(total), dtype=torch.float64)
            )


@pytest.mark.parametrize(
    "num_nodes", [pytest.param(n, marks=[pytest.mark.slow] * (n == 4)) for n in NODES]
)
def test_small_all_reduce_at_the_root(run, num_nodes):
    """gloo's small all-reduces go gather, reduce at node 0, broadcast (one machine);
    the results are the process group's own, for every op and dtype."""
    n = num_nodes
    contributors = [r for r in range(n) if r != 1 or n == 1]
    for res in run("gloo", n):
        node, res = res["node_index"], res["reduce_at_root"]
        for way in ("root", "ring"):
            for op in ("sum", "max", "min"):
                for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
                    parts = [torch.arange(10) * (r + 1) - 3 * r for r in contributors]
                    want = torch.stack(parts)
                    want = {"sum": want.sum(0), "max": want.amax(0), "min": want.amin(0)}[op]
                    assert res[f"{way}.{op}.{dtype}.count"] == len(contributors)
                    assert_same(res[f"{way}.{op}.{dtype}"], want.to(dtype), what=f"{way} {op}")
            total = sum(r + 1 for r in range(n))
            want = torch.tensor([1 + 2j, -0.5j], dtype=torch.complex64) * total
            assert_same(res[f"{way}.complex"], want, what=f"{way} complex")
            assert res[f"{way}.big.count"] == n
            assert_same(res[f"{way}.big"], torch.full((3,), float(total)))
        # 13 small all-reduces: at the root on 2+ nodes, on the ring when told or alone
        at_root = n > 1
        assert res["root.calls"] == {"gather": 13 * at_root, "allreduce": 13 * (not at_root)}
        assert res["ring.calls"] == {"gather": 0, "allreduce": 13}
        # just over the bound, the data goes round the ring (a separate count may not)
        assert res["root.big.calls"]["allreduce"] == (1 if at_root else 2)
        assert res["ring.big.calls"]["gather"] == 0
        if n > 1:  # nodes on two machines: asked once, then the ring
            assert res["machines.one"] is False
            assert res["machines.calls"] == {"gather": 0, "allreduce": 2}
            assert_same(res["machines"], torch.full((4,), float(total * n)))
            # a core for each of the nodes' threads: the ring; the fewest cores decide
            assert res["cores.many"] is False
            assert res["cores.many.calls"] == {"gather": 0, "allreduce": 1}
            assert res["cores.fewest"] is True
            assert res["cores.fewest.calls"] == {"gather": 1, "allreduce": 0}
            for name in ("cores.many", "cores.fewest"):
                assert_same(res[f"{name}.value"], torch.full((4,), float(total)))
            values = ", ".join(f"{i}: {0 if i % 2 else 1 << 20}" for i in range(n))
            assert "gather_bytes differs between nodes" in res["differ"], res["differ"]
            assert values in res["differ"]
            assert_same(res["differ.after"], torch.full((2,), float(total)))
        if n >= 3 and node > 0:  # a group of ranks 1..n-1, rank 1 its root
            assert res["group.count"] == n - 1
            assert_same(res["group"], torch.full((3,), float(total - 1)))
            assert res["group.calls"] == {"gather": 1, "allreduce": 0}


@pytest.mark.parametrize("comm, num_nodes", RUN_CASES)
def test_sgd_with_a_complex_parameter(run, comm, num_nodes):
    """A complex parameter trains as in one process (its count and marks read from the
    real part), with buckets and without; AllReduceEA's centers agree."""
    results = run(comm, num_nodes)
    cfg = config(num_nodes)["sgd_complex"]
    reference = sim.complex_reference(cfg["steps"], cfg["batch"])
    for res in results:
        for overlap in (True, False):
            ours = res["sgd_complex"][overlap]
            assert_same(ours, reference, atol=1e-6, rtol=1e-5, what=f"overlap {overlap}")
        assert_same(res["sgd_complex"]["ea_center"], results[0]["sgd_complex"]["ea_center"])


# -- next to DDP ------------------------------------------------------------------------

# (atol, rtol) against DDP: float32 differs only in the order of additions; float16
# also in where the division by the node count rounds (DDP's hook divides after the
# cast, ours before it); bfloat16 is held to DDP in float32 (DDP's bfloat16 hook needs
# NCCL), so by bfloat16's precision.
BESIDE_DDP_TOLERANCE = {"float16": (3e-4, 3e-4), "bfloat16": (3e-3, 3e-3)}


@pytest.mark.parametrize("comm, num_nodes", RUN_CASES)
def test_sgd_beside_ddp(run, comm, num_nodes):
    """The same training next to DistributedDataParallel gives DDP's weights, with a
    head that some nodes or all of them leave unused (a parameter nobody used keeps
    `.grad = None`, so momentum does not move it), no_sync() accumulation, and float16
    gradients against DDP's own compression hook."""
    for res in run(comm, num_nodes):
        for name, got in res["sgd_beside_ddp"].items():
            atol, rtol = BESIDE_DDP_TOLERANCE.get(name, (1e-6, 1e-5))
            what = f"{comm}, {num_nodes} nodes, {name}, node {res['node_index']}"
            assert_same(got["ours"], got["ddp"], atol, rtol, what)
            assert got["ddp_b_grad_none"] and got["b_grad_none"], what


# -- AllReduceSGD ----------------------------------------------------------------------


@pytest.mark.parametrize("comm, num_nodes", RUN_CASES)
def test_sgd_matches_one_process_on_the_whole_batch(run, comm, num_nodes):
    results = run(comm, num_nodes)
    cfg = config(num_nodes)["sgd_equivalence"]
    reference = sim.sgd_reference(cfg["steps"], cfg["batch"])
    for res in results:
        ours = res["sgd_equivalence"]
        assert ours["counts"] == [num_nodes] * cfg["steps"]
        assert_same(
            ours["state"], reference, atol=1e-6, rtol=1e-5, what=f"node {res['node_index']}"
        )
        # Every node holds exactly the same bits.
        assert_same(ours["state"], results[0]["sgd_equivalence"]["state"])


@pytest.mark.parametrize("comm", COMMS)
def test_sgd_uneven_steps_keep_the_replicas_equal_with_momentum(run, comm):
    """Given the optimizer, synchronize_parameters hands on the momentum of the node that
    took the most steps with its weights: in the next epoch every node still takes the
    same step, and all follow one process's SGD with momentum on the mean gradients.
    (Without it, node 2, which sat out epoch 0, steps without momentum in epoch 1.)"""
    results = run(comm, 3)
    table = config(3)["sgd_uneven_momentum"]["steps"]
    reference, buf = sim.uneven_momentum_reference(table, lr=0.1, momentum=0.9)
    for res in results:
        r, ours = res["node_index"], res["sgd_uneven_momentum"]
        for epoch, steps in enumerate(table):
            assert len(ours["after"][epoch]) == steps[r]
            for k, p in enumerate(ours["after"][epoch]):
                assert_same(p, reference[epoch][k], atol=1e-12, rtol=1e-12,
                            what=f"node {r}, epoch {epoch}, step {k}")  # fmt: skip
                # the same bits as every other node that took step k
                for other in results:
                    theirs = other["sgd_uneven_momentum"]["after"][epoch]
                    if k < len(theirs):
                        assert_same(p, theirs[k], what=f"nodes {r}, {other['node_index']}")
        assert_same(ours["buf"], buf, atol=1e-12, rtol=1e-12, what=f"node {r}'s momentum")


@pytest.mark.parametrize("comm, num_nodes", RUN_CASES)
def test_sgd_uneven_steps_end_on_the_longest_node(run, comm, num_nodes):
    results = run(comm, num_nodes)
    table = config(num_nodes)["sgd_uneven"]["steps"]
    reference = sim.uneven_reference(table)
    for res in results:
        ours = res["sgd_uneven"]
        # Identical on all nodes after every synchronisation...
        assert_same(ours["synced"], results[0]["sgd_uneven"]["synced"])
        # ...and equal to the parameters of the node that took the most steps.
        assert_same(
            ours["synced"], reference, atol=1e-12, rtol=1e-12, what=f"node {res['node_index']}"
        )
        # The contributor count drops as nodes run out of data.
        r = res["node_index"]
        expected = [sum(s > k for s in steps) for steps in table for k in range(steps[r])]
        assert ours["counts"] == expected


def _expect_overlap(comm: str) -> bool:
    """gloo always has the asynchronous all-reduce; the tree once it takes `async_op`."""
    if comm.startswith("gloo"):
        return True
    import inspect

    from distlearn import ipc

    return "async_op" in inspect.signature(ipc.Tree.all_reduce).parameters


OVERLAP_RUNS = {
    # name: (reference frozen steps, steps whose hooks found no buckets yet, resent steps)
    "plain": (None, 0, 0),
    "overlap_off": (None, 0, 0),  # the one-call path after backward
    "first_step": (None, 1, 0),  # hooks are set by the first sum_and_normalize_gradients
    "no_sync": (None, 0, 0),
    "accumulate": (None, 0, 4),  # a second backward after buckets left: sent again
    "accumulate_in_place": (None, 0, 4),  # ...into a .grad that is a bucket's buffer
    "accumulate_node0": (None, 0, 4),  # ...even when only node 0 does it
    "frozen": (DEEP_FROZEN, 0, 2),  # the trainable set changed twice
    # ...after backward, before the sum: the frozen ones get the mean all the same
    "frozen_late": (DEEP_FROZEN, 0, 2),
    "frozen_late_off": (DEEP_FROZEN, 0, 0),
    "bfloat16": (None, 0, 0),
    "float16": (None, 0, 0),
}


@pytest.mark.parametrize("comm, num_nodes", RUN_CASES)
def test_sgd_overlap_matches_one_process(run, comm, num_nodes):
    """Buckets during backward give what one process gets on the whole batch, in every
    way of using the loop, and the buckets really start during backward."""
    results = run(comm, num_nodes)
    cfg = config(num_nodes)["sgd_overlap"]
    overlap = _expect_overlap(comm)
    for name, (frozen, unhooked, resent) in OVERLAP_RUNS.items():
        late = name.startswith("frozen_late")
        reference = sim.deep_reference(cfg["steps"], cfg["batch"], frozen, late=late)
        compressed = name in ("bfloat16", "float16")
        for res in results:
            ours = res["sgd_overlap"][name]
            what = f"{name}, node {res['node_index']}"
            assert ours["counts"] == [num_nodes] * cfg["steps"], what
            tol = {"atol": 2e-3, "rtol": 1e-2} if compressed else {"atol": 1e-6, "rtol": 1e-5}
            assert_same(ours["state"], reference, what=what, **tol)
            assert_same(ours["state"], results[0]["sgd_overlap"][name]["state"], what=what)
            stats = ours["stats"]
            assert stats["overlap"] == (overlap and not name.endswith("_off")), what
            if not stats["overlap"]:
                assert "bucket_bytes" not in stats, what
                continue
            buckets = len(stats["bucket_bytes"])
            assert buckets >= 3, what  # tiny buckets: several per step
            if not name.startswith("frozen"):  # (its layout changes)
                hooked_steps = cfg["steps"] - unhooked
                assert stats["started_in_backward"] == hooked_steps * (buckets - 1), what
            assert stats["resent"] == resent, what
            assert stats["steps"] == cfg["steps"], what
        if compressed:
            # Really sent in 16 bits: the buckets are half the size, and the result is
            # near the float32 one, not equal to it.
            ours = results[0]["sgd_overlap"][name]
            exact = results[0]["sgd_overlap"]["plain"]
            if overlap:
                assert 2 * sum(ours["stats"]["bucket_bytes"]) == sum(exact["stats"]["bucket_bytes"])
            assert any(not torch.equal(ours["state"][k], exact["state"][k]) for k in exact["state"])


@pytest.mark.parametrize("comm, num_nodes", RUN_CASES)
def test_sgd_overlap_random_steps(run, comm, num_nodes):
    """torch-distlearn's random-steps test on a module, buckets on and off: uneven epochs
    (an idle node, a tie), parameters unused by some nodes or by all (whose .grad stays
    None), a trainable set that changes."""
    results = run(comm, num_nodes)
    cfg = config(num_nodes)["sgd_coefficients"]
    table = cfg["steps"]
    reference = sim.coefficients_reference(table, cfg["frozen"])
    for overlap in (True, False):
        for res in results:
            ours = res["sgd_coefficients"][overlap]
            r = res["node_index"]
            what = f"node {r}, overlap {overlap}"
            assert ours["stats"]["overlap"] == (overlap and _expect_overlap(comm))
            assert_same(ours["synced"], results[0]["sgd_coefficients"][overlap]["synced"])
            assert_same(ours["synced"], reference, atol=1e-12, rtol=1e-12, what=what)
            expected = [sum(s > k for s in steps) for steps in table for k in range(steps[r])]
            assert ours["counts"] == expected, what
        # A .grad is None after a step exactly where no node still in its epoch had one.
        nobody = 0
        for epoch, steps in enumerate(table):
            for k in range(max(steps)):
                step = [
                    (res["node_index"], res["sgd_coefficients"][overlap]["grads"][f"{epoch}.{k}"])
                    for res in results
                    if f"{epoch}.{k}" in res["sgd_coefficients"][overlap]["grads"]
                ]
                trainable = [
                    j for j in range(len(sim.Coefficients.SHAPES)) if j not in FROZEN[epoch]
                ]
                want = [not any(had[j] for _, (had, _) in step) for j in trainable]
                nobody += sum(want)
                for r, (_, none_after) in step:
                    assert [none_after[j] for j in trainable] == want, (epoch, k, r, overlap)
        assert nobody > 0  # the case is really exercised


@pytest.mark.parametrize("comm", RUN_COMMS)
def test_state_buffers_and_optimizer(run, comm):
    num_nodes = 3
    results = run(comm, num_nodes)
    first = results[0]["state"]
    for res in results:
        ours = res["state"]
        # BatchNorm running statistics are synchronised with the parameters.
        assert any("running_mean" in k for k in ours["after_sync"])
        assert_same(ours["after_sync"], first["after_sync"])
        # The root's Adam state reached nodes with different (or empty) state, so one
        # more identical step keeps the replicas identical.
        assert_same(ours["opt"], first["opt"])
        assert_same(ours["after_step"], first["after_step"])
    # The root had taken one step, the others more: its state is what everyone has.
    assert int(first["opt"]["state"][0]["step"]) == 2


@pytest.mark.parametrize("comm", COMMS)
def test_nodes_with_different_models_get_a_clear_error(comm, tmp_path):
    """What DDP checks when it is built: a node whose model differs (a wider head, a
    frozen layer) makes every node raise ValueError saying so, at the first collective
    of AllReduceSGD or AllReduceEA; gloo used to abort the process from its thread."""
    results = launch(comm, 3, tmp_path, {"models_differ": {}})
    for res in results:
        ours = res["models_differ"]
        for case in ("sgd_sync", "sgd_first_step", "ea_sync"):
            assert ours[case] is not None, (case, res["node_index"])
            assert "models differ" in ours[case], ours[case]
        assert "elements per node: 58 to 67" in ours["sgd_sync"], ours["sgd_sync"]
        assert ours["same"] is None  # the communicator still works after the errors


# Each case on each communicator in the slow tier; in every run, each case on one or two.
_SLOW = pytest.mark.slow
_TRAINABLE_CASES = [
    ("gloo", "one"), ("ipc", "one"), ("gloo", "unlike"), pytest.param("ipc", "unlike", marks=_SLOW),
    pytest.param("gloo", "after_finish", marks=_SLOW), ("ipc", "after_finish"),
]  # fmt: skip


@pytest.mark.parametrize("comm, how", _TRAINABLE_CASES)
def test_a_trainable_set_changed_on_one_node_is_a_clear_error(comm, how, tmp_path):
    """One node alone freezes a layer mid-training, every node freezes a different one,
    or the nodes still in their epoch freeze one that a finished node cannot: every
    node raises the same ValueError at that step, where the tree used to raise
    MismatchError on some nodes, gloo aborted a process, or (unlike layers of one
    shape) gradients were summed into another layer's; the communicator still works."""
    results = launch(comm, 3, tmp_path, {"trainable_differs": {"how": how}})
    assert len(results) == 3
    for res in results:
        ours, node = res["trainable_differs"], res["node_index"]
        assert ours["error"] is not None, ours
        assert ours["step"] == ("drain" if how == "after_finish" and node == 2 else 3), ours
        if how == "one":
            assert "trainable parameters (which ones require grad" in ours["error"], ours
            mine = "this one among them" if node == 2 else "not this one"
            assert f"changed on 1 of 3 nodes in this step, {mine}" in ours["error"], ours
        else:
            assert "the nodes' models differ" in ours["error"], ours
        assert ours["after"].tolist() == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("comm", COMMS)
def test_a_peer_killed_mid_backward_is_an_error_not_a_hang(comm, tmp_path):
    """SIGKILL one node while its buckets are in flight: the others raise, promptly."""
    num_nodes = 3
    cfg = {"peer_dies": {"steps": 50, "die_at": 3}}
    survivors = launch(comm, num_nodes, tmp_path, cfg, killed=(num_nodes - 1,))
    assert len(survivors) == num_nodes - 1
    for res in survivors:
        ours = res["peer_dies"]
        assert ours["error"] is not None, "a node ran all its steps without its peer"
        assert ours["seconds"] < 120, ours


@pytest.mark.skipif(not _has_ipc_tree(), reason="the ipc tree is not on this branch yet")
def test_a_peer_stopped_mid_backward_is_named_in_seconds(tmp_path):
    """SIGSTOP one node while its buckets are in flight over the tree: its link's
    heartbeats stop, and the others raise naming it within seconds. (Over gloo a
    stopped peer is waited for until the process group's timeout, torch's choice.)"""
    num_nodes = 3
    cfg = {"peer_dies": {"steps": 50, "die_at": 3, "signal": "STOP"}}
    survivors = launch("ipc", num_nodes, tmp_path, cfg, killed=(num_nodes - 1,))
    for res in survivors:
        ours = res["peer_dies"]
        assert ours["error"] is not None and "PeerError" in ours["error"], ours
        assert f"node {num_nodes - 1}" in ours["error"], ours
        assert ours["seconds"] < 30, ours  # heartbeats: 6 s; the tree's timeout is 300 s


def test_a_peer_stopped_over_gloo_is_an_error_within_the_timeout_given_to_from_env(tmp_path):
    """Over gloo a stopped peer is waited for until the process group's timeout (torch's
    default: 30 minutes); `TorchDistributed.from_env(timeout=5)` makes it 5 s, and the
    others raise and exit."""
    num_nodes = 3
    cfg = {"peer_dies": {"steps": 50, "die_at": 3, "signal": "STOP"}}
    port = free_port()  # the group's store listens there
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DISTLEARN_TEST_PG_TIMEOUT_S": "5"}
    started = time.monotonic()
    survivors = launch("gloo", num_nodes, tmp_path, cfg, (num_nodes - 1,), torchrun_env=env)
    assert len(survivors) == num_nodes - 1
    errors = [res["peer_dies"] for res in survivors]
    # The first to time out exits; one whose own timeout was a moment away may see that
    # instead ("Connection closed by peer"), at the same time.
    assert any(e["error"] is not None and "Timed out" in e["error"] for e in errors), errors
    for ours in errors:
        assert ours["error"] is not None, ours
        assert 4 < ours["seconds"] < 30, ours
    assert time.monotonic() - started < 90  # they exited too (the stopped one is killed)


# -- AllReduceEA -----------------------------------------------------------------------


@pytest.mark.parametrize("comm, num_nodes", RUN_CASES)
def test_easgd_matches_replica_simulation(run, comm, num_nodes):
    results = run(comm, num_nodes)
    cfg = config(num_nodes)["easgd"]
    for alpha in cfg["alphas"]:
        ref = sim.ea_reference(num_nodes, cfg["steps"], cfg["tau"], alpha)
        for res in results:
            r = res["node_index"]
            ours = res["easgd"][f"alpha={alpha}"]
            for epoch, params in enumerate(ours["params"]):
                assert_same(
                    params,
                    ref["params"][epoch][r],
                    atol=1e-10,
                    rtol=1e-10,
                    what=f"{alpha=} {epoch=} node {r}",
                )
            # Averages overlap the next steps wherever the all-reduce can be asynchronous.
            assert ours["overlap"] == (_expect_overlap(comm) and alpha != 0)
            averages = sum(s // cfg["tau"] for s in (row[r] for row in cfg["steps"]))
            assert ours["in_flight"] == (averages if ours["overlap"] else 0)
            # The center is bitwise identical everywhere after synchronize_center.
            theirs = [list(c) for c in results[0]["easgd"][f"alpha={alpha}"]["centers"]]
            assert_same([list(c) for c in ours["centers"]], theirs)
            for epoch, center in enumerate(ours["centers"]):
                # ea.center lists parameters in the walk order of the dict: b, w.
                want = [ref["centers"][epoch]["b"], ref["centers"][epoch]["w"]]
                assert_same(list(center), want, atol=1e-10, rtol=1e-10, what=f"center {epoch=}")


@pytest.mark.parametrize("comm", RUN_COMMS)
def test_easgd_alpha_zero_keeps_nodes_independent(run, comm):
    num_nodes = 3
    results = run(comm, num_nodes)
    table = config(num_nodes)["easgd"]["steps"]
    root = {"w": sim.ea_init(0), "b": sim.ea_init(1000)[:2]}
    for res in results:
        r = res["node_index"]
        ours = res["easgd"]["alpha=0.0"]
        p = {k: v.clone() for k, v in root.items()}
        for epoch, steps in enumerate(table):
            for step in range(steps[r]):
                noise = sim.ea_noise(epoch, r, step)
                p = {k: p[k] + noise[k] for k in p}
            assert_same(ours["params"][epoch], p, atol=1e-12, rtol=1e-12, what=f"node {r} {epoch=}")
            assert_same(list(ours["centers"][epoch]), [root["b"], root["w"]])


# -- torchrun ----------------------------------------------------------------------------


@pytest.mark.parametrize("comm", COMMS)
def test_torchrun_two_processes(comm, tmp_path):
    """`torchrun --nproc-per-node=2` with the communicator built from its environment
    (`ipc.Tree.from_env()` or `TorchDistributed.from_env()`)."""
    out = tmp_path / "out"
    out.mkdir()
    cfg = {k: v for k, v in config(2).items() if k in ("sgd_equivalence", "sgd_uneven")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free rendezvous port on loopback
        "--nproc-per-node=2",
        str(WORKER),
        f"--comm={comm}",
        f"--out={out}",
        f"--config={tmp_path / 'config.json'}",
    ]
    # The tree listens on MASTER_PORT + 1 unless told; --standalone picks MASTER_PORT at
    # random, so name a port that is free now rather than hope its neighbour is.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        env = repo_env(IPC_PORT=str(sock.getsockname()[1]))
    # A session of its own, so a timeout kills torchrun's workers too, not just torchrun.
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    assert proc.returncode == 0, output.decode(errors="replace")[-4000:]
    results = [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(2)]
    reference = sim.sgd_reference(cfg["sgd_equivalence"]["steps"], cfg["sgd_equivalence"]["batch"])
    uneven = sim.uneven_reference(cfg["sgd_uneven"]["steps"])
    for r, res in enumerate(results):
        assert (res["node_index"], res["num_nodes"]) == (r, 2)
        assert_same(res["sgd_equivalence"]["state"], reference, atol=1e-6, rtol=1e-5)
        assert_same(res["sgd_uneven"]["synced"], uneven, atol=1e-12, rtol=1e-12)


# -- CUDA (NCCL, and CUDA tensors through gloo and the tree) ------------------------------


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.cuda
@pytest.mark.parametrize(
    "comm, gpus",
    [
        pytest.param("nccl", 1, id="nccl"),
        pytest.param("gloo", 1, id="gloo-cuda-tensors"),
        pytest.param(
            "ipc",
            1,
            id="ipc-cuda-tensors",
            marks=pytest.mark.skipif(not _has_ipc_tree(), reason="the ipc tree is not here"),
        ),
    ],
)
def test_cuda_sgd(tmp_path, comm, gpus):
    """Two nodes training on CUDA, sharing the GPUs when there are fewer than two: gloo
    and the tree stage CUDA tensors through the host; NCCL, which refuses two ranks on
    one GPU of one host, gets a host id per rank and talks over loopback sockets."""
    if _cuda_devices() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s); this machine has {_cuda_devices()}")
    cfg = {k: v for k, v in config(2).items() if k in ("sgd_equivalence", "sgd_uneven")}
    for scenario in cfg.values():
        scenario["device"] = "cuda"
    results = launch(comm, 2, tmp_path, cfg, gpus=_cuda_devices())
    reference = sim.sgd_reference(cfg["sgd_equivalence"]["steps"], cfg["sgd_equivalence"]["batch"])
    uneven = sim.uneven_reference(cfg["sgd_uneven"]["steps"])
    for res in results:
        assert_same(res["sgd_equivalence"]["state"], reference, atol=1e-5, rtol=1e-4)
        assert_same(res["sgd_uneven"]["synced"], uneven, atol=1e-12, rtol=1e-12)


@pytest.mark.cuda
def test_nccl_starts_collectives_without_waiting_for_the_device(tmp_path):
    """Over NCCL, starting an all-reduce queues it behind the work already on the GPU:
    the host never waits there (it did once: a count slot set by assignment copied the
    value from host memory, which waits for backward to finish first), and a whole step
    of AllReduceSGD waits once, to read its count and marks, also when a parameter has
    no gradient."""
    if _cuda_devices() < 1:
        pytest.skip("needs a CUDA GPU")
    cfg = {"cuda_syncs": {"steps": 4, "batch": 12}}
    for res in launch("nccl", 2, tmp_path, cfg, gpus=_cuda_devices()):
        ours = res["cuda_syncs"]
        assert (ours["start_counted"], ours["complete"], ours["start_tensors"]) == (0, 0, 0)
        assert ours["count"] == 2
        assert ours["stats"]["started_in_backward"] > 0  # the hooks' launches are counted too
        assert ours["per_step"][1:] == [1, 1, 1], ours["per_step"]  # the first builds buckets
        # a parameter without a .grad on every node: its marks are zeroed on the device
        assert ours["per_step_unused"][1:] == [1, 1, 1], ours["per_step_unused"]
        assert ours["unused_grad"] is None
