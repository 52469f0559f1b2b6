"""ipc.launch: how node 0 tells its launch's processes from another launch's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from distlearn.ipc import launch


def _joiner_digests(monkeypatch, index: int, **changes: str | None) -> dict:
    """The digests a joiner with node index `index` would send, its environment being
    this process's with `changes` (None removes a variable)."""
    with monkeypatch.context() as m:
        for name, value in changes.items():
            if value is None:
                m.delenv(name, raising=False)
            else:
                m.setenv(name, value)
        return launch.environment_digests(index)


def test_environments_equal_up_to_the_node_index(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOG", "out-0.txt")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the same on every node
    monkeypatch.setenv("SLURM_TASK_PID", "4242")  # a launcher's per-process value
    theirs = _joiner_digests(monkeypatch, 2, RANK="2", LOG="out-2.txt", SLURM_TASK_PID="77")
    assert launch.environment_differs(theirs) is None


def test_environments_that_differ_are_named(monkeypatch):
    monkeypatch.setenv("JOB", "A")
    monkeypatch.setenv("SEED", "1000")
    theirs = _joiner_digests(monkeypatch, 1, JOB="B", SEED="1001")
    assert launch.environment_differs(theirs) == (
        "its environment differs from node 0's in JOB, SEED"
    )
    theirs = _joiner_digests(monkeypatch, 1, EXTRA_FLAG="1")
    assert "1 variable(s) node 0 has not" in launch.environment_differs(theirs)
    theirs = _joiner_digests(monkeypatch, 1, JOB=None)
    assert launch.environment_differs(theirs).endswith("in JOB")


def test_a_joiner_in_another_directory_differs(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other").mkdir()
    with monkeypatch.context() as m:
        m.chdir(tmp_path / "other")
        theirs = launch.environment_digests(1)
    assert launch.environment_differs(theirs).endswith("in (cwd)")


@pytest.mark.parametrize(
    "junk",
    [None, "x", {}, {"raw": "abc", "blanked": ""}, {"raw": "zzzzzzzz", "blanked": ""},
     {"raw": ["0" * 8], "blanked": ""}, {"raw": "0" * 8}],
)  # fmt: skip
def test_a_malformed_environment_is_refused(junk):
    assert launch.environment_differs(junk) == "it sent no environment"


def test_running_tells_a_stopped_or_dead_process_from_a_live_one():
    me = launch.start_ticks()
    assert launch.running(os.getpid(), me)
    assert not launch.running(os.getpid(), me + 1)  # another process under a reused pid
    assert not launch.running(True, me) and not launch.running(-1, me)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = launch.start_ticks(child.pid)
        assert launch.running(child.pid, start)
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while launch.running(child.pid, start) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not launch.running(child.pid, start)
        child.kill()
        time.sleep(0.5)  # a zombie until we reap it
        assert launch.pid_alive(child.pid) and not launch.running(child.pid, start)
    finally:
        child.kill()
        child.wait()
    assert not launch.pid_alive(child.pid)


def test_a_twin_launch_is_counted_among_the_parents_processes():
    """Processes with one command line (numbers aside) under one parent, a shell as in a
    launch script: three are more than a launch of 2 has, not more than one of 3; other
    command lines do not count."""
    probe = (
        "import sys, time; from distlearn.ipc import launch; s = launch.start_ticks(); "
        "print(launch.twin_launch(s, 100, 2), launch.twin_launch(s, 100, 3), flush=True); "
        "time.sleep(float(sys.argv[1]))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

    def run(script: str) -> list[str]:
        out = subprocess.run(
            ["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env
        )
        return out.stdout.split()

    def after(background: str) -> list[str]:
        me = f"\"{sys.executable}\" -c '{probe}' 0"
        return run(f"{background} & {background} & sleep 1; {me}; kill $(jobs -p)")

    others = f'"{sys.executable}" -c "import time; time.sleep(4)" 1'
    assert after(others) == ["False", "False"]
    twins = f"\"{sys.executable}\" -c '{probe}' 4 > /dev/null"
    assert after(twins) == ["True", "False"]
