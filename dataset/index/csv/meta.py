"""The meta file beside a CSV index: the URL prefix (and query string) of its relative names.

torch-dataset's meta file is one column of any name with the prefix on line 2
(``train-meta.csv`` beside ``train.csv``, or ``index-meta.csv``); ours may instead have
``url_prefix`` and ``url_params`` columns.
"""

from __future__ import annotations

import csv
import logging
from typing import Any

from ...errors import BadIndex, FetchError
from ...fetch import sources as src
from ...fetch.fetcher import Fetcher
from ...fetch.files import read_bytes

log = logging.getLogger("distlearn.dataset.index")

__all__ = ["read_meta"]


# Columns of a meta file we know by name; any other single column is the URL prefix.
PREFIX_COLUMNS = ("url_prefix", "urlPrefix")


PARAMS_COLUMNS = ("url_params", "urlParams")


def _meta_candidates(index: str) -> list[str]:
    """Where a meta file may sit beside `index`: ``<stem>-meta.csv`` (torch-dataset's
    name, e.g. ``train-meta.csv`` for ``train.csv``), then ``index-meta.csv``."""
    folder = src.parent_of(index)
    name = index.rsplit("/", 1)[-1].split("?", 1)[0]
    stem = name.rsplit(".", 1)[0] if "." in name else name
    names = [f"{stem}-meta.csv", "index-meta.csv"]
    return [src.resolve(folder, n) for n in dict.fromkeys(names)]


def read_meta(
    index: str, meta: str | None, cache: Any = None, fetcher: Fetcher | None = None
) -> tuple[str, str]:
    """``(url_prefix, url_params)`` from the meta file beside the index (or `meta`).

    torch-dataset's meta file is one column of any name (``hostname``,
    ``prefix``...) with the URL prefix on line 2, taken as it is. Ours may
    instead have ``url_prefix`` and ``url_params`` columns. No meta file: ("", "").
    """
    if meta is not None:
        location, data = meta, read_bytes(meta, cache=cache, fetcher=fetcher)
    else:
        for location in _meta_candidates(index):
            try:
                data = read_bytes(location, missing_ok=True, cache=cache, fetcher=fetcher)
            except FetchError as err:
                # S3 without ListBucket and CloudFront answer 403, not 404, for a key that
                # does not exist: the optional meta file is then taken as absent (`meta=`
                # names one that must be read).
                if not err.cause.startswith("HTTP 403"):
                    raise
                log.info("%s: HTTP 403 for the optional meta file: taken as absent", location)
                data = None
            if data is not None:
                break
    if data is None:
        return "", ""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise BadIndex(f"{location}: meta file is not UTF-8 text ({err})") from err
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        raise BadIndex(f"{location}: a meta file holds a header and, on line 2, the URL prefix")
    rows = list(csv.reader(lines[:2]))
    header = [h.strip() for h in rows[0]]
    values = dict(zip(header, (v.strip() for v in rows[1]), strict=False))
    known = [h for h in header if h in PREFIX_COLUMNS + PARAMS_COLUMNS]
    if known:
        for h in header:
            if h not in known:
                log.warning("%s: unknown meta column %r (ignored)", location, h)
        prefix = next((values.get(h, "") for h in PREFIX_COLUMNS if h in values), "")
        params = next((values.get(h, "") for h in PARAMS_COLUMNS if h in values), "")
        return prefix, params
    if len(header) == 1:  # torch-dataset: line 2 is the prefix, whatever the column's name
        value = rows[1][0] if len(rows[1]) == 1 else lines[1]  # a prefix holding a comma
        return value.strip(), ""
    raise BadIndex(
        f"{location}: cannot tell the URL prefix among columns {header}; a meta file is one "
        "column (any name) with the prefix on line 2, or url_prefix and url_params columns"
    )
