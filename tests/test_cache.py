"""dataset.cache: atomic entries, LRU eviction, and several real processes sharing one cache."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

import distlearn.dataset.fetch.cache
from distlearn.dataset import Dataset, DatasetError
from distlearn.dataset.fetch import hostlock
from distlearn.dataset.fetch.cache import Cache
from tests.conftest import repo_env, wait_for_file

CACHE_PY = distlearn.dataset.fetch.cache.__file__
TRAILER = 16  # length + CRC-32 after each entry


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
    assert cache.hits == 2 and cache.size() == 11 + 2 * TRAILER  # each entry: payload, trailer
    cache.put("http://h/a", b"AA")  # overwrite replaces
    assert cache.get("http://h/a") == b"AA"
    assert cache.get(("http://h/b", 0, 10)) is None  # a byte range is its own key
    cache.clear()
    assert cache.size() == 0 and cache.get("http://h/a") is None


def test_local_files_are_read_where_they_lie_not_from_the_cache(tmp_path):
    """Keyed by the path alone, a cached local file was served stale after it changed."""
    from distlearn.dataset import Fetcher

    item = tmp_path / "item.bin"
    item.write_bytes(b"OLD!")
    cache = Cache(tmp_path / "c")
    with Fetcher(cache=cache) as f:
        assert f.read(str(item)) == b"OLD!"
        item.write_bytes(b"NEW!")
        assert f.read(str(item)) == b"NEW!"
    assert str(item) not in cache and cache.size() == 0


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
    entry = 300 - TRAILER  # 300 bytes on disk
    cache = Cache(tmp_path, max_cache_bytes=1000)
    for i, name in enumerate("abc"):
        cache.put(name, bytes(entry))
        os.utime(cache.path(name), (100 + i, 100 + i))  # a, b, c from old to new
    assert cache.get("a") is not None  # a becomes the most recently used
    cache.put("d", bytes(entry))  # 1200 > 1000: evict the least recently used (b) down to 900
    assert [n for n in "abcd" if n in cache] == ["a", "c", "d"]
    assert cache.size() == 900


def test_failed_producer_leaves_nothing(tmp_path):
    cache = Cache(tmp_path)

    def broken():
        raise ConnectionError("server went away")

    with pytest.raises(ConnectionError):
        cache.fill("u", broken)
    assert "u" not in cache
    assert not [p for p in cache.objects.rglob("*") if p.is_file()]
    assert cache.fill("u", lambda: b"ok") == b"ok"
    assert cache.fill("u", broken) == b"ok"  # a hit: the producer is not called


CHILD = r"""
import os, sys, time, random, hashlib, importlib, types
# Load dataset/fetch/cache.py (and the modules it imports) without the package:
# importing the package would import torch, which takes seconds per child on a
# busy machine and is not what is tested.
pkg = types.ModuleType("dlcache")
pkg.__path__ = [os.path.dirname(os.path.dirname(os.environ["CACHE_PY"]))]
sys.modules["dlcache"] = pkg
Cache = importlib.import_module("dlcache.fetch.cache").Cache

def body(url, size):
    seed = hashlib.sha256(url.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]

mode, root, log, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if mode == "fill":
    cache = Cache(root)
    for i in range(n):
        url = f"http://host/part-{i:03d}"
        def download(url=url):
            with open(log, "a") as lf:
                lf.write(url + "\n")
            time.sleep(0.01)  # a slow download: the others must wait, not repeat it
            return body(url, 200_000)
        assert cache.fill(url, download) == body(url, 200_000), url
elif mode == "churn":
    cache = Cache(root, max_cache_bytes=400_000)
    rng = random.Random(os.getpid())
    seen = 0
    for i in range(n):
        url = f"item-{rng.randrange(40)}"
        if i % 2:  # as part files are read: the entry, whoever evicts what meanwhile
            assert cache.fill(url, lambda url=url: body(url, 50_000)) == body(url, 50_000)
            continue
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
    def download():
        open(log, "w").write("started\n")
        time.sleep(60)
        return b"never"
    cache.fill("http://host/stuck", download)
elif mode == "ledger":  # holds the ledger's lock, as a flush or an eviction does
    cache = Cache(root)
    with cache._global():
        open(log, "w").write("started\n")
        time.sleep(60)
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
    assert Cache(tmp_path / "cache").size() == 12 * (200_000 + TRAILER)


def test_processes_churning_a_small_cache(tmp_path):
    seen = run_children(tmp_path, "churn", 150, procs=3)
    assert sum(map(int, seen)) > 0  # hits happened, and every hit was checked
    cache = Cache(tmp_path / "cache", max_cache_bytes=400_000)
    assert cache.size() <= 400_000
    assert not list(cache.objects.rglob(".tmp-*"))


def _holding_child(tmp_path, mode: str, script: str = CHILD) -> subprocess.Popen:
    """A child in `mode` ("hang": filling an entry; "ledger": holding the ledger's lock),
    once it holds its lock."""
    (tmp_path / "child.py").write_text(script)
    started = tmp_path / "started"
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "child.py"), mode, str(tmp_path / "cache"), str(started),
         "1"], env=repo_env(CACHE_PY=CACHE_PY),
    )  # fmt: skip
    try:
        wait_for_file(started, proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def test_killed_filler_releases_the_lock(tmp_path):
    proc = _holding_child(tmp_path, "hang")
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cache = Cache(tmp_path / "cache")
    assert "http://host/stuck" not in cache  # the half-written entry never appeared
    t0 = time.monotonic()
    assert cache.fill("http://host/stuck", lambda: b"whole") == b"whole"
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("mode", ["hang", "ledger"])
def test_a_stopped_lock_holder_is_gone_on_without(tmp_path, caplog, mode):
    """A process stopped (SIGSTOP, Ctrl-Z, a debugger) while it fills an entry, or while
    it holds the ledger, made every other process of the host wait forever, before any
    collective could name it; they now go on without it after a grace period, and say so.
    The entries stay whole: each is written before it has its name."""
    proc = _holding_child(tmp_path, mode)
    proc.send_signal(signal.SIGSTOP)
    try:
        cache = Cache(tmp_path / "cache", max_cache_bytes=1000)
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="distlearn.dataset.fetch.cache"):
            assert cache.fill("http://host/stuck", lambda: b"whole") == b"whole"
            assert cache.put("other", bytes(100))  # a flush of the ledger: 1% of the limit
        assert time.monotonic() - t0 < hostlock.STOPPED_GRACE + 10
        assert f"process {proc.pid} holds its lock and is stopped" in caplog.text
        assert cache.get("http://host/stuck") == b"whole" and cache.get("other") == bytes(100)
    finally:
        proc.kill()
        proc.wait()
    assert cache.fill("http://host/later", lambda: b"after") == b"after"  # the locks work on


def test_a_working_lock_holder_is_waited_for(tmp_path):
    """A holder that runs, however slowly, is not gone on without: the entry is its."""
    proc = _holding_child(tmp_path, "hang", CHILD.replace("time.sleep(60)", "time.sleep(3)"))
    try:
        got = Cache(tmp_path / "cache").fill("http://host/stuck", lambda: b"ours")
        assert got == b"never" and proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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


def test_damaged_entries_read_as_misses_and_are_removed(tmp_path, caplog):
    cache = Cache(tmp_path)
    for name in ("cut", "flipped", "foreign"):
        cache.put(name, body(name, 1000))
    p = cache.path("cut")
    p.write_bytes(p.read_bytes()[:600])  # a crash or a full disk mid-write
    p = cache.path("flipped")
    raw = bytearray(p.read_bytes())
    raw[10] ^= 0xFF  # a bad sector
    p.write_bytes(bytes(raw))
    cache.path("foreign").write_bytes(body("foreign", 1000))  # no trailer at all
    for name in ("cut", "flipped", "foreign"):
        assert cache.get(name) is None and name not in cache
    assert cache.corrupt == 3 and "damaged" in caplog.text
    assert cache.fill("cut", lambda: b"fresh") == b"fresh" and cache.get("cut") == b"fresh"


def test_oversized_entry_is_not_stored_and_a_large_one_survives_its_own_write(tmp_path):
    cache = Cache(tmp_path, max_cache_bytes=1000)
    cache.put("small", bytes(100))
    assert cache.put("huge", bytes(2000)) is False and "huge" not in cache
    assert cache.fill("huge", lambda: bytes(2000)) == bytes(2000)  # served, not stored
    # 950 bytes: past the 90% low-water mark on its own, so eviction must not take it
    assert cache.put("large", bytes(950))
    assert cache.get("large") == bytes(950) and "small" not in cache


def test_entries_are_synced_before_they_get_their_name(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("rename"), real_replace(a, b))[1])
    Cache(tmp_path).put("u", b"data")
    assert calls == ["fsync", "rename"]


def test_the_cache_directory_must_be_private(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # whoever can write here chooses what the trainer reads
    with pytest.raises(DatasetError, match="writable by other users"):
        Cache(shared)
    if os.geteuid() == 0:  # only root can give a folder away
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 4321, 4321)
        with pytest.raises(DatasetError, match="belongs to uid 4321"):
            Cache(theirs)
    assert Cache(tmp_path / "new").root.stat().st_mode & 0o777 == 0o700


def test_a_folder_given_as_cache_is_refused_where_it_is_given(tmp_path):
    """cache= takes a cache object; a folder there used to fail every item with an
    AttributeError and end the epoch with "no item"."""
    index = tmp_path / "train.csv"
    index.write_text("filename\na.bin\n")
    with pytest.raises(TypeError, match=r"cache must be a cache object .*use cache_dir="):
        Dataset(str(index)).sampled_batcher(batch_size=1, input_dims=(1,), cache=str(tmp_path))
