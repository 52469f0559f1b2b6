"""The lobby (ipc.rendezvous.lobby): how a process started again finds its launch's running
tree, and what it refuses: files that are not our private ones, knocks of dead processes,
a lobby whose node 0 is gone, a malformed admission."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from distlearn.ipc.errors import IPCError
from distlearn.ipc.rendezvous import lobby as lobby_mod
from distlearn.ipc.rendezvous.lobby import Admission, Lobby
from distlearn.ipc.transport import runtime


@pytest.fixture
def rundir(short_tmp, monkeypatch):
    """A private runtime directory of this test's own (TMPDIR)."""
    monkeypatch.setenv("TMPDIR", str(short_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    yield runtime.runtime_dir()
    tempfile.tempdir = None


def test_no_lobby_is_a_launch_of_its_own(rundir):
    assert not Lobby("k").running()


def test_a_knock_is_answered_with_where_to_join(rundir):
    root, newcomer = Lobby("k"), Lobby("k")
    root.publish(generation=1, nodes=3)
    assert newcomer.running() and root.knocks(fresh=True) == []
    got: list = []
    t = threading.Thread(target=lambda: got.append(newcomer.knock(rank=2)))
    t.start()
    deadline = time.monotonic() + 10
    while not (knocks := root.knocks(fresh=True)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [(k.pid, k.rank) for k in knocks] == [(os.getpid(), 2)]
    root.admit(knocks[0], Admission("k/gen1/gen2", 3, 4, 2))
    t.join(10)
    assert got == [Admission("k/gen1/gen2", 3, 4, 2)]
    assert root.knocks(fresh=True) == []  # answered: no knock left, nor the answer
    assert not [p for p in rundir.iterdir() if "knock" in p.name or "admit" in p.name]
    root.close()
    assert not Lobby("k").running()


def test_another_launchs_lobby_is_not_ours(rundir):
    Lobby("k").publish(generation=0, nodes=2)
    assert not Lobby("another key").running()


def test_a_lobby_whose_node_0_died_is_waited_on_then_dropped(rundir, monkeypatch):
    monkeypatch.setattr(lobby_mod, "REPLACED_S", 0.3)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"{Lobby('k').prefix}.json"
    record = {"v": 1, "pid": dead.pid, "start": 1, "generation": 1, "nodes": 2}
    runtime.create_private(rundir, name, json.dumps(record).encode())
    t0 = time.monotonic()
    assert not Lobby("k").running()
    assert 0.3 <= time.monotonic() - t0 < 5
    assert not (rundir / name).exists()


def test_knocks_of_dead_processes_are_removed_not_admitted(rundir):
    root = Lobby("k")
    root.publish(generation=0, nodes=2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    knock = f"{root.prefix}-knock-{dead.pid}.json"
    runtime.create_private(rundir, knock, json.dumps({"pid": dead.pid, "start": 1}).encode())
    assert root.knocks(fresh=True) == []
    assert not (rundir / knock).exists()


def test_a_knock_that_is_not_our_private_file_is_ignored(rundir):
    root = Lobby("k")
    root.publish(generation=0, nodes=2)
    from distlearn.ipc.procs import start_ticks

    body = json.dumps({"pid": os.getpid(), "start": start_ticks(), "rank": 1}).encode()
    path = rundir / f"{root.prefix}-knock-{os.getpid()}.json"
    path.write_bytes(body)
    os.chmod(path, 0o644)  # readable by others: not one we wrote
    assert root.knocks(fresh=True) == []
    target = rundir / "elsewhere.json"
    target.write_bytes(body)
    os.chmod(target, 0o600)
    path.unlink(missing_ok=True)
    path.symlink_to(target)  # a link to a private file: not followed
    assert root.knocks(fresh=True) == []


def test_a_malformed_admission_is_refused(rundir):
    root, newcomer = Lobby("k"), Lobby("k")
    root.publish(generation=1, nodes=2)
    answer = f"{root.prefix}-admit-{os.getpid()}.json"

    def answer_badly():
        time.sleep(0.2)
        bad = {"key": "k/gen2", "index": 0, "nodes": 3, "generation": 2, "pid": os.getpid()}
        runtime.create_private(rundir, answer, json.dumps(bad).encode())  # index 0: node 0's

    threading.Thread(target=answer_badly).start()
    with pytest.raises(IPCError, match="malformed admission"):
        newcomer.knock(rank=1)


def test_a_knock_ends_when_the_tree_ends(rundir):
    root, newcomer = Lobby("k"), Lobby("k")
    root.publish(generation=1, nodes=2)
    threading.Timer(0.3, root.close).start()
    t0 = time.monotonic()
    with pytest.raises(IPCError, match="ended before taking it in"):
        newcomer.knock(rank=1)
    assert time.monotonic() - t0 < 5
