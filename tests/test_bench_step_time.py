"""bench.step_time: a real job of its rows on this machine, and the environment that lets
NCCL ranks share a GPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench.step_time import make_model, rank_env

REPO = Path(__file__).resolve().parent.parent


def test_nccl_ranks_sharing_a_gpu_each_get_a_host_of_their_own(monkeypatch):
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_IB_DISABLE", raising=False)
    envs = [rank_env("nccl", r, 2, 1) for r in range(2)]
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" and e["NCCL_IB_DISABLE"] == "1" for e in envs)
    # a GPU for every rank, or gloo: nothing added
    assert rank_env("nccl", 0, 2, 2) == {} and rank_env("gloo", 0, 4, 1) == {}
    # the user's own NCCL settings win
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    assert rank_env("nccl", 1, 4, 1)["NCCL_SOCKET_IFNAME"] == "eth0"


def test_the_models_train_on_their_items():
    import torch
    import torch.nn.functional as F

    tensors = {"convnet": 10, "mnist": 8, "transformer": 98}
    for name, count in tensors.items():
        model, item = make_model(name)
        assert len(list(model.parameters())) == count, name
        F.cross_entropy(model(torch.randn(2, *item)), torch.tensor([0, 9])).backward()
        assert all(p.grad is not None for p in model.parameters()), name


def test_a_job_of_every_row_reports_each_against_ddp(tmp_path):
    cmd = [
        sys.executable, "-m", "bench.step_time", "--models", "mnist", "--nodes", "2",
        "--rows", "none", "ddp", "ddp-join", "gloo", "ipc", "--reps", "1", "--rounds", "2",
        "--block", "3", "--timeout", "240", "--profile", str(tmp_path / "prof"),
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # | model | processes | row | ms per step | vs DDP | ...
    line = r"^\| mnist \(0\.04M\) \| 2 \| ([\w-]+) \| [\d.]+ \([^)]*\) \| ([^|]+) \|"
    rows = {m.group(1): m.group(2) for m in re.finditer(line, out.stdout, re.M)}
    assert set(rows) == {"none", "ddp", "ddp-join", "gloo", "ipc"}, out.stdout
    assert rows["ddp"].strip() == "-"
    for row in ("none", "ddp-join", "gloo", "ipc"):
        assert re.fullmatch(r"\d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\)", rows[row].strip()), rows
    # --profile: each row's ops on rank 0, the collectives among them, and a trace
    for row in ("none", "ddp", "ddp-join", "gloo", "ipc"):
        text = (tmp_path / "prof" / f"mnist-x2-{row}.txt").read_text()
        assert text.startswith(f"{row}: 3 steps, mnist model, 2 processes") and "aten::" in text
        trace = json.loads((tmp_path / "prof" / f"mnist-x2-{row}.trace.json").read_text())
        assert trace["traceEvents"]
    assert "c10d::allreduce_" in (tmp_path / "prof" / "mnist-x2-ddp.txt").read_text()
    # under join(), DDP's forward adds two one-element all-reduces to each step's bucket
    calls = {
        row: _calls(tmp_path / "prof" / f"mnist-x2-{row}.txt", "c10d::allreduce_")
        for row in ("ddp", "ddp-join")
    }
    assert calls == {"ddp": 3, "ddp-join": 9}, calls
    assert "c10d::" not in (tmp_path / "prof" / "mnist-x2-none.txt").read_text()


def _calls(table: Path, op: str) -> int:
    """An op's call count (the table's last column) in a profile's first table."""
    for line in table.read_text().splitlines():
        if line.strip().startswith(op + " "):
            return int(line.split()[-1])
    raise AssertionError(f"{op} not in {table}")
