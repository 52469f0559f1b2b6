"""The MNIST examples end to end: real data over HTTP, 4 real processes, real faults.

Every job runs in its own session (start_new_session), so "no orphans" is checked
for real: after the job, no process of that session may be left. The data is the
quick MNIST subset (4000 train + 4000 test items) that `launch.py --quick`
prepares once into examples/data/mnist-quick (ignored by git).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, children, repo_env

EXAMPLES = REPO / "examples"
QUICK_DATA = EXAMPLES / "data" / "mnist-quick"
# The full set, where mnist.sh keeps it: a job that trains until stopped uses it, since
# the launcher given QUICK_DATA without --quick would rebuild that folder with every
# item, and the next --quick job rebuild it again (21 s of a 37 s test, measured).
FULL_DATA = EXAMPLES / "data" / "mnist"
STARTUP_S = 240  # four processes importing torch on a loaded 2-core machine
# 1 process on this host has a core to spare, so --loader auto takes worker processes
SPARE_CORE = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="auto takes the thread loader on 1 core"
)


def session_processes(sid: int) -> list[str]:
    """Live processes of session `sid` (pid and command), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            found.append(f"{entry} {cmd.strip()}")
    return found


class Job:
    """A launcher run in its own session; output is collected line by line."""

    def __init__(self, *args: str) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "launch.py"), *args],
            cwd=REPO,
            env=repo_env(PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.sid = self.proc.pid
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            # tqdm redraws with \r: keep only what is on screen at the end
            self.lines.append(line.rstrip("\n").split("\r")[-1])

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} within {timeout}s:\n{self.output}")

    def pids(self) -> list[int]:
        """The server's and the workers' pids, as the launcher reports them."""
        server = self.wait_for(r"serving .* pid (\d+)\)", STARTUP_S)
        workers = self.wait_for(r"started \d+ processes of .*: pids \[([\d, ]+)\]", STARTUP_S)
        return [int(server.group(1))] + [int(p) for p in workers.group(1).split(",")]

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end within {timeout}s:\n{self.output}") from None
        self._reader.join(timeout=10)
        return code

    def kill_all(self) -> None:
        """Test teardown: whatever happened, leave nothing of this session behind."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.sid, signal.SIGKILL)
        self.proc.wait()

    def assert_no_orphans(self, pids: list[int]) -> None:
        deadline = time.monotonic() + 15  # the kernel reaps asynchronously
        while time.monotonic() < deadline and session_processes(self.sid):
            time.sleep(0.1)
        assert session_processes(self.sid) == [], f"left behind:\n{self.output}"
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


@pytest.fixture
def job():
    jobs: list[Job] = []

    def start(*args: str) -> Job:
        jobs.append(Job(*args))
        return jobs[-1]

    yield start
    for j in jobs:
        j.kill_all()


def test_quick_run_end_to_end(job, tmp_path):
    """prepare, serve, 4 processes, AllReduceSGD, evaluation, outputs, clean exit."""
    j = job("--script", "examples/mnist.py", "--quick", "--output", str(tmp_path / "out"))
    pids = j.pids()
    code = j.finish(timeout=280)
    assert code == 0, j.output
    last = j.lines[-1]
    m = re.fullmatch(
        r"mnist\.py: final test accuracy ([\d.]+)% after 1 epoch, 4 processes, .*", last
    )
    assert m, j.output
    # 4000 training items are enough for a CNN to beat chance (10%) by far.
    assert float(m.group(1)) > 60, j.output
    record = json.loads((tmp_path / "out" / "log.json").read_text())
    assert record["nodes"] == 4 and record["algorithm"] == "AllReduceSGD"
    (epoch,) = record["epochs"]
    assert epoch["test_items"] == 2000  # the quick test split, shared by the 4 nodes
    assert sum(map(sum, epoch["confusion"])) == 2000
    # A sample of every digit: a linear walk of the first 2000 gave digits 0-4 only.
    assert all(sum(row) > 0 for row in epoch["confusion"]), epoch["confusion"]
    assert epoch["train_items"] >= 4000
    assert (tmp_path / "out" / "plot.png").stat().st_size > 1000
    # Only node 0 prints: one header line, one epoch line.
    assert sum("AllReduceSGD, 4 processes" in line for line in j.lines) == 1
    assert sum(line.startswith("epoch 1/1:") for line in j.lines) == 1
    # ... which says where the loader's time went, over every rank
    (line,) = [line for line in j.lines if line.startswith("epoch 1/1:")]
    assert re.search(r"; loader: (bound by [\w /]+ on every rank|straggler rank \d)", line), line
    assert epoch["loader"] in line
    assert sum("final test accuracy" in line for line in j.lines) == 1
    assert len(record["train_curve"]) >= 10  # the plot has a curve, not one dot per epoch
    j.assert_no_orphans(pids)


def test_elastic_averaging_quick_run_end_to_end(job, tmp_path):
    """examples/mnist-ea.sh's script: 4 processes each training its own replica over
    HTTP, averaged every tau steps (AllReduceEA), evaluated on the center."""
    j = job("--script", "examples/mnist-ea.py", "--quick", "--output", str(tmp_path / "out"))
    pids = j.pids()
    code = j.finish(timeout=280)
    assert code == 0, j.output
    m = re.fullmatch(
        r"mnist-ea\.py: final test accuracy ([\d.]+)% after 1 epoch, 4 processes, .*",
        j.lines[-1],
    )
    assert m, j.output
    assert float(m.group(1)) > 60, j.output
    record = json.loads((tmp_path / "out" / "log.json").read_text())
    assert record["nodes"] == 4 and record["algorithm"] == "AllReduceEA (tau 10, alpha 0.2)"
    (epoch,) = record["epochs"]
    assert epoch["test_items"] == 2000 and epoch["train_items"] >= 4000
    j.assert_no_orphans(pids)


def test_elastic_quick_run_kills_a_rank_and_finishes_on_three(job, tmp_path):
    """examples/elastic.sh's script: rank 1 of 4 SIGKILLed at step 10; the other 3 take
    over its examples and finish with no restart, and the ledgers of every process (the
    dead one's too) say each training example was used exactly once."""
    j = job("--script", "examples/elastic.py", "--survive", "--quick", "--kill-at", "10",
            "--kill-rank", "1", "--output", str(tmp_path / "out"))  # fmt: skip
    pids = j.pids()
    code = j.finish(timeout=280)
    assert code == 0, j.output
    assert any(re.fullmatch(r"rank 1 died; 3 ranks took over its examples in [\d.]+ s", line)
               for line in j.lines), j.output  # fmt: skip
    at = j.lines.index("every training example was used exactly once in each epoch")
    assert j.lines[at + 1] == "  epoch 1: 4000 of 4000 examples, 0 used more than once, 0 never"
    m = re.fullmatch(r"elastic\.py: final test accuracy ([\d.]+)% after 1 epoch, 3 of 4 "
                     r"processes at the end, \d+ s", j.lines[-1])  # fmt: skip
    assert m and float(m.group(1)) > 60, j.output
    j.assert_no_orphans(pids)


def test_elastic_quick_run_a_killed_rank_comes_back(job, tmp_path):
    """examples/elastic.sh --come-back: rank 1 SIGKILLed at step 3 and started again by the
    launcher; it rejoins the running job at a step, and the job ends on 4 processes with
    every training example used exactly once. (Batches of 2: 500 steps a rank, so the job
    is still running when the process started again has imported torch, under load too.)"""
    j = job("--script", "examples/elastic.py", "--survive", "--quick", "--kill-at", "3",
            "--kill-rank", "1", "--batch-size", "2", "--come-back", "--output",
            str(tmp_path / "out"))  # fmt: skip
    pids = j.pids()
    code = j.finish(timeout=280)
    assert code == 0, j.output
    assert any(re.fullmatch(r"a process came back; 4 ranks go on from the same step \(taken "
                            r"in in [\d.]+ s\)", line) for line in j.lines), j.output  # fmt: skip
    at = j.lines.index("every training example was used exactly once in each epoch")
    assert j.lines[at + 1] == "  epoch 1: 4000 of 4000 examples, 0 used more than once, 0 never"
    m = re.fullmatch(r"elastic\.py: final test accuracy ([\d.]+)% after 1 epoch, 4 of 4 "
                     r"processes at the end, \d+ s", j.lines[-1])  # fmt: skip
    assert m and float(m.group(1)) > 60, j.output
    # two ledgers of rank 1's pids: the killed process's and the one that came back
    assert len(list((tmp_path / "out" / "ledger").glob("rank*.txt"))) == 5
    j.assert_no_orphans(pids)


@SPARE_CORE
def test_one_process_with_a_core_to_spare_fetches_in_worker_processes(job, tmp_path):
    """Where the host has a core to spare for it (1 process on 2 cores), the example's
    loader fetches and decodes in worker processes; they end with the job."""
    j = job(
        "--script", "examples/mnist.py", "--quick", "--nodes", "1",
        "--output", str(tmp_path / "out"),
    )  # fmt: skip
    pids = j.pids()
    j.wait_for(r"1 process \(ipc\), .* loader process(es)? and \d+ torch threads? a process", 60)
    code = j.finish(timeout=280)
    assert code == 0, j.output
    m = re.fullmatch(
        r"mnist\.py: final test accuracy ([\d.]+)% after 1 epoch, 1 process, .*", j.lines[-1]
    )
    assert m and float(m.group(1)) > 60, j.output
    record = json.loads((tmp_path / "out" / "log.json").read_text())
    loader = record["loader"]
    assert loader["workers"] == "process" and loader["num_workers"] >= 1, loader
    assert loader["prefetch"] == 16, loader
    (epoch,) = record["epochs"]
    assert epoch["test_items"] == 2000 and epoch["train_items"] >= 4000
    j.assert_no_orphans(pids)  # the loader's processes too: they are in the job's session


def test_typo_gets_one_usage_message_and_nothing_starts():
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "launch.py"), "--script", "examples/mnist.py", "--epohcs"],
        cwd=REPO,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out
    assert out.stderr.count("usage:") == 1 and "unrecognized arguments: --epohcs" in out.stderr
    assert "serving" not in out.stderr and "started" not in out.stderr


def test_help_shows_the_launcher_and_script_options_but_not_internals():
    out = subprocess.run(
        ["bash", str(EXAMPLES / "mnist.sh"), "--help"],
        cwd=REPO,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out
    assert out.stdout.startswith("usage: ") and "mnist.sh [--nodes N]" in out.stdout
    assert "--script" not in out.stdout and "--check-args" not in out.stdout
    assert "--server {auto,nginx,serve}" in out.stdout and "--batch-size" in out.stdout


def test_a_run_without_data_says_how_to_make_it(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "mnist.py"), "--data-url", str(tmp_path)],
        cwd=REPO,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "run `python examples/prepare_mnist.py` once" in out.stderr, out.stderr


def test_each_run_gets_its_own_output_folder_and_latest_points_to_it(monkeypatch, tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    import mnist_lib

    monkeypatch.setattr(mnist_lib, "HERE", tmp_path)
    first, second = mnist_lib.run_folder("mnist.py"), mnist_lib.run_folder("mnist.py")
    assert first != second and first.parent == second.parent == tmp_path / "output" / "mnist"
    assert (tmp_path / "output" / "mnist" / "latest").resolve() == second.resolve()


@pytest.mark.parametrize(
    ("cores", "local", "argv", "loader", "threads"),
    [
        # 4 processes on 2 cores: no core to spare, one thread fetches and decodes
        (2, 4, [], dict(workers="thread", num_workers=0), 1),
        # a core to spare: the fetching leaves the training process's GIL
        (2, 1, [], dict(workers="process", num_workers=1), 1),
        # 4 cores each: half to torch, half to the loader (the fastest split measured)
        (16, 4, [], dict(workers="process", num_workers=2), 2),
        (16, 4, ["--threads", "3"], dict(workers="process", num_workers=1), 3),
        (16, 4, ["--loader", "thread"], dict(workers="thread", num_workers=0), 4),
        (2, 4, ["--loader", "process"], dict(workers="process", num_workers=1), 1),
        (16, 4, ["--loader-workers", "5"], dict(workers="process", num_workers=5), 2),
        # asking for loader workers asks for worker processes, even without a spare core
        (2, 4, ["--loader-workers", "2"], dict(workers="process", num_workers=2), 1),
    ],
)
def test_the_loader_takes_worker_processes_where_the_host_has_a_core_to_spare(
    monkeypatch, cores, local, argv, loader, threads
):
    sys.path.insert(0, str(EXAMPLES))
    import mnist_lib

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    args = mnist_lib.parser("x", lr=0.1, epochs=1, batch_size=32).parse_args(argv)
    assert mnist_lib.loader_plan(args, nodes=local) == (loader, threads)


def test_loader_options_are_checked_before_anything_starts(capsys):
    sys.path.insert(0, str(EXAMPLES))
    import mnist_lib

    def parse(*argv: str) -> str:
        p = mnist_lib.parser("x", lr=0.1, epochs=1, batch_size=32)
        with pytest.raises(SystemExit) as stopped:
            mnist_lib.main("mnist.py", None, p, ["--check-args", *argv])
        assert stopped.value.code == 2
        return capsys.readouterr().err

    assert "--loader-workers: must be 1 or more, not 0" in parse("--loader-workers", "0")
    assert "--threads: must be 1 or more, not 0" in parse("--threads", "0")
    assert "--prefetch: must be 1 or more, not 0" in parse("--prefetch", "0")
    err = parse("--loader", "thread", "--loader-workers", "2")
    assert "--loader-workers needs worker processes: --loader process or auto" in err


def long_job(job, tmp_path, nodes: int = 4) -> tuple[Job, list[int]]:
    """A job that trains until stopped (the full data, many epochs)."""
    j = job(
        "--script", "examples/mnist.py", "--data", str(FULL_DATA), "--nodes", str(nodes),
        "--output", str(tmp_path / "out"), "--epochs", "1000",
    )  # fmt: skip
    pids = j.pids()
    processes = "1 process " if nodes == 1 else f"{nodes} processes"
    j.wait_for(rf"AllReduceSGD, {processes}", STARTUP_S)  # node 0 is training
    return j, pids


def test_ctrl_c_stops_every_process_and_the_server(job, tmp_path):
    j, pids = long_job(job, tmp_path)
    os.killpg(j.sid, signal.SIGINT)  # what a terminal does on Ctrl-C
    code = j.finish(timeout=60)
    assert code == 128 + signal.SIGINT, j.output
    assert "FAILED" in j.lines[-1]
    j.assert_no_orphans(pids)


def test_a_failing_process_ends_the_job(job, tmp_path):
    j, pids = long_job(job, tmp_path)
    victim = pids[3]  # node 2
    os.kill(victim, signal.SIGKILL)
    code = j.finish(timeout=60)
    assert code != 0, j.output
    assert f"node 2 (pid {victim}) failed: killed by SIGKILL; stopping the job" in j.output
    j.assert_no_orphans(pids)


@SPARE_CORE
def test_a_killed_process_takes_its_loader_workers_with_it(job, tmp_path):
    j, pids = long_job(job, tmp_path, nodes=1)  # 1 process on 2 cores: worker processes
    victim = pids[1]
    workers = [
        line for line in session_processes(j.sid)
        if "mnist.py" in line and not line.startswith(f"{victim} ")
    ]  # fmt: skip
    assert workers, session_processes(j.sid)  # the loader's, forked by the training process
    os.kill(victim, signal.SIGKILL)
    code = j.finish(timeout=60)
    assert code != 0, j.output
    assert f"node 0 (pid {victim}) failed: killed by SIGKILL; stopping the job" in j.output
    j.assert_no_orphans(pids)


NGINX = pytest.mark.skipif(not shutil.which("nginx"), reason="nginx is not on PATH")


@pytest.mark.parametrize(
    ("kind", "workers"), [pytest.param("nginx", 0, marks=NGINX), ("serve", 1), ("serve", 2)]
)
def test_server_serves_and_stops(kind, workers, tmp_path):
    """Either server answers with the right bytes, refuses a busy explicit port with an
    error naming it, and leaves no process behind (serve's workers included)."""
    sys.path.insert(0, str(EXAMPLES))
    import launch

    (tmp_path / "train.csv").write_text("filename,label\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(b"\x89PNG" + bytes(range(256)) * 10)
    first = launch.Server(tmp_path, kind, workers=workers)
    forked = []
    try:
        base = first.start()
        for _ in range(4):  # new connections, spread over the workers
            with urllib.request.urlopen(base + "sub/a.png") as r:
                assert r.read() == (tmp_path / "sub" / "a.png").read_bytes()
        if kind == "serve":
            forked = children(first.proc.pid)
            assert len(forked) == (workers if workers > 1 else 0)
        second = launch.Server(tmp_path, kind, port=first.port, workers=workers)  # busy
        with pytest.raises(RuntimeError, match=f"port {first.port} on 127.0.0.1 is in use"):
            second.start()
        second.stop()
    finally:
        proc = first.proc
        first.stop()
    assert proc.poll() is not None
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in forked):
        time.sleep(0.05)
    assert not [p for p in forked if Path(f"/proc/{p}").exists()]


def test_server_processes_follow_the_cores_and_are_checked():
    sys.path.insert(0, str(EXAMPLES))
    import launch

    assert [launch.server_workers(c) for c in (1, 2, 4, 7, 8, 16, 64, 256)] == [
        1, 1, 1, 1, 2, 4, 8, 8
    ]  # fmt: skip
    for args, why in [
        (
            ["--server-workers", "-1"],
            "--server-workers must be at least 1 (0: the default), not -1",
        ),
        (["--server", "nginx", "--server-workers", "2"], "--server-workers is for --server serve"),
    ]:
        r = subprocess.run(
            [sys.executable, str(EXAMPLES / "launch.py"), "--script", "examples/mnist.py", *args],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 2, r.stderr
        assert why in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ipc", "gloo"])
def test_torchrun_quick(backend, serve_dir, tmp_path):
    """`torchrun --nproc-per-node=4 examples/mnist.py` with rank and rendezvous from the
    environment, for both communicators."""
    assert (QUICK_DATA / "prepared.json").exists(), "run test_quick_run_end_to_end first"
    url = serve_dir(QUICK_DATA)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += [str(EXAMPLES / "mnist.py"), "--data-url", url, "--quick", "--backend", backend]
    cmd += ["--output", str(tmp_path / "out")]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=repo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=280)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, out
    assert re.search(r"mnist\.py: final test accuracy [\d.]+% after 1 epoch", out), out
    record = json.loads((tmp_path / "out" / "log.json").read_text())
    assert record["nodes"] == 4 and record["backend"] == backend
