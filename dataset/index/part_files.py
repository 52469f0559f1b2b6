"""Finding part files: a folder or URL listed, a brace pattern expanded, their sizes.

``http://host/shard-{000..019}.tar`` names 20 parts; a folder (local, or any fsspec URL)
is listed and its part files kept (``part-*``, ``.tar``, ``.tgz``, ``.tfrecord(s)``,
``.gz``), sorted by name. An index file (``.csv``, ``.tsv``, ``.pt``) among them is
refused: it is an index, not a part.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from ..errors import PartError
from ..fetch import sources as src
from ..fetch.retry import with_retries
from ..options import FetchOptions

__all__ = [
    "MAX_PATTERN_NAMES",
    "brace_count",
    "expand_braces",
    "is_part_source",
    "list_part_sizes",
    "list_parts",
]

_PART_NAME = re.compile(r"(\.tar|\.tgz|\.tfrecords?|\.gz)$|^part-", re.IGNORECASE)


_BRACES = re.compile(r"\{([^{}]*)\}")


_RANGE = re.compile(r"(\d+)\.\.(\d+)")


# The most names a brace pattern may stand for: a typo such as {0..999999999} would
# otherwise build a billion strings before anything could say so.
MAX_PATTERN_NAMES = 1_000_000


def brace_count(pattern: str) -> int:
    """How many names `pattern` stands for (:func:`expand_braces`), without making them."""
    count = 1
    for m in _BRACES.finditer(pattern):
        rng = _RANGE.fullmatch(m.group(1))
        count *= max(0, int(rng[2]) - int(rng[1]) + 1) if rng else len(m.group(1).split(","))
    return count


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{000..019}`` ranges (zero padding kept) and ``{a,b}`` alternatives;
    :class:`PartError` for a pattern of more than :data:`MAX_PATTERN_NAMES` names."""
    count = brace_count(pattern)
    if count > MAX_PATTERN_NAMES:
        raise PartError(f"{pattern}: the pattern stands for {count:,} names (at most "
                         f"{MAX_PATTERN_NAMES:,}): a range with a digit too many?")  # fmt: skip
    return _expand(pattern)


def _expand(pattern: str) -> list[str]:
    m = _BRACES.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    rng = _RANGE.fullmatch(body)
    if rng:
        lo, hi = rng.group(1), rng.group(2)
        width = len(lo) if lo.startswith("0") else 0
        choices = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        choices = body.split(",")
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [x for c in choices for x in _expand(head + c + tail)]


def has_scheme(index: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", index) is not None


def is_part_source(index: Any) -> bool:
    """Does ``index`` name part files (rather than a CSV, a .pt or a labelled directory)?

    Yes for a brace pattern, a URL with a scheme ending in ``/``, and a local
    folder without sub-folders whose files look like parts (``.tar``,
    ``.tfrecord``, ``.gz``, ``part-*``).
    """
    if isinstance(index, os.PathLike):
        index = os.fspath(index)
    if not isinstance(index, str):
        return False
    if _BRACES.search(index) and brace_count(index) > 1:
        return True
    if index.startswith("file://"):
        index = index[len("file://") :]
    elif has_scheme(index):
        return index.endswith("/")
    if not os.path.isdir(index):
        return False
    names = [e for e in os.scandir(index) if not e.name.startswith((".", "_"))]
    if not names or any(e.is_dir() for e in names):
        return False
    return all(_PART_NAME.search(e.name) for e in names)


_INDEX_FILE = re.compile(r"\.(csv|tsv|pt)$", re.IGNORECASE)


def retry_policy(fetch: FetchOptions | None) -> dict:
    """The retry options of a fetch policy, for :func:`dataset.fetch.retry.with_retries`."""
    fetch = fetch or FetchOptions()
    return {"retries": fetch.retries, "backoff": fetch.backoff, "max_backoff": fetch.max_backoff}


def list_parts(
    url: str, storage_options: dict | None = None, fetch: FetchOptions | None = None
) -> list[str]:
    """The part files of a folder URL (any fsspec store) or brace pattern, sorted by name."""
    return [name for name, _ in list_part_sizes(url, storage_options, fetch)]


def list_part_sizes(
    url: str, storage_options: dict | None = None, fetch: FetchOptions | None = None
) -> list[tuple[str, int | None]]:
    """``(part, size in bytes or None)`` for the parts of a folder URL or brace pattern.

    Hidden files and markers (names starting with ``.`` or ``_``, e.g.
    Hadoop's ``_SUCCESS``) are skipped; sub-folders are not descended into. A
    listing is retried like a fetch (``fetch``: the policy); a missing folder is not.
    """
    import fsspec

    url = os.fspath(url)
    if _BRACES.search(url):
        return [(name, None) for name in sorted(expand_braces(url))]
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    hint = (
        "; for a server without folder listings, name the parts with a brace pattern "
        "such as 'http://host/train/shard-{000..099}.tar', or name the index file "
        f"itself, such as {url.rstrip('/') + '/train.csv'!r}"
        if src.is_http(url)
        else ""
    )
    try:
        entries = with_retries(
            lambda: fs.ls(path, detail=True), f"{url} (listing)", **retry_policy(fetch)
        )
    except FileNotFoundError:
        raise PartError(f"{url}: no such folder{hint}") from None
    except Exception as err:  # an HTTP server without listings, a denied bucket, ...
        raise PartError(f"{url}: cannot list part files ({err}){hint}") from err
    parts = []
    for e in entries:
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if e.get("type") == "directory" or name.startswith((".", "_")):
            continue
        size = e.get("size")
        parts.append((e["name"], int(size) if isinstance(size, int) else None))
    if not parts:
        raise PartError(f"{url}: no part files found{hint}")
    if has_scheme(url) and not url.startswith("file://"):
        parts = [(fs.unstrip_protocol(p) if not has_scheme(p) else p, n) for p, n in parts]
    return sorted(parts)


def refuse_index_files(url: str, parts: Sequence[str]) -> None:
    """A folder that holds index files is not a folder of part files: say which to open."""
    found = [p.rsplit("/", 1)[-1] for p in parts if _INDEX_FILE.search(p)]
    found.sort(key=lambda name: (name.lower().endswith(".pt"), name))  # CSV/TSV first
    if found:
        folder = url if url.endswith("/") else url + "/"
        raise PartError(
            f"{url} is a folder that holds index files ({', '.join(found[:5])}): open one, "
            f"such as Dataset({folder + found[0]!r}); to read its files as part files "
            "instead, pass record_format="
        )
