"""distlearn in one process: argument checks, structure walking, state broadcast, and the
communicator protocol on a real one-node gloo group (no other processes needed)."""

from __future__ import annotations

import copy
import datetime
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from distlearn import AllReduceEA, AllReduceSGD, broadcast_state_dict, synchronize_optimizer
from distlearn.backends import TorchDistributed
from distlearn.buckets import _Bucket, _layout
from distlearn.comm import Completed, start_all_reduce, supports_async
from distlearn.tensors import gradients_of, leaves, parameters_of, state_of


@pytest.fixture(scope="module")
def comm(tmp_path_factory):
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield TorchDistributed()
    dist.destroy_process_group()


def test_torch_distributed_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchDistributed()


def test_from_env_names_missing_variables(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        TorchDistributed.from_env()


@pytest.mark.parametrize(("nodes", "root"), [("1", "127.0.0.1"), ("3", "gpu03")])
def test_from_env_under_srun_takes_slurms_variables(nodes, root):
    """Under srun without torchrun's variables: rank, world and the root from Slurm's
    (the first host of the step's node list across hosts, loopback on one)."""
    from distlearn.backends.torch_distributed import _from_slurm

    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0",
           "SLURM_STEP_NUM_NODES": nodes, "SLURM_STEP_NODELIST": "gpu[03-05]",
           "SLURM_JOB_ID": "1234"}  # fmt: skip
    _from_slurm(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("2", "6", root)
    assert env["MASTER_PORT"] == str(30000 + 1234)


@pytest.mark.parametrize(
    "timeout", [0, -1, float("nan"), float("inf"), True, "30", datetime.timedelta(0)]
)
def test_from_env_refuses_a_timeout_that_is_not_a_positive_duration(timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        TorchDistributed.from_env(timeout=timeout)


def test_leaves_order_and_errors():
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    # Dict keys are sorted, so dicts built in a different order line up across nodes.
    assert leaves({"z": a, "b": [b, (c,)]}) == [b, c, a]
    with pytest.raises(TypeError, match=r"found str at \['b'\]\[1\]"):
        leaves({"b": [b, "oops"]})


def test_gradients_of_module_and_parameters():
    model = nn.Linear(3, 2)
    assert all(p.grad is None for p in model.parameters())
    grads = gradients_of(model)
    # Missing gradients become zeros, so every node sends the same list.
    assert [g.shape for g in grads] == [torch.Size([2, 3]), torch.Size([2])]
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    # Parameters (tensors that require grad) stand for their .grad; others are gradients.
    plain = torch.ones(4)
    assert gradients_of([model.weight, plain])[0] is model.weight.grad
    assert gradients_of([model.weight, plain])[1] is plain
    # Frozen parameters are not all-reduced.
    model.bias.requires_grad_(False)
    assert len(gradients_of(model)) == 1


def test_parameters_and_state_are_detached_views():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    params, state = parameters_of(model), state_of(model)
    assert len(params) == 4 and len(state) == 7  # + running_mean, running_var, num_batches
    assert not any(t.requires_grad for t in state)
    state[0].fill_(3.0)  # writes through to the module
    assert torch.equal(model[0].weight, torch.full((2, 2), 3.0))


def test_bad_arguments(comm):
    with pytest.raises(ValueError, match="tau"):
        AllReduceEA(comm, tau=0)
    with pytest.raises(ValueError, match="alpha"):
        AllReduceEA(comm, alpha=1.5)
    with pytest.raises(TypeError, match="not a communicator: it has no node_index"):
        AllReduceSGD(object())
    with pytest.raises(ValueError, match="op must be one of"):
        comm.all_reduce(torch.zeros(1), op="mean")
    with pytest.raises(ValueError, match="at least one tensor"):
        comm.all_reduce([])
    ea = AllReduceEA(comm, tau=1)
    ea.average_parameters([torch.zeros(2)])
    with pytest.raises(ValueError, match="different parameters"):
        ea.average_parameters([torch.zeros(3)])


def test_one_node_protocol(comm):
    assert (comm.node_index, comm.num_nodes) == (0, 1)
    x = {"f": torch.tensor([1.5, -2.0]), "i": torch.tensor([3, 4]), "h": torch.ones(2).half()}
    assert comm.all_reduce(x) == 1
    assert x["f"].tolist() == [1.5, -2.0] and x["i"].tolist() == [3, 4]
    # Finished: nothing contributed, so every tensor holds the identity of the op.
    assert comm.all_reduce(x, op="max", finished=True) == 0
    assert x["f"].tolist() == [float("-inf")] * 2
    assert x["i"].tolist() == [torch.iinfo(torch.int64).min] * 2
    y = torch.tensor([2.0])
    assert comm.all_reduce(y, op="min", finished=True) == 0 and y.item() == float("inf")
    comm.barrier()


def test_sgd_one_node_counts_steps(comm):
    model = nn.Linear(2, 1)
    sgd = AllReduceSGD(comm)
    model(torch.ones(1, 2)).sum().backward()
    grad = model.weight.grad.clone()
    assert sgd.sum_and_normalize_gradients(model) == 1
    assert torch.equal(model.weight.grad, grad) and sgd.steps == 1
    before = [p.detach().clone() for p in model.parameters()]
    sgd.synchronize_parameters(model)
    assert sgd.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_generators_of_parameters_are_walked_once(comm):
    """`model.parameters()` is a generator: every call that takes it walks it more than
    once, so it must not see it empty the second time."""
    model = nn.Linear(3, 2)
    sgd = AllReduceSGD(comm)
    sgd.synchronize_parameters(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    assert sgd.sum_and_normalize_gradients(model.parameters()) == 1
    assert torch.equal(model.weight.grad, torch.ones(2, 3))
    sgd.synchronize_parameters(model.parameters())
    ea = AllReduceEA(comm, tau=1, alpha=0.5)
    ea.synchronize_parameters(model.parameters())
    ea.average_parameters(model.parameters())
    ea.synchronize_center(model.parameters())


def test_broadcast_state_dict_keeps_structure(comm):
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = opt.state_dict()
    back = broadcast_state_dict(comm, state)
    assert back["param_groups"][0]["betas"] == (0.8, 0.9)  # tuples stay tuples
    assert sorted(back["state"]) == [0, 1]  # int keys stay ints
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    synchronize_optimizer(comm, opt)
    with pytest.raises(TypeError, match=r"state_dict\['bad'\]: cannot broadcast a set"):
        broadcast_state_dict(comm, {"bad": {1, 2}})
    for src in (1, -1, True, "0"):  # one node: only node 0 is a node
        with pytest.raises(ValueError, match=r"src must be a node index in \[0, 1\)"):
            broadcast_state_dict(comm, state, src=src)


def test_synchronize_parameters_checks_the_optimizer(comm):
    model = nn.Linear(3, 2)
    sgd = AllReduceSGD(comm)
    with pytest.raises(TypeError, match="optimizer must have state_dict"):
        sgd.synchronize_parameters(model, optimizer=model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd.synchronize_parameters(model, opt)  # one node: its own state back, unchanged


# -- the asynchronous all-reduce ---------------------------------------------------------


def test_async_handles_complete_in_place_and_in_order(comm):
    assert supports_async(comm)
    small = [torch.ones(3), torch.full((3,), 2.0)]
    handles = [comm.all_reduce(t, async_op=True) for t in small]
    # Two packed all-reduces in flight at once: each has a buffer of its own.
    assert [h.wait() for h in handles] == [1, 1]
    assert small[0].tolist() == [1.0] * 3 and small[1].tolist() == [2.0] * 3
    assert handles[0].is_completed() and handles[0].wait() == 1  # waiting again is fine
    # A large contiguous tensor is reduced in its own memory, its count on the side.
    big = torch.arange(comm.direct_bytes // 4 + 5, dtype=torch.float32)
    ptr = big.data_ptr()
    h = comm.all_reduce(big, async_op=True)
    assert h.wait() == 1 and big.data_ptr() == ptr and big[-1].item() == big.numel() - 1
    assert comm.all_reduce(big, finished=True, async_op=True).wait() == 0
    assert big.abs().sum().item() == 0  # a finished node contributes nothing
    # ...and a large view that is not contiguous travels packed, back in place.
    wide = torch.arange(2 * (comm.direct_bytes // 8 + 8), dtype=torch.float32).view(2, -1)
    col = wide.t()
    want = col.clone()
    assert comm.all_reduce(col, async_op=True).wait() == 1 and torch.equal(col, want)
    # A callable op runs at once and hands back a completed handle.
    h = comm.all_reduce(torch.ones(2), op=lambda a, b: a.add_(b), async_op=True)
    assert isinstance(h, Completed) and h.wait() == 1


class SyncOnly:
    """A communicator with only the synchronous form; records what it was given."""

    def __init__(self, comm):
        self.comm, self.node_index, self.num_nodes = comm, comm.node_index, comm.num_nodes
        self.seen: list[list[torch.dtype]] = []

    def all_reduce(self, tensors, op="sum", finished=False):
        self.seen.append([t.dtype for t in leaves(tensors)])
        return self.comm.all_reduce(tensors, op, finished)

    def scatter(self, tensors):
        self.comm.scatter(tensors)

    def barrier(self):
        self.comm.barrier()


def test_which_communicators_overlap(comm):
    from distlearn.backends import XLA

    # XLA traces backward rather than running it: nothing to overlap with there.
    assert "async_op" not in inspect.signature(XLA.all_reduce).parameters
    sync = SyncOnly(comm)
    assert not supports_async(sync)
    handle = start_all_reduce(sync, torch.ones(2))
    assert isinstance(handle, Completed) and handle.wait() == 1
    assert not AllReduceSGD(sync).overlap and AllReduceSGD(comm).overlap
    assert not AllReduceSGD(comm, overlap=False).overlap


# -- AllReduceSGD's buckets --------------------------------------------------------------


def test_sgd_options_are_checked(comm):
    with pytest.raises(ValueError, match=r"grad_dtype must be .*'bf16'"):
        AllReduceSGD(comm, grad_dtype="bf17")
    with pytest.raises(ValueError, match="grad_dtype"):
        AllReduceSGD(comm, grad_dtype=torch.float64)
    with pytest.raises(ValueError, match="bucket_bytes must be a positive"):
        AllReduceSGD(comm, bucket_bytes=0)
    with pytest.raises(ValueError, match="first_bucket_bytes must be a positive"):
        AllReduceSGD(comm, first_bucket_bytes=1.5)
    assert AllReduceSGD(comm, grad_dtype="bf16").grad_dtype == torch.bfloat16


def test_bucket_layout_follows_backward_order():
    def p(*shape, dtype=torch.float32):
        return nn.Parameter(torch.zeros(shape, dtype=dtype))

    # In backward order: the first bucket closes at 64 bytes, the others at 256; a
    # parameter larger than a bucket is a bucket of its own; dtypes never share one.
    a, b, c, d, e = p(8), p(20), p(100), p(4, dtype=torch.float64), p(30)
    groups = _layout([a, b, c, d, e], lambda t: t, first=64, cap=256)
    assert [[id(x) for x in g] for g in groups] == [
        [id(a), id(b)],  # 32 + 80 bytes >= 64
        [id(c)],  # 400 bytes
        [id(d)],  # float64: its own first bucket, still open at the end
        [id(e)],
    ]
    # Compressed: sizes count the bytes that travel.
    assert [len(g) for g in _layout([a, b, c], lambda t: t, first=64, cap=256)] == [2, 1]
    assert [len(g) for g in _layout([a, b, c], lambda t: torch.bfloat16, 64, 256)] == [3]
    # bfloat16 parameters and float32 ones sent as bfloat16 travel alike but land
    # differently (a view of the buffer, a copy back): never one bucket.
    h = p(4, dtype=torch.bfloat16)
    assert [len(g) for g in _layout([a, h, b], lambda t: torch.bfloat16, 1024, 1024)] == [2, 1]


def test_a_users_hook_on_the_gradient_has_run_when_its_bucket_is_filled(comm):
    """A post-accumulate hook that changes .grad in place, registered after ours (at the
    first synchronize_parameters): its change is in the sum, as under DDP (the bucket
    used to take the gradient before it ran: twice the gradient here)."""
    model, reference = _deep(), _deep()
    sgd = AllReduceSGD(comm, bucket_bytes=64, first_bucket_bytes=16)
    sgd.synchronize_parameters(model)
    assert len(sgd._buckets[model].buckets) >= 3

    def halve(q):
        q.grad.mul_(0.5)

    for m in (model, reference):
        for q in m.parameters():
            q.register_post_accumulate_grad_hook(halve)
    x = torch.ones(3, 4)
    for m in (model, reference):
        m(x).sum().backward()
    assert sgd.sum_and_normalize_gradients(model) == 1
    for q, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(q.grad, r.grad)


def test_buckets_of_mixed_dtypes_with_compression(comm):
    """A bfloat16 head beside float32 layers, gradients sent as bfloat16: each lands in
    its parameter's dtype (a float32 .grad used to be handed a bfloat16 view)."""
    model, reference = _deep(), _deep()
    for m in (model, reference):
        m[4].bfloat16()
        m[3].register_forward_hook(lambda mod, inp, out: out.bfloat16())
    sgd = AllReduceSGD(comm, grad_dtype=torch.bfloat16)  # one bucket's worth: bfloat16 first
    sgd.synchronize_parameters(model)
    x = torch.ones(3, 4)
    for m in (model, reference):
        m(x).float().sum().backward()
    assert sgd.sum_and_normalize_gradients(model) == 1
    for q, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert q.grad.dtype == q.dtype
        torch.testing.assert_close(q.grad, r.grad, atol=0, rtol=2**-8)


def test_zero_element_and_frozen_modules(comm):
    """A parameter without elements alone in its dtype (it made an empty bucket, which
    the counted all-reduce refused), and a module with nothing trainable: both go
    through a step and a synchronize_parameters."""
    model = _deep()
    model[2].empty = nn.Parameter(torch.zeros(0, dtype=torch.float64))
    sgd = AllReduceSGD(comm, bucket_bytes=64, first_bucket_bytes=16)
    sgd.synchronize_parameters(model)
    (model(torch.ones(3, 4)).sum() + model[2].empty.sum()).backward()
    assert sgd.sum_and_normalize_gradients(model) == 1
    assert model[2].empty.grad.shape == (0,)
    sgd.synchronize_parameters(model)
    teacher = _deep().requires_grad_(False)  # e.g. the teacher of a distillation
    for overlap in (True, False):
        AllReduceSGD(comm, overlap=overlap).synchronize_parameters(teacher)


def _deep(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


class _Counting(TorchDistributed):
    """The world group, counting the collectives it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.started = 0

    def _start_all_reduce_flat(self, buf, op):
        self.started += 1
        return super()._start_all_reduce_flat(buf, op)


def test_a_model_trained_on_alone_starts_no_all_reduce(comm):
    """Once its AllReduceSGD is gone, a model's backward is plain torch's again: no
    hooks left in its parameters, no bucket started. A node that trains on alone (or
    takes gradients to explain a prediction) would otherwise start all-reduces that
    no other node joins."""
    import gc

    model = _deep()
    counting = _Counting()
    sgd = AllReduceSGD(counting, bucket_bytes=64, first_bucket_bytes=16)
    sgd.synchronize_parameters(model)
    model(torch.ones(3, 4)).sum().backward()
    sgd.sum_and_normalize_gradients(model)
    assert counting.started > 0
    del sgd
    gc.collect()
    before = counting.started
    model.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    assert counting.started == before
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_buckets_start_during_backward(comm):
    model = _deep()
    sgd = AllReduceSGD(comm, bucket_bytes=64, first_bucket_bytes=16)
    sgd.synchronize_parameters(model)  # hooks set here
    buckets = sgd._buckets[model]
    started = []
    # A tensor hook on the input's first layer runs at the very end of backward.
    x = torch.ones(3, 4, requires_grad=True)
    x.register_hook(lambda g: started.append(buckets.launched))
    model(x).sum().backward()
    assert started == [len(buckets.buckets) - 1] and len(buckets.buckets) >= 3
    grads = [p.grad.clone() for p in model.parameters()]
    assert sgd.sum_and_normalize_gradients(model) == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    # no_sync(): backward only accumulates; the next sum sends the total.
    model.zero_grad()
    with sgd.no_sync():
        model(x).sum().backward()
        assert buckets.launched == 0
    model(x).sum().backward()
    assert buckets.launched == len(buckets.buckets) - 1
    assert sgd.sum_gradients(model) == 1
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(model.parameters(), grads, strict=True))
    assert sgd.stats["modules"][0]["resent"] == 0


class _Copies(TorchDispatchMode):
    """Counts the operators that copy or scale tensors, backward's own among them (a
    dispatch mode sees what runs during backward; a function mode does not)."""

    NAMES = {"copy_", "mul", "mul_", "zero_", "_foreach_copy_", "_foreach_mul_"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.NAMES:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def test_hooks_copy_a_bucket_at_once_not_a_gradient_at_a_time(comm):
    """A torch call made from a hook, right after backward's own kernels, costs several
    times one made in a loop: the hooks only count, and a full bucket is copied in with
    one call (small buckets) when it leaves, not one call a parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(24)])  # 48 tensors of 80 bytes a layer
    sgd = AllReduceSGD(comm, bucket_bytes=1024, first_bucket_bytes=256)
    sgd.synchronize_parameters(model)
    buckets = sgd._buckets[model]
    assert len(buckets.buckets) == 3
    x = torch.ones(2, 4)
    for _ in range(2):
        model.zero_grad()
        with _Copies() as mode:
            model(x).sum().backward()
        assert buckets.launched == 2
        assert mode.calls == ["_foreach_copy_"] * 2  # (48 copies, one a hook, before)
        grads = [p.grad.clone() for p in model.parameters()]
        assert sgd.sum_and_normalize_gradients(model) == 1
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_buckets_leave_from_a_backward_that_builds_a_graph(comm):
    """backward(create_graph=True) runs the hooks with grad enabled, where the copies
    into a bucket must not be recorded (nor can they be: `out=` refuses autograd)."""
    model = _deep()
    sgd = AllReduceSGD(comm, bucket_bytes=64, first_bucket_bytes=16)
    sgd.synchronize_parameters(model)
    buckets = sgd._buckets[model]
    loss = model(torch.ones(3, 4)).pow(2).sum()
    loss.backward(create_graph=True)
    assert buckets.launched == len(buckets.buckets) - 1
    grads = [p.grad.detach().clone() for p in model.parameters()]
    assert all(p.grad.requires_grad for p in model.parameters())  # backward's own graph
    assert sgd.sum_and_normalize_gradients(model) == 1
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g) and not p.grad.requires_grad


class _HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's values back to the host, and the numbers
    assigned into a tensor (`t[i] = 1`, which on CUDA travels from host memory): on
    CUDA each one waits for the device (a sync)."""

    READS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.writes: list[object] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        if name == "__setitem__" and not isinstance(args[2], torch.Tensor):
            self.writes.append(args[2])
        return func(*args, **(kwargs or {}))


def test_a_step_reads_back_to_the_host_once(comm):
    """Every bucket's count and the late count come back in one read a step, however
    many buckets travel (each read is a device sync on CUDA)."""
    model = _deep()
    sgd = AllReduceSGD(comm, bucket_bytes=64, first_bucket_bytes=16)
    sgd.synchronize_parameters(model)
    assert len(sgd._buckets[model].buckets) >= 3
    x = torch.ones(3, 4)
    for _ in range(2):
        model.zero_grad()
        model(x).sum().backward()
        with _HostReads() as mode:
            assert sgd.sum_and_normalize_gradients(model) == 1
        assert mode.reads == ["tolist"]
        assert mode.writes == []  # the count slots and marks are filled on the device
    # A finished node's drain reads the same once a step.
    with _HostReads() as mode:
        sgd.synchronize_parameters(model)
    assert mode.reads.count("tolist") == 1


def test_the_mean_over_every_node_needs_no_second_pass_for_any_node_count():
    """Gradients go into a bucket as their share of the mean over n nodes; what the
    result is still multiplied by must be exactly 1.0 when all n contributed. As
    1 / (1 / n) / n it is not for some n (49, 93, 98, ...), and each step paid a pass
    over the gradients that changed nothing."""
    bucket = _Bucket([nn.Parameter(torch.zeros(3))], torch.float32, 1)
    for n in (1, 2, 3, 49, 93, 98, 1000):
        bucket.reset()
        bucket.target(n)
        assert bucket.scale == 1.0 / n
        assert bucket.still_to_apply(n) == 1.0, n
        assert bucket.still_to_apply(None) == n  # the sum, not the mean
        if n > 1:
            assert bucket.still_to_apply(n - 1) == n / (n - 1)  # a node had finished


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x, use_b):
        h = torch.tanh(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_parameter_nobody_used_keeps_grad_none(comm, overlap):
    """As in one process: a head the step did not use keeps `.grad = None` (so the
    optimizer skips it), one it used gets its gradient; the step still reads back to
    the host once with buckets."""
    model = _TwoHeads()
    sgd = AllReduceSGD(comm, overlap=overlap, bucket_bytes=64, first_bucket_bytes=16)
    sgd.synchronize_parameters(model)
    x = torch.ones(3, 4)
    for use_b in (True, False, True):
        model.zero_grad()  # set_to_none
        model(x, use_b).sum().backward()
        want = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        with _HostReads() as mode:
            assert sgd.sum_and_normalize_gradients(model) == 1
        if overlap:
            assert mode.reads == ["tolist"]
        assert mode.writes == []  # (the places of the missing .grad: queued on the device)
        for n, p in model.named_parameters():
            assert (p.grad is None) == (want[n] is None) == (n.startswith("b.") and not use_b)
            if p.grad is not None:
                assert torch.equal(p.grad, want[n]), n
    # zero_grad(set_to_none=False): zeros are a gradient, as in one process
    model.zero_grad(set_to_none=False)
    model(x, False).sum().backward()
    sgd.sum_and_normalize_gradients(model)
    assert model.b.weight.grad is not None and not model.b.weight.grad.any()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_sparse_gradient_is_named_not_a_failed_copy(comm, overlap):
    """nn.Embedding(sparse=True) gives a sparse .grad, which dense buckets cannot hold:
    a ValueError names it (from the hook during backward, or from the sum)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 4), nn.Linear(4, 1))
    sgd = AllReduceSGD(comm, overlap=overlap, bucket_bytes=64, first_bucket_bytes=16)
    sgd.synchronize_parameters(model)
    with pytest.raises(ValueError, match=r"shape \(10, 4\) has a torch.sparse_coo gradient"):
        model(torch.tensor([1, 2, 2])).sum().backward()
        sgd.sum_and_normalize_gradients(model)


def test_grads_are_views_of_the_buckets_never_of_the_one_in_flight(comm):
    model = _deep()
    sgd = AllReduceSGD(comm, bucket_bytes=64, first_bucket_bytes=16)
    sgd.synchronize_parameters(model)
    buckets = sgd._buckets[model]

    def storages():
        return {p.grad.untyped_storage().data_ptr() for p in model.parameters()}

    def flats(i):
        return {b.flats[i].untyped_storage().data_ptr() for b in buckets.buckets}

    x = torch.ones(2, 4)
    model(x).sum().backward()
    sgd.sum_and_normalize_gradients(model)
    assert storages() == flats(0)  # nothing copied back: .grad is the bucket
    want = [p.grad.clone() for p in model.parameters()]
    # zero_grad(set_to_none=False) keeps those views: the next step fills a second
    # buffer, so a backward that lands late can never write into the one in flight.
    for p in model.parameters():
        p.grad.zero_()
    model(x).sum().backward()
    # (the buckets that left during backward; the last one leaves in the sum)
    assert all(len(b.flats) == 2 and b.cur == 1 for b in buckets.buckets[:-1])
    sgd.sum_and_normalize_gradients(model)
    assert all(len(b.flats) == 2 and b.cur == 1 for b in buckets.buckets)
    assert storages() == flats(1)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want, strict=True))
    # set_to_none=True: a single buffer suffices, whichever it is.
    model.zero_grad()
    model(x).sum().backward()
    sgd.sum_and_normalize_gradients(model)
    assert storages() == flats(1)


def test_sgd_follows_a_model_that_changes_dtype(comm):
    model = _deep()
    sgd = AllReduceSGD(comm, bucket_bytes=64, first_bucket_bytes=16)
    sgd.synchronize_parameters(model)
    model.double()  # the same Parameter objects, now float64: the buckets are rebuilt
    model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert sgd.sum_and_normalize_gradients(model) == 1
    assert all(p.grad.dtype == torch.float64 for p in model.parameters())
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert sgd._buckets[model].buckets[0].flat.dtype == torch.float64


class _Scaled(nn.Module):
    """A parameter whose shape can change under the buckets (its gradient then no
    longer fits the slot the buckets kept for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum()


def test_sgd_follows_a_parameter_that_changes_shape(comm):
    model = _Scaled()
    sgd = AllReduceSGD(comm)  # one bucket: the gradient is copied in after backward
    sgd.synchronize_parameters(model)
    model(torch.ones(3)).backward()
    sgd.sum_and_normalize_gradients(model)
    model.zero_grad()
    model.w.data = torch.ones(5)  # the same Parameter, now 5 elements
    model(torch.arange(5.0)).backward()
    assert sgd.sum_and_normalize_gradients(model) == 1
    assert torch.equal(model.w.grad, torch.arange(5.0))
    assert sgd.stats["modules"][0]["resent"] == 1
    assert sgd._buckets[model].buckets[0].numel == 5


class _ThreeScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.ones(3)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((x[: w.numel()] * w * k).sum() for k, w in enumerate((self.a, self.b, self.c)))


@pytest.mark.parametrize("grows", ["a", "c"])
def test_sgd_follows_a_parameter_that_changes_shape_under_hooks(comm, grows):
    """A bucket a parameter (hooks on every one): backward takes a parameter whose
    `.data` became another shape, as in plain torch, whether its bucket leaves during
    backward ("c", the first to get its gradient) or at the sum ("a"). A hook that held
    the parameter's gradient accumulator from one step to the next made backward refuse
    it ("invalid gradient ... expected shape compatible with [3]")."""
    model = _ThreeScaled()
    sgd = AllReduceSGD(comm, bucket_bytes=8, first_bucket_bytes=8)
    sgd.synchronize_parameters(model)
    assert len(sgd._buckets[model].buckets) == 3
    model(torch.ones(5)).backward()
    sgd.sum_and_normalize_gradients(model)
    model.zero_grad()
    getattr(model, grows).data = torch.ones(5)
    model(torch.arange(5.0)).backward()
    assert sgd.sum_and_normalize_gradients(model) == 1
    for k, name in enumerate("abc"):
        want = k * torch.arange(5.0 if name == grows else 3.0)
        assert torch.equal(getattr(model, name).grad, want), name
    assert sgd.stats["modules"][0]["resent"] == 1


def test_buckets_walk_the_module_tree_like_parameters(comm):
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(2, 1))
    model[1].register_module("absent", None)
    model[3].register_parameter("unused", None)
    # Frozen from the start, with several buckets (hooks): it gets no hook (a tensor
    # that does not require grad refuses one; that used to fail here).
    model[1].register_parameter("frozen", nn.Parameter(torch.ones(1), requires_grad=False))
    sgd = AllReduceSGD(comm, bucket_bytes=16, first_bucket_bytes=8)
    sgd.synchronize_parameters(model)
    buckets = sgd._buckets[model]
    # Each trainable parameter once, in backward order, as model.parameters() has them.
    held = [id(p) for b in buckets.buckets for p in b.params]
    assert held == [id(p) for p in model.parameters() if p.requires_grad][::-1]
    assert not buckets.changed()
    model[1].frozen.requires_grad_(True)
    assert buckets.changed()
    model[1].frozen.requires_grad_(False)
    assert not buckets.changed()
    model.append(nn.Linear(1, 1))
    assert buckets.changed()
    model(torch.ones(3, 2)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    assert sgd.sum_and_normalize_gradients(model) == 1
    got = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(got, grads, strict=True))


def test_a_newer_sgd_takes_over_the_hooks(comm):
    model = _deep()
    old = AllReduceSGD(comm, bucket_bytes=64, first_bucket_bytes=16)
    old.synchronize_parameters(model)
    new = AllReduceSGD(comm, bucket_bytes=64, first_bucket_bytes=16)
    new.synchronize_parameters(model)
    model(torch.ones(1, 4)).sum().backward()
    assert old._buckets[model].launched == 0  # its hooks are gone: nothing started twice
    assert new._buckets[model].launched > 0
    assert new.sum_and_normalize_gradients(model) == 1
    with pytest.raises(RuntimeError, match="newer AllReduceSGD"):
        old.sum_and_normalize_gradients(model)


def test_plain_path_sends_compressed_gradients(comm):
    sync = SyncOnly(comm)
    model = _deep()
    model[0].half()  # float16 parameters travel as they are
    sgd = AllReduceSGD(sync, grad_dtype=torch.bfloat16)
    model[0].float()
    model(torch.ones(2, 4)).sum().backward()
    exact = [p.grad.clone() for p in model.parameters()]
    assert sgd.sum_and_normalize_gradients(model) == 1
    # the gradients, then a flag a parameter (had it a .grad?) in the first one's dtype
    assert sync.seen[-1] == [torch.bfloat16] * (len(exact) + 1)
    for p, g in zip(model.parameters(), exact, strict=True):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, g, atol=0, rtol=2**-8)


def test_an_elastic_average_reads_back_to_the_host_once(comm):
    """An average's one read is the communicator's count (on CUDA each read is a sync);
    whether any node is still in its epoch is read only where the epoch ends."""
    model = nn.Linear(3, 2)
    for overlap in (False, True):
        ea = AllReduceEA(comm, tau=1, alpha=0.5, overlap=overlap)
        ea.synchronize_parameters(model)
        for step in range(3):
            with _HostReads() as mode:
                ea.average_parameters(model)
            # (with overlap the read is the previous average's, as it lands)
            assert mode.reads == ([] if overlap and step == 0 else ["item"]), overlap
        ea.synchronize_center(model)


# -- AllReduceEA's center --------------------------------------------------------------


def test_center_model_is_a_copy_holding_the_center(comm):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    ea = AllReduceEA(comm, tau=1, alpha=0.5)
    ea.synchronize_parameters(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a local step away from the center
    model(torch.randn(5, 3)).sum().backward()
    ea.average_parameters(model)  # (one node: the center meets the parameters)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next local step
    before = {k: v.clone() for k, v in model.state_dict().items()}
    center = ea.center_model(model)
    assert center is not model
    for p, c, q in zip(center.parameters(), ea.center, model.parameters(), strict=True):
        assert torch.equal(p, c) and not torch.equal(p, q) and p.grad is None
    # The node's model is untouched and keeps training; buffers are the node's.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(center[1].running_mean, model[1].running_mean)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        ea.center_model(list(model.parameters()))
    with pytest.raises(ValueError, match="not those being averaged"):
        ea.center_model(nn.Linear(3, 4))


def test_center_model_maps_tensors_given_as_a_dict_by_where_they_live(comm):
    """A dict of parameters is averaged in sorted key order ("10" before "2"): the
    center goes back into the module's own order, not position by position."""
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(11)])
    ea = AllReduceEA(comm, tau=1, alpha=0.5)
    ea.synchronize_parameters(dict(model.named_parameters()))
    center = ea.center_model(model)
    for p, q in zip(center.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    # Another instance of the model has no such map, and no module order to fall back on.
    with pytest.raises(ValueError, match="was given tensors, not this module"):
        ea.center_model(copy.deepcopy(model))
    # Given the module, a moved or copied model is matched in module order.
    ea = AllReduceEA(comm, tau=1, alpha=0.5)
    ea.synchronize_parameters(model)
    twin = copy.deepcopy(model)
    for p, q in zip(ea.center_model(twin).parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
