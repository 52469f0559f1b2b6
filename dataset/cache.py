"""A local disk cache keyed by URL, shared safely by the processes of one host.

    from distlearn.dataset.cache import Cache

    cache = Cache()                               # ~/.cache/distlearn, 64 GiB
    data = cache.get(url)                         # bytes, or None on a miss
    cache.put(url, data)
    path = cache.fill(url, lambda f: download(url, f))   # one download per host

Every entry is written to a temporary file in the cache and renamed into
place, so a reader sees a whole entry or none. ``fill`` holds a per-URL file
lock, so when several processes want the same part file one downloads it and
the others wait and read it. Least recently used entries are evicted (a hit
refreshes the entry's mtime) once the cache grows past ``max_cache_bytes``;
an entry evicted while another process reads it stays readable to that
process (POSIX unlink semantics).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from filelock import FileLock

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 30
# Evict down to this fraction of the limit, so a full cache does not rescan
# its directory on every put.
_LOW_WATER = 0.9
# A temporary file this old was left by a process that died mid-write.
_STALE_TMP_S = 3600


def default_cache_dir() -> Path:
    """``$DISTLEARN_CACHE``, else ``$XDG_CACHE_HOME/distlearn``, else ``~/.cache/distlearn``."""
    env = os.environ.get("DISTLEARN_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "distlearn"


class Cache:
    """A directory of entries named by the SHA-256 of their URL, with LRU eviction."""

    def __init__(
        self, cache_dir: str | os.PathLike | None = None, max_cache_bytes: int | None = None
    ):
        self.root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.max_bytes = DEFAULT_MAX_BYTES if max_cache_bytes is None else int(max_cache_bytes)
        if self.max_bytes <= 0:
            raise ValueError(f"max_cache_bytes must be positive, got {max_cache_bytes}")
        self.objects = self.root / "objects"
        self.locks = self.root / "locks"
        for d in (self.objects, self.locks):
            d.mkdir(parents=True, exist_ok=True)
        self._ledger = self.root / "size"  # bytes written since the last exact count
        self._lock_pid = -1  # file locks belong to one process: rebuilt after a fork
        self._dirs: set[Path] = set()
        self._unaccounted = 0  # bytes this process wrote, not yet in the ledger
        self._flushed_at = time.monotonic()
        self._flush_bytes = max(1, self.max_bytes // 100)
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        return f"Cache({str(self.root)!r}, max_cache_bytes={self.max_bytes})"

    def __getstate__(self) -> dict:
        # FileLock objects are per process; rebuild them in a worker process.
        return {"root": self.root, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"], state["max_bytes"])

    @property
    def _global(self) -> FileLock:
        if self._lock_pid != os.getpid():
            self._global_lock = FileLock(str(self.root / "cache.lock"))
            self._lock_pid = os.getpid()
        return self._global_lock

    def path(self, url: str | tuple) -> Path:
        """Where the entry for ``url`` lives (whether or not it exists).

        A key may also be a tuple such as ``(url, offset, length)`` (a byte range).
        """
        key = url if isinstance(url, str) else repr(tuple(url))
        h = hashlib.sha256(key.encode("utf-8")).hexdigest()
        return self.objects / h[:2] / h

    # ------------------------------------------------------------ reading

    def get(self, url: str) -> bytes | None:
        """The cached bytes of ``url``, or None; a hit makes it most recently used."""
        p = self.path(url)
        try:
            with open(p, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.misses += 1
            return None
        self._touch(p)
        self.hits += 1
        return data

    def get_path(self, url: str) -> Path | None:
        """The local path of a cached ``url``, or None. Open it soon: it may be evicted."""
        p = self.path(url)
        if not self._touch(p):
            self.misses += 1
            return None
        self.hits += 1
        return p

    def __contains__(self, url: str) -> bool:
        return self.path(url).exists()

    @staticmethod
    def _touch(p: Path) -> bool:
        try:
            os.utime(p)
            return True
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------ writing

    def put(self, url: str, data: bytes | bytearray | memoryview) -> Path:
        """Store ``data`` as the entry for ``url`` (atomically) and return its path."""
        return self._write(url, lambda f: f.write(data))

    def fill(self, url: str, writer: Callable[[BinaryIO], object]) -> Path:
        """The path of ``url``'s entry; on a miss ``writer(file)`` writes it, once per host.

        A per-URL file lock makes other processes wanting the same URL wait for
        this one's download instead of repeating it. If ``writer`` raises,
        nothing is stored and the error propagates.
        """
        p = self.get_path(url)
        if p is not None:
            return p
        with FileLock(str(self.locks / (self.path(url).name + ".lock"))):
            p = self.path(url)
            if self._touch(p):  # another process filled it while we waited
                return p
            return self._write(url, writer)

    def _write(self, url: str, writer: Callable[[BinaryIO], object]) -> Path:
        p = self.path(url)
        if p.parent not in self._dirs:
            p.parent.mkdir(exist_ok=True)
            self._dirs.add(p.parent)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                writer(f)
                size = f.tell()
            os.replace(tmp, p)  # readers see the whole entry or none
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._account(size)
        return p

    # ------------------------------------------------------------ eviction

    def _account(self, size: int) -> None:
        # Bytes written are added to the shared ledger in bulk (every 1% of the
        # limit, or every second), not per entry: a lock and a ledger rewrite
        # per small item would cost more than the item. The cache may so
        # overshoot its limit by about 1% per writing process, briefly.
        self._unaccounted += size
        now = time.monotonic()
        if self._unaccounted < self._flush_bytes and now - self._flushed_at < 1.0:
            return
        with self._global:
            total = self._read_ledger() + self._unaccounted
            if total > self.max_bytes:
                total = self._evict_locked(int(self.max_bytes * _LOW_WATER))
            self._ledger.write_text(f"{total}\n")
        self._unaccounted = 0
        self._flushed_at = now

    def _read_ledger(self) -> int:
        try:
            return int(self._ledger.read_text())
        except (FileNotFoundError, ValueError):
            return self._scan_total()

    def _scan(self) -> list[tuple[float, int, Path]]:
        entries = []
        for sub in self.objects.iterdir():
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                for p in sub.iterdir():
                    with contextlib.suppress(FileNotFoundError):
                        st = p.stat()
                        if not p.name.startswith(".tmp-"):
                            entries.append((st.st_mtime, st.st_size, p))
                        elif time.time() - st.st_mtime > _STALE_TMP_S:
                            p.unlink()
        return entries

    def _scan_total(self) -> int:
        return sum(size for _, size, _ in self._scan())

    def _evict_locked(self, target: int) -> int:
        entries = sorted(self._scan(), key=lambda e: e[0])  # oldest use first
        total = sum(size for _, size, _ in entries)
        evicted = 0
        for _, size, p in entries:
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                evicted += 1
            total -= size
        if evicted:
            log.debug("cache %s: evicted %d entries, %d bytes remain", self.root, evicted, total)
        return total

    def evict(self, target_bytes: int | None = None) -> int:
        """Evict least recently used entries down to ``target_bytes``; returns bytes left."""
        with self._global:
            total = self._evict_locked(self.max_bytes if target_bytes is None else target_bytes)
            self._ledger.write_text(f"{total}\n")
            self._unaccounted = 0  # the scan counted everything
            return total

    def size(self) -> int:
        """Bytes held by entries now (an exact count)."""
        return self._scan_total()

    def clear(self) -> None:
        """Remove every entry."""
        self.evict(0)


def item_cache(opts: dict) -> Cache | None:
    """For :class:`dataset.Dataset`: pop ``cache_items``, ``cache_dir``, ``max_cache_bytes``.

    Returns the cache for fetched items when ``cache_items=True`` (so a second
    epoch over HTTP reads from local disk), else None.
    """
    cache_items = opts.pop("cache_items", False)
    cache_dir = opts.pop("cache_dir", None)
    max_cache_bytes = opts.pop("max_cache_bytes", None)
    if not cache_items:
        return None
    return Cache(cache_dir, max_cache_bytes)
