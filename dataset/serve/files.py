"""Opening request paths strictly below the root, and the cache of small files."""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import stat
from urllib.parse import unquote_to_bytes

from .limits import CACHE_BYTES, BadRequest

__all__ = ["Files"]


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)
_RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x04, 0x08
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


class Files:
    """Opens request paths strictly below `root` and caches small files' bytes.

    `open(path)` returns (fd, stat) or None; the fd is the caller's to close.
    The kernel enforces the boundary (no `..`, no symlink, no other mount
    escape) on each open, so a tree that changes under the server cannot make
    it read outside `root`.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.path.realpath(root)
        self.root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._cache: collections.OrderedDict[str, tuple[tuple, bytes]] = collections.OrderedDict()
        self._cached_bytes = 0
        self._openat2 = self._probe_openat2()

    def _probe_openat2(self):
        if _SYS_OPENAT2 is None:
            return None
        try:
            syscall = ctypes.CDLL(None, use_errno=True).syscall
        except (OSError, AttributeError):
            return None
        how = _OpenHow(_OPEN_FLAGS | os.O_DIRECTORY, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
        fd = syscall(_SYS_OPENAT2, self.root_fd, b".", ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:  # ENOSYS (old kernel) or EPERM (a seccomp filter): walk instead
            return None
        os.close(fd)
        how = _OpenHow(_OPEN_FLAGS, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
        size = ctypes.sizeof(how)
        ref = ctypes.byref(how)
        return lambda rel: syscall(_SYS_OPENAT2, self.root_fd, rel, ref, size)

    def _open_fd(self, parts: list[bytes]) -> int:
        if self._openat2 is not None:
            fd = self._openat2(b"/".join(parts))
            if fd < 0:
                raise OSError(ctypes.get_errno(), "openat2")
            return fd
        fd = self.root_fd
        try:  # one component at a time, never following a link
            for part in parts[:-1]:
                nxt = os.open(part, _OPEN_FLAGS | os.O_DIRECTORY, dir_fd=fd)
                if fd != self.root_fd:
                    os.close(fd)
                fd = nxt
            return os.open(parts[-1], _OPEN_FLAGS, dir_fd=fd)
        finally:
            if fd != self.root_fd:
                os.close(fd)

    def open(self, path: bytes) -> tuple[int, os.stat_result] | None:
        """The regular file at URL path `path` (percent-encoded, '/'-rooted), or None.

        BadRequest(503) when it cannot be opened for want of files or memory: that
        is not "no such file", and a client must not take it for one."""
        try:
            raw = unquote_to_bytes(path)
        except (TypeError, ValueError):
            return None
        parts = [p for p in raw.split(b"/") if p and p != b"."]
        if not parts or b".." in parts or any(b"\x00" in p for p in parts):
            return None
        try:
            fd = self._open_fd(parts)
        except OSError as err:
            if err.errno in _OUT_OF:
                raise BadRequest(503, f"out of resources ({os.strerror(err.errno)})") from None
            return None
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return fd, st

    def small(self, key: bytes, fd: int, st: os.stat_result) -> bytes:
        """The bytes of a small file, from the cache while its identity is unchanged."""
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._cache.get(key)
        if hit is not None and hit[0] == ident:
            self._cache.move_to_end(key)
            return hit[1]
        data = os.pread(fd, st.st_size, 0)
        if hit is not None:
            self._cached_bytes -= len(hit[1])
        self._cache[key] = (ident, data)
        self._cached_bytes += len(data)
        while self._cached_bytes > CACHE_BYTES:
            _, (_, old) = self._cache.popitem(last=False)
            self._cached_bytes -= len(old)
        return data

    def close(self) -> None:
        os.close(self.root_fd)
