"""The static HTTP server every loader row reads from: nginx, or distlearn.dataset.serve.

nginx is what a real deployment would put in front of files (or a CDN would be),
so it is the default: the bench starts its own instance on a free loopback port
with a minimal config in a temporary folder (keep-alive on, access log off,
directory listings on so part-file readers can list the shard folder), and stops
it afterwards. Where nginx is not installed, `python -m distlearn.dataset.serve` stands in.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import free_port, kill_group, tree, tree_cpu_seconds, wait_port

log = logging.getLogger(__name__)

NGINX_CONF = """\
{root_only}worker_processes {workers};
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_timeout 120s;
    keepalive_requests 10000000;
{file_cache}    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        root {root};
        autoindex on;
    }}
}}
"""


def find_nginx() -> str | None:
    """The nginx binary, or None (it lives in /usr/sbin, often not on a user's PATH)."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def ensure_nginx() -> str | None:
    """nginx, installed from Debian's packages when missing and we may (root, apt-get)."""
    nginx = find_nginx()
    if nginx or os.geteuid() != 0 or not shutil.which("apt-get"):
        return nginx
    log.info("nginx missing: apt-get install -y nginx (about a minute, once)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "nginx"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("%s failed: %s", " ".join(cmd), done.stderr.strip()[-500:])
            return None
    return find_nginx()


class Server:
    """A running static file server over `root`; a context manager that always stops it."""

    def __init__(self, root: str | os.PathLike, kind: str = "auto", workers: int = 1):
        self.root = Path(root).resolve()
        self.workers = workers
        nginx = find_nginx()
        if kind == "auto":
            kind = "nginx" if nginx else "serve"
            if not nginx:
                log.warning(
                    "nginx not found; serving with python -m distlearn.dataset.serve instead"
                )
        if kind == "nginx" and not nginx:
            raise RuntimeError("nginx requested but not installed (apt-get install nginx)")
        self.kind = kind
        self._nginx = nginx
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def describe(self) -> str:
        if self.kind == "nginx":
            version = subprocess.run([self._nginx, "-v"], capture_output=True, text=True)
            return f"nginx {version.stderr.strip().split('/')[-1]}, {self.workers} worker(s)"
        return f"python -m distlearn.dataset.serve, {self.workers} process(es)"

    def start(self) -> Server:
        self._tmp = tempfile.TemporaryDirectory(prefix="bench-server-")
        tmp = self._tmp.name
        for attempt in range(5):  # a free port can be taken between probe and bind
            try:
                if self.kind == "nginx":
                    self._start_nginx(tmp)
                else:
                    self._start_serve(tmp)
                return self
            except (RuntimeError, TimeoutError) as err:
                if self.proc is not None:
                    kill_group(self.proc)
                if attempt == 4:
                    raise
                log.warning("server start failed (%s); retrying", err)
        return self

    def _start_nginx(self, tmp: str) -> None:
        self.port = free_port()
        root_only = file_cache = ""
        if os.geteuid() == 0:
            # as root: read any file, and lift the 1,024 descriptor limit so nginx can keep
            # every sample's file open (open_file_cache), as a tuned static server would;
            # without the higher limit the cache runs out of descriptors and answers 500
            # The cache must stay below the hard limit, or it fills every descriptor
            # and nginx answers 500 (seen at 20,000 files under a 20,000 hard limit).
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            nofile = 200000 if hard == resource.RLIM_INFINITY else min(200000, hard)
            root_only = f"user root root;\nworker_rlimit_nofile {nofile};\n"
            file_cache = f"    open_file_cache max={max(256, nofile // 2)} inactive=600s;\n"
        conf = Path(tmp, "nginx.conf")
        conf.write_text(
            NGINX_CONF.format(
                root_only=root_only,
                file_cache=file_cache,
                workers=self.workers,
                tmp=tmp,
                port=self.port,
                root=self.root,
            )
        )
        err = open(Path(tmp, "stderr"), "wb")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(
            [self._nginx, "-c", str(conf), "-p", tmp],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            wait_port("127.0.0.1", self.port, self.proc)
        except RuntimeError as e:
            log_text = Path(tmp, "error.log").read_text() if Path(tmp, "error.log").exists() else ""
            raise RuntimeError(f"{e}: {Path(tmp, 'stderr').read_text()} {log_text}") from None

    def _start_serve(self, tmp: str) -> None:
        port_file = Path(tmp, "port")
        repo = Path(__file__).resolve().parent.parent
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distlearn.dataset.serve",
                str(self.root),
                "--port-file",
                str(port_file),
                "--workers",
                str(self.workers),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("python -m distlearn.dataset.serve did not start")
            time.sleep(0.02)
        self.port = int(port_file.read_text())
        wait_port("127.0.0.1", self.port, self.proc)

    def cpu_seconds(self) -> float:
        """CPU the server's processes have used so far (to show what serving costs)."""
        return tree_cpu_seconds(self.proc.pid) if self.proc else 0.0

    def pids(self) -> list[int]:
        return tree(self.proc.pid) if self.proc else []

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
