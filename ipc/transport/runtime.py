"""The private runtime directory: rendezvous files, Unix sockets and FIFOs of this user's trees.

It is trusted only once verified: a real directory (not a symbolic link),
owned by this user, with no access for anyone else (mode 0700). On a shared
host another user could otherwise plant it, swap the sockets in it, or have
us write a secret through a symbolic link. A directory that fails the check
is left alone and the next candidate name is used (`distlearn-ipc-<uid>.1`,
`.2`, ...), which every process of this user tries in the same order, so the
processes of one job still meet; when all candidates are taken, a clear error.

Files are created with O_EXCL | O_NOFOLLOW relative to the directory's file
descriptor, read back only if they are regular files of ours that nobody
else can read, and replaced atomically by rename.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import stat
import tempfile
import time
from pathlib import Path

from ..errors import IPCError

__all__ = [
    "create_private",
    "listened_on",
    "private_file",
    "problem_with",
    "read_private",
    "read_secret_file",
    "remove",
    "replace_private",
    "runtime_dir",
    "socket_path",
    "sweep_dead_sockets",
]

log = logging.getLogger(__name__)

CANDIDATES = 8  # distlearn-ipc-<uid>, .1 ... .7
MAX_FILE = 64 << 10  # rendezvous files are small JSON; never read more
# sockaddr_un holds 108 bytes including the final NUL.
MAX_SOCKET_PATH = 107
_warned: set[str] = set()


def problem_with(path: Path) -> str | None:
    """Why `path` cannot be our private directory, or None if it can."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "it does not exist"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by us (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"its mode {stat.S_IMODE(st.st_mode):04o} lets other users in (want 0700)"
    return None


def runtime_dir() -> Path:
    """This user's verified private directory under $TMPDIR (created 0700 if missing)."""
    base = Path(tempfile.gettempdir())
    uid = os.getuid()
    refused = []
    for i in range(CANDIDATES):
        path = base / (f"distlearn-ipc-{uid}" + (f".{i}" if i else ""))
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
            # mkdir honours the umask, which may only remove bits: 0700 or less. Make it exact.
            os.chmod(path, 0o700, follow_symlinks=False)
        why = problem_with(path)
        if why is None:
            if refused and str(path) not in _warned:
                _warned.add(str(path))
                log.warning("ipc: not using %s; using %s instead", "; ".join(refused), path)
            return path
        refused.append(f"{path} ({why})")
    raise IPCError(
        "ipc: no private runtime directory could be made under "
        f"{base}: {'; '.join(refused)}. Remove those directories, or point TMPDIR at a "
        "directory only you can access"
    )


def _dir_fd(directory: Path) -> int:
    why = problem_with(directory)
    if why is not None:
        raise IPCError(f"ipc: refusing to use {directory}: {why}")
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def create_private(directory: Path, name: str, data: bytes) -> None:
    """Create `directory/name` (mode 0600) holding `data`; fails if the name exists.

    The file appears whole: written under a temporary name, then linked in place
    without replacing anything."""
    _publish(directory, name, data, replace=False)


def replace_private(directory: Path, name: str, data: bytes) -> None:
    """Make `directory/name` (mode 0600) hold `data`, whatever it held: a reader sees the
    old content or the new, never a part."""
    _publish(directory, name, data, replace=True)


def _publish(directory: Path, name: str, data: bytes, replace: bool) -> None:
    dfd = _dir_fd(directory)
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        if replace:
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        else:
            # link() never replaces an existing name: two roots cannot overwrite each other.
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        os.close(dfd)


def private_file(st: os.stat_result) -> bool:
    """Whether `st` is a regular file of ours that no other user can read or write."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def read_private(directory: Path, name: str) -> bytes | None:
    """The content of `directory/name` if it is a regular file of ours that only we
    can read (at most MAX_FILE bytes); None if it is missing or fails a check."""
    dfd = _dir_fd(directory)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except OSError:
        return None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not private_file(st) or st.st_size > MAX_FILE:
            log.warning("ipc: ignored %s/%s: not a private regular file of ours", directory, name)
            return None
        return os.read(fd, MAX_FILE)
    finally:
        os.close(fd)


def remove(directory: Path, name: str) -> None:
    """Remove `directory/name` if it is there."""
    with contextlib.suppress(OSError):
        os.unlink(directory / name)


def socket_path(tag: str) -> str:
    """A fresh Unix socket path in the runtime directory, named after this process (see
    `sweep_dead_sockets`); checked against the kernel's limit."""
    directory = runtime_dir()
    global _swept
    if not _swept:
        _swept = True
        sweep_dead_sockets(directory)
    path = str(directory / f"{tag}-{os.getpid()}-{secrets.token_hex(4)}.sock")
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise IPCError(
            f"ipc: the Unix socket path {path} is longer than {MAX_SOCKET_PATH} bytes; "
            "point TMPDIR at a shorter directory"
        )
    return path


_swept = False  # once per process: a sweep reads the whole directory
_SOCKET_NAME = re.compile(r"[a-z]+-([0-9]+)-[0-9a-f]{8}\.sock")


def sweep_dead_sockets(directory: Path, min_age: float = 60.0) -> int:
    """Remove socket files in `directory` that nobody listens on; returns how many.

    A process that closes its tree removes its sockets; one that was killed (SIGKILL,
    the OOM killer) cannot, and on a long-lived host its files would pile up. Only our
    own sockets older than `min_age` seconds whose process is dead are candidates, and
    each is removed only if a connection to it is refused: a process in another pid
    namespace sharing the directory looks dead from here while it still listens."""
    removed = 0
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            m = _SOCKET_NAME.fullmatch(entry.name)
            if m is None:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if (
                    not stat.S_ISSOCK(st.st_mode)
                    or st.st_uid != os.getuid()
                    or now - st.st_mtime < min_age
                ):
                    continue
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                if not listened_on(entry.path):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                        removed += 1
            except (OSError, OverflowError):
                continue  # alive, gone meanwhile, or not ours to judge
    return removed


def listened_on(path: str) -> bool:
    """Whether a process listens on the Unix socket at `path` (a refused connection, or
    no file there: nobody does)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except BlockingIOError:
            return True  # its backlog is full: it listens
        except OSError:
            return True  # not ours to judge: keep it
    return True


def read_secret_file(path: str | os.PathLike) -> str:
    """The token in `path`, a file that only this user can read (as ssh demands of its keys)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        raise IPCError(f"ipc: cannot open the secret file {path}: {err.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IPCError(f"ipc: the secret file {path} is not a regular file")
        if st.st_uid != os.getuid():
            raise IPCError(f"ipc: the secret file {path} is owned by uid {st.st_uid}, not by us")
        if st.st_mode & 0o077:
            raise IPCError(
                f"ipc: the secret file {path} has mode {stat.S_IMODE(st.st_mode):04o}: "
                f"other users can read it; run `chmod 600 {path}`"
            )
        token = os.read(fd, MAX_FILE).decode(errors="strict").strip()
    except UnicodeDecodeError:
        raise IPCError(f"ipc: the secret file {path} is not text") from None
    finally:
        os.close(fd)
    return token  # (auth.check_token judges it, as it judges every token)
