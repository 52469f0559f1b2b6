"""The loopback static server: what it serves, and what it refuses under attack.

Clients are urllib (a real HTTP client) and raw sockets, for bytes no polite
client would send.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import children, repo_env, wait_for_file


def get(url: str, headers: dict | None = None, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def raw(base: str, data: bytes, wait: float = 5.0) -> bytes:
    """Send `data` on a fresh connection; everything the server answers until it
    closes the connection or stays silent for a moment."""
    host, port = base.split("//")[1].rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def statuses(data: bytes) -> list[int]:
    """The status of each response in `data`, framed by Content-Length."""
    out = []
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"a response head without its end: {head[:200]!r}"
        lines = head.split(b"\r\n")
        out.append(int(lines[0].split()[1]))
        length = [
            int(v) for k, _, v in (x.partition(b":") for x in lines) if k == b"Content-Length"
        ]
        head_only = len(data) < length[0] if length else True  # HEAD answers
        data = data if head_only else data[length[0] :]
    return out


def serve_cmd(root, *args: str) -> list[str]:
    return [sys.executable, "-m", "distlearn.dataset.serve", str(root), *args]


def make_tree(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.bin").write_bytes(bytes(range(256)))
    (root / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024 + 7))  # over the in-memory limit
    (root / "empty").write_bytes(b"")
    (tmp_path / "secret.txt").write_text("outside the root")
    (root / "link.txt").symlink_to(tmp_path / "secret.txt")
    (root / "linkdir").symlink_to(tmp_path)
    return root


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path)


@pytest.fixture(scope="module", params=[1, 2], ids=["1-process", "2-workers"])
def served(request, tmp_path_factory):
    """One server over a tree that no test changes: (root, base URL); every test that
    uses it runs against one process and against two workers on one port."""
    root = make_tree(tmp_path_factory.mktemp("served"))
    port_file = root.parent / "port"
    cmd = serve_cmd(root, "--port-file", str(port_file), "--workers", str(request.param))
    proc = subprocess.Popen(cmd, env=repo_env(), stderr=subprocess.PIPE)
    try:
        yield root, f"http://127.0.0.1:{wait_for_file(port_file, proc)}/"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_serves_files_heads_and_ranges(served):
    tree, base = served
    assert get(base + "sub/a.bin") == (200, bytes(range(256)))
    assert get(base + "sub/%61.bin") == (200, bytes(range(256)))  # percent-decoded
    assert get(base + "sub/a.bin?v=1") == (200, bytes(range(256)))  # query ignored
    assert get(base + "sub/a.bin", {"Range": "bytes=10-19"}) == (206, bytes(range(10, 20)))
    assert get(base + "sub/a.bin", {"Range": "bytes=250-"}) == (206, bytes(range(250, 256)))
    assert get(base + "sub/a.bin", {"Range": "bytes=-3"}) == (206, bytes(range(253, 256)))
    assert get(base + "sub/a.bin", {"Range": "bytes=250-999"}) == (206, bytes(range(250, 256)))
    assert get(base + "sub/a.bin", {"Range": "bytes=0-1,5-6"}) == (200, bytes(range(256)))
    assert get(base + "sub/a.bin", {"Range": "bytes=300-"})[0] == 416
    assert get(base + "empty") == (200, b"")
    assert get(base + "sub/a.bin", method="HEAD") == (200, b"")
    big = (tree / "big.bin").read_bytes()
    assert get(base + "big.bin") == (200, big)
    lo, hi = 2 * 1024 * 1024, 2 * 1024 * 1024 + 99
    assert get(base + "big.bin", {"Range": f"bytes={lo}-{hi}"}) == (206, big[lo : hi + 1])


def test_a_changed_small_file_is_served_new(tree, serve_dir):
    base = serve_dir(tree)
    assert get(base + "sub/a.bin")[1] == bytes(range(256))
    (tree / "sub" / "a.bin").write_bytes(b"new contents")
    assert get(base + "sub/a.bin") == (200, b"new contents")


@pytest.mark.parametrize(
    "path",
    [
        "/../secret.txt",
        "/sub/../../secret.txt",
        "/%2e%2e/secret.txt",
        "/sub/%2E%2E/%2e%2e/secret.txt",
        "/link.txt",  # a symlink to a file outside
        "/linkdir/secret.txt",  # through a symlinked directory
        "/sub",  # directories are not listed
        "/",
        "/sub/a.bin%00.png",
        "/missing",
    ],
)
def test_nothing_outside_the_root_and_no_links(served, path):
    _, base = served
    answer = raw(base, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    assert statuses(answer) == [404], answer[:200]
    assert b"outside the root" not in answer


def test_keep_alive_and_pipelining_answer_in_order(served):
    _, base = served
    requests = b"".join(
        f"GET /{p} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for p in ["sub/a.bin", "missing", "empty"]
    )
    answer = raw(base, requests + b"GET /sub/a.bin HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert statuses(answer) == [200, 404, 200, 200]
    assert answer.count(bytes(range(256))) == 2
    # HTTP/1.0 closes after one answer unless asked to keep alive
    assert statuses(raw(base, b"GET /empty HTTP/1.0\r\n\r\nGET /empty HTTP/1.0\r\n\r\n")) == [200]


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"\x00\xff\xfe junk\r\n\r\n", 400),
        (b"GET\r\n\r\n", 400),
        (b"GET /empty HTTP/2.0\r\n\r\n", 505),
        (b"GET /empty HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"GET /empty HTTP/1.1\r\nHost : x\r\n\r\n", 400),  # space before the colon
        (b"GET /empty HTTP/1.1\r\nX: a\r\n folded\r\n\r\n", 400),  # obsolete line folding
        (b"GET /empty HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 413),
        (b"GET /empty HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 413),
        (b"GET /empty HTTP/1.1\r\nRange: bytes=0-\r\nRange: bytes=1-\r\n\r\n", 400),
        (b"GET /empty HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431),
        (b"GET /empty HTTP/1.1\r\nX: " + b"a" * 20000, 431),  # no end of head at all
        (b"DELETE /empty HTTP/1.1\r\nConnection: close\r\n\r\n", 405),
    ],
)
def test_malformed_requests_are_refused_and_the_server_goes_on(served, request_bytes, status):
    _, base = served
    assert statuses(raw(base, request_bytes))[:1] == [status]
    assert get(base + "sub/a.bin") == (200, bytes(range(256)))


def test_slow_heads_and_idle_connections_are_closed(tree, serve_dir):
    base = serve_dir(tree, 0, "--head-timeout", "1", "--idle-timeout", "2")
    host, port = base.split("//")[1].rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as slow:
        slow.sendall(b"GET /empty HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        t0 = time.monotonic()
        assert slow.recv(100) == b""  # closed by the server
        assert time.monotonic() - t0 < 8
    with socket.create_connection((host, int(port)), timeout=10) as idle:
        idle.sendall(b"GET /empty HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(1000).startswith(b"HTTP/1.1 200")
        assert idle.recv(100) == b""  # idle keep-alive closed after 2 s


def test_a_client_gone_mid_file_leaves_the_server_serving(served):
    tree, base = served
    host, port = base.split("//")[1].rstrip("/").split(":")
    for _ in range(5):
        s = socket.create_connection((host, int(port)))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET /big.bin HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        s.recv(1000)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()  # a reset in the middle of sendfile
    assert get(base + "big.bin")[1] == (tree / "big.bin").read_bytes()


@pytest.mark.parametrize(
    ("reuse_port", "workers"),
    [(False, 1), (False, 2), (True, 1), (True, 2)],
    ids=["plain-1-process", "plain-2-workers", "reuseport-1-process", "reuseport-2-workers"],
)
def test_a_busy_explicit_port_is_an_error(tree, reuse_port, workers):
    # A socket of this very user with SO_REUSEPORT: workers could join its group and
    # share its connections; the server must refuse the port instead.
    with socket.socket() as busy:
        if reuse_port:
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        r = subprocess.run(
            serve_cmd(tree, "--port", str(taken), "--workers", str(workers)),
            env=repo_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 2
    assert f"port {taken} on 127.0.0.1 is in use" in r.stderr


@pytest.mark.parametrize(
    ("below", "args", "why"),
    [
        ("does-not-exist", [], "not a directory"),
        ("", ["--workers", "0"], "--workers must be at least 1, not 0"),
    ],
    ids=["a-missing-directory", "workers-below-one"],
)
def test_refuses_bad_arguments_before_serving(tree, below, args, why):
    r = subprocess.run(
        serve_cmd(tree / below, *args),
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert why in r.stderr


# ----------------------------------------------------------------------------- workers


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def sockets_of(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


@pytest.fixture
def workers(tree, tmp_path):
    """Start a 3-worker server: (supervisor Popen, base URL, worker pids)."""
    started = []

    def start(n: int = 3) -> tuple[subprocess.Popen, str, list[int]]:
        port_file = tmp_path / f"port-{len(started)}"
        cmd = serve_cmd(tree, "--port-file", str(port_file), "--workers", str(n))
        proc = subprocess.Popen(cmd, env=repo_env(), stderr=subprocess.PIPE, text=True)
        started.append(proc)
        base = f"http://127.0.0.1:{wait_for_file(port_file, proc)}/"
        deadline = time.monotonic() + 30
        while len(pids := children(proc.pid)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pids) == n, f"{len(pids)} of {n} workers"
        return proc, base, pids

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_workers_share_one_port_and_the_kernel_spreads_connections(workers):
    _proc, base, pids = workers(3)
    host, port = base.split("//")[1].rstrip("/").split(":")
    conns = [socket.create_connection((host, int(port)), timeout=10) for _ in range(30)]
    try:
        for c in conns:  # each held open, after one answered request
            c.sendall(b"GET /sub/a.bin HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(bytes(range(256))):
                answer += c.recv(65536)
        mine = {os.fstat(c.fileno()).st_ino for c in conns}
        assert len(mine) == 30
        held = [len(sockets_of(pid)) for pid in pids]  # its listening socket + connections
        # 30 connections hashed over 3 sockets: all on one worker has odds of 3 ** -29
        assert sum(h > 1 for h in held) >= 2, held
        assert sum(held) >= 30 + 3, held
    finally:
        for c in conns:
            c.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_join_the_workers_port(workers):
    # SO_REUSEPORT groups are per user: a process of another user that asks for the
    # port with SO_REUSEPORT must be refused, not handed a share of the connections.
    _proc, base, _pids = workers(2)
    port = int(base.rsplit(":", 1)[1].rstrip("/"))
    attempt = (
        "import os, socket\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
        "try:\n"
        f"    s.bind(('127.0.0.1', {port})); s.listen(); print('joined')\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
    )
    r = subprocess.run([sys.executable, "-c", attempt], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "refused 98", r.stdout + r.stderr  # EADDRINUSE
    assert get(base + "sub/a.bin") == (200, bytes(range(256)))


def test_sigterm_stops_the_supervisor_and_every_worker(workers):
    proc, base, pids = workers(3)
    assert get(base + "sub/a.bin") == (200, bytes(range(256)))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    assert wait_gone(pids) == []


def test_ctrl_c_stops_the_server_cleanly(tree, tmp_path):
    # A terminal's Ctrl-C: SIGINT to every process of the group, workers included.
    port_file = tmp_path / "port"
    cmd = serve_cmd(tree, "--port-file", str(port_file), "--workers", "3")
    proc = subprocess.Popen(
        cmd, env=repo_env(), stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        wait_for_file(port_file, proc)
        deadline = time.monotonic() + 30
        while len(pids := children(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        # Workers leave SIGINT to the supervisor, however the signals land in time:
        # one that ended on it first would look like a worker that died.
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None and all(alive(pid) for pid in pids)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=15) == 0, proc.stderr.read()
        assert "stopping the others" not in proc.stderr.read()
        assert wait_gone(pids) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_killed_worker_stops_the_server_with_an_error(workers):
    proc, _base, pids = workers(3)
    os.kill(pids[1], signal.SIGKILL)
    assert proc.wait(timeout=15) == 1
    assert f"worker {pids[1]} was killed by SIGKILL" in proc.stderr.read()
    assert wait_gone(pids) == []


def test_workers_die_with_a_killed_supervisor(workers):
    proc, _base, pids = workers(2)
    proc.kill()
    proc.wait(timeout=10)
    assert wait_gone(pids) == []


# ----------------------------------------------------------------------------- under attack


@contextlib.contextmanager
def server_process(root, *args: str, nofile: tuple[int, int] | None = None):
    """One server process over `root` (its open-file limits `nofile`, if given):
    (Popen, base URL), stopped afterwards. Its log goes to a file, read by nobody: a
    pipe nobody reads would stop a server that logs much."""
    import resource
    import tempfile
    from pathlib import Path

    def limits() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "log", "w") as log:
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen(serve_cmd(root, "--port-file", str(port_file), *args),
                                env=repo_env(), stderr=log, preexec_fn=limits)  # fmt: skip
        try:
            yield proc, f"http://127.0.0.1:{wait_for_file(port_file, proc)}/"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connect(base: str, timeout: float = 10.0) -> socket.socket:
    host, port = base.split("//")[1].rstrip("/").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def test_no_request_leaks_a_file(tree):
    """A Range of 5000 digits raised after the file was opened (int() refuses more
    than 4300 digits): 300 such requests held 300 files, and a server out of files
    answered 404 to everything, which a trainer takes for "no such item"."""
    digits = b"9" * 5000
    bad = [b"bytes=" + digits + b"-", b"bytes=0-" + digits, b"bytes=-" + digits,
           b"bytes=" + digits + b"-" + digits]  # fmt: skip
    with server_process(tree) as (proc, base):
        assert get(base + "sub/a.bin")[0] == 200
        before = open_files(proc.pid)
        answers = []
        for i in range(300):
            path = (b"/sub/a.bin", b"/big.bin")[i % 2]
            request = b"GET %s HTTP/1.1\r\nHost: x\r\nRange: %s\r\nConnection: close\r\n\r\n"
            answers += statuses(raw(base, request % (path, bad[i // 2 % len(bad)])))
        time.sleep(0.5)
        after = open_files(proc.pid)
        assert after - before <= 2, f"{after - before} files leaked by 300 requests"
        assert set(answers) <= {200, 206, 416} and len(answers) == 300
        assert get(base + "sub/a.bin") == (200, bytes(range(256)))
        assert (
            get(base + "big.bin", {"Range": "bytes=-5"})[1] == (tree / "big.bin").read_bytes()[-5:]
        )


def test_a_slow_drip_head_is_cut_at_the_head_deadline(tree):
    """The head timeout ran between bytes: a byte every 0.3 s kept a connection (and a
    file) forever. It is a deadline on the whole head now."""
    with server_process(tree, "--head-timeout", "1") as (_proc, base), connect(base) as s:
        t0 = time.monotonic()
        closed = None
        for byte in b"GET /sub/a.bin HTTP/1.1\r\nHost: x\r\nX-Drip: " + b"a" * 200:
            try:
                s.sendall(bytes([byte]))
                time.sleep(0.3)
                if time.monotonic() - t0 > 8:
                    break
            except (BrokenPipeError, ConnectionResetError):
                closed = time.monotonic() - t0
                break
        assert closed is not None, "a dripping client kept its connection 8 s"
        assert closed < 3.5


@pytest.mark.parametrize("what", ["large-file", "pipelined-small-files"])
def test_a_client_that_does_not_read_is_cut_at_the_send_deadline(tree, what):
    """A connection whose answer was not read (a large file, or small answers
    pipelined until the socket buffer filled) was exempt from every timeout: the
    slow reader held it, and its file, for ever."""
    (tree / "bigger.bin").write_bytes(bytes(48 << 20))  # more than socket buffers hold
    with server_process(tree, "--send-timeout", "1") as (proc, base):
        alone = len(sockets_of(proc.pid))  # (its listening socket, the loop's self-pipe)
        host, port = base.split("//")[1].rstrip("/").split(":")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connect: the window)
        s.settimeout(10)
        s.connect((host, int(port)))
        try:
            if what == "large-file":
                s.sendall(b"GET /bigger.bin HTTP/1.1\r\nHost: x\r\n\r\n")
            else:
                with contextlib.suppress(OSError):
                    s.settimeout(2)
                    for _ in range(20000):  # until the server stops reading
                        s.sendall(b"GET /sub/a.bin HTTP/1.1\r\nHost: x\r\n\r\n" * 64)
            assert s.recv(12) == b"HTTP/1.1 200"  # the server has the connection (and no
            # more is read). Its deadline: 1 s, and 1 s for each 8 MiB of the answer
            deadline = time.monotonic() + 20
            while len(sockets_of(proc.pid)) > alone and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(sockets_of(proc.pid)) == alone, "a client that reads nothing kept its conn."
        finally:
            s.close()
        assert get(base + "sub/a.bin") == (200, bytes(range(256)))


def test_connections_are_capped_below_the_file_limit_and_answers_stay_honest(tree):
    """Out of files, the server answered 404 ("no such file") to every request, and the
    trainer dropped the items as missing. Connections are capped below the file limit
    now: one over the cap gets 503 (retried by the fetcher), never 404."""
    with server_process(tree, nofile=(96, 96)) as (proc, base):
        conns, answers = [], []
        try:
            for _ in range(150):
                try:
                    conns.append(connect(base, timeout=3))
                except OSError:
                    answers.append("refused")
            for c in conns:
                with contextlib.suppress(OSError):
                    c.sendall(b"GET /sub/a.bin HTTP/1.1\r\nHost: x\r\n\r\n")
            for c in conns:
                try:
                    c.settimeout(5)
                    head = c.recv(65536)
                    answers.append(statuses(head.split(b"\r\n\r\n")[0] + b"\r\n\r\n")[0]
                                   if head else "closed")  # fmt: skip
                except OSError:
                    answers.append("timeout")
        finally:
            for c in conns:
                c.close()
        assert 404 not in answers, answers
        assert answers.count(200) >= 20 and 503 in answers, answers
        assert proc.poll() is None
        time.sleep(0.5)
        assert get(base + "sub/a.bin") == (200, bytes(range(256)))


def test_the_file_limit_is_raised_to_the_hard_one(tree):
    with server_process(tree, nofile=(256, 4096)) as (proc, base):
        assert get(base + "sub/a.bin")[0] == 200
        with open(f"/proc/{proc.pid}/limits") as f:
            line = next(x for x in f if x.startswith("Max open files"))
        assert line.split()[3:5] == ["4096", "4096"], line
