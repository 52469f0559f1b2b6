"""distlearn.Checkpoint on real communicators and stores: collective saves, atomic
publish, keep/prune, partial and corrupt checkpoints skipped, restore at another world
size, RNG states, S3 (moto's server), and preemption by SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from distlearn import ipc
from distlearn.checkpoint import Checkpoint, CheckpointError
from tests.conftest import repo_env

HERE = Path(__file__).resolve().parent
WORKER = HERE / "checkpoint_workers.py"
# Each launch starts processes that import torch (20-40 s on a busy 2-core machine): the
# tree runs in every run, gloo and the refusals in the slow tier.
COMMS = ["ipc", pytest.param("gloo", marks=pytest.mark.slow)]


def launch(kind: str, world: int, cfg: dict, tmp: Path, timeout: float = 200, signal_rank=None):
    """Run `world` ranks of the worker with `cfg`; their results by rank."""
    out = tmp / f"out-{uuid.uuid4().hex[:6]}"
    out.mkdir()
    cfg = {**cfg, "out": str(out)}
    config = out / "config.json"
    config.write_text(json.dumps(cfg))
    key = str(out) if kind == "gloo" else f"ckpt-{uuid.uuid4().hex}"
    args = [sys.executable, str(WORKER), kind]
    procs = [subprocess.Popen([*args, str(r), str(world), key, str(config)], env=repo_env(),
                              stderr=subprocess.PIPE, text=True) for r in range(world)]  # fmt: skip
    try:
        if signal_rank is not None:
            rank, after = signal_rank
            pid_file = out / f"pid-{rank}"
            deadline = time.monotonic() + timeout
            while not pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(after)
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, err) in enumerate(zip(procs, errs, strict=True)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{err[-3000:]}"
    return [torch.load(out / f"rank-{r}.pt", weights_only=False) for r in range(world)]


def folders(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name.startswith("step-"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", COMMS)
def test_save_and_restore_everything_at_the_same_world_size(kind, tmp_path):
    d = tmp_path / "ckpt"
    saved = launch(kind, 2, {"scenario": "save", "dir": str(d), "steps": [1, 2, 3],
                             "per_rank": True}, tmp_path)  # fmt: skip
    assert [f.split("-")[1] for f in folders(d)] == ["000000000002", "000000000003"]  # keep=2
    manifest = json.loads((d / folders(d)[-1] / "MANIFEST.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 2
    assert manifest["objects"] == {"model": "replicated", "optim": "replicated",
                                   "data": "elastic", "mine": "per_rank"}  # fmt: skip
    assert manifest["data"]["data"] == [{"rank": 0, "consumed": 100}, {"rank": 1, "consumed": 101}]
    back = launch(kind, 2, {"scenario": "restore", "dir": str(d), "seed": 7,
                            "per_rank": True}, tmp_path)  # fmt: skip
    for r in range(2):
        assert back[r]["step"] == 3
        for name, t in saved[0]["state"].items():
            assert torch.equal(back[r]["state"][name], t), name  # rank 0's model everywhere
        o_saved, o_back = saved[0]["optim"]["state"], back[r]["optim"]["state"]
        assert o_saved.keys() == o_back.keys()
        for i in o_saved:
            for k in o_saved[i]:
                assert torch.equal(o_saved[i][k], o_back[i][k]), (i, k)
        assert back[r]["data"] == {"rank": r, "consumed": 100 + r}  # its own at the same W
        assert back[r]["mine"] == 1000 + r
        assert back[r]["draws"] == saved[r]["draws"], "the RNGs draw what they would have"


@pytest.mark.timeout(300)
def test_restore_at_another_world_size(tmp_path):
    d = tmp_path / "ckpt"
    saved = launch("ipc", 3, {"scenario": "save", "dir": str(d), "steps": [4]}, tmp_path)
    back = launch("ipc", 2, {"scenario": "restore", "dir": str(d), "seed": 9}, tmp_path)
    everyone = [{"rank": r, "consumed": 100 + r} for r in range(3)]
    for r in range(2):
        assert back[r]["step"] == 4
        assert back[r]["data"] == everyone  # the list of every old rank's state
        for name, t in saved[0]["state"].items():
            assert torch.equal(back[r]["state"][name], t)
    assert back[0]["draws"] != back[1]["draws"]  # seeded per rank, not copied


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_per_rank_state_is_refused_at_another_world_size(tmp_path):
    d2 = tmp_path / "ckpt2"
    launch("ipc", 3, {"scenario": "save", "dir": str(d2), "steps": [4], "per_rank": True},
           tmp_path)  # fmt: skip
    back = launch("ipc", 2, {"scenario": "restore", "dir": str(d2), "per_rank": True}, tmp_path)
    assert all("'mine': per-rank state saved by 3 ranks cannot be restored by 2" in b["error"]
               for b in back)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_at_different_steps_save_as_the_highest(tmp_path):
    """Ranks of uneven epochs count different steps: the checkpoint is the job's highest."""
    d = tmp_path / "c"
    launch("ipc", 2, {"scenario": "different-steps", "dir": str(d)}, tmp_path)
    assert json.loads((d / folders(d)[-1] / "MANIFEST.json").read_text())["step"] == 6


# ----------------------------------------------------------------------------- one process


@pytest.fixture
def tree():
    t = ipc.LocalhostTree(0, 1, key=f"ckpt-{uuid.uuid4().hex}")
    yield t
    t.close()


class Box:
    def __init__(self, value):
        self.value = value

    def state_dict(self):
        return {"v": torch.tensor([self.value])}

    def load_state_dict(self, state):
        self.value = int(state["v"][0])


def test_partial_and_corrupt_checkpoints_are_skipped_saying_why(tree, tmp_path, caplog):
    ckpt = Checkpoint(tmp_path, tree, keep=None, signals=())
    for step in (1, 2, 3):
        ckpt.save(step, {"box": Box(step)})
    names = folders(tmp_path)
    (tmp_path / names[2] / "MANIFEST.json").unlink()  # step 3: a save that did not finish
    victim = tmp_path / names[1] / "replicated.pt"  # step 2: a flipped byte
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    box = Box(0)
    with caplog.at_level(logging.WARNING, logger="distlearn.checkpoint"):
        assert ckpt.restore({"box": box}) == 1
    assert box.value == 1
    text = caplog.text
    assert "no MANIFEST.json (a save that did not finish): skipped" in text
    assert "replicated.pt does not match its checksum" in text
    assert ckpt.latest() == 2  # by manifest only (files not read)


def test_keep_prunes_only_after_a_newer_one_is_complete(tree, tmp_path):
    ckpt = Checkpoint(tmp_path, tree, keep=2, signals=())
    (tmp_path / "step-000000000000-0badf00d").mkdir()  # a partial save, older
    (tmp_path / "step-000000000009-0badf00d").mkdir()  # a partial save, newer than all
    for step in (1, 2, 3):
        ckpt.save(step, {"box": Box(step)})
    names = folders(tmp_path)
    assert [n.split("-")[1] for n in names] == ["000000000002", "000000000003", "000000000009"]
    assert Checkpoint(tmp_path, tree, signals=()).restore({"box": Box(0)}) == 3


def test_nothing_to_restore_and_bad_arguments(tree, tmp_path):
    ckpt = Checkpoint(tmp_path / "none", tree, signals=())
    assert ckpt.restore({"box": Box(0)}) is None
    with pytest.raises(ValueError, match="keep must be an int >= 1 or None"):
        Checkpoint(tmp_path, tree, keep=0)
    with pytest.raises(TypeError, match=r"objects\['x'\]: int has no state_dict"):
        ckpt.save(1, {"x": 3})
    ckpt.save(1, {"box": Box(1)})
    with pytest.raises(CheckpointError, match="holds no 'other'"):
        ckpt.restore({"box": Box(0), "other": Box(0)})


def test_on_s3(tree):
    from tests.moto_server import moto_s3

    with moto_s3() as storage:
        import s3fs

        s3fs.S3FileSystem(**storage).mkdir("ckpt-bucket")
        ckpt = Checkpoint("s3://ckpt-bucket/run", tree, keep=2, storage_options=storage,
                          signals=())  # fmt: skip
        model = torch.nn.Linear(4, 2)
        for step in (10, 20, 30):
            path = ckpt.save(step, {"model": model, "box": Box(step)})
        assert path.startswith("s3://ckpt-bucket/run/step-000000000030-")
        fs = s3fs.S3FileSystem(**storage)
        assert len(fs.ls("ckpt-bucket/run")) == 2
        fresh, box = torch.nn.Linear(4, 2), Box(0)
        again = Checkpoint("s3://ckpt-bucket/run", tree, storage_options=storage, signals=())
        assert again.restore({"model": fresh, "box": box}) == 30
        assert box.value == 30 and torch.equal(fresh.weight, model.weight)


@pytest.mark.timeout(300)
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    d = tmp_path / "ckpt"
    got = launch("ipc", 3, {"scenario": "preempt", "dir": str(d)}, tmp_path,
                 signal_rank=(1, 2.0))  # fmt: skip
    steps = {g["stopped_at"] for g in got}
    assert len(steps) == 1 and {g["exit"] for g in got} == {0}
    (step,) = steps
    manifest = json.loads((d / folders(d)[-1] / "MANIFEST.json").read_text())
    assert manifest["step"] == step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algo", ["sgd", pytest.param("ea", marks=pytest.mark.slow)])
def test_the_stop_flag_rides_the_algorithms_all_reduce(algo, tmp_path):
    """With AllReduceSGD (every step) or AllReduceEA (every tau steps) the flag travels in
    their all-reduce: Checkpoint.step adds no collective of its own."""
    d = tmp_path / "ckpt"
    got = launch("ipc", 3, {"scenario": f"preempt-{algo}", "dir": str(d)}, tmp_path,
                 signal_rank=(2, 2.0))  # fmt: skip
    assert len({g["stopped_at"] for g in got}) == 1 and {g["exit"] for g in got} == {0}
    assert all(g["rides"] > 0 for g in got)
    if algo == "ea":
        assert got[0]["stopped_at"] % 3 == 0  # learned at an average


def test_the_marks_carry_the_stop_count(tree):
    """One node: a request() rides the next step's last bucket (and the plain path's
    flags), and is agreed after it."""
    from distlearn import AllReduceSGD, preemption

    model = torch.nn.Linear(3, 2)
    for overlap in (True, False):
        preemption.reset()
        sgd = AllReduceSGD(tree, overlap=overlap)
        model(torch.randn(2, 3)).sum().backward()
        sgd.sum_and_normalize_gradients(model)
        assert not preemption.agreed()
        preemption.request("test")
        model(torch.randn(2, 3)).sum().backward()
        sgd.sum_and_normalize_gradients(model)
        assert preemption.agreed() and preemption.requested() == "test"
    preemption.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_on_nccl_with_cuda_tensors(tmp_path):
    """One NCCL rank: Checkpoint's collectives go on the GPU (NCCL reduces CUDA tensors
    only), the model and optimizer on it are saved from the CPU copies and restored
    onto it, and the stop flag rides the CUDA buckets."""
    import torch.distributed as dist

    from distlearn import AllReduceSGD, preemption
    from distlearn.backends import TorchDistributed

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)  # fmt: skip
    try:
        comm = TorchDistributed()
        model = torch.nn.Linear(8, 4).cuda()
        opt = torch.optim.Adam(model.parameters())
        sgd = AllReduceSGD(comm)
        preemption.reset()
        preemption.request("test")
        model(torch.randn(2, 8, device="cuda")).sum().backward()
        sgd.sum_and_normalize_gradients(model)
        opt.step()
        assert preemption.agreed()
        ckpt = Checkpoint(tmp_path / "c", comm, signals=())
        assert ckpt.device.type == "cuda"
        ckpt.save(3, {"model": model, "optim": opt, "box": Box(3)})
        fresh = torch.nn.Linear(8, 4).cuda()
        fresh_opt = torch.optim.Adam(fresh.parameters())
        box = Box(0)
        assert ckpt.restore({"model": fresh, "optim": fresh_opt, "box": box}) == 3
        assert torch.equal(fresh.weight, model.weight) and fresh.weight.is_cuda
        assert box.value == 3
        state = fresh_opt.state_dict()["state"]
        assert torch.equal(state[0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    finally:
        preemption.reset()
        dist.destroy_process_group()
