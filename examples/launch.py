"""Run an example as a job: prepare the data, serve it over HTTP, start N processes.

    examples/mnist.sh [--nodes 4] [--data DIR] [--quick] [--server auto|nginx|serve]
                      [--server-workers N] [--port P] [MNIST.PY OPTIONS...]
    python examples/launch.py --script SCRIPT [the same options]

This is what ``examples/mnist.sh`` and ``mnist-ea.sh`` run. It stands in for a
cluster scheduler plus a CDN on one machine:

1. checks the script's options once (one usage message for a typo, not one per
   process), then makes the MNIST folder if it is missing (``prepare_mnist.py``,
   idempotent);
2. serves it on 127.0.0.1 with nginx when installed, else with
   ``python -m distlearn.dataset.serve`` (both cost about 50 us of CPU per
   file; serve runs one process for every 4 cores of the host, see
   ``server_workers``); ``--port`` picks the port, and a busy one is an error;
3. starts SCRIPT N times with the torchrun environment (RANK, WORLD_SIZE,
   LOCAL_RANK, MASTER_ADDR, MASTER_PORT), a fresh IPC_TOKEN and ``--data-url``,
   so the script has one code path for this launcher and for torchrun;
4. waits. The first process that fails, or Ctrl-C / SIGTERM, stops every
   process and the server (SIGTERM, then SIGKILL after a grace period); the
   exit status is non-zero if any process failed. Children also get SIGKILL
   from the kernel if the launcher itself is killed (PR_SET_PDEATHSIG), so no
   orphan outlives the job.

The last line printed is node 0's result: the final test accuracy.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import prepare_mnist  # noqa: E402  (a sibling script, not a package)

from distlearn.common.procs import die_with_parent  # noqa: E402  (no torch: a light import)

log = logging.getLogger("launch")

GRACE_S = 10.0  # how long a stopped process gets to exit before SIGKILL
SERVER_START_S = 120.0  # generous: importing aiohttp on a busy 2-core machine is slow
QUICK_ITEMS = 4000  # items per split in --quick mode


LAUNCHER = os.getpid()  # (this module runs in the launcher)


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends SIGKILL when the launcher dies."""
    die_with_parent(LAUNCHER, signal.SIGKILL, before_exec=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def stop_processes(procs: list[subprocess.Popen], grace: float = GRACE_S) -> None:
    """SIGTERM every live process, then SIGKILL what is left after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop within %.0f s; killing it", p.pid, grace)
            p.kill()
            p.wait()


# ----------------------------------------------------------------------------- the server


def server_workers(cores: int) -> int:
    """How many processes distlearn.dataset.serve runs on a host with `cores` cores.

    Beside the MNIST example's 4 training processes on 16 cores one process held them
    back (20-32% of their epoch went to loading); with 4 they trained 1.12-1.29x
    faster, loading 14-16% (bench/RESULTS-training.md). One for every 4 cores, at
    most 8; on 2 cores one, as the training processes take both cores anyway and a
    second process costs more CPU a file. nginx keeps its one worker (34-55 us of
    CPU a file against serve's 36-120, bench/RESULTS-serving.md)."""
    return max(1, min(8, cores // 4))


class Server:
    """A static file server for `root` on 127.0.0.1: nginx or distlearn.dataset.serve
    (`workers` processes; 0 for `server_workers` of this host's cores)."""

    def __init__(self, root: Path, kind: str = "auto", port: int = 0, workers: int = 0) -> None:
        self.root = Path(root).resolve()
        self.kind = kind
        self.port = port
        self.workers = workers or server_workers(os.cpu_count() or 1)
        self.proc: subprocess.Popen | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="mnist-server-"))
        self.url = ""

    def start(self) -> str:
        kind = self.kind
        if kind == "auto":
            kind = "nginx" if shutil.which("nginx") else "serve"
        if self.port and not port_is_free(self.port):
            raise RuntimeError(f"port {self.port} on 127.0.0.1 is in use: pick another with --port")
        if kind == "nginx":
            self._start_nginx()
        else:
            self._start_serve()
        self.kind = kind
        self.url = f"http://127.0.0.1:{self.port}/"
        self._wait_ready()
        n = self.workers
        how = f"{kind}, {n} process{'es' if n > 1 else ''}" if kind == "serve" else kind
        log.info("serving %s at %s (%s, pid %d)", self.root, self.url, how, self.proc.pid)
        return self.url

    def _start_serve(self) -> None:
        port_file = self.tmp / "port"
        cmd = [sys.executable, "-m", "distlearn.dataset.serve", str(self.root)]
        cmd += ["--port", str(self.port), "--port-file", str(port_file)]
        cmd += ["--workers", str(self.workers)]
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        )
        errors = self.tmp / "serve.log"
        with open(errors, "w") as err:
            self.proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent, stderr=err)
        deadline = time.monotonic() + SERVER_START_S
        while not port_file.exists():
            if self.proc.poll() is not None:
                why = errors.read_text(errors="replace").strip().splitlines()[-1:] or [""]
                raise RuntimeError(
                    f"the data server exited ({describe(self.proc.returncode)}): {why[0]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the data server did not start in {SERVER_START_S:.0f} s: {cmd}"
                )
            time.sleep(0.05)
        self.port = int(port_file.read_text())

    def _start_nginx(self) -> None:
        for _attempt in range(5):  # a free port can be taken between our check and nginx's bind
            port = self.port or free_port()
            conf = self.tmp / "nginx.conf"
            conf.write_text(NGINX_CONF.format(tmp=self.tmp, port=port, root=self.root))
            cmd = ["nginx", "-p", str(self.tmp), "-c", str(conf), "-e", str(self.tmp / "error.log")]
            self.proc = subprocess.Popen(
                cmd, preexec_fn=_die_with_parent, stderr=subprocess.DEVNULL
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                if not port_is_free(port):
                    self.port = port
                    return
                time.sleep(0.05)
            stop_processes([self.proc], grace=2)
            errors = (self.tmp / "error.log").read_text(errors="replace")[-2000:]
            if "Address already in use" not in errors or self.port:
                raise RuntimeError(f"nginx did not start ({cmd}):\n{errors}")
        raise RuntimeError("nginx: no free port after 5 attempts")

    def _wait_ready(self) -> None:
        """The server answers a real request for a file we know is there."""
        deadline = time.monotonic() + SERVER_START_S
        probe = self.url + "train.csv"
        while True:
            try:
                with urllib.request.urlopen(probe, timeout=2) as r:
                    r.read(1)
                return
            except OSError as err:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"the {self.kind} data server does not answer {probe}: {err}"
                    ) from err
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc], grace=5)  # nginx: SIGTERM is a fast shutdown
            self.proc = None
        shutil.rmtree(self.tmp, ignore_errors=True)


NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    types {{ text/csv csv; image/png png; }}
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        autoindex off;
        disable_symlinks on;
    }}
}}
"""


# ----------------------------------------------------------------------------- the job


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, _frame) -> None:
    # Once is enough: a second Ctrl-C must not cut the (bounded) cleanup short.
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_job(script: Path, nodes: int, url: str, args: list[str], survive: bool = False) -> int:
    """Start `nodes` processes of `script`; wait for all, or stop all at the first failure.

    With `survive` (examples/elastic.sh), a process killed by SIGKILL is the fault the
    job is there to survive: the others go on, and the job succeeds if they all do. With
    ``--come-back`` among the script's options too, the killed process is started again
    (once, the same command and variables) and rejoins the running job; every process
    then gets the same ``--output`` folder (the one that comes back cannot ask rank 0)."""
    master_port, ipc_port = free_port(), free_port()  # ipc would otherwise take MASTER_PORT+1
    token = secrets.token_hex(16)  # the ipc tree admits only processes of this job
    restart = survive and "--come-back" in args
    if restart and "--output" not in args:
        from mnist_lib import run_folder  # (no torch at import)

        args = [*args, "--output", str(run_folder(script.name))]
    procs: list[subprocess.Popen] = []
    envs: list[dict] = []
    try:
        for rank in range(nodes):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(nodes),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(nodes),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master_port),
                IPC_PORT=str(ipc_port),
                IPC_TOKEN=token,
            )
            cmd = [sys.executable, str(script), "--data-url", url, *args]
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent))
            envs.append(env)
        log.info("started %d processes of %s: pids %s", nodes, script.name, [p.pid for p in procs])
        killed: set[int] = set()
        restarted: set[int] = set()
        while True:
            codes = [p.poll() for p in procs]
            if survive:
                for rank, c in enumerate(codes):
                    if c == -signal.SIGKILL and rank not in killed:
                        log.warning("node %d (pid %d) was killed; the others go on", rank,
                                    procs[rank].pid)  # fmt: skip
                        if restart and rank not in restarted:
                            restarted.add(rank)
                            procs[rank] = subprocess.Popen(cmd, env=envs[rank],
                                                           preexec_fn=_die_with_parent)  # fmt: skip
                            codes[rank] = None
                            log.warning("node %d started again (pid %d): it rejoins the job",
                                        rank, procs[rank].pid)  # fmt: skip
                        else:
                            killed.add(rank)
                if len(killed) == len(procs):
                    return 128 + signal.SIGKILL
                codes = [None if r in killed else c for r, c in enumerate(codes)]
                if all(c == 0 for r, c in enumerate(codes) if r not in killed):
                    return 0
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                log.error(
                    "node %d (pid %d) failed: %s; stopping the job",
                    rank,
                    procs[rank].pid,
                    describe(code),
                )
                stop_processes(procs)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)
    finally:
        stop_processes(procs)


def check_script_args(script: Path, args: list[str]) -> int:
    """Let the script's own parser judge its options once, before anything starts."""
    return subprocess.run([sys.executable, str(script), "--check-args", *args]).returncode


def script_help(script: Path) -> str:
    """The script's options, from its own --help, for the launcher's --help."""
    out = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True
    ).stdout
    # Without the script's usage, description and -h: only its option groups.
    groups = [g for g in out.split("\n\n") if g.rstrip().endswith(":") or "\n  -" in g]
    groups = [g for g in groups if not g.startswith("options:\n  -h, --help")]
    return f"options of {script.name} (passed on to every process):\n\n" + "\n\n".join(groups)


def parser(prog: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [--nodes N] [--data DIR] [--quick] [--server KIND] "
        "[--server-workers N] [--port P] [SCRIPT OPTIONS...]",
        add_help=False,
    )
    # mnist.sh and mnist-ea.sh pass these two; a user never needs to.
    p.add_argument("--script", type=Path, required=True, help=argparse.SUPPRESS)
    p.add_argument("--prog", help=argparse.SUPPRESS)
    # elastic.sh: a process killed by SIGKILL is the fault the job survives, not a failure
    p.add_argument("--survive", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    p.add_argument("--nodes", type=int, default=4, help="processes to start (default %(default)s)")
    p.add_argument("--data", type=Path, help="MNIST folder (default examples/data/mnist[-quick])")
    p.add_argument(
        "--server",
        choices=["auto", "nginx", "serve"],
        default="auto",
        help="nginx, or python -m distlearn.dataset.serve (default: nginx if installed)",
    )
    p.add_argument(
        "--server-workers",
        type=int,
        default=0,
        help="serve with python -m distlearn.dataset.serve in N processes (default: "
        "one for every 4 cores, at most 8, when serve is the server)",
    )
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_ITEMS} items per split, one epoch")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prog = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--prog"), None)
    p = parser(prog)
    a, script_args = p.parse_known_args(argv)
    if a.help:
        print(p.format_help() + "\n" + script_help(a.script))
        return 0
    if a.nodes < 1:
        p.error(f"--nodes must be at least 1, not {a.nodes}")
    if a.server_workers < 0:
        p.error(f"--server-workers must be at least 1 (0: the default), not {a.server_workers}")
    if a.server_workers and a.server == "nginx":
        p.error("--server-workers is for --server serve (nginx keeps its one worker)")
    if a.server_workers:
        a.server = "serve"
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = script_args + (["--quick"] if a.quick else [])
    code = check_script_args(a.script, args)
    if code != 0:
        return code

    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_interrupted)
    data = a.data or prepare_mnist.DEFAULT_OUT.with_name("mnist-quick" if a.quick else "mnist")
    server = Server(data, a.server, a.port, a.server_workers)
    code = 1
    try:
        prepare_mnist.prepare(data, limit=QUICK_ITEMS if a.quick else None)
        url = server.start()
        code = run_job(a.script.resolve(), a.nodes, url, args, a.survive)
    except Interrupted as sig:
        log.error("%s: stopping every process and the server", sig)
        code = 128 + sig.signum
    except RuntimeError as err:  # the server could not start: say why, no traceback
        log.error("%s", err)
    finally:
        # Ctrl-C again while cleaning up must not leave the server behind.
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        server.stop()
    if code != 0:  # on success, node 0's result line stays the last line
        what = describe(code) if code < 128 else describe(128 - code)
        print(f"{a.script.name}: FAILED ({what})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
