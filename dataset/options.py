"""The option names each stage takes, and the check that a misspelt one fails at once.

``Dataset(...)`` and ``sampled_batcher(...)`` take flat keywords; each name
belongs to one group below (the stage that reads it). :func:`check` runs where
the options are given, so ``Dataset(url, num_worker=4)`` raises ``TypeError``
naming ``num_workers`` instead of failing late, or never.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# CSV/TSV and other index files (dataset.index, dataset.sources)
INDEX = ("sep", "meta", "url_params", "multi_hot", "allow_schemes", "cache_index")
# every read of the world: items, index/meta/.pt files, part files (dataset.fetch)
FETCH = ("timeout", "retries", "backoff", "max_backoff", "headers", "redirects", "max_item_bytes")
# the local disk cache (dataset.cache)
CACHE = ("cache_items", "cache_dir", "max_cache_bytes")
# folders of part files (dataset.parts)
PARTS = (
    "record_format",
    "resident_parts",
    "label_key",
    "labels",
    "check_crc",
    "storage_options",
    "part_retries",
    "cache_parts",
    "max_part_bytes",
    "part_timeout",
)
# the batcher's own arguments (Dataset.sampled_batcher's signature)
BATCHER_ARGS = (
    "batch_size",
    "input_dims",
    "sampler",
    "processor",
    "processor_opt",
    "pool_size",
    "prefetch",
    "seed",
)
# the batcher's keyword options: sampling, workers, failure policy (dataset.batcher);
# given to Dataset(...), they become defaults for its batchers
BATCHER = (
    "sampler_opt",
    "workers",
    "num_workers",
    "drop_last",
    "cache",
    "max_failed_batches",
    "progress",
    "mp_context",
    "on_error",
    "worker_timeout",
)


def check(where: str, given: Iterable[str], *groups: Iterable[str]) -> None:
    """Raise TypeError for a name in `given` that no group has, naming the closest valid one."""
    valid = sorted({name for group in groups for name in group})
    for name in given:
        if name in valid:
            continue
        if name in BATCHER_ARGS:
            raise TypeError(f"{where} got {name!r}: pass it to sampled_batcher()")
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else f"; valid options: {', '.join(valid)}"
        raise TypeError(f"{where} got an unknown option {name!r}{hint}")
