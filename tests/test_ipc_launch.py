"""ipc.rendezvous.launches and ipc.procs: how node 0 tells its launch's processes from
another launch's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from distlearn.ipc import procs
from distlearn.ipc.rendezvous import launches


def _joiner_digests(monkeypatch, index: int, **changes: str | None) -> dict:
    """The digests a joiner with node index `index` would send, its environment being
    this process's with `changes` (None removes a variable)."""
    with monkeypatch.context() as m:
        for name, value in changes.items():
            if value is None:
                m.delenv(name, raising=False)
            else:
                m.setenv(name, value)
        return launches.environment_digests(index)


def test_environments_equal_up_to_the_node_index(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the devices: left out
    monkeypatch.setenv("SLURM_TASK_PID", "4242")  # a launcher's per-process value
    theirs = _joiner_digests(
        monkeypatch, 2, RANK="2", LOCAL_RANK="2", CUDA_VISIBLE_DEVICES="4,5", SLURM_TASK_PID="7"
    )
    assert launches.environment_differs(theirs) is None


def test_environments_that_differ_are_named(monkeypatch):
    monkeypatch.setenv("JOB", "A")
    monkeypatch.setenv("SEED", "1000")
    theirs = _joiner_digests(monkeypatch, 1, JOB="B", SEED="1001")
    assert launches.environment_differs(theirs) == (
        "its environment differs from node 0's in JOB, SEED"
    )
    theirs = _joiner_digests(monkeypatch, 1, EXTRA_FLAG="1")
    assert launches.environment_differs(theirs).endswith("in 1 variable(s) node 0 has not")
    theirs = _joiner_digests(monkeypatch, 1, JOB=None)
    assert launches.environment_differs(theirs).endswith("in JOB")
    monkeypatch.setenv("RANK", "0")
    theirs = _joiner_digests(monkeypatch, 1, RANK="3")
    assert "in RANK (beyond the node index)" in launches.environment_differs(theirs)


def test_a_number_that_tells_launches_apart_is_not_taken_for_the_node_index(monkeypatch):
    """Node 1 of the launch with JOB=1 beside node 0 of the one with JOB=0: blanking the
    node index everywhere made both JOB=#, and the launches crossed. Only the variables
    that name the node are compared so; a per-node log file therefore needs a key."""
    monkeypatch.setenv("JOB", "0")
    monkeypatch.setenv("OUT", "/runs/0/log")
    theirs = _joiner_digests(monkeypatch, 1, JOB="1", OUT="/runs/1/log")
    assert launches.environment_differs(theirs).endswith("in JOB, OUT")


def test_a_large_environment_fits_a_join(monkeypatch):
    """8 hex a variable made a JOIN of 2,100 variables pass the 16 KiB control frame, and
    the rendezvous failed even without a twin launch."""
    for i in range(3000):
        monkeypatch.setenv(f"MODULE_VAR_{i}", f"/opt/v1/lib/{i}" * 5)
    digests = launches.environment_digests(1)
    assert len(json.dumps(digests)) < 200 and launches.environment_differs(digests) is None
    theirs = _joiner_digests(monkeypatch, 1, MODULE_VAR_7="other")
    assert launches.environment_differs(theirs).endswith("variables) differs from node 0's")
    for i in range(2500):
        monkeypatch.delenv(f"MODULE_VAR_{i}")
    digests = launches.environment_digests(1)
    assert len(json.dumps(digests)) < 6 * 600 and launches.environment_differs(digests) is None


def test_a_joiner_in_another_directory_differs(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other").mkdir()
    with monkeypatch.context() as m:
        m.chdir(tmp_path / "other")
        theirs = launches.environment_digests(1)
    assert launches.environment_differs(theirs).endswith("in (cwd)")


@pytest.mark.parametrize(
    "junk",
    [None, "x", {}, {"same": "a", "node": "b", "named": "abc", "count": 1},
     {"same": "a", "node": "b", "named": "zzzzzz", "count": 1},
     {"same": "a", "node": "b", "named": ["abcdef"], "count": 1},
     {"same": "a", "node": "b", "named": "", "count": "1"}, {"same": "a", "node": "b"}],
)  # fmt: skip
def test_a_malformed_environment_is_refused(junk):
    assert launches.environment_differs(junk) == "it sent no environment"


def test_running_tells_a_stopped_or_dead_process_from_a_live_one():
    me = procs.start_ticks()
    assert procs.running(os.getpid(), me)
    assert not procs.running(os.getpid(), me + 1)  # another process under a reused pid
    assert not procs.running(True, me) and not procs.running(-1, me)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = procs.start_ticks(child.pid)
        assert procs.running(child.pid, start)
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while procs.running(child.pid, start) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not procs.running(child.pid, start)
        child.kill()
        time.sleep(0.5)  # a zombie until we reap it
        assert procs.pid_alive(child.pid) and not procs.running(child.pid, start)
    finally:
        child.kill()
        child.wait()
    assert not procs.pid_alive(child.pid)


def test_a_twin_launch_is_counted_among_the_parents_processes():
    """Processes with one command line (numbers aside) under one parent, a shell as in a
    launch script: three are more than a launch of 2 has, not more than one of 3; other
    command lines do not count. (The probes load ipc/rendezvous/launches.py and ipc/procs.py
    alone, as a package of their own: no torch to import.)"""
    probe = (
        "import importlib, sys, time, types; "
        'ipc = types.ModuleType("_ipc"); ipc.__path__ = [sys.argv[2]]; '
        'rv = types.ModuleType("_ipc.rendezvous"); rv.__path__ = [sys.argv[2] + "/rendezvous"]; '
        'sys.modules.update({"_ipc": ipc, "_ipc.rendezvous": rv}); '
        'launches = importlib.import_module("_ipc.rendezvous.launches"); '
        's = sys.modules["_ipc.procs"].start_ticks(); '
        "print(launches.twin_launch(s, 100, 2), launches.twin_launch(s, 100, 3), flush=True); "
        "time.sleep(float(sys.argv[1]))"
    )
    ipc_dir = os.path.dirname(procs.__file__)

    def run(script: str) -> list[str]:
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
        return out.stdout.split()

    def after(background: str) -> list[str]:
        me = f"\"{sys.executable}\" -c '{probe}' 0 {ipc_dir}"
        return run(f"{background} & {background} & sleep 1; {me}; kill $(jobs -p)")

    others = f'"{sys.executable}" -c "import time; time.sleep(4)" 1'
    assert after(others) == ["False", "False"]
    twins = f"\"{sys.executable}\" -c '{probe}' 4 {ipc_dir} > /dev/null"
    assert after(twins) == ["True", "False"]


# ---- the joiner's policy after a failed join -----------------------------------------


def test_the_joiner_s_policy_reads_types_and_fields_not_words():
    """The joiner decided whether to give up by matching "refused by the endpoint" in
    str(err), and read attributes set on exceptions after they were made: a reworded
    message changed the policy. Each case here, under three wordings, decides alike;
    the old words on a plain error decide nothing."""
    from distlearn.ipc.errors import AuthError, EndpointRefused, IPCError, IPCTimeoutError
    from distlearn.ipc.rendezvous.exchange import JoinRefused, RootLeft
    from distlearn.ipc.rendezvous.localhost_joiner import Next, after_failed_join

    cases = [  # (make(message), we hold a token, node 0 runs, what the joiner does)
        (lambda m: EndpointRefused(m, "out of files"), False, True, Next.RAISE),
        (lambda m: EndpointRefused(m, "x", closing=True), False, True, Next.PASS_OVER),
        (lambda m: EndpointRefused(m, "x", closing=True), True, True, Next.PASS_OVER),
        (lambda m: RootLeft(m, had_its_nodes=True), False, False, Next.PASS_OVER),
        (lambda m: RootLeft(m), False, True, Next.PASS_OVER),
        (lambda m: RootLeft(m), False, False, Next.RAISE),
        (lambda m: RootLeft(m, gave_up=True), False, True, Next.RAISE),
        (lambda m: JoinRefused(m, "another launch"), False, True, Next.PASS_OVER),
        (lambda m: AuthError(m), True, True, Next.RAISE),
        (lambda m: AuthError(m), False, True, Next.AGAIN),
        (lambda m: IPCTimeoutError(m), False, True, Next.LATER),
        (lambda m: OSError(m), False, True, Next.AGAIN),
    ]
    wordings = ["refused by the endpoint at tcp://x: y", "refused by node 0: z", "reworded"]
    for make, given, runs, want in cases:
        for words in wordings:
            got = after_failed_join(make(words), given, lambda runs=runs: runs)
            assert got is want, (make(words), given, runs)
    for words in wordings:
        assert after_failed_join(IPCError(words), False, lambda: True) is Next.AGAIN


def test_a_closing_endpoint_says_so_in_a_field_of_its_refusal():
    """The refusal of a closing endpoint carries `closing` on the wire: the dialer's
    EndpointRefused says so whatever its reason's words."""
    from distlearn.ipc.errors import EndpointRefused
    from distlearn.ipc.transport import Endpoint, random_secret

    secret = random_secret()
    server = Endpoint(secret, "server", bind=["tcp://127.0.0.1:*"])
    address = server.addresses[0]
    server._closed = True  # (as close() marks it, before its sockets go)
    client = Endpoint(secret, "client")
    try:
        link = client.dial(address, reconnect=False)
        deadline = time.monotonic() + 20
        while link.failure is None and time.monotonic() < deadline:
            server.recv(time.monotonic() + 0.05)
            client.recv(time.monotonic() + 0.05)
        assert isinstance(link.failure, EndpointRefused), link.failure
        assert link.failure.closing and "closing" in link.failure.reason
    finally:
        client.close(linger=0)
        server._closed = False
        server.close(linger=0)
