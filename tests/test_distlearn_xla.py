"""distlearn.backends.XLA on a real torch_xla runtime (opt-in tier: tests/run-xla.sh).

torch_xla 2.9.0 pins torch 2.9.0, so these tests run in their own environment
(.venv-xla) with PJRT_DEVICE=CPU, never in the main one (torch 2.13.0).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import repo_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distlearn_sim as sim

pytestmark = pytest.mark.xla
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def comm():
    # Imported here, not at the top: the default tier collects this file without torch_xla.
    from distlearn.backends import XLA

    return XLA()


def test_protocol_on_one_device(comm):
    dev = comm.device
    assert (comm.node_index, comm.num_nodes) == (0, 1)
    x = {"a": torch.full((3,), 2.0).to(dev), "b": [torch.arange(4).to(dev)]}
    assert comm.all_reduce(x) == 1
    assert x["a"].cpu().tolist() == [2.0] * 3 and x["b"][0].cpu().tolist() == [0, 1, 2, 3]
    # A finished node contributes nothing: with one node the result is the identity.
    assert comm.all_reduce(x, finished=True) == 0
    assert x["a"].cpu().tolist() == [0.0] * 3
    y = torch.tensor([1.0, -2.0]).to(dev)
    assert comm.all_reduce(y, op="max", finished=True) == 0
    assert y.cpu().tolist() == [float("-inf")] * 2
    z = torch.tensor([3.0, 4.0]).to(dev)
    assert comm.all_reduce(z, op=lambda a, b: a.mul_(b)) == 1
    assert z.cpu().tolist() == [3.0, 4.0]
    comm.scatter(z)
    assert z.cpu().tolist() == [3.0, 4.0]
    comm.barrier()


def test_sgd_on_xla_matches_cpu(comm):
    from distlearn import AllReduceSGD

    dev = comm.device
    model = sim.make_model(seed=100).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd = AllReduceSGD(comm)
    sgd.synchronize_parameters(model)
    for step in range(4):
        x, y = sim.batch(step, 12)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
        assert sgd.sum_and_normalize_gradients(model) == 1
        opt.step()
    sgd.synchronize_parameters(model)
    reference = sim.sgd_reference(4, 12)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value.cpu(), reference[name], atol=1e-5, rtol=1e-4)


def test_a_parameter_without_a_gradient_keeps_grad_none_on_xla(comm):
    """The plain path zeroes the count of a parameter this node had no .grad for on
    the device (index_fill_): the parameter keeps None, the others their gradient."""
    from distlearn import AllReduceSGD

    dev = comm.device
    model = sim.make_model(seed=100).to(dev)
    model.register_parameter("unused", nn.Parameter(torch.zeros(3).to(dev)))
    sgd = AllReduceSGD(comm)
    x, y = sim.batch(0, 12)
    nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
    want = {n: p.grad.cpu().clone() for n, p in model.named_parameters() if n != "unused"}
    assert sgd.sum_and_normalize_gradients(model) == 1
    assert model.unused.grad is None
    for n, p in model.named_parameters():
        if n != "unused":
            torch.testing.assert_close(p.grad.cpu(), want[n])


def test_easgd_on_xla_matches_simulation(comm):
    from distlearn import AllReduceEA

    dev = comm.device
    table = [[7], [2], [9]]
    params = {"w": sim.ea_init(0).to(dev), "b": sim.ea_init(1000)[:2].to(dev)}
    ea = AllReduceEA(comm, tau=3, alpha=0.4)
    ea.synchronize_parameters(params)
    ref = sim.ea_reference(1, table, tau=3, alpha=0.4)
    for epoch, steps in enumerate(table):
        for step in range(steps[0]):
            noise = sim.ea_noise(epoch, 0, step)
            params["w"].add_(noise["w"].to(dev))
            params["b"].add_(noise["b"].to(dev))
            ea.average_parameters(params)
        for k in params:
            torch.testing.assert_close(params[k].cpu(), ref["params"][epoch][0][k])
        ea.synchronize_center(params)
        torch.testing.assert_close(ea.center[1].cpu(), ref["centers"][epoch]["w"])


def test_several_devices(tmp_path):
    """One replica per device through torch_xla.launch, compared with gloo's results."""
    import torch_xla.runtime as xr

    if xr.device_type() == "CPU":
        pytest.skip(
            "PJRT CPU runs replicas as threads of one process; torch_xla 2.9.0 compiles "
            "each thread's graph separately and their all-reduce op_ids differ, so the "
            "in-process rendezvous aborts after 10 s ('Expected N threads to join the "
            "rendezvous'). Runs on TPU/GPU PJRT devices."
        )
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, str(HERE / "distlearn_xla_launch.py"), str(out)],
        env=repo_env(),
        capture_output=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-4000:]
    files = sorted(out.glob("rank-*.pt"))
    assert len(files) == xr.global_runtime_device_count()
    reference = sim.sgd_reference(4, 24)
    for f in files:
        state = torch.load(f)
        for name, value in state.items():
            torch.testing.assert_close(value, reference[name], atol=1e-5, rtol=1e-4)


def test_checkpoint_and_the_stop_flag_on_xla(comm, tmp_path):
    """Checkpoint's collectives on the XLA device, its files written from CPU copies of
    the XLA tensors, and the stop flag riding AllReduceSGD's all-reduce (the plain path)."""
    from distlearn import AllReduceSGD, Checkpoint, preemption

    dev = comm.device
    model = sim.make_model(seed=3).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sgd = AllReduceSGD(comm)
    preemption.reset()
    try:
        preemption.request("test")
        x, y = sim.batch(0, 8)
        nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
        sgd.sum_and_normalize_gradients(model)
        opt.step()
        assert preemption.agreed()
        ckpt = Checkpoint(tmp_path, comm, signals=())
        ckpt.save(1, {"model": model, "optim": opt})
        fresh = sim.make_model(seed=4).to(dev)
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        assert ckpt.restore({"model": fresh, "optim": fresh_opt}) == 1
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
            assert torch.equal(a.cpu(), b.cpu())
    finally:
        preemption.reset()
