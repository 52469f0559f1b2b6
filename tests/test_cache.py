"""dataset.cache: atomic entries, LRU eviction, and several real processes sharing one cache."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import distlearn.dataset.cache
from distlearn.dataset.cache import Cache
from tests.conftest import repo_env, wait_for_file

CACHE_PY = distlearn.dataset.cache.__file__


def body(url: str, size: int) -> bytes:
    """Content derived from the URL, so any reader can check what it got."""
    seed = hashlib.sha256(url.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def test_put_get_keyed_by_url(tmp_path):
    cache = Cache(tmp_path / "c")
    assert cache.get("http://h/a") is None and cache.misses == 1
    cache.put("http://h/a", b"A")
    cache.put("http://h/b", b"B" * 10)
    assert cache.get("http://h/a") == b"A" and cache.get("http://h/b") == b"B" * 10
    assert "http://h/a" in cache and "http://h/c" not in cache
    assert cache.hits == 2 and cache.size() == 11
    cache.put("http://h/a", b"AA")  # overwrite replaces
    assert cache.get("http://h/a") == b"AA"
    assert cache.get_path("http://h/b").read_bytes() == b"B" * 10
    cache.clear()
    assert cache.size() == 0 and cache.get("http://h/a") is None


def test_default_dir_and_bad_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLEARN_CACHE", str(tmp_path / "env"))
    assert Cache().root == tmp_path / "env"
    monkeypatch.delenv("DISTLEARN_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert Cache().root == tmp_path / "home" / ".cache" / "distlearn"
    with pytest.raises(ValueError, match="max_cache_bytes"):
        Cache(tmp_path, max_cache_bytes=0)


def test_lru_eviction(tmp_path):
    cache = Cache(tmp_path, max_cache_bytes=1000)
    for i, name in enumerate("abc"):
        cache.put(name, bytes(300))
        os.utime(cache.path(name), (100 + i, 100 + i))  # a, b, c from old to new
    assert cache.get("a") is not None  # a becomes the most recently used
    cache.put("d", bytes(300))  # 1200 > 1000: evict the least recently used (b) down to 900
    assert [n for n in "abcd" if n in cache] == ["a", "c", "d"]
    assert cache.size() == 900


def test_failed_writer_leaves_nothing(tmp_path):
    cache = Cache(tmp_path)

    def broken(f):
        f.write(b"partial")
        raise ConnectionError("server went away")

    with pytest.raises(ConnectionError):
        cache.fill("u", broken)
    assert "u" not in cache
    assert not [p for p in cache.objects.rglob("*") if p.is_file()]
    assert cache.fill("u", lambda f: f.write(b"ok")).read_bytes() == b"ok"


CHILD = r"""
import os, sys, time, random, hashlib, importlib.util
# Load dataset/cache.py on its own: importing the package would import torch,
# which takes seconds per child on a busy machine and is not what is tested.
spec = importlib.util.spec_from_file_location("cache", os.environ["CACHE_PY"])
cache_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cache_mod)
Cache = cache_mod.Cache

def body(url, size):
    seed = hashlib.sha256(url.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]

mode, root, log, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if mode == "fill":
    cache = Cache(root)
    for i in range(n):
        url = f"http://host/part-{i:03d}"
        def writer(f, url=url):
            with open(log, "a") as lf:
                lf.write(url + "\n")
            time.sleep(0.01)  # a slow download: the others must wait, not repeat it
            f.write(body(url, 200_000))
        p = cache.fill(url, writer)
        assert p.read_bytes() == body(url, 200_000), url
elif mode == "churn":
    cache = Cache(root, max_cache_bytes=400_000)
    rng = random.Random(os.getpid())
    seen = 0
    for _ in range(n):
        url = f"item-{rng.randrange(40)}"
        got = cache.get(url)
        if got is None:
            cache.put(url, body(url, 50_000))
        else:
            assert got == body(url, 50_000), url  # never a torn or foreign entry
            seen += 1
    with open(log, "a") as lf:
        lf.write(f"{seen}\n")
elif mode == "hang":
    cache = Cache(root)
    def writer(f):
        f.write(b"half")
        f.flush()
        open(log, "w").write("started\n")
        time.sleep(60)
    cache.fill("http://host/stuck", writer)
"""


def run_children(tmp_path, mode, n, procs=4, timeout=120):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    log = tmp_path / f"{mode}.log"
    children = [
        subprocess.Popen(
            [sys.executable, str(script), mode, str(tmp_path / "cache"), str(log), str(n)],
            env=repo_env(CACHE_PY=CACHE_PY),
            stderr=subprocess.PIPE,
        )
        for _ in range(procs)
    ]
    try:
        for c in children:
            _, err = c.communicate(timeout=timeout)
            assert c.returncode == 0, err.decode()
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    return log.read_text().split()


def test_processes_download_each_url_once(tmp_path):
    fills = run_children(tmp_path, "fill", 12)
    assert sorted(fills) == [f"http://host/part-{i:03d}" for i in range(12)]
    assert Cache(tmp_path / "cache").size() == 12 * 200_000


def test_processes_churning_a_small_cache(tmp_path):
    seen = run_children(tmp_path, "churn", 150, procs=3)
    assert sum(map(int, seen)) > 0  # hits happened, and every hit was checked
    cache = Cache(tmp_path / "cache", max_cache_bytes=400_000)
    assert cache.size() <= 400_000
    assert not list(cache.objects.rglob(".tmp-*"))


def test_killed_filler_releases_the_lock(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    started = tmp_path / "started"
    proc = subprocess.Popen(
        [sys.executable, str(script), "hang", str(tmp_path / "cache"), str(started), "1"],
        env=repo_env(CACHE_PY=CACHE_PY),
    )
    try:
        wait_for_file(started, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cache = Cache(tmp_path / "cache")
    assert "http://host/stuck" not in cache  # the half-written entry never appeared
    t0 = time.monotonic()
    p = cache.fill("http://host/stuck", lambda f: f.write(b"whole"))
    assert p.read_bytes() == b"whole" and time.monotonic() - t0 < 5
    assert isinstance(p, Path)


def _child_put(cache: Cache, q) -> None:
    cache.put("from-child", b"child")
    q.put(cache.get("from-parent"))


def test_usable_after_fork(tmp_path):
    """Process workers fork with the cache in hand: its file locks must not be inherited."""
    import multiprocessing as mp

    cache = Cache(tmp_path, max_cache_bytes=1 << 20)
    cache.put("from-parent", b"parent")  # the parent has used its locks
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_child_put, args=(cache, q))
    proc.start()
    try:
        assert q.get(timeout=60) == b"parent"
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert cache.get("from-child") == b"child"
