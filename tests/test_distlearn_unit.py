"""distlearn in one process: argument checks, structure walking, state broadcast, and the
communicator protocol on a real one-node gloo group (no other processes needed)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distlearn import AllReduceEA, AllReduceSGD, broadcast_state_dict, synchronize_optimizer
from distlearn.backends import TorchDistributed
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
