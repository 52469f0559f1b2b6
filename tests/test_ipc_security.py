"""ipc's trust boundary, attacked: strangers, junk, replays, planted directories, sniffers.

Each test plays the attacker with real processes and sockets against a real
tree, then checks that the job completed with the right values and that the
attacker got nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
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
    WORKER,
    collect,
    netns_pair,  # noqa: F401 (a fixture)
    start_worker,
    wait_all,
)
from ipc_workers import TEST_TOKEN, WRONG_TOKEN, node_tensor

from distlearn import ipc
from distlearn.ipc.transport import Secret

HERE = Path(__file__).resolve().parent
NOBODY = 65534


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "node 0 exited before listening"
        with socket.socket() as s:
            # A port from _free_port is in the ephemeral range: a probe whose source port the
            # kernel picks equal to it connects to itself (TCP simultaneous open) while nothing
            # listens. Only a connection to another socket counts.
            if s.connect_ex(("127.0.0.1", port)) == 0 and s.getsockname() != s.getpeername():
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


# ---- who may join ----------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the stranger as another user (needs root)")
def test_stranger_knowing_public_values_cannot_join(netns_pair, tmp_path):  # noqa: F811
    """A torchrun job on one host (no IPC_TOKEN): another user who knows MASTER_ADDR,
    MASTER_PORT and the run id, and sees every listening port, cannot join it.

    The job and the stranger share a network namespace of their own: the stranger
    knocks on every port listening there, which are the job's alone (not those of
    tests running beside this one)."""
    host = netns_pair[0]
    port = _free_port()
    env = {
        "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "none", "TEST_IPC_TIMEOUT": "40",
        "TEST_NETNS": host,
    }  # fmt: skip
    drop = Path(tempfile.mkdtemp(prefix="dlt-stranger-"))
    drop.chmod(0o777)  # the stranger writes its verdict here
    verdict = drop / "stranger.json"
    node0 = start_worker("env", 0, 2, tmp_path, env={**env, "RANK": "0"})
    stranger = subprocess.Popen(
        ["ip", "netns", "exec", host,
         sys.executable, str(HERE / "ipc_stranger.py"), "8", str(verdict), str(NOBODY)],
        env=repo_env(**env), cwd="/",
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(4)  # the stranger tries while node 0 waits for node 1
    node1 = start_worker("env", 1, 2, tmp_path, env={**env, "RANK": "1"})
    codes = wait_all([node0, node1, stranger], timeout=120)
    result = json.loads(verdict.read_text())
    shutil.rmtree(drop, ignore_errors=True)
    assert not result["joined"], result["attempts"]
    results, _ = collect(tmp_path, codes[:2])
    for r in results:
        assert r["count"] == 2 and r["sum"] == 3.0
        assert torch.equal(r["scattered"], node_tensor(0, (10,), torch.float32))


def test_multi_host_tree_needs_a_secret(monkeypatch, caplog):
    """Across hosts there is no safe default: a clear error that says how to set one."""
    for var in ["IPC_TOKEN", "IPC_TOKEN_FILE", "SLURM_PROCID", "SLURM_NTASKS"]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ipc.IPCError, match="IPC_TOKEN") as err:
        ipc.Tree.from_env()
    assert "more than one host" in str(err.value) and "IPC_TOKEN_FILE" in str(err.value)
    with pytest.raises(ipc.IPCError, match="IPC_TOKEN"):
        ipc.StaticTree(1, 2, "10.1.2.3", 29600)
    # insecure=True is for trusted clusters, and says so loudly
    with caplog.at_level("WARNING"):
        tree = ipc.StaticTree(0, 1, "127.0.0.1", _free_port(), insecure=True)
    tree.close()
    assert "insecure=True" in caplog.text and "any process" in caplog.text


def test_launchers_map_to_handlers(monkeypatch):
    """torchrun and Slurm variables: one host -> Localhost keyed by the launch (no TCP, no
    token needed); several -> Static at MASTER_ADDR with the token."""
    from distlearn.ipc import rendezvous

    names = (
        "RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT IPC_PORT IPC_TOKEN "
        "IPC_TOKEN_FILE IPC_KEY TORCHELASTIC_RUN_ID SLURM_PROCID SLURM_NTASKS SLURM_NNODES "
        "SLURM_JOB_NUM_NODES SLURM_STEP_NUM_NODES SLURM_JOB_ID SLURM_STEP_ID SLURM_NODELIST"
    )
    for var in names.split():
        monkeypatch.delenv(var, raising=False)
    env = {
        "RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc",
    }  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    h = rendezvous.from_env()
    assert isinstance(h, rendezvous.Localhost) and (h.node_index, h.num_nodes) == (2, 4)
    assert h.key == "torchrun:10.0.0.1:29500:abc:" and h.explicit and h.given is None
    monkeypatch.setenv("MASTER_PORT", "29600")  # another launch, another key
    assert rendezvous.from_env().key != h.key
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("IPC_TOKEN", TEST_TOKEN)
    h = rendezvous.from_env()
    assert isinstance(h, rendezvous.Static)
    assert (h.root_host, h.root_port, h.secret.text) == ("10.0.0.1", 29601, TEST_TOKEN)
    for k in env:
        monkeypatch.delenv(k)
    monkeypatch.delenv("IPC_TOKEN")
    slurm = {
        "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0", "SLURM_NODELIST": "gpu[03-05,07]",
    }  # fmt: skip
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    h = rendezvous.from_env()
    assert isinstance(h, rendezvous.Localhost) and h.key == "slurm:77:0"
    monkeypatch.setenv("SLURM_NNODES", "4")
    with pytest.raises(ipc.IPCError, match="IPC_TOKEN"):
        rendezvous.from_env()
    monkeypatch.setenv("IPC_TOKEN", WRONG_TOKEN)
    h = rendezvous.from_env()
    assert isinstance(h, rendezvous.Static) and h.root_host == "gpu03"
    assert h.root_port == 20000 + 77


def test_secret_file_must_be_private(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text("a-long-enough-secret-token\n")
    path.chmod(0o644)
    monkeypatch.setenv("IPC_TOKEN_FILE", str(path))
    monkeypatch.delenv("IPC_TOKEN", raising=False)
    with pytest.raises(ipc.IPCError, match="chmod 600"):
        ipc.StaticTree(0, 1, "10.1.2.3", 29600)
    path.chmod(0o600)
    from distlearn.ipc.transport import given_secret

    assert given_secret().text == "a-long-enough-secret-token"


# ---- junk and replays during the rendezvous -----------------------------------------


ZMTP_NULL_GREETING = (
    b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
)


def _attack_root(port: int, token: str) -> int:
    """Everything a stranger (and a peer past ZeroMQ's handshake but not ours) can throw
    at node 0's rendezvous port. Returns the bytes thrown."""
    thrown = 0
    # raw TCP: junk, and a ZMTP greeting followed by a frame announcing 2**62 bytes
    for payload in (os.urandom(65536), ZMTP_NULL_GREETING + b"\x02" + (1 << 62).to_bytes(8, "big")):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(payload)
            thrown += len(payload)
            time.sleep(0.1)
    ctx = zmq.Context()
    big = b"\x01" + b"x" * (256 << 20)
    nested = b"[" * 15000
    junk = [
        b"", b"\xff\xfe", nested, b"\x01" + nested, b"\x01not json{{", b"\x01[]",
        b"\x01" + json.dumps({"name": "x", "nonce": "\u00e9" * 32, "info": {}}).encode(),
        b"\x03" + json.dumps({"mac": "\u00e9" * 64}).encode(),  # a non-ASCII mac
        b"\x03" + json.dumps({"mac": 12}).encode(),
        b"\x03" + json.dumps({"mac": "00" * 32}).encode(),  # AUTH without HELLO
        b"\x10" + b"\0" * 20,  # a data header before any handshake
        json.dumps({"type": "join", "node": 1, "num_nodes": 3, "mac": "\u00e9"}).encode(),
    ]  # fmt: skip
    secret = Secret(token, "test")
    # Nothing; a wrong password; the password of the old PLAIN-over-TCP protocol (a sniffer
    # saw it); and the job's own CURVE keys: a member of the job, past ZeroMQ's handshake
    # but not ours.
    old_password = secret.mac(b"plain").hex().encode()
    for creds in (None, (b"distlearn", b"wrong"), (b"distlearn", old_password), "curve"):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        if creds == "curve":
            keys = secret.curve_keys()
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        elif creds is not None:
            sock.setsockopt(zmq.PLAIN_USERNAME, creds[0])
            sock.setsockopt(zmq.PLAIN_PASSWORD, creds[1])
        sock.connect(f"tcp://127.0.0.1:{port}")
        hello = b"\x01" + json.dumps({"name": "s", "nonce": "ab" * 16, "info": {}}).encode()
        # a flood of handshakes that never finish, then a frame above any MAXMSGSIZE
        messages = [*([m] for m in junk), [b"\x01{}", b"extra", b"frames"]]
        messages += [[hello]] * 2000 + [[big]]
        for msg in messages:
            try:  # a refused connection has no pipe left: sends would block
                sock.send_multipart(msg, zmq.NOBLOCK)
            except zmq.Again:
                break
            thrown += sum(len(m) for m in msg)
        time.sleep(1.0)
        sock.close(linger=0)
    ctx.destroy(linger=0)
    return thrown


def test_junk_and_oversized_messages_during_rendezvous(tmp_path):
    """Node 0 of a StaticTree takes junk, nested JSON, non-ASCII MACs, handshake floods and
    a 256 MiB frame on its port while it waits; it logs them, holds no more memory than
    it needs, and the real nodes still join and reduce."""
    n = 3
    port = _free_port()
    env = {"TEST_ROOT_HOST": "127.0.0.1", "TEST_ROOT_PORT": str(port), "IPC_TOKEN": TEST_TOKEN,
           "TEST_IPC_TIMEOUT": "60"}  # fmt: skip
    node0 = start_worker("static_token", 0, n, tmp_path, env=env)
    try:
        _wait_listening(port, node0)
        thrown = _attack_root(port, env["IPC_TOKEN"])
        assert thrown > 256 << 20  # the big frame went out at least once
    except BaseException:
        wait_all([node0], timeout=0)
        raise
    procs = [node0] + [start_worker("static_token", i, n, tmp_path, env=env) for i in (1, 2)]
    results, texts = collect(tmp_path, wait_all(procs, timeout=120))
    for r in results:
        assert r["count"] == n and r["sum"] == 6.0
        assert torch.equal(r["scattered"], torch.zeros(10))
    assert results[0]["rss_growth_mib"] < 100, results[0]
    assert "ipc node 0" in texts[0] and ("dropped" in texts[0] or "refused" in texts[0])


class _Relay:
    """A TCP relay to node 0 that records what the client sends (what a sniffer sees)."""

    def __init__(self, target: int):
        self.target = target
        self.recorded = bytearray()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _connect_upstream(self, timeout: float = 30) -> socket.socket:
        """Node 0's port, retried: a refusal here would leave the client hanging on a relay
        that never forwards, and the test failing with "nothing recorded"."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
                upstream.settimeout(None)  # the pumps block as long as the link lives
                return upstream
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _accept(self) -> None:
        with self.server:
            client, _ = self.server.accept()
        upstream = self._connect_upstream()

        def pump(src, dst, record):
            try:
                while data := src.recv(65536):
                    if record:
                        self.recorded += data
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

        for args in ((client, upstream, True), (upstream, client, False)):
            t = threading.Thread(target=pump, args=args, daemon=True)
            t.start()
            self.threads.append(t)


def _parse_zmtp(stream: bytes) -> tuple[tuple[bytes, bytes] | None, list[list[bytes]]]:
    """What a sniffer reads from a recorded ZMTP 3 client stream: the PLAIN credentials
    (sent in the clear) and the messages, as lists of frames."""
    pos, creds, messages, current = 64, None, [], []  # after the 64-byte greeting
    while pos < len(stream):
        flags = stream[pos]
        if flags & 0x02:
            size, pos = int.from_bytes(stream[pos + 1 : pos + 9], "big"), pos + 9
        else:
            size, pos = stream[pos + 1], pos + 2
        body, pos = stream[pos : pos + size], pos + size
        if flags & 0x04:  # a command
            name = body[1 : 1 + body[0]]
            if name == b"HELLO":
                data = body[1 + body[0] :]
                user = data[1 : 1 + data[0]]
                rest = data[1 + data[0] :]
                creds = (user, rest[1 : 1 + rest[0]])
            continue
        current.append(body)
        if not flags & 0x01:
            messages.append(current)
            current = []
    return creds, messages


def _replay(port: int, creds: tuple[bytes, bytes] | None, messages: list[list[bytes]]) -> None:
    """Send recorded messages on a new connection with the recorded credentials."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if creds is not None:
        sock.setsockopt(zmq.PLAIN_USERNAME, creds[0])
        sock.setsockopt(zmq.PLAIN_PASSWORD, creds[1])
    sock.connect(f"tcp://127.0.0.1:{port}")
    for msg in messages:
        sock.send_multipart(msg)
    time.sleep(2.0)  # long enough for node 0 to answer the replayed handshake
    ctx.destroy(linger=0)


def test_recorded_join_replayed_is_refused(tmp_path):
    """With encrypt=False (a network trusted not to be read), a sniffer records node 1's
    join to node 0 (the PLAIN password is in the clear, and so are our handshake's
    messages) and replays those messages on a new connection: past ZeroMQ's handshake,
    but our challenge's fresh nonce makes the recorded proof worthless. Node 1 stays
    node 1. (By default the sniffer reads nothing: test_ipc_attacks.py.)"""
    n = 3
    port = _free_port()
    relay = _Relay(port)
    base = {"TEST_ROOT_HOST": "127.0.0.1", "IPC_TOKEN": TEST_TOKEN, "TEST_IPC_TIMEOUT": "60",
            "TEST_ENCRYPT": "0"}  # fmt: skip
    node0 = start_worker("static_token", 0, n, tmp_path, env={**base, "TEST_ROOT_PORT": str(port)})
    procs = [node0]
    try:
        _wait_listening(port, node0)
        env1 = {**base, "TEST_ROOT_PORT": str(relay.port)}
        procs.append(start_worker("static_token", 1, n, tmp_path, env=env1))
        deadline = time.monotonic() + 60
        while b'"options"' not in relay.recorded and time.monotonic() < deadline:  # its JOIN
            time.sleep(0.05)
        creds, messages = _parse_zmtp(bytes(relay.recorded))
        assert messages, "nothing recorded"
        _replay(port, creds, messages)
        env2 = {**base, "TEST_ROOT_PORT": str(port)}
        procs.append(start_worker("static_token", 2, n, tmp_path, env=env2))
    except BaseException:
        wait_all(procs, timeout=0)
        raise
    results, texts = collect(tmp_path, wait_all(procs, timeout=120))
    for r in results:
        assert r["count"] == n and r["sum"] == 6.0
    assert "does not know this job's secret" in texts[0], texts[0]


# ---- the runtime directory -----------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="plants a directory owned by another uid")
def test_planted_runtime_directories_are_not_used(tmp_path, short_tmp):
    """Another user planted our runtime directory's name (owned by them), a copy with mode
    0777, and a symbolic link: none is used or written to; the tree works in the next."""
    tmpdir = short_tmp
    uid = os.getuid()
    planted = tmpdir / f"distlearn-ipc-{uid}"
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    open_dir = tmpdir / f"distlearn-ipc-{uid}.1"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    elsewhere = tmpdir / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmpdir / f"distlearn-ipc-{uid}.2").symlink_to(elsewhere)
    n = 3
    procs = [start_worker("launch", i, n, tmp_path, env={"TMPDIR": str(tmpdir)}) for i in range(n)]
    results, texts = collect(tmp_path, wait_all(procs, timeout=120))
    assert all(r["count"] == n for r in results)
    for d in (planted, open_dir, elsewhere):
        assert list(d.iterdir()) == [], f"something was written to {d}"
    used = tmpdir / f"distlearn-ipc-{uid}.3"
    assert used.is_dir() and (used.stat().st_mode & 0o777) == 0o700
    log = "".join(texts)
    assert "owned by uid 65534" in log and "lets other users in" in log
    assert "symbolic link" in log


# ---- launches ---------------------------------------------------------------------------


def test_two_launches_from_one_shell_do_not_meet(tmp_path):
    """One shell starts three jobs at once with the same script (two differ only in their
    output directory, one in its node count): each job's nodes find only each other."""
    jobs = {"a": 2, "b": 2, "c": 3}
    lines = []
    for name, n in jobs.items():
        out = tmp_path / name
        out.mkdir()
        lines.append(
            f'for i in $(seq 0 {n - 1}); do "{sys.executable}" "{WORKER}" launch $i {n} "{out}" '
            f'> "{out}/log-$i.txt" 2>&1 & done'
        )
    script = "\n".join(lines) + "\nwait\n"
    proc = subprocess.Popen(["bash", "-c", script], env=repo_env(), start_new_session=True)
    try:
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for name, n in jobs.items():
        results, _ = collect(tmp_path / name, [0] * n)
        pids = [r["pid"] for r in results]
        for r in results:
            assert r["count"] == n
            assert r["sum"] == float(sum(pids)), f"job {name} met another launch"


_SWEEP_NODE = """
import json, os, pathlib, sys, time
i, job = int(sys.argv[1]), os.environ["JOB"]
if (pathlib.Path(os.environ["MARKS"]) / f"slow-{job}{i}").exists():
    time.sleep(3)  # comes after the other launch's node of the other index
import torch
from distlearn import ipc
tree = ipc.LocalhostTree(i, 2, timeout=40)
x = torch.tensor([1.0 if job == "0" else 100.0])
tree.all_reduce(x)
tree.close()
print(json.dumps({"job": job, "node": i, "sum": x.item()}), flush=True)
"""


def test_two_launches_of_one_command_line_told_apart_by_environment_do_not_cross(tmp_path):
    """A sweep driver starts two 2-node jobs at once with one command line, the jobs told
    apart by $JOB=0 or 1. Job 0's node 1 and job 1's node 0 come late, so job 1's node 1
    finds only job 0's node 0: it was admitted (same parent, start time and command line),
    and each job summed with the other's nodes. Node 0 now sees that the parent runs more
    processes like these than a launch has, compares environments, and refuses it (JOB=1
    is not its JOB=0 with the node index in place of 0: only RANK and the like are)."""
    env = {k: v for k, v in repo_env(MARKS=str(tmp_path)).items() if k != "IPC_KEY"}
    for late in ("slow-01", "slow-10"):
        (tmp_path / late).touch()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SWEEP_NODE, str(i)],
            env=dict(env, JOB=job),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for job in "01"
        for i in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=90))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    sums = {}
    for out, err in outs:
        assert out.startswith("{"), err
        r = json.loads(out)
        sums[r["job"], r["node"]] = r["sum"]
    assert sums == {("0", 0): 2.0, ("0", 1): 2.0, ("1", 0): 200.0, ("1", 1): 200.0}
    assert "its environment differs from node 0's in JOB" in outs[0][1], outs[0][1]


def test_waiting_nodes_say_what_they_wait_for(tmp_path):
    """A node whose peers never come says so after a few seconds, naming the key and how
    to share it, instead of waiting silently for the whole timeout."""
    lone1 = start_worker("launch", 1, 2, tmp_path, key="nobody-else", env={"TEST_IPC_TIMEOUT": "8"})
    out0 = tmp_path / "zero"
    out0.mkdir()
    lone0 = start_worker("launch", 0, 3, out0, key="nobody-either", env={"TEST_IPC_TIMEOUT": "8"})
    codes = wait_all([lone1, lone0], timeout=60)
    assert codes == [1, 1]
    text1 = (tmp_path / "log-1.txt").read_text()
    assert "waiting" in text1 and "'nobody-else'" in text1 and "IPC_KEY" in text1, text1
    assert "IPCTimeoutError" in text1
    text0 = (out0 / "log-0.txt").read_text()
    assert "waiting for nodes [1, 2]" in text0, text0


# ---- encryption --------------------------------------------------------------------------

MARKER = b"DISTLEARN-PLAINTEXT-MARKER-"

SNIFFER = """
import socket, sys, time, pathlib
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(3))
s.bind((sys.argv[1], 0))
s.settimeout(0.2)
out, stop = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
got = bytearray()
pathlib.Path(sys.argv[2] + ".ready").write_text("1")
while not stop.exists():
    try:
        got += s.recv(65536)
    except socket.timeout:
        pass
out.write_bytes(bytes(got))
"""


def _sniffed_tree(netns, tmp_path: Path, encrypt: bool | None, port: int) -> tuple[bytes, list]:
    """Run a 3-node tree across two namespaces while a sniffer records node 1's veth."""
    tmp_path.mkdir()
    veth = f"dl{netns[0][5:11]}b"
    cap, stop = tmp_path / "capture", tmp_path / "stop"
    sniffer = subprocess.Popen(
        ["ip", "netns", "exec", netns[1], sys.executable, "-c", SNIFFER, veth, str(cap), str(stop)]
    )
    try:
        deadline = time.monotonic() + 30
        while not Path(str(cap) + ".ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        env = {"TEST_ROOT_HOST": "10.77.0.1", "TEST_ROOT_PORT": str(port), "IPC_TOKEN": TEST_TOKEN,
               "TEST_ENCRYPT": {True: "1", False: "0", None: ""}[encrypt]}  # fmt: skip
        procs = [
            start_worker(
                "marker", i, 3, tmp_path, env={**env, "TEST_NETNS": netns[0 if i == 0 else 1]}
            )
            for i in range(3)
        ]
        results, _ = collect(tmp_path, wait_all(procs, timeout=120))
    finally:
        stop.write_text("1")
        sniffer.wait(timeout=30)
    return cap.read_bytes(), results


def test_encrypted_links_show_no_plaintext(netns_pair, tmp_path):  # noqa: F811
    """By default (and with encrypt=True) a sniffer on the wire between two hosts (network
    namespaces) never sees the scattered tensor's bytes; with encrypt=False (a trusted
    network) it does."""
    plain, results = _sniffed_tree(netns_pair, tmp_path / "plain", encrypt=False, port=29881)
    assert all(r["ok"] for r in results)
    assert MARKER in plain, "the sniffer saw nothing: the test would prove nothing"
    secret, results = _sniffed_tree(netns_pair, tmp_path / "default", encrypt=None, port=29882)
    assert all(r["ok"] and r["encrypt"] is None for r in results)
    assert len(secret) > 64 << 10  # the tensor did cross this wire
    assert MARKER not in secret
