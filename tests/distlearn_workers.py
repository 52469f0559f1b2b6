"""One node of the distlearn multi-process tests.

    python tests/distlearn_workers.py --comm gloo|gloo-ring|ipc --rank R --world N \
        --rendezvous DIR --out DIR --scenarios protocol,sgd_equivalence,...

Each scenario runs on a real communicator and returns tensors that the test compares
with a single-process computation (tests/distlearn_sim.py); results go to
OUT/rank-R.pt. Also importable: the torchrun scripts reuse the scenarios.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distlearn_sim as sim

from distlearn import AllReduceEA, AllReduceSGD, synchronize_optimizer


def make_comm(kind: str, rank: int, world: int, rendezvous: str | None):
    """The communicator under test ("gloo-ring": gloo without the small all-reduce at
    the root, so the process group's own all-reduce carries everything)."""
    options = {"gather_bytes": 0} if kind == "gloo-ring" else {}
    kind = "gloo" if kind == "gloo-ring" else kind
    if kind in ("gloo", "nccl"):
        import torch.distributed as dist

        from distlearn.backends import TorchDistributed

        if rendezvous is None:  # torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
            if os.environ.get("DISTLEARN_TEST_PG_TIMEOUT_S"):
                options["timeout"] = float(os.environ["DISTLEARN_TEST_PG_TIMEOUT_S"])
            return TorchDistributed.from_env(kind, **options)
        if kind == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())  # ranks may share
        dist.init_process_group(
            kind, init_method=f"file://{rendezvous}/{kind}-store", rank=rank, world_size=world
        )
        return TorchDistributed(**options)
    if kind == "ipc":
        from distlearn import ipc

        if rendezvous is None:
            return ipc.Tree.from_env()
        return ipc.LocalhostTree(rank, world)
    raise ValueError(f"unknown communicator {kind!r}")


# -- scenarios: each returns a dict of tensors / numbers -------------------------------


def protocol(comm, cfg) -> dict:
    """The communicator protocol itself: ops, nesting, dtypes, finished counts, scatter."""
    r = comm.node_index
    out = {}

    def sample():
        return {
            "a": torch.full((3,), r + 1.0, dtype=torch.float64),
            "b": [torch.arange(4, dtype=torch.int64) * (r + 1), torch.tensor([float(r)])],
        }

    for op in ("sum", "max", "min"):
        x = sample()
        out[f"{op}.count"] = comm.all_reduce(x, op=op)
        out[f"{op}.value"] = x
        # Odd nodes are finished: they take part but contribute nothing.
        x = sample()
        out[f"{op}.finished.count"] = comm.all_reduce(x, op=op, finished=r % 2 == 1)
        out[f"{op}.finished.value"] = x
    x = sample()
    out["callable.count"] = comm.all_reduce(x, op=lambda a, b: a.mul_(b))
    out["callable.value"] = x
    x = torch.full((5,), float(r))
    comm.scatter(x)
    out["scatter"] = x
    # A tensor that is not contiguous is reduced in place all the same.
    big = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (r + 1)
    view = big.t()
    comm.all_reduce(view)
    out["noncontiguous"] = big
    if hasattr(comm, "all_reduce_counted"):
        # A buffer whose last slot is left for the count (how gradient buckets travel),
        # odd nodes finished; then every node in, synchronously.
        for dtype in (torch.float32, torch.bfloat16):
            flat = torch.full((6,), r + 1.0, dtype=dtype)
            handle = comm.all_reduce_counted(flat, finished=r % 2 == 1, async_op=True)
            out[f"counted.{dtype}.count"] = handle.wait()
            out[f"counted.{dtype}.value"] = flat[:-1]
        # bool cannot count past 1: the count travels in a collective of its own, and
        # complete() must still leave the result in place.
        flat = torch.tensor([r == 0, r == 1, False, False])
        handle = comm.all_reduce_counted(flat, finished=r % 2 == 1, async_op=True)
        out["counted.bool.in_slot"] = handle.count_in_slot
        handle.complete()
        out["counted.bool.value"] = flat[:-1].clone()
        out["counted.bool.count"] = handle.wait()
        flat = torch.full((3,), r + 1.0, dtype=torch.float64)
        out["counted.sync.count"] = comm.all_reduce_counted(flat)
        out["counted.sync.value"] = flat[:-1]
    comm.barrier()
    return out


def reduce_at_root(comm, cfg) -> dict:
    """TorchDistributed's small all-reduce at node 0 (gather, reduce, broadcast) against
    the process group's own, on the same group: every op and dtype, sizes on both sides
    of `gather_bytes`, nodes that say they are on different machines, nodes given
    different bounds, and a group without rank 0. The calls that reach
    torch.distributed are counted, to see which way each one went."""
    import torch.distributed as dist

    from distlearn.backends import TorchDistributed, torch_distributed

    if not isinstance(comm, TorchDistributed):
        return {}
    r, n = comm.node_index, comm.num_nodes
    calls = {"gather": 0, "allreduce": 0}
    gather = dist.gather

    def counted_gather(*args, **kwargs):
        calls["gather"] += 1
        return gather(*args, **kwargs)

    class CountedGroup:  # the process group, its all-reduces counted
        def __init__(self, pg):
            self.pg = pg

        def allreduce(self, *args):
            calls["allreduce"] += 1
            return self.pg.allreduce(*args)

    def make(**options):
        c = TorchDistributed(**options)
        c._pg = CountedGroup(c._pg)
        return c

    def took() -> dict:
        taken = dict(calls)
        calls.update(gather=0, allreduce=0)
        return taken

    dist.gather = counted_gather
    # Nodes that outnumber half the cores, whatever this host has (the rule's other
    # side is tried below).
    real_cores = torch_distributed._cores
    torch_distributed._cores = lambda: 1
    out = {}
    try:
        for way, options in (("root", {}), ("ring", {"gather_bytes": 0})):
            c = make(**options)
            for op in ("sum", "max", "min"):
                for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
                    x = (torch.arange(10) * (r + 1) - 3 * r).to(dtype)
                    out[f"{way}.{op}.{dtype}.count"] = c.all_reduce(x, op=op, finished=r == 1)
                    out[f"{way}.{op}.{dtype}"] = x
            z = torch.tensor([1 + 2j, -0.5j], dtype=torch.complex64) * (r + 1)
            c.all_reduce(z, async_op=True).wait()
            out[f"{way}.complex"] = z
            out[f"{way}.calls"] = took()
            # just over the default bound: the process group's all-reduce (its count apart)
            big = torch.full(((1 << 20) // 4 // max(n - 1, 1) + 1,), r + 1.0)
            out[f"{way}.big.count"] = c.all_reduce(big)
            out[f"{way}.big"] = big[:3].clone()
            out[f"{way}.big.calls"] = took()
        # Nodes on different machines (as their ids say): the ring, asked once.
        real = torch_distributed._machine_id
        torch_distributed._machine_id = lambda: real() + (r % 2)
        try:
            c = make()
            x = torch.full((4,), r + 1.0)
            c.all_reduce(x)
            c.all_reduce(x)
            out["machines"] = x
            out["machines.one"] = c._root_path
            out["machines.calls"] = took()
        finally:
            torch_distributed._machine_id = real
        # A core for each thread of every node: the ring. The fewest cores count, so
        # every node decides alike when they see different counts.
        for name, cores in (("cores.many", 2 * n), ("cores.fewest", 64 if r == 0 else 1)):
            torch_distributed._cores = lambda cores=cores: cores
            c = make()
            x = torch.full((4,), r + 1.0)
            c.all_reduce(x)
            out[name] = c._root_path
            out[f"{name}.value"] = x
            out[f"{name}.calls"] = took()
        torch_distributed._cores = lambda: 1
        if n > 1:  # nodes given different bounds: a clear error on every node, not a hang
            try:
                make(gather_bytes=0 if r % 2 else 1 << 20).all_reduce(torch.ones(2))
                out["differ"] = None
            except ValueError as exc:
                out["differ"] = str(exc)
            x = torch.full((2,), r + 1.0)
            make().all_reduce(x)  # the group goes on
            out["differ.after"] = x
            took()
        if n >= 3:  # a group without rank 0: its node 0 is rank 1
            members = list(range(1, n))
            group = dist.new_group(members)
            if r in members:
                c = make(group=group)
                x = torch.full((3,), r + 1.0)
                out["group.count"] = c.all_reduce(x)
                out["group"] = x
                out["group.calls"] = took()
    finally:
        torch_distributed._cores = real_cores
        dist.gather = gather
    comm.barrier()
    return out


def sgd_equivalence(comm, cfg) -> dict:
    """N nodes on 1/N of each batch, starting from different weights."""
    dev = torch.device(cfg.get("device", "cpu"))
    model = sim.make_model(seed=100 + comm.node_index).to(dev)  # synchronize_parameters fixes it
    opt = sim.MomentumSGD(model)
    sgd = AllReduceSGD(comm)
    sgd.synchronize_parameters(model)
    counts = []
    for step in range(cfg["steps"]):
        x, y = sim.batch(step, cfg["batch"])
        x, y = x[comm.node_index :: comm.num_nodes], y[comm.node_index :: comm.num_nodes]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
        counts.append(sgd.sum_and_normalize_gradients(model))
        opt.step()
    sgd.synchronize_parameters(model)
    return {"state": model.state_dict(), "counts": counts}


def sgd_uneven(comm, cfg) -> dict:
    """The torch-distlearn test: random step counts per node per epoch."""
    r = comm.node_index
    dev = torch.device(cfg.get("device", "cpu"))
    params = [torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(r))]
    params = [params[0].to(dev)]
    grads = [torch.zeros(7, dtype=torch.float64, device=dev)]
    sgd = AllReduceSGD(comm)
    sgd.synchronize_parameters(params)
    synced, counts = [params[0].clone()], []
    for epoch, steps_per_node in enumerate(cfg["steps"]):
        steps = steps_per_node[r]
        for step in range(steps):
            grads[0].copy_(sim.uneven_grad(epoch, r, step, steps))
            counts.append(sgd.sum_and_normalize_gradients(grads))
            params[0].add_(grads[0])
        sgd.synchronize_parameters(params)
        synced.append(params[0].clone())
    return {"synced": synced, "counts": counts}


def sgd_uneven_momentum(comm, cfg) -> dict:
    """Uneven epochs under torch.optim.SGD with momentum, the optimizer given to
    synchronize_parameters: the parameters after every step, and the final state."""
    r = comm.node_index
    g = torch.Generator().manual_seed(r)  # different weights: the first sync fixes them
    p = nn.Parameter(torch.randn(7, dtype=torch.float64, generator=g))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    sgd = AllReduceSGD(comm)
    sgd.synchronize_parameters([p], opt)
    after = []  # per epoch, the parameters after each of this node's steps
    for epoch, steps_per_node in enumerate(cfg["steps"]):
        steps, mine = steps_per_node[r], []
        for step in range(steps):
            p.grad = sim.uneven_grad(epoch, r, step, steps)
            sgd.sum_and_normalize_gradients([p])
            opt.step()
            mine.append(p.detach().clone())
        sgd.synchronize_parameters([p], opt)
        after.append(mine)
    return {"after": after, "buf": opt.state_dict()["state"][0]["momentum_buffer"]}


def easgd(comm, cfg) -> dict:
    """AllReduceEA with uneven epochs, for comparison with a replica simulation."""
    out = {}
    for alpha in cfg["alphas"]:
        r = comm.node_index
        params = {"w": sim.ea_init(r), "b": sim.ea_init(r + 1000)[:2]}
        # Both paths: the averages overlapped with the next steps, and not.
        ea = AllReduceEA(comm, tau=cfg["tau"], alpha=alpha, overlap=alpha != 0)
        ea.synchronize_parameters(params)
        trajectory, centers = [], []
        in_flight = 0  # averages still travelling when average_parameters returned
        for epoch, steps_per_node in enumerate(cfg["steps"]):
            for step in range(steps_per_node[r]):
                noise = sim.ea_noise(epoch, r, step)
                params["w"].add_(noise["w"])
                params["b"].add_(noise["b"])
                ea.average_parameters(params)
                in_flight += ea.steps % ea.tau == 0 and ea._pending is not None
            trajectory.append({k: v.clone() for k, v in params.items()})
            ea.synchronize_center(params)
            centers.append([c.clone() for c in ea.center])
        out[f"alpha={alpha}"] = {
            "params": trajectory,
            "centers": centers,
            "overlap": ea.overlap,
            "in_flight": in_flight,
        }
    return out


def state(comm, cfg) -> dict:
    """Optimizer state from the root reaches nodes whose state is empty; buffers sync."""
    r = comm.node_index
    model = sim.make_model(seed=7, batchnorm=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sgd = AllReduceSGD(comm)
    sgd.synchronize_parameters(model)
    # Node r takes r local steps (the root none): different Adam state and BN statistics.
    for step in range(r + 1):
        x, y = sim.batch(100 + 10 * r + step, 8)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        sgd.sum_and_normalize_gradients(model)
        opt.step()
    sgd.synchronize_parameters(model)  # the node with the most steps wins (the last)
    after_sync = {k: v.clone() for k, v in model.state_dict().items()}
    synchronize_optimizer(comm, opt)
    x, y = sim.batch(999, 8)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return {"after_sync": after_sync, "after_step": model.state_dict(), "opt": opt.state_dict()}


def _overlap_stats(sgd: AllReduceSGD) -> dict:
    stats = sgd.stats
    mod = stats["modules"][0] if stats["modules"] else {}
    return {"overlap": stats["overlap"], **{k: v for k, v in mod.items() if k != "module"}}


def sgd_overlap(comm, cfg) -> dict:
    """AllReduceSGD on a module with tiny buckets (several start during backward): the
    plain loop, the first step before any hook, accumulation with and without no_sync()
    (and on one node only), and compressed gradients; each against one process."""
    r, n = comm.node_index, comm.num_nodes
    dev = torch.device(cfg.get("device", "cpu"))
    buckets = {"bucket_bytes": cfg["bucket_bytes"], "first_bucket_bytes": cfg["first_bucket_bytes"]}
    out = {}

    def train(
        name,
        micro=1,
        no_sync=False,
        sync_first=True,
        grad_dtype=None,
        frozen=None,
        overlap=True,
        zero_in_place=False,
        late=False,
    ):
        # Every node starts from seed 100's weights when it skips synchronize_parameters.
        model = sim.make_deep_model(seed=100 + (r if sync_first else 0)).to(dev)
        opt = sim.MomentumSGD(model)
        sgd = AllReduceSGD(comm, grad_dtype=grad_dtype, overlap=overlap, **buckets)
        if sync_first:
            sgd.synchronize_parameters(model)
        counts = []

        def freeze(step):
            if frozen and step in frozen:
                for i, p in enumerate(model.parameters()):
                    p.requires_grad_(i not in frozen[step])

        for step in range(cfg["steps"]):
            if not late:
                freeze(step)
            x, y = sim.batch(step, cfg["batch"])
            x, y = x[r::n].to(dev), y[r::n].to(dev)
            if zero_in_place:  # zero_grad(set_to_none=False): .grad is last step's bucket
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
            else:
                opt.zero_grad()
            parts = micro(r) if callable(micro) else micro
            pieces = zip(x.tensor_split(parts), y.tensor_split(parts), strict=True)
            for k, (xs, ys) in enumerate(pieces):
                # sum over the node's share / its size: the node's mean, micro-batch or not
                loss = nn.functional.cross_entropy(model(xs), ys, reduction="sum") / len(x)
                if no_sync and k < parts - 1:
                    with sgd.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            if late:  # after backward, before the sum: the optimizer still steps on them
                freeze(step)
            counts.append(sgd.sum_and_normalize_gradients(model))
            opt.step()
        sgd.synchronize_parameters(model)
        out[name] = {"state": model.state_dict(), "counts": counts, "stats": _overlap_stats(sgd)}

    train("plain")
    train("overlap_off", overlap=False)
    train("first_step", sync_first=False)
    train("no_sync", micro=3, no_sync=True)
    train("accumulate", micro=3)
    train("accumulate_in_place", micro=3, zero_in_place=True)
    train("accumulate_node0", micro=lambda node: 2 if node == 0 else 1)
    frozen = {int(step): ps for step, ps in cfg["frozen"].items()}
    train("frozen", frozen=frozen)
    train("frozen_late", frozen=frozen, late=True)
    train("frozen_late_off", frozen=frozen, late=True, overlap=False)
    for dtype in ("bfloat16", "float16"):
        train(dtype, grad_dtype=dtype)
    return out


def _syncs(fn) -> int:
    """How many times `fn()` makes the host wait for the CUDA device (torch's sync
    debug mode warns once for each such call)."""
    import warnings

    torch.cuda.synchronize()  # nothing left over from before
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing CUDA operation" in str(w.message) for w in seen)


def cuda_syncs(comm, cfg) -> dict:
    """Where a CUDA step waits for the device: starting a collective must not (the
    host would stop queueing work until backward is done, and NCCL's kernel would
    start only after the host has caught up), and a step of AllReduceSGD reads back
    once (its count and marks), where DDP reads back nothing."""
    r, n = comm.node_index, comm.num_nodes
    dev = torch.device("cuda", torch.cuda.current_device())
    flat = torch.ones(1001, device=dev)
    started = {}

    def start_counted():
        started["counted"] = comm.all_reduce_counted(flat, async_op=True)

    def start_tensors():
        started["tensors"] = comm.all_reduce([flat[:10], flat[10:20]], async_op=True)

    out = {"start_counted": _syncs(start_counted)}
    out["complete"] = _syncs(lambda: started["counted"].complete())
    out["start_tensors"] = _syncs(start_tensors)
    out["count"] = started["tensors"].wait()
    for name, unused in (("per_step", False), ("per_step_unused", True)):
        model = sim.make_deep_model(seed=100).to(dev)
        if unused:  # a parameter no step uses: its .grad stays None on every node
            model.register_parameter("unused", nn.Parameter(torch.zeros(3, device=dev)))
        opt = sim.MomentumSGD(model)
        sgd = AllReduceSGD(comm, bucket_bytes=256, first_bucket_bytes=256)
        sgd.synchronize_parameters(model)
        per_step = []
        for step in range(cfg["steps"]):
            x, y = sim.batch(step, cfg["batch"])
            x, y = x[r::n].to(dev), y[r::n].to(dev)
            opt.zero_grad()

            def step_(x=x, y=y, model=model, sgd=sgd):
                nn.functional.cross_entropy(model(x), y).backward()
                sgd.sum_and_normalize_gradients(model)

            per_step.append(_syncs(step_))
        out[name] = per_step
        if unused:
            out["unused_grad"] = model.unused.grad
        else:
            out["stats"] = _overlap_stats(sgd)
    return out


def sgd_beside_ddp(comm, cfg) -> dict:
    """AllReduceSGD next to DistributedDataParallel, in the same processes: the same
    model (a head unused on some nodes or all of them), data and optimizer, DDP over a
    gloo group (the communicator's own, or one made here beside the `ipc` tree). Ours
    with buckets and without, with no_sync() accumulation, and in float16 against DDP's
    own compression hook; the test compares the weights with DDP's."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = comm.node_index, comm.num_nodes
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=r, world_size=n)
    buckets = {"bucket_bytes": cfg["bucket_bytes"], "first_bucket_bytes": cfg["first_bucket_bytes"]}
    # DDP's bfloat16 hook refuses gloo (it needs NCCL): bfloat16 is held to DDP in float32.
    hooks = {"float16": default_hooks.fp16_compress_hook}

    def loop(model, opt, reduce, no_sync, micro):
        for step in range(cfg["steps"]):
            use_b = sim.branchy_uses_b(step, r)
            x, y = sim.batch(step, cfg["batch"])
            x, y = x[r::n], y[r::n]
            opt.zero_grad()
            pieces = list(zip(x.tensor_split(micro), y.tensor_split(micro), strict=True))
            for k, (xs, ys) in enumerate(pieces):
                loss = nn.functional.cross_entropy(model(xs, use_b), ys) * len(xs) / len(x)
                if k < micro - 1:
                    with no_sync():
                        loss.backward()
                else:
                    loss.backward()
            reduce()
            opt.step()

    out = {}
    for name, kw, micro in (
        ("plain", {}, 1),
        ("overlap_off", {"overlap": False}, 1),
        ("no_sync", {}, 2),
        ("float16", {"grad_dtype": "float16"}, 1),
        ("bfloat16", {"grad_dtype": "bfloat16"}, 1),
    ):
        ddp = DDP(sim.Branchy(seed=7), find_unused_parameters=True, bucket_cap_mb=1e-4)
        if kw.get("grad_dtype") in hooks:
            ddp.register_comm_hook(None, hooks[kw["grad_dtype"]])
        loop(ddp, sim.MomentumSGD(ddp.module), lambda: None, ddp.no_sync, micro)
        model = sim.Branchy(seed=7)
        sgd = AllReduceSGD(comm, **buckets, **kw)
        sgd.synchronize_parameters(model)
        reduce = functools.partial(sgd.sum_and_normalize_gradients, model)
        loop(model, sim.MomentumSGD(model), reduce, sgd.no_sync, micro)
        out[name] = {
            "ddp": ddp.module.state_dict(),
            "ours": model.state_dict(),
            "b_grad_none": model.b.weight.grad is None,  # the last step: nobody used b
            "ddp_b_grad_none": ddp.module.b.weight.grad is None,
        }
    if own_group:
        dist.destroy_process_group()
    return out


def sgd_coefficients(comm, cfg) -> dict:
    """The random-steps test on a module, buckets on and off: uneven epochs (an idle
    node, a tie), parameters some nodes do not use in a step, a trainable set that
    changes each epoch, and .grad zeroed or set to None in turn. Also, per step, which
    parameters had a .grad before the sum and which are None after it."""
    r = comm.node_index
    dev = torch.device(cfg.get("device", "cpu"))
    out = {}
    for overlap in (True, False):
        model = sim.Coefficients(seed=r).to(dev)
        sgd = AllReduceSGD(
            comm,
            overlap=overlap,
            bucket_bytes=cfg["bucket_bytes"],
            first_bucket_bytes=cfg["first_bucket_bytes"],
        )
        sgd.synchronize_parameters(model)
        synced, counts, grads = [[p.detach().clone() for p in model.ps]], [], {}
        for epoch, steps_per_node in enumerate(cfg["steps"]):
            frozen = cfg["frozen"][epoch]
            for j, p in enumerate(model.ps):
                p.requires_grad_(j not in frozen)
            for step in range(steps_per_node[r]):
                for p in model.ps:
                    if epoch % 2:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.zero_()
                c = sim.coefficients(epoch, r, step, frozen)
                model({j: t.to(dev) for j, t in c.items()}).backward()
                had = [p.grad is not None for p in model.ps]
                counts.append(sgd.sum_and_normalize_gradients(model))
                grads[f"{epoch}.{step}"] = (had, [p.grad is None for p in model.ps])
                with torch.no_grad():
                    for p in model.ps:
                        if p.grad is not None:  # None: no node had one this step
                            p.sub_(p.grad)
            sgd.synchronize_parameters(model)
            synced.append([p.detach().clone() for p in model.ps])
        out[overlap] = {
            "synced": synced, "counts": counts, "grads": grads, "stats": _overlap_stats(sgd)
        }  # fmt: skip
    return out


def sgd_complex(comm, cfg) -> dict:
    """A model with a complex parameter: AllReduceSGD with buckets (the complex one in
    the last bucket, with the marks and the count) and without, then AllReduceEA."""
    from distlearn import AllReduceEA

    r, n = comm.node_index, comm.num_nodes
    out = {}
    for overlap in (True, False):
        model = sim.ComplexNet(seed=100 + r)
        sgd = AllReduceSGD(comm, overlap=overlap, bucket_bytes=32, first_bucket_bytes=16)
        sgd.synchronize_parameters(model)
        for step in range(cfg["steps"]):
            x, y = sim.batch(step, cfg["batch"])
            model.zero_grad()
            nn.functional.cross_entropy(model(x[r::n]), y[r::n]).backward()
            sgd.sum_and_normalize_gradients(model)
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(0.1 * p.grad)
        out[overlap] = model.state_dict()
    model = sim.ComplexNet(seed=100 + r)
    ea = AllReduceEA(comm, tau=1, alpha=0.5)
    ea.synchronize_parameters(model)
    with torch.no_grad():
        model.w.mul_(1 + r)  # the nodes drift apart; averaging pulls them to the center
    for _ in range(3):
        ea.average_parameters(model)
    ea.synchronize_center(model)
    out["ea_center"] = [c.clone() for c in ea.center]
    return out


def models_differ(comm, cfg) -> dict:
    """The last node's model differs (a wider head, or a frozen layer): every node gets
    the same ValueError, from AllReduceSGD's first collective, whichever call makes it,
    and from AllReduceEA's; then the communicator still works."""
    from distlearn import AllReduceEA

    r, last = comm.node_index, comm.num_nodes - 1

    def model(kind):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3 if kind == "wider" and r == last else 2))
        if kind == "frozen" and r == last:
            m[0].requires_grad_(False)
        return m

    def first_step(m):
        sgd = AllReduceSGD(comm)
        m(torch.ones(2, 4)).sum().backward()
        sgd.sum_and_normalize_gradients(m)

    cases = {
        "sgd_sync": ("wider", lambda m: AllReduceSGD(comm).synchronize_parameters(m)),
        "sgd_first_step": ("frozen", first_step),
        "ea_sync": (
            "wider",
            lambda m: AllReduceEA(comm, tau=2, alpha=0.5).synchronize_parameters(m),
        ),
        "same": ("same", lambda m: AllReduceSGD(comm).synchronize_parameters(m)),
    }
    out = {}
    for name, (kind, call) in cases.items():
        try:
            call(model(kind))
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def trainable_differs(comm, cfg) -> dict:
    """At step 3 the trainable set changes on the last node alone (`cfg["how"]`
    "one"), on every node but not alike ("unlike": the last node freezes another
    layer), or on every node still in its epoch ("after_finish": the last node ended
    its epoch after 2 steps): every node must get the same ValueError at that step (the
    last one, in "after_finish", in the drain of its synchronize_parameters), not a
    hang, an abort or a sum over mismatched gradients; then the communicator works."""
    import time

    r, last, how = comm.node_index, comm.num_nodes - 1, cfg["how"]
    model = sim.make_deep_model(seed=100)
    sgd = AllReduceSGD(comm, bucket_bytes=256, first_bucket_bytes=64)
    sgd.synchronize_parameters(model)
    t0, error, at = time.monotonic(), None, None
    try:
        for step in range(2 if how == "after_finish" and r == last else 6):
            at = step
            if step == 3 and (r == last or how != "one"):
                model[2 if r == last else 4].requires_grad_(False)
            x, y = sim.batch(step, 8)
            model.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(model(x), y).backward()
            sgd.sum_and_normalize_gradients(model)
        at = "drain"
        sgd.synchronize_parameters(model)
        at = None
    except ValueError as exc:
        error = str(exc)
    after = torch.ones(3)
    comm.all_reduce(after)
    return {"error": error, "step": at, "seconds": time.monotonic() - t0, "after": after}


def peer_dies(comm, cfg) -> dict:
    """The last node kills itself (or stops: `cfg["signal"]` "STOP") in the middle of a
    backward pass, with buckets in flight; the others must get an error from
    AllReduceSGD, not hang."""
    import signal
    import time

    r, last = comm.node_index, comm.num_nodes - 1
    model = sim.make_deep_model(seed=100)
    sgd = AllReduceSGD(comm, bucket_bytes=256, first_bucket_bytes=64)
    sgd.synchronize_parameters(model)
    t0 = time.monotonic()
    try:
        for step in range(cfg["steps"]):
            x, y = sim.batch(step, 8)
            x = x.requires_grad_()
            if r == last and step == cfg["die_at"]:
                # Runs once backward reaches the input: buckets have left by then.
                sig = signal.SIGSTOP if cfg.get("signal") == "STOP" else signal.SIGKILL
                x.register_hook(lambda g, sig=sig: os.kill(os.getpid(), sig))
            nn.functional.cross_entropy(model(x), y).backward()
            sgd.sum_and_normalize_gradients(model)
    except Exception as exc:  # what the survivors must see
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


SCENARIOS = {
    f.__name__: f
    for f in (
        protocol,
        reduce_at_root,
        sgd_equivalence,
        sgd_uneven,
        sgd_uneven_momentum,
        easgd,
        state,
        sgd_overlap,
        sgd_coefficients,
        sgd_beside_ddp,
        cuda_syncs,
        sgd_complex,
        models_differ,
        trainable_differs,
        peer_dies,
    )
}


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--comm", required=True, choices=["gloo", "gloo-ring", "nccl", "ipc"])
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--rendezvous", default=None, help="a shared directory; none: torchrun env")
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", required=True, help="JSON: scenario name -> its config")
    args = ap.parse_args()
    torch.manual_seed(0)
    comm = make_comm(args.comm, args.rank, args.world, args.rendezvous)
    config = json.loads(Path(args.config).read_text())
    results = {name: SCENARIOS[name](comm, cfg) for name, cfg in config.items()}
    results = _to_cpu(results)  # CUDA runs are compared on the CPU
    results["node_index"] = comm.node_index
    results["num_nodes"] = comm.num_nodes
    comm.close()
    if args.comm in ("gloo", "gloo-ring", "nccl"):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    out = Path(args.out)
    tmp = out / f".rank-{comm.node_index}.pt"
    torch.save(results, tmp)
    os.replace(tmp, out / f"rank-{comm.node_index}.pt")


if __name__ == "__main__":
    main()
