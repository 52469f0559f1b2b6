"""ipc attacked from the network and from the host, each test against the real thing.

Every test here plays an attacker with real processes and sockets (the attacks are in
tests/ipc_attacker.py) and checks the job's side: memory, admissions, values. Each
one failed on the link layer before CURVE became the default across hosts (PLAIN's
password crossed the wire in the clear, and with it a stranger reached queues that
ZeroMQ does not bound).
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from conftest import repo_env
from ipc_harness import (
    collect,
    netns_line,  # noqa: F401 (a fixture)
    read_server_until,
    start_worker,
    wait_all,
)
from ipc_workers import TEST_TOKEN, node_tensor

from distlearn import ipc
from distlearn.ipc.transport import Endpoint, Kind, Secret, wire

HERE = Path(__file__).resolve().parent
ATTACKER = HERE / "ipc_attacker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (in its own network namespace)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # LISTEN, one of its sockets
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def _wait_listening(pid: int, port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while port not in _listening(pid):
        assert time.monotonic() < deadline, f"process {pid} does not listen on {port}"
        time.sleep(0.05)


def _peak_mib(pid: int) -> float:
    """The peak resident memory of `pid` (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def _attacker(*args: str, netns: str | None = None, **env: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ATTACKER), *args]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.Popen(
        cmd, env=repo_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _static_env(port: int, **extra: str) -> dict[str, str]:
    return {"TEST_ROOT_HOST": "127.0.0.1", "TEST_ROOT_PORT": str(port),
            "IPC_TOKEN": TEST_TOKEN, "TEST_IPC_TIMEOUT": "120", **extra}  # fmt: skip


def _check_tree(results: list, n: int) -> None:
    for r in results:
        assert r["count"] == n and r["sum"] == n * (n + 1) / 2, r
        assert torch.equal(r["scattered"], torch.zeros(10))


# ---- node 0's port, taken first ---------------------------------------------------


def test_a_squatter_on_node_0s_port_learns_nothing_that_lets_it_queue(tmp_path):
    """A squatter takes node 0's predictable port before the job, answers node 1's
    ZeroMQ greeting in whatever mechanism node 1 asks for, records node 1's first
    handshake command and hangs up. With what it recorded it then sends node 0, once up,
    an unfinished message of 20,000 frames of 16,000 bytes (ZeroMQ bounds neither the
    frames of a message nor, counting whole messages, the memory they take). Node 0's
    peak memory is watched: it must not grow by the 305 MiB sent. Node 1 goes on dialing
    (a listener that hangs up mid-handshake is not the end), and the tree completes.

    Before: node 1 sent PLAIN credentials in the clear, the squatter replayed them, and
    node 0 held every frame (its peak grew by the whole message)."""
    n, port = 3, _free_port()
    recorded = tmp_path / "recorded.json"
    squatter = _attacker("squat", str(port), str(recorded))
    procs: list[subprocess.Popen] = []
    try:
        _wait_file(Path(str(recorded) + ".ready"), squatter)
        procs.append(start_worker("static_token", 1, n, tmp_path, env=_static_env(port)))
        squatter.wait(timeout=60)
        record = json.loads(recorded.read_text())
        procs.insert(0, start_worker("static_token", 0, n, tmp_path, env=_static_env(port)))
        _wait_listening(procs[0].pid, port)
        time.sleep(1.0)  # node 0 settles in its rendezvous
        before = _peak_mib(procs[0].pid)
        attack = _attacker("frames", "127.0.0.1", str(port), str(recorded), "20000", "16000")
        attack.wait(timeout=120)
        grew = _peak_mib(procs[0].pid) - before
        assert grew < 64, f"node 0's peak memory grew by {grew:.0f} MiB under the attack"
        assert record["mechanism"] == "CURVE" and "plain" not in record, record
        assert procs[1].poll() is None, "node 1 gave up when the squatter hung up"
        procs.append(start_worker("static_token", 2, n, tmp_path, env=_static_env(port)))
    except BaseException:
        wait_all(procs, timeout=0)
        raise
    finally:
        if squatter.poll() is None:
            squatter.kill()
        squatter.communicate()
    results, _ = collect(tmp_path, wait_all(procs, timeout=180))
    _check_tree(results, n)


def test_a_flood_of_hellos_does_not_keep_real_nodes_out(tmp_path):
    """300 connections flood node 0's rendezvous with HELLOs of our handshake (a few
    queued on each, so every round of node 0's fair queue reads one from each) while the
    real nodes join. The attacker logs in with what crossed the wire in the clear before:
    PLAIN's password, derived from the token. The real nodes must get in.

    Before: each real joiner's place in the table of 256 handshakes went to the newest
    stranger before its AUTH came, 100 times, and it gave up."""
    n, port = 3, _free_port()
    creds = tmp_path / "creds.json"
    sniffed = Secret(TEST_TOKEN, "sniffed").mac(b"plain").hex()  # PLAIN's password before
    creds.write_text(json.dumps({"plain": ["distlearn", sniffed]}))
    procs = [start_worker("static_token", 0, n, tmp_path, env=_static_env(port))]
    flood = None
    try:
        _wait_listening(procs[0].pid, port)
        flood = _attacker("hellos", "127.0.0.1", str(port), str(creds), "300", "45")
        time.sleep(5)  # the flood is on
        assert flood.poll() is None, flood.communicate()[1][-2000:]
        procs += [start_worker("static_token", i, n, tmp_path, env=_static_env(port))
                  for i in (1, 2)]  # fmt: skip
        results, _ = collect(tmp_path, wait_all(procs, timeout=180))
    finally:
        wait_all(procs, timeout=0)
        if flood is not None:
            flood.kill()
            flood.communicate()
    _check_tree(results, n)


def _limit_files(n: int):
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return limit


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_connections_do_not_make_the_rendezvous_refuse_real_nodes(tmp_path):
    """Node 0 of a StaticTree may hold 400 files; before the real nodes come, a stranger
    opens connections that never say a word, until node 0 holds all but a few of its
    files (some 350). Node 0 must admit the real nodes: a connection that has not
    finished ZeroMQ's handshake is no reason to refuse one that has, and idle ones are
    closed once the handshake timeout passes.

    Before: node 0 counted the strangers' connections against the files it keeps for the
    joins and refused every real node, saying it was out of files."""
    n, port, limit = 3, _free_port(), 400
    ready = tmp_path / "idle.ready"
    procs = [start_worker("static_token", 0, n, tmp_path, env=_static_env(port),
                          preexec_fn=_limit_files(limit))]  # fmt: skip
    idle = None
    try:
        _wait_listening(procs[0].pid, port)
        time.sleep(1.0)  # node 0 settles in its rendezvous
        count = limit - _open_files(procs[0].pid) - 6
        assert count > 300, count
        idle = _attacker("idle", "127.0.0.1", str(port), str(count), "90",
                         ATTACKER_READY=str(ready))  # fmt: skip
        _wait_file(ready, idle)
        deadline = time.monotonic() + 30
        while _open_files(procs[0].pid) < limit - 8:  # node 0 took them in
            assert time.monotonic() < deadline, _open_files(procs[0].pid)
            time.sleep(0.1)
        procs += [start_worker("static_token", i, n, tmp_path, env=_static_env(port))
                  for i in (1, 2)]  # fmt: skip
        results, texts = collect(tmp_path, wait_all(procs, timeout=180))
    finally:
        wait_all(procs, timeout=0)
        if idle is not None:
            idle.kill()
            idle.communicate()
    _check_tree(results, n)
    assert "limit of open files" not in texts[0], texts[0][-2000:]


_IDLE_SERVER = """
import sys, time
from distlearn import ipc
server = ipc.Server("127.0.0.1", 0, token=sys.argv[1])
print(server.port, flush=True)
time.sleep(120)  # ZeroMQ's I/O thread accepts and times out handshakes on its own
"""


def test_connections_that_never_finish_the_handshake_are_closed_within_its_timeout(tmp_path):
    """A stranger opens 60 TCP connections to a Server and never sends a byte, holding its
    ends open. Each costs the server a file until ZeroMQ's handshake times out: within
    `Limits.handshake_timeout` (10 s) of the last connection, the server holds the files
    it held before (a few hundred of them would otherwise keep a listener at its file
    limit for as long as the stranger keeps coming back).

    Before: no ZMQ_HANDSHAKE_IVL was set and libzmq's default of 30 s applied: the
    server still held every one of them 20 s after."""
    server = subprocess.Popen([sys.executable, "-c", _IDLE_SERVER, TEST_TOKEN], env=repo_env(),
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    idle = None
    try:
        port = int(server.stdout.readline())
        time.sleep(0.5)
        before = _open_files(server.pid)
        ready = tmp_path / "idle.ready"
        idle = _attacker("idle", "127.0.0.1", str(port), "60", "60", ATTACKER_READY=str(ready))
        _wait_file(ready, idle)
        start = time.monotonic()
        # the stranger's connect() calls have returned; the server's I/O thread accepts
        # them a moment later (46 of 60 were in at once in a full suite's run)
        while _open_files(server.pid) < before + 50:
            assert time.monotonic() - start < 5, "the server did not take them in"
            time.sleep(0.05)
        while (held := _open_files(server.pid) - before) > 2:
            waited = time.monotonic() - start
            assert waited < 20, f"{held} idle connections still held after {waited:.0f} s"
            time.sleep(0.2)
        assert idle.poll() is None  # (the stranger still holds its ends: the server let go)
    finally:
        for proc in (server, idle):
            if proc is not None:
                proc.kill()
                proc.communicate()


# ---- a relay between two hosts ---------------------------------------------------------


def test_a_relay_between_hosts_cannot_change_what_a_node_sums(netns_line, tmp_path):  # noqa: F811
    """Node 0 on host A, node 1 on host B, and between them only a relay on host R that
    forwards node 0's ports and rewrites node 1's bytes on their way: a run of float
    1.0s becomes 2.0s where the bytes are in the clear, else one byte is flipped. No node
    may end with a wrong sum: each sums right or names the link that broke.

    Before: the links were in the clear, and both nodes summed 3.0 where 2.0 was due,
    without a word."""
    ns = netns_line
    port = 29871
    ports_file, counts = tmp_path / "ports.json", tmp_path / "relay.json"
    ports_file.write_text(json.dumps([port]))
    relay = _attacker("relay", "10.77.2.254", "10.77.1.1", str(ports_file), str(counts),
                      netns=ns["r"])  # fmt: skip
    env = {"TEST_ROOT_HOST": "10.77.2.254", "TEST_ROOT_PORT": str(port),
           "IPC_TOKEN": TEST_TOKEN, "TEST_IPC_TIMEOUT": "60"}  # fmt: skip
    procs = []
    try:
        procs.append(start_worker("relayed", 0, 2, tmp_path, env={**env, "TEST_NETNS": ns["a"]}))
        _wait_listening(procs[0].pid, port)
        # The relay forwards node 0's other port too (its tree endpoint, advertised at the
        # relay's address: node 0 binds every interface of a host whose name is not its own).
        ports_file.write_text(json.dumps(sorted(_listening(procs[0].pid))))
        served = Path(str(ports_file) + ".served")
        deadline = time.monotonic() + 30
        while not (served.exists() and len(json.loads(served.read_text())) >= 2):
            assert time.monotonic() < deadline and relay.poll() is None, "the relay is not up"
            time.sleep(0.05)
        procs.append(start_worker("relayed", 1, 2, tmp_path, env={**env, "TEST_NETNS": ns["b"]}))
        results, _ = collect(tmp_path, wait_all(procs, timeout=120))
    finally:
        wait_all(procs, timeout=0)
        relay.kill()
        relay.communicate()
    did = json.loads(counts.read_text())
    assert did["rewrote_plain"] + did["flipped"] > 0, f"the relay changed nothing: {did}"
    for i, r in enumerate(results):
        if r["error"] is None:
            assert r["wrong"] == 0, f"node {i} summed wrong without a word: {r}, {did}"
        else:
            assert r["error"] == "PeerError" and "lost the link" in r["message"], r
    assert any(r["error"] is not None for r in results) or did["rewrote_plain"] == 0


# ---- routing ids -----------------------------------------------------------------------


def _impostor(listener: Endpoint, rid: bytes) -> tuple[zmq.Context, zmq.Socket]:
    """A process of this user that dials the listener's Unix socket with the routing id of
    a link that was (it can pass ZeroMQ's handshake: the password is the job's)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, rid)
    sock.setsockopt(zmq.PLAIN_USERNAME, b"distlearn")
    sock.setsockopt(zmq.PLAIN_PASSWORD, listener._password)
    sock.connect(listener.addresses[0])
    return ctx, sock


@pytest.mark.parametrize("ended", ["goodbye", "death"])
def test_a_routing_id_is_never_trusted_again_after_its_link_ended(ended):
    """A peer's link ends (it said goodbye, or its process died: the socket closed
    without a word), and another connection comes with the same routing id and sends a
    message. Nothing it sends is taken for the old peer's.

    Before: after a goodbye, messages on the routing id went on being delivered as the
    peer's; after a death, the new connection took over the link before the listener
    noticed the old one had gone, and kept it."""
    secret = Secret(TEST_TOKEN, "test")
    listener = Endpoint(secret, "listener", bind=["ipc"], info={"name": "listener"})
    dialer = Endpoint(secret, "peer")
    ctx = None
    try:
        link = dialer.dial(listener.addresses[0], reconnect=False)
        deadline = time.monotonic() + 10
        while link.state != "up" or not listener.events:
            assert time.monotonic() < deadline, link
            dialer.poll(0.01)
            listener.poll(0.01)
        rid = link.rid
        if ended == "goodbye":
            closing = threading.Thread(target=dialer.close, kwargs={"linger": 10})
            closing.start()  # BYE, acknowledged
            while closing.is_alive():
                listener.poll(0.01)
            assert link.acked
            for _ in range(20):
                listener.poll(0.01)  # (the old connection is gone)
            ctx, sock = _impostor(listener, rid)
        else:
            # Connected first (ZeroMQ sets a second connection with a routing id in use
            # aside until the first has gone), then the peer's process dies: its socket
            # closes, no BYE.
            ctx, sock = _impostor(listener, rid)
            time.sleep(0.5)
            dialer._forget_dealer(link)
            dialer.links.clear()
        sock.send(wire.control(Kind.MESSAGE, {"from": "impostor"}))
        end = time.monotonic() + 3
        while time.monotonic() < end:
            listener.poll(0.05)
        taken = [frames[0].bytes for _, frames in listener.inbox]
        assert not taken, f"the impostor's message was taken for the old peer's: {taken}"
    finally:
        if ctx is not None:
            ctx.destroy(linger=0)
        dialer.close(linger=0)
        listener.close(linger=0)


# ---- tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    ["abc", "s3cret-t0ken", "0123456789abcdef0123456789abcde", "x" * 64, "ab" * 32, "9" * 38],
)
def test_tokens_of_fewer_than_128_bits_are_refused(token, tmp_path, monkeypatch):
    """A token too short to carry 128 bits (fewer hex digits than 32, fewer characters
    than its alphabet needs) or made of a few characters repeated is refused wherever
    it is given: token=, $IPC_TOKEN, a token file. A listener's keys derive from it, and a
    guessable token is found offline from one recorded connection attempt.

    Before: any non-empty token= or $IPC_TOKEN was taken (token files: 16 characters)."""
    monkeypatch.delenv("IPC_TOKEN_FILE", raising=False)
    monkeypatch.delenv("IPC_TOKEN", raising=False)
    with pytest.raises(ipc.IPCError, match="128"):
        ipc.Server("127.0.0.1", 0, token=token)
    monkeypatch.setenv("IPC_TOKEN", token)
    with pytest.raises(ipc.IPCError, match=r"\$IPC_TOKEN.*128"):
        ipc.StaticTree(1, 2, "127.0.0.1", _free_port(), timeout=5)
    monkeypatch.delenv("IPC_TOKEN")
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    with pytest.raises(ipc.IPCError, match="128"):
        ipc.Client("127.0.0.1", _free_port(), token_file=str(path), timeout=5)


@pytest.mark.parametrize(
    "make", [lambda: secrets.token_hex(16), lambda: secrets.token_hex(32),
             lambda: secrets.token_urlsafe(17), lambda: secrets.token_urlsafe(32)],
    ids=["hex16", "hex32", "urlsafe17", "urlsafe32"],
)  # fmt: skip
def test_random_tokens_of_128_bits_and_more_are_taken(make):
    token = make()
    sent = node_tensor(1, (4,), torch.float32)

    def client(port: int) -> None:
        with ipc.Client("127.0.0.1", port, token=token, timeout=30) as c:
            c.send(sent)

    with ipc.Server("127.0.0.1", 0, token=token) as server:
        t = threading.Thread(target=client, args=(server.port,))
        t.start()
        value, _ = server.recv_any(timeout=30)
        read_server_until(server, lambda: not t.is_alive(), 30)
        t.join(30)
    assert torch.equal(value, sent)


# ---- /dev/shm, shared with every user of the host ---------------------------------------

_SHM_NODE = """
import sys
import torch
from distlearn import ipc
i, key = int(sys.argv[1]), sys.argv[2]
tree = ipc.LocalhostTree(i, 2, key=key, timeout=60, shm=True)
x = torch.full((1000,), float(i + 1))
tree.all_reduce(x)
print("sum", float(x[0]), "shm", tree.net_stats()["shm"] is not None, flush=True)
tree.close()
"""


VICTIM, PLANTER = 65534, 65533  # two users of the host (uids: no account is needed)


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the nodes as another user (needs root)")
def test_a_link_another_user_planted_in_dev_shm_does_not_stop_shared_memory_trees(tmp_path):
    """User A plants a symbolic link in /dev/shm named like a segment that a dead node 0
    of user B left, pointing at an old file of B's. B's node 0 sweeps stale segments as
    its tree starts: it must neither follow the link nor fail on it. The tree starts,
    the link and the file stay. (On hosts with fs.protected_symlinks=0, as here.)

    Before: the sweep followed the link, judged B's file stale, and the PermissionError
    of removing A's link from the sticky /dev/shm escaped the setup of every
    shared-memory tree of B on the host."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs setpriv (util-linux) to run the nodes as another user")
    as_victim = [setpriv, f"--reuid={VICTIM}", f"--regid={VICTIM}", "--clear-groups", "--"]
    probe = subprocess.run([*as_victim, sys.executable, "-c", "import distlearn.ipc"],
                           env=repo_env(), capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"uid {VICTIM} cannot import this checkout: {probe.stderr[-300:]}")
    dead = subprocess.Popen(["true"])
    dead.wait()
    where = Path(tempfile.mkdtemp(prefix="dlt-shm-"))  # (tmp_path: closed to other users)
    where.chmod(0o755)
    ours = where / "ours"
    ours.write_bytes(b"keep me")
    os.chown(ours, VICTIM, VICTIM)
    old = time.time() - 7200
    os.utime(ours, (old, old))
    link = Path(f"/dev/shm/distlearn-ipc-planted{secrets.token_hex(4)}-ctl.{dead.pid}")
    link.symlink_to(ours)
    os.lchown(link, PLANTER, PLANTER)
    os.utime(link, (old, old), follow_symlinks=False)
    key = f"planted-{secrets.token_hex(4)}"
    cmd = [*as_victim, sys.executable, "-c", _SHM_NODE]
    procs = [
        subprocess.Popen([*cmd, str(i), key], env=repo_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd="/")
        for i in range(2)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=120) for p in procs]
        kept = ours.read_bytes()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        planted_still = link.is_symlink()
        link.unlink(missing_ok=True)
        shutil.rmtree(where, ignore_errors=True)
    for out, err in outs:
        assert out.startswith("sum 3.0 shm True"), err[-2000:]
    assert planted_still and kept == b"keep me"
