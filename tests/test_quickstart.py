"""The README's "In twenty lines" example, as a newcomer runs it: the block in the README
is examples/quickstart.py, and it trains in one plain process and under torchrun."""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys

import pytest
from conftest import REPO, repo_env

PIL = pytest.importorskip("PIL.Image")

QUICKSTART = REPO / "examples" / "quickstart.py"
LINE = re.compile(r"^epoch (\d): loss ([\d.]+) over (\d+) items$", re.M)
ITEMS = 192  # two classes a linear model tells apart in a few steps


def _launcher_free_env() -> dict[str, str]:
    """The environment of a plain shell: none of torchrun's or Slurm's variables."""
    env = repo_env()
    launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"}
    launcher |= {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "IPC_TOKEN"}
    for name in list(env):
        if name in launcher or name.startswith("SLURM_"):
            del env[name]
    return env


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """A folder of 28x28 grayscale PNGs and its index: a bright 4x4 patch at the top left
    (label 0) or the bottom right (label 1), on a faintly noisy black ground."""
    root = tmp_path_factory.mktemp("quickstart")
    rows = ["filename,label"]
    for i in range(ITEMS):
        label = i % 2
        pixels = bytearray((i * 7 + j) % 5 for j in range(28 * 28))
        at = 2 if label == 0 else 22
        for y in range(at, at + 4):
            pixels[y * 28 + at : y * 28 + at + 4] = b"\xff" * 4
        buf = io.BytesIO()
        PIL.frombytes("L", (28, 28), bytes(pixels)).save(buf, format="PNG")
        (root / f"{i:04d}.png").write_bytes(buf.getvalue())
        rows.append(f"{i:04d}.png,{label}")
    (root / "train.csv").write_text("\n".join(rows) + "\n")
    return root


def _run(cmd: list[str], timeout: float) -> str:
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_launcher_free_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a timeout kills torchrun's workers too
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, out
    return out


def _epochs(out: str) -> list[tuple[float, int]]:
    lines = [(int(e), float(loss), int(n)) for e, loss, n in LINE.findall(out)]
    assert [e for e, _, _ in lines] == [0, 1, 2], out  # printed once per epoch, by rank 0 only
    return [(loss, n) for _, loss, n in lines]


def test_readme_block_is_the_example():
    """What the README shows is what examples/quickstart.py runs (code after the docstring;
    the file's formatter markers aside)."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## In twenty lines", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = QUICKSTART.read_text().split('"""', 2)[2].lstrip("\n")
    assert block == code.replace("  # fmt: skip", "")


def test_one_plain_process(images, serve_dir):
    """`python examples/quickstart.py URL` in a plain shell: one node, every item, loss drops."""
    url = serve_dir(images) + "train.csv"
    epochs = _epochs(_run([sys.executable, str(QUICKSTART), url], timeout=120))
    assert all(n == ITEMS for _, n in epochs)
    assert epochs[-1][0] < epochs[0][0]


def test_under_torchrun(images, serve_dir):
    """`torchrun --nproc-per-node=2 examples/quickstart.py URL`: the partitions cover every
    item once per epoch, and only rank 0 prints."""
    url = serve_dir(images) + "train.csv"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    epochs = _epochs(_run([*cmd, str(QUICKSTART), url], timeout=180))
    assert all(n == ITEMS for _, n in epochs)
    assert epochs[-1][0] < epochs[0][0]
