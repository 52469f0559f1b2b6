"""A local folder as an index: labels are the names of its sub-folders, hidden files skipped."""

from __future__ import annotations

import logging
import os

import numpy as np

from ..errors import BadIndex
from .rows import NameRows, Resolver
from .table import Index, labelled

log = logging.getLogger("distlearn.dataset.index")

__all__ = ["from_directory"]


def from_directory(root: str, multi_hot: bool = False) -> Index:
    """Files under sub-folders are labelled by the (top) sub-folder name; top files unlabeled.

    Hidden files and folders (leading dot) are skipped; examples are in label,
    then path order, so every machine sees the same order. Symbolic links are
    followed, as torchvision's ImageFolder follows them (a class may be a link, two
    may share a folder), except a link back to a folder above it: a loop, skipped
    with a warning. Names that are not UTF-8 are kept as the file system gives them
    (``os.fsdecode``: undecodable bytes as surrogates), so every file is found and
    opened, as ``os.walk`` and ``open`` find them.
    """
    root = os.path.abspath(root)
    found: list[tuple[str, str | None]] = []
    # each folder walked: the (device, inode) of it and of the folders above it
    above = {root: frozenset([_identity(root)])}

    def unreadable(err: OSError) -> None:
        # os.walk skips a folder it cannot list: a whole label (or part of one) would
        # vanish from the index, and the label ids after it shift.
        raise BadIndex(f"{err.filename}: cannot list this folder of the index ({err.strerror})")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=True):
        keep = []
        for d in dirnames:
            if d.startswith("."):
                continue
            path = os.path.join(dirpath, d)
            key = _identity(path)
            if key is not None and key in above[dirpath]:  # (os.walk: round until ELOOP)
                log.warning("%s: a link to a folder above it (a loop); not walked", path)
                continue
            above[path] = above[dirpath] | {key}
            keep.append(d)
        dirnames[:] = keep
        rel_dir = os.path.relpath(dirpath, root)
        label = None if rel_dir == "." else rel_dir.split(os.sep)[0]
        for f in filenames:
            if not f.startswith("."):
                found.append((os.path.join(rel_dir, f) if label else f, label))
    if not found:
        raise BadIndex(f"{root}: empty directory index (no visible files)")
    found.sort()
    names = [os.fsencode(rel) for rel, _ in found]
    size = np.asarray([len(n) for n in names], dtype=np.int64)
    buf = np.frombuffer(b"".join(names), dtype=np.uint8)
    table = NameRows(buf, np.cumsum(size) - size, size, Resolver(root + os.sep))
    distinct = sorted({lab for _, lab in found if lab})
    where = {lab: i for i, lab in enumerate(distinct)}
    ids = np.asarray([where[lab] for _, lab in found if lab], dtype=np.int64)
    ptr = np.zeros(len(found) + 1, dtype=np.int64)
    np.cumsum([lab is not None for _, lab in found], out=ptr[1:])
    return labelled(table, ptr, ids, distinct, root, multi_hot=multi_hot)


def _identity(path: str) -> tuple[int, int] | None:
    """A folder's (device, inode), its links followed; None where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
