"""A local disk cache keyed by URL, shared safely by the processes of one host.

    from distlearn.dataset.cache import Cache

    cache = Cache()                               # ~/.cache/distlearn, 64 GiB
    data = cache.get(url)                         # bytes, or None on a miss
    cache.put(url, data)
    data = cache.fill(url, lambda: download(url))   # one download per host

What it guarantees, with several processes reading, writing and evicting:

- A reader gets a whole, intact entry or a miss: an entry is written to a
  temporary file, synced to disk, then renamed into place, and carries its
  length and a CRC-32 in a 16-byte trailer. A truncated or corrupt entry (a
  crash, a full disk, a bad sector) reads as a miss, is removed, and is
  fetched again.
- Entries are handed out as bytes, never as paths: an entry that is being
  read cannot be evicted under its reader (the open file survives an unlink).
- ``fill`` holds a per-URL file lock, so when several processes want the same
  part file one downloads it and the others wait and read it.
- Least recently used entries are evicted (a hit refreshes the entry's mtime)
  once the cache grows past ``max_cache_bytes``, never the entry just written;
  an entry larger than the whole cache is not stored at all.
- The directory must be ours: owned by this user and not writable by others,
  since whoever can write it chooses what the trainer reads.
- A cache that cannot be written (a full disk, a quota, a read-only mount) costs
  its entries, never the data: a ``put`` that fails is logged and returns False,
  and ``fill`` and ``map_fill`` hand out what was fetched or made all the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import stat
import struct
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distlearn.common.envvars import env_str

from ..errors import DatasetError
from .hostlock import HostLock

if TYPE_CHECKING:
    from ..options import CacheOptions

__all__ = [
    "DEFAULT_MAX_BYTES",
    "Cache",
    "default_cache_dir",
    "disk_cache",
    "intact",
    "item_cache",
    "seal",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 << 30
# Evict down to this fraction of the limit, so a full cache does not rescan
# its directory on every put.
_LOW_WATER = 0.9
# A temporary file this old was left by a process that died mid-write.
_STALE_TMP_S = 3600
# Every entry ends with: magic, payload length, CRC-32 of the payload.
_TRAILER = struct.Struct("<4sQI")
_MAGIC = b"DLC1"


def default_cache_dir() -> Path:
    """``$DISTLEARN_CACHE``, else ``$XDG_CACHE_HOME/distlearn``, else ``~/.cache/distlearn``."""
    env = env_str("DISTLEARN_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = env_str("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "distlearn"


def _private_dir(path: Path) -> None:
    """Create `path` (0700) or check that an existing one is ours and not writable by others."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise DatasetError(
            f"cache directory {path} belongs to uid {st.st_uid}, not to this user "
            f"({os.geteuid()}); pick another cache_dir"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DatasetError(
            f"cache directory {path} is writable by other users (mode "
            f"{stat.S_IMODE(st.st_mode):o}), who could replace what the trainer reads; "
            f"chmod go-w {path} or pick another cache_dir"
        )


def seal(data: bytes | bytearray | memoryview) -> bytes:
    """The trailer that makes `data` a cache entry."""
    return _seal_chunks([data])


def _seal_chunks(chunks: list) -> bytes:
    crc, size = 0, 0
    for c in chunks:
        crc = zlib.crc32(c, crc)
        size += memoryview(c).nbytes
    return _TRAILER.pack(_MAGIC, size, crc)


def intact(payload: bytes, trailer: bytes) -> bool:
    """Whether `payload` is what the entry's `trailer` says was written."""
    if len(trailer) != _TRAILER.size:
        return False
    magic, length, crc = _TRAILER.unpack(trailer)
    return magic == _MAGIC and length == len(payload) and zlib.crc32(payload) == crc


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
        for d in (self.root, self.objects, self.locks):
            _private_dir(d)
        self._ledger = self.root / "size"  # bytes written since the last exact count
        self._dirs: set[Path] = set()
        self._unaccounted = 0  # bytes this process wrote, not yet in the ledger
        self._flushed_at = time.monotonic()
        self._flush_bytes = max(1, self.max_bytes // 100)
        self.hits = 0
        self.misses = 0
        self.corrupt = 0
        self.unwritten = 0  # entries that could not be stored (a full disk...)
        self._write_errors: set[int | None] = set()

    def __repr__(self) -> str:
        return f"Cache({str(self.root)!r}, max_cache_bytes={self.max_bytes})"

    def __getstate__(self) -> dict:
        # (a worker process starts with its own counters)
        return {"root": self.root, "max_bytes": self.max_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"], state["max_bytes"])

    def _global(self) -> HostLock:
        """The lock of the ledger and of eviction."""
        return HostLock(str(self.root / "cache.lock"), f"cache {self.root}")

    def _entry_lock(self, url: str | tuple) -> HostLock:
        """The lock of one entry's filling (held while it is made: once per host)."""
        return HostLock(str(self.locks / (self.path(url).name + ".lock")), f"cache entry {url}")

    def path(self, url: str | tuple) -> Path:
        """Where the entry for ``url`` lives (whether or not it exists).

        A key may also be a tuple such as ``(url, offset, length)`` (a byte range).
        The file holds the payload and a trailer: read it with :meth:`get`.
        """
        key = url if isinstance(url, str) else repr(tuple(url))
        # (a local file's name may hold bytes that are not UTF-8: os.fsdecode's surrogates)
        h = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
        return self.objects / h[:2] / h

    # ------------------------------------------------------------ reading

    def get(self, url: str | tuple) -> bytes | None:
        """The cached bytes of ``url``, or None; a hit makes it most recently used.

        A damaged entry counts as a miss: it is removed (and logged), so the
        caller fetches and stores it again.
        """
        p = self.path(url)
        try:
            with open(p, "rb") as f:  # an open file stays readable if it is evicted now
                st = os.fstat(f.fileno())
                data = f.read(max(0, st.st_size - _TRAILER.size))
                trailer = f.read()
        except FileNotFoundError:
            self.misses += 1
            return None
        if not intact(data, trailer):
            self.corrupt += 1
            self.misses += 1
            log.warning("cache %s: entry for %s is damaged (%d bytes); refetching", self.root,
                        url, st.st_size)  # fmt: skip
            self._remove_damaged(p, st)
            return None
        self._touch(p)
        self.hits += 1
        return data

    def _remove_damaged(self, p: Path, seen: os.stat_result) -> None:
        # another process may have replaced it with a good entry since we read it
        with contextlib.suppress(FileNotFoundError), self._global() as held:
            if not held:  # (its holder is stopped: the damaged entry is left to a rewrite)
                return
            now = p.stat()
            if (now.st_ino, now.st_size, now.st_mtime_ns) == (
                seen.st_ino, seen.st_size, seen.st_mtime_ns
            ):  # fmt: skip
                p.unlink()

    def __contains__(self, url: str | tuple) -> bool:
        return self.path(url).exists()

    @staticmethod
    def _touch(p: Path) -> bool:
        try:
            os.utime(p)
            return True
        except FileNotFoundError:
            return False

    # ------------------------------------------------------------ writing

    def put(self, url: str | tuple, data: bytes | bytearray | memoryview) -> bool:
        """Store ``data`` as the entry for ``url`` (atomically); False when it is too large
        or cannot be written (a full disk: logged, the caller keeps its data)."""
        if len(data) + _TRAILER.size > self.max_bytes:
            log.debug("cache %s: %s (%d bytes) is larger than the cache; not stored",
                      self.root, url, len(data))  # fmt: skip
            return False
        return self._try_write(url, data)

    def _try_write(self, url: str | tuple, data: Any) -> bool:
        try:
            self._write(url, data)
            return True
        except OSError as err:
            self.unwritten += 1
            if err.errno not in self._write_errors:  # once per kind of failure
                self._write_errors.add(err.errno)
                log.warning(
                    "cache %s: cannot store entries (%s); reading on without caching them "
                    "(%s was fetched and is used)", self.root, err.strerror or err, url
                )  # fmt: skip
            return False

    def mapped(self, url: str | tuple) -> memoryview | None:
        """The entry of ``url`` memory-mapped read-only (its payload), or None on a miss.

        Every process that maps an entry shares its pages (one copy per host).
        The trailer's magic and length are checked, not its CRC, which would
        read every page; an entry is written whole before it has its name.
        """
        p = self.path(url)
        try:
            with open(p, "rb") as f:
                st = os.fstat(f.fileno())
                mm = None
                if st.st_size >= _TRAILER.size:
                    mm = mmap.mmap(f.fileno(), st.st_size, prot=mmap.PROT_READ)
        except FileNotFoundError:
            self.misses += 1
            return None
        if mm is not None:
            magic, length, _ = _TRAILER.unpack(mm[st.st_size - _TRAILER.size :])
            if magic == _MAGIC and length == st.st_size - _TRAILER.size:
                self._touch(p)
                self.hits += 1
                return memoryview(mm)[:length]
            mm.close()
        self.corrupt += 1
        self.misses += 1
        log.warning("cache %s: mapped entry for %s is damaged; rebuilding", self.root, url)
        self._remove_damaged(p, st)
        return None

    def map_fill(self, url: str | tuple, produce: Callable[[], list]) -> memoryview:
        """:meth:`mapped`, where on a miss ``produce()`` writes the entry (once per host).

        ``produce`` returns the payload as a list of buffers, written one after
        the other (no copy into one). Other processes wanting the same entry
        wait for it, then map it too.
        """
        view = self.mapped(url)
        if view is not None:
            return view
        with self._entry_lock(url):  # (not held: its holder is stopped; made here too)
            view = self.mapped(url)
            if view is None:
                made = produce()
                if not self._try_write(url, made):  # (a full disk: this process's own copy)
                    return memoryview(b"".join(made))
                view = self.mapped(url)
        if view is None:
            raise DatasetError(f"cache {self.root}: cannot map the entry just written for {url}")
        return view

    def fill(self, url: str | tuple, produce: Callable[[], bytes]) -> bytes:
        """The bytes of ``url``'s entry; on a miss ``produce()`` makes them, once per host.

        A per-URL file lock makes other processes wanting the same URL wait for
        this one's download instead of repeating it. If ``produce`` raises,
        nothing is stored and the error propagates.
        """
        data = self.get(url)
        if data is not None:
            return data
        with self._entry_lock(url):  # (not held: its holder is stopped; made here too)
            data = self.get(url)  # another process filled it while we waited
            if data is not None:
                return data
            data = produce()
            self.put(url, data)
            return data

    def _write(self, url: str | tuple, data: bytes | bytearray | memoryview | list) -> None:
        chunks = data if isinstance(data, list) else [data]
        p = self.path(url)
        if p.parent not in self._dirs:
            p.parent.mkdir(exist_ok=True, mode=0o700)
            self._dirs.add(p.parent)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                for c in chunks:
                    f.write(c)
                f.write(_seal_chunks(chunks))
                f.flush()
                os.fsync(f.fileno())  # on disk before it has its name: no torn entry
                size = f.tell()
            os.replace(tmp, p)  # readers see the whole entry or none
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._account(size, keep=p)

    # ------------------------------------------------------------ eviction

    def _account(self, size: int, keep: Path | None = None) -> None:
        # Bytes written are added to the shared ledger in bulk (every 1% of the
        # limit, or every second), not per entry: a lock and a ledger rewrite
        # per small item would cost more than the item. The cache may so
        # overshoot its limit by about 1% per writing process, briefly.
        self._unaccounted += size
        now = time.monotonic()
        if self._unaccounted < self._flush_bytes and now - self._flushed_at < 1.0:
            return
        with self._global() as held:
            if not held:  # (counted at the next flush: no ledger written by two at once)
                return
            total = self._read_ledger() + self._unaccounted
            if total > self.max_bytes:
                total = self._evict_locked(int(self.max_bytes * _LOW_WATER), keep)
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

    def _evict_locked(self, target: int, keep: Path | None = None) -> int:
        entries = sorted(self._scan(), key=lambda e: e[0])  # oldest use first
        total = sum(size for _, size, _ in entries)
        evicted = 0
        for _, size, p in entries:
            if total <= target:
                break
            if p == keep:  # the entry just written is what its writer is about to use
                continue
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                evicted += 1
            total -= size
        if evicted:
            log.debug("cache %s: evicted %d entries, %d bytes remain", self.root, evicted, total)
        return total

    def evict(self, target_bytes: int | None = None) -> int:
        """Evict least recently used entries down to ``target_bytes``; returns bytes left."""
        with self._global():  # (not held: its holder is stopped; the scan is exact)
            total = self._evict_locked(self.max_bytes if target_bytes is None else target_bytes)
            self._ledger.write_text(f"{total}\n")
            self._unaccounted = 0  # the scan counted everything
            return total

    def size(self) -> int:
        """Bytes held by entries now, trailers included (an exact count)."""
        return self._scan_total()

    def clear(self) -> None:
        """Remove every entry."""
        self.evict(0)


def disk_cache(options: CacheOptions) -> Cache:
    """A :class:`Cache` at ``options.cache_dir`` of at most ``options.max_cache_bytes``."""
    return Cache(options.cache_dir, options.max_cache_bytes)


def item_cache(options: CacheOptions) -> Any:
    """The cache for fetched items: ``options.cache`` (any object with the Cache's
    get/put/fill), or a disk cache with ``cache_items``, else None."""
    if options.cache is not None:
        return options.cache
    return disk_cache(options) if options.cache_items else None
