"""The ipc examples run end to end (small sizes) and check their own results."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, repo_env

EXAMPLES = {
    "client_server.py": ["--clients", "2", "--size", "262144", "--rounds", "10"],
    "workqueue_map.py": ["--workers", "3", "--items", "500"],
    "pipeline.py": ["--batches", "8"],
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_ipc_example_runs(script):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "ipc" / script), *EXAMPLES[script]],
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith(f"{script}: ")
