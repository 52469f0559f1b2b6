"""One import namespace: distlearn installs beside PyPI's `dataset` and `ipc`.

PyPI's `dataset` (a database toolkit) and `ipc` (a stdio IPC module) own those
top-level names. These tests install them from PyPI into a fresh venv next to
ours, in both orders (ours as a wheel and as an editable install), uninstall
each in turn, and check that every package still imports and works. The fresh
venv borrows torch and the other dependencies from the project venv through a
.pth line, so nothing large is installed twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NEIGHBOURS = ["dataset==2.0.0", "ipc==1.2.1"]

# What "works" means for each package, run in the fresh venv from a neutral folder.
USES = {
    "ours": """
        from distlearn import AllReduceSGD, ipc
        from distlearn.dataset import Dataset
        import torch
        ds = Dataset({"x": torch.arange(6.0).view(6, 1), "y": torch.tensor([0, 1] * 3)})
        batch = next(iter(ds.sampled_batcher(batch_size=6, input_dims=(1,), workers="thread")))
        assert batch.input.flatten().tolist() == [0, 1, 2, 3, 4, 5], batch.input
        assert issubclass(ipc.PeerError, ipc.IPCError) and AllReduceSGD
        import distlearn.dataset, distlearn.ipc
        assert distlearn.dataset.__file__.startswith(ROOT), distlearn.dataset.__file__
    """,
    "dataset": """
        import dataset
        db = dataset.connect("sqlite:///:memory:")
        db["t"].insert({"a": 1})
        assert db["t"].find_one(a=1)["a"] == 1
    """,
    "ipc": """
        import ipc
        assert ipc.__version__ == "1.2.1" and ipc.AttrDict(a=1).a == 1
    """,
}


def _run(cmd: list[str], cwd: Path, **kw) -> str:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, **kw)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


class Venv:
    """A fresh venv whose sys.path ends with the project venv's site-packages."""

    def __init__(self, path: Path) -> None:
        _run([sys.executable, "-m", "venv", str(path)], cwd=path.parent)
        self.python = path / "bin" / "python"
        self.root = str(path)
        site = _run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=path.parent,
        ).strip()
        # A plain path line: the project venv's own .pth files (our editable
        # finder among them) are not run, so only its dependencies show through.
        Path(site, "zz_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        self.cwd = path.parent

    def pip(self, *args: str) -> None:
        _run([str(self.python), "-m", "pip", "--disable-pip-version-check", *args], cwd=self.cwd)

    def works(self, *names: str) -> None:
        for name in names:
            code = f"ROOT = {self.root!r}\n" + textwrap.dedent(USES[name])
            _run([str(self.python), "-c", code], cwd=self.cwd, env=dict(os.environ, PYTHONPATH=""))

    def missing(self, module: str) -> None:
        code = f"import importlib.util as u; assert u.find_spec({module!r}) is None"
        _run([str(self.python), "-c", code], cwd=self.cwd, env=dict(os.environ, PYTHONPATH=""))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = ["--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)]
    _run([sys.executable, "-m", "pip", "wheel", "-q", *build], cwd=out)
    (whl,) = out.glob("distlearn-*.whl")
    return whl


def test_wheel_installs_only_the_distlearn_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert tops == {"distlearn"}, tops
    assert "distlearn/dataset/index/table.py" in names
    assert "distlearn/ipc/collectives/tree.py" in names


@pytest.mark.slow  # two venvs and PyPI installs: 40-75 s
@pytest.mark.timeout(600)
def test_beside_pypi_dataset_and_ipc_in_both_orders(tmp_path, wheel):
    env = Venv(tmp_path / "venv")

    # Ours first (a wheel), then PyPI's.
    env.pip("install", "-q", "--no-deps", str(wheel))
    env.missing("dataset")
    env.missing("ipc")
    env.pip("install", "-q", *NEIGHBOURS)
    env.works("ours", "dataset", "ipc")
    env.pip("uninstall", "-y", "distlearn")  # removing ours leaves theirs whole
    env.works("dataset", "ipc")

    # Theirs first, then ours as an editable install of this checkout.
    env.root = str(REPO)
    env.pip("install", "-q", "--no-deps", "-e", str(REPO))
    env.works("ours", "dataset", "ipc")
    env.pip("uninstall", "-y", "dataset", "ipc")  # removing theirs leaves ours whole
    env.works("ours")
    env.missing("dataset")
    env.missing("ipc")


def test_checkout_folders_refuse_a_second_identity():
    """With the checkout on sys.path, `import dataset` must not load a second copy."""
    for name in ("dataset", "ipc"):
        out = subprocess.run(
            [sys.executable, "-c", f"import {name}"], cwd=REPO, capture_output=True, text=True
        )
        assert out.returncode != 0
        assert f"is distlearn.{name}; import it as `from distlearn import {name}`" in out.stderr
