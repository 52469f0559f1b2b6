"""Part files on any store: list, partition by file, read in the background, sample.

    ds = Dataset("s3://bucket/train/", partition=rank, partitions=world)
    batcher = ds.sampled_batcher(batch_size=128, sampler="part-linear-permutation", ...)

A folder (or fsspec URL of one, or a brace pattern such as
``http://host/shard-{000..019}.tar``) holds part files. Sorted by name, file
i belongs to partition ``i % partitions``. An epoch walks this partition's
parts in order (``part-linear``, ``part-linear-permutation``) or in a new
random order (``part-permutation-permutation``), and the records of each part
in order or in a random permutation. The next parts download and parse in
background threads while the current one is read, and at most
``resident_parts`` parsed parts are in memory at once, so memory is bounded
by the part size, not by the dataset size.

How many records an epoch holds is not known until every part has been read
once: ``len(index)`` is an estimate that becomes exact after the first epoch.
Before any part is read it reads this partition's first part and scales its
record count by the part sizes of the listing (records per byte); then the
parts read so far stand for the rest, by size when sizes are known.

Every read is retried with the fetch policy (``timeout``, ``retries``,
``backoff``...); a part that still fails, or that decompresses to more than
``max_part_bytes``, is logged, counted in ``failed_parts`` and read as empty.
A part loader that finishes nothing within ``part_timeout`` raises PartError.

A :class:`PartIndex` is a *part source*, not an :class:`dataset.index.table.Index`:
its records have no positions, so nothing addresses them one by one. Its
contract, all the batcher and the ``part-*`` samplers of
:mod:`dataset.sampling.samplers` use:

- ``origin``, ``labels`` (grow as ``label_key`` values are read, unless given),
  ``multi_hot`` (False);
- ``partition(p, n)``: the part source of one partition (file i to ``i % n``);
- ``len()``: records, an estimate until ``exact``;
- ``epoch(rng, parts, items)``: one epoch (a :class:`PartEpoch`, an iterable of
  :class:`dataset.items.Record`), parts and records each ``"linear"`` or
  ``"permutation"``, readable from any (part, record) place without reading the
  parts before it; ``stream(rng, parts, items)``: the same as a plain iterator;
- ``numbers``: each part's number in the whole listing (``partition`` keeps them);
- ``read_counters()``: what reading produced, for ``batcher.stats``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import FetchError, PartError
from ..fetch import sources as src
from ..fetch.cache import Cache, disk_cache
from ..fetch.fetcher import Fetcher
from ..fetch.local import NotRegular, open_local, read_at_most
from ..fetch.retry import with_retries
from ..fetch.scope import scope_for
from ..formats import OutOfTime, ReadStats, TooLarge, read_part
from ..items import Record
from ..options import CacheOptions, FetchOptions, Options, PartOptions
from .part_files import (
    has_scheme,
    list_part_sizes,
    refuse_index_files,
    retry_policy,
)

log = logging.getLogger(__name__)


__all__ = ["MAX_CLASS_IDS", "PartEpoch", "PartIndex", "SampleMember", "open_parts"]

# Integer class ids (label_key values, no labels= given) read at most: ids 0..id are
# named by their number as they appear, so one record's id sets how many names are
# made. ImageNet-21k has 21,841 classes; more than this needs labels=[...].
MAX_CLASS_IDS = 1 << 16


def _read_local(path: str, url: str, cap: int) -> bytes:
    """A local part, if it is a regular file of at most `cap` bytes: a FIFO would block
    the loader for ever, a device such as /dev/zero would be read until memory ran out."""
    try:
        with open_local(path) as f:
            data = read_at_most(f, cap)
    except FileNotFoundError:
        raise FetchError(url, "no such file", missing=True) from None
    except NotRegular:
        raise FetchError(url, "not a regular file (a FIFO or a device)") from None
    except OSError as err:
        raise FetchError(url, f"{type(err).__name__}: {err}") from None
    if len(data) > cap:
        raise FetchError(url, f"larger than max_part_bytes={cap}")
    return data


def _read_fsspec(url: str, storage_options: dict, cap: int, size: int | None) -> bytes:
    """A part on an fsspec store, refused by its size before it is read when the store
    says it is too large, and read at most `cap` + 1 bytes whatever it says."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    if getattr(fs, "local_file", False):  # local://, or a scheme chained onto a local path
        return _read_local(path, url, cap)
    try:
        if size is None:
            size = fs.size(path)
        if size is not None and size > cap:
            raise FetchError(url, f"{size} bytes exceed max_part_bytes={cap}")
        with fs.open(path, "rb") as f:
            data = f.read(cap + 1)
    except FileNotFoundError:
        raise FetchError(url, "no such file", missing=True) from None
    if len(data) > cap:
        raise FetchError(url, f"larger than max_part_bytes={cap}")
    return data


class _Deadline:
    """When one part's loading must be done (``part_timeout`` from its start)."""

    def __init__(self, seconds: float | None):
        self.at = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def check(self, url: str) -> None:
        left = self.left()
        if left is not None and left <= 0:
            raise OutOfTime(f"{url}: loading it ran past part_timeout")


class PartIndex:
    """The part files of one partition and what is known so far about their records.

    A part source (see the module docstring). ``options`` (a
    :class:`dataset.options.PartOptions`): ``record_format`` ("tar",
    "tfrecord", "lines"; default from the extension), ``resident_parts``
    (parsed parts in memory at most, >= 2), ``label_key`` (tar samples: the
    member whose text is the label, e.g. "cls"), ``labels`` (label names;
    without them ``label_key`` values must be integer class ids),
    ``check_crc``, ``storage_options`` (for fsspec), ``part_retries`` (per
    part download). ``cache``: a :class:`dataset.fetch.cache.Cache` for downloaded
    parts, or None; ``fetch``: the read policy.
    """

    multi_hot = False

    def __init__(
        self,
        parts: Sequence[str],
        origin: str,
        *,
        options: PartOptions | None = None,
        fetch: FetchOptions | None = None,
        cache: Cache | None = None,
        partition: int = 0,
        partitions: int = 1,
        sizes: Sequence[int | None] | None = None,
        numbers: Sequence[int] | None = None,
        labels: tuple[list[str], dict[str, int]] | None = None,
    ):
        self.options = options = options or PartOptions()
        self.parts = list(parts)
        # each part's number in the whole listing: what a position names across world sizes
        self.numbers = list(numbers) if numbers is not None else list(range(len(self.parts)))
        self.sizes = list(sizes) if sizes is not None else [None] * len(self.parts)
        self.origin = origin
        self.max_part_bytes, self.part_timeout = options.max_part_bytes, options.part_timeout
        self.fetch = fetch or FetchOptions()
        self._own_fetcher: Fetcher | None = None
        self.record_format = options.record_format
        self.resident_parts = options.resident_parts
        self.cache = cache
        self.label_key = options.label_key
        self._fixed_labels = options.labels is not None
        if labels is not None:  # a partition's: the whole's, growing together (the same ids)
            self.labels, self._label_ids = labels
        else:
            self.labels: list[str] = list(options.labels) if options.labels is not None else []
            self._label_ids = {name: i for i, name in enumerate(self.labels)}
        self.check_crc = options.check_crc
        self.storage_options = dict(options.storage_options or {})
        self.retries = options.part_retries
        self.partition_id, self.partitions = partition, partitions
        self.counts: dict[int, int] = {}  # part number -> records read from it
        self.failed: set[int] = set()  # parts whose last read failed (read as empty)
        self.stats = ReadStats()
        self.failed_parts = 0
        self.resident = 0  # parsed parts held now (loaded, not yet released by the reader)
        self.max_resident_seen = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"PartIndex({self.origin!r}, parts={len(self.parts)}, "
            f"partition={self.partition_id}/{self.partitions}, records~{len(self)})"
        )

    def __len__(self) -> int:
        """Records in this partition: exact once every part was read, else an estimate.

        With nothing read yet, the first part is read to count its records
        (what a record weighs is unknown before); the parts read stand for the
        unread ones, scaled by size when the listing gave sizes.
        """
        for n in range(len(self.parts)):
            if self.counts:
                break
            if n not in self.failed:
                self.load_part(n)
        with self._lock:
            counts, failed = dict(self.counts), set(self.failed)
        known = sum(counts.values())
        unread = [n for n in range(len(self.parts)) if n not in counts and n not in failed]
        if not unread or not counts:
            return known
        read_bytes = sum(self.sizes[n] or 0 for n in counts)
        if read_bytes and all(self.sizes[n] is not None for n in (*counts, *unread)):
            unread_bytes = sum(self.sizes[n] or 0 for n in unread)
            return known + round(unread_bytes * known / read_bytes)
        return known + round(len(unread) * known / len(counts))

    def read_counters(self) -> dict[str, int]:
        """What reading the parts produced so far, for ``batcher.stats``.

        Returns:
            `parts`, `part_bytes`, `corrupt` and `failed_parts` counts.
        """
        with self._lock:
            return {
                "parts": self.stats.parts,
                "part_bytes": self.stats.bytes,
                "corrupt": self.stats.corrupt,
                "failed_parts": self.failed_parts,
            }

    @property
    def exact(self) -> bool:
        """Whether ``len()`` is exact (every part has been read once, or failed)."""
        return len(self.counts) + len(self.failed) == len(self.parts)

    def partition(self, partition: int, partitions: int) -> PartIndex:
        """The parts of one partition: file i goes to partition ``i % partitions``.

        Args:
            partition: The partition, 0-based.
            partitions: How many partitions.

        Returns:
            The part source of that partition.

        Raises:
            ValueError: `partition` out of range.
            PartError: Fewer part files than partitions, naming both counts.
        """
        if partitions < 1 or not 0 <= partition < partitions:
            raise ValueError(f"partition must be in [0, {partitions}), got {partition}")
        if len(self.parts) < partitions:
            raise PartError(
                f"{self.origin}: {len(self.parts)} part files cannot feed {partitions} "
                "partitions (each partition reads whole files; use fewer partitions or "
                "split the data into more part files)"
            )
        return PartIndex(
            self.parts[partition::partitions],
            self.origin,
            options=self.options,
            fetch=self.fetch,
            cache=self.cache,
            partition=partition,
            partitions=partitions,
            sizes=self.sizes[partition::partitions],
            numbers=self.numbers[partition::partitions],
            labels=(self.labels, self._label_ids),
        )

    # ------------------------------------------------------------ loading

    def _read_remote(self, url: str, number: int, deadline: _Deadline) -> bytes:
        """One part file, whole, retried with the fetch policy; FetchError when it fails,
        OutOfTime when its deadline passes (a download in flight is cancelled)."""
        cap = self.max_part_bytes
        if src.is_http(url):
            fetcher = self._fetcher()
            left = deadline.left()
            # The deadline is kept on the fetcher's loop too (wait_for: its timer comes
            # before the request's own, which starts later), not only by this thread's
            # wait: woken late under load, the waiter's cancel came after the request's
            # own timeout had fired and its retry had gone out, past part_timeout.
            work = fetcher.fetch(url)
            if left is not None:
                work = asyncio.wait_for(work, max(left, 0.0))
            job = fetcher.submit(work)
            try:
                return job.result(timeout=None if left is None else max(left, 0.0) + 5.0)
            except TimeoutError:  # (asyncio's and concurrent.futures' are this one)
                job.cancel()  # the request is dropped on the fetcher's loop, retries too
                raise OutOfTime(f"{url}: its download ran past part_timeout") from None
        path = src.local_path(url)
        if path is not None:  # read here, in the loader's thread: a large file must not
            return _read_local(path, url, cap)  # hold the fetcher's loop

        def read() -> bytes:
            deadline.check(url)  # (a store's read cannot be stopped: none starts late)
            return _read_fsspec(url, self.storage_options, cap, self.sizes[number])

        policy = retry_policy(self.fetch)
        policy["retries"] = self.retries
        return with_retries(read, url, final=(FileNotFoundError, OutOfTime), **policy)

    def _fetcher(self) -> Fetcher:
        """This index's Fetcher for http(s) parts: one session, kept alive."""
        with self._lock:
            if self._own_fetcher is None:
                policy = self.fetch.fetcher_kwargs()
                policy.update(retries=self.retries, max_item_bytes=self.max_part_bytes)
                # a part is large: the fetch timeout bounds each wait for data (idle),
                # part_timeout a whole download, retries included (`_read_remote`: on the
                # fetcher's loop). No timeout of aiohttp's own for an attempt: one that
                # fell with the part's deadline turned its cancellation into a timeout,
                # which was retried past part_timeout.
                policy.update(timeout=None, idle_timeout=self.fetch.timeout)
                # the parts are in the folder (or pattern) the user named: theirs
                scope = scope_for(self.parts, None, self.fetch.credential_origins, guard=False)
                self._own_fetcher = Fetcher(pool_size=self.resident_parts, scope=scope, **policy)
                weakref.finalize(self, self._own_fetcher.close)
            return self._own_fetcher

    def _download(self, url: str, number: int, deadline: _Deadline) -> bytes:
        def read() -> bytes:
            return self._read_remote(url, number, deadline)

        if self.cache is None or not has_scheme(url) or url.startswith(("file://", "memory://")):
            return read()
        return self.cache.fill(url, read)

    def load_part(self, number: int) -> list[tuple[int, Any]]:
        """Download and parse part ``number`` of this partition: ``[(offset, record)]``.

        Download errors are retried with the fetch policy; a part that still
        fails, is missing or is too large is logged, counted in
        ``failed_parts`` and read as empty. Loading stops at ``part_timeout``
        from its start, download and parse alike, with PartError: the loader
        does not go on in the background once its waiter has given up.
        """
        url = self.parts[number]
        stats = ReadStats()
        deadline = _Deadline(self.part_timeout)
        try:
            data = self._download(url, number, deadline)
            records = read_part(
                data,
                url,
                record_format=self.record_format,
                stats=stats,
                check_crc=self.check_crc,
                max_bytes=self.max_part_bytes,
                deadline=deadline.at,
            )
            recs = list(records)
        except OutOfTime as err:
            raise PartError(
                f"{url}: the part loader finished nothing in part_timeout={self.part_timeout}s "
                f"(a stuck download or parse: {err})"
            ) from None
        except (FetchError, TooLarge) as err:
            log.error("%s: skipping this part file: %s", url, err)
            with self._lock:
                self.failed_parts += 1
                self.failed.add(number)
                self.counts.pop(number, None)
            return []
        with self._lock:
            self.counts[number] = len(recs)
            self.failed.discard(number)
            self.stats.add(stats)
        return recs

    def _load_resident(self, number: int) -> list[tuple[int, Any]]:
        """load_part, counted as resident until the reader releases it (even if it fails)."""
        try:
            return self.load_part(number)
        finally:
            with self._lock:
                self.resident += 1
                self.max_resident_seen = max(self.max_resident_seen, self.resident)

    def _release(self) -> None:
        with self._lock:
            self.resident -= 1

    def iter_parts(self, order: Sequence[int]) -> Iterator[tuple[int, list[tuple[int, Any]]]]:
        """Yield ``(part number, records)`` in ``order``, loading ahead in the background.

        At most ``resident_parts`` parts are held at once: the one the caller
        is reading (the last one yielded) and the ones loading or waiting.
        """
        pool = ThreadPoolExecutor(
            max_workers=self.resident_parts - 1, thread_name_prefix="part-loader"
        )
        pending: deque[tuple[int, Future]] = deque()
        todo = iter(order)
        try:
            for n in itertools.islice(todo, self.resident_parts):
                pending.append((n, pool.submit(self._load_resident, n)))
            while pending:
                n, fut = pending[0]
                try:
                    recs = fut.result(timeout=self.part_timeout)
                except concurrent.futures.TimeoutError:
                    raise PartError(
                        f"{self.parts[n]}: the part loader finished nothing in "
                        f"part_timeout={self.part_timeout}s (a stuck download or parse)"
                    ) from None
                pending.popleft()
                try:
                    yield n, recs
                finally:
                    # The caller asks for the next part once done with this one.
                    del recs
                    self._release()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(self._load_resident, nxt)))
        finally:
            for _, fut in pending:
                if not fut.cancel():
                    fut.add_done_callback(lambda _: self._release())
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ sampling

    def _labels_of(self, rec: Any, where: str) -> tuple[int, ...]:
        if self.label_key is None or not isinstance(rec, dict):
            return ()
        raw = rec.get(self.label_key)
        if raw is None:
            return ()
        text = raw.decode("utf-8").strip() if isinstance(raw, bytes) else str(raw).strip()
        lab = self._label_ids.get(text)
        if lab is not None:
            return (lab,)
        if self._fixed_labels:
            raise PartError(f"{where}: label {text!r} is not one of labels={self.labels}")
        try:
            lab = int(text)
        except ValueError:
            raise PartError(
                f"{where}: label {text!r} is not an integer class id; pass labels=[...] "
                "to name the classes"
            ) from None
        if lab < 0:
            raise PartError(f"{where}: negative class id {lab}")
        if lab >= MAX_CLASS_IDS:  # one record must not make the reader name 3e9 labels
            raise PartError(
                f"{where}: class id {lab} is beyond the {MAX_CLASS_IDS:,} class ids read "
                "without names; pass labels=[...] to name the classes"
            )
        while len(self.labels) <= lab:  # class ids 0..lab, named by their number
            self._label_ids[str(len(self.labels))] = len(self.labels)
            self.labels.append(str(len(self.labels)))
        return (lab,)

    def epoch(
        self, rng: np.random.Generator | None, parts: str = "linear", items: str = "linear"
    ) -> PartEpoch:
        """One epoch: parts and the records of each in order or permuted (by ``rng``).

        Args:
            rng: The epoch's generator (None: both in order).
            parts: `"linear"` or `"permutation"`: the order of the parts.
            items: `"linear"` or `"permutation"`: the order within each part.

        Returns:
            A `PartEpoch`: iterable, and readable from any (part, record) place.
        """
        return PartEpoch(self, rng, parts, items)

    def stream(
        self, rng: np.random.Generator | None, parts: str = "linear", items: str = "linear"
    ) -> Iterator[Record]:
        """One epoch of records: parts and items each in order or permuted by ``rng``.

        Args:
            rng: The epoch's generator.
            parts: `"linear"` or `"permutation"`: the order of the parts.
            items: `"linear"` or `"permutation"`: the order within each part.

        Returns:
            An iterator of each `Record`, its payload in memory (see `epoch`).
        """
        return iter(self.epoch(rng, parts, items))

    def record(self, url: str, off: int, rec: Any) -> Record:
        """The `Record` of a parsed record at byte `off` of part `url`, its labels read."""
        name = f"{url}#{off}"
        return Record(rec, self._labels_of(rec, name), name)


class PartEpoch:
    """One epoch of a part source: the order of its parts, and its records from any place.

    The part order is drawn from the epoch's generator; each part's record permutation
    from a generator of its own, keyed by the part's number in the whole listing (one
    draw of the epoch's generator, then the number), so where part k's records go does
    not depend on how many records the parts before it hold: a position (k parts done, j
    records of the next) is resumed by reading part k alone, and a part is read the same
    from any partitioning. Iterating gives every record of the epoch in order.
    """

    def __init__(self, index: PartIndex, rng: np.random.Generator | None, parts: str,
                 items: str):  # fmt: skip
        for what, mode in (("parts", parts), ("items", items)):
            if mode not in ("linear", "permutation"):
                raise ValueError(f"{what} must be 'linear' or 'permutation', got {mode!r}")
        if rng is None and "permutation" in (parts, items):
            raise ValueError("a permuted part epoch needs a generator")
        self.index, self.items = index, items
        self.local = list(range(len(index.parts)))  # this partition's parts, in epoch order
        if parts == "permutation":
            self.local = [int(i) for i in rng.permutation(len(self.local))]
        self._base = int(rng.integers(0, 2**63)) if items == "permutation" else 0

    @property
    def order(self) -> list[int]:
        """The parts of this epoch in their order, by number in the whole listing."""
        return [self.index.numbers[i] for i in self.local]

    def permutation(self, number: int, n: int) -> Any:
        """The order of the `n` records of part `number` (in the whole listing)."""
        if self.items == "linear":
            return range(n)
        return np.random.default_rng([self._base, number]).permutation(n)

    def __iter__(self) -> Iterator[Record]:
        for rec, _, _ in self.walk(0, 0):
            yield rec

    def walk(self, k: int = 0, j: int = 0) -> Iterator[tuple[Record, tuple[int, int], int]]:
        """``(record, (k', j') after it, its key)`` from record j of the k-th part on; the
        key (``number << 32 | place``) names the record whatever the partitioning."""
        index = self.index
        for ordinal, (n, recs) in enumerate(index.iter_parts(self.local[k:]), start=k):
            number, url = index.numbers[n], index.parts[n]
            perm = self.permutation(number, len(recs))
            for place in range(j if ordinal == k else 0, len(recs)):
                off, rec = recs[perm[place]]
                after = (ordinal, place + 1) if place + 1 < len(recs) else (ordinal + 1, 0)
                yield index.record(url, off, rec), after, number << 32 | place

    def part(self, number: int, j: int = 0) -> Iterator[tuple[Record, int]]:
        """``(record, key)`` of part `number` (in the whole listing) from its j-th on."""
        index = self.index
        try:
            n = index.numbers.index(number)
        except ValueError:
            raise PartError(f"{index.origin}: part {number} is not one of this partition's "
                            f"{index.numbers[:8]}...") from None  # fmt: skip
        for _, recs in index.iter_parts([n]):
            perm = self.permutation(number, len(recs))
            for place in range(j, len(recs)):
                off, rec = recs[perm[place]]
                yield index.record(index.parts[n], off, rec), number << 32 | place


def open_parts(
    index: Any,
    *,
    options: PartOptions | None = None,
    fetch: FetchOptions | None = None,
    cache: CacheOptions | None = None,
    **flat: Any,
) -> PartIndex:
    """A :class:`PartIndex` over every part file of ``index`` (unpartitioned).

    Options as typed groups, or flat keywords (``record_format=``,
    ``cache_dir=``, ``retries=``...). Downloaded parts are cached on local
    disk (``cache_dir``) unless ``cache_parts=False``.

    Args:
        index: A folder (local or any fsspec URL) or a brace pattern of part files.
        options: The part options.
        fetch: The read policy.
        cache: The disk cache's options.
        **flat (Any): Or the same as flat keywords.

    Returns:
        The part source of every part file.

    Raises:
        PartError: No such folder, a listing that failed, no part files, a folder of
            index files (naming the file to open instead), or a brace pattern of more
            than a million names.
    """
    given = Options(
        fetch=fetch or FetchOptions(), cache=cache or CacheOptions(), parts=options or PartOptions()
    )
    o = given.update("open_parts()", flat, ("parts", "cache", "fetch"))
    url = os.fspath(index)
    listed = list_part_sizes(url, o.parts.storage_options, o.fetch)
    if o.parts.record_format is None:
        refuse_index_files(url, [name for name, _ in listed])
    return PartIndex(
        [name for name, _ in listed],
        url,
        options=o.parts,
        fetch=o.fetch,
        cache=disk_cache(o.cache) if o.parts.cache_parts else None,
        sizes=[size for _, size in listed],
    )


class SampleMember:
    """A processor for tar samples: hands one member's bytes to another processor.

    ``SampleMember(Image(mode="L"))`` decodes the first of ``exts`` present in
    the sample (``png``, ``jpg``, ``jpeg``, ``webp`` by default). A class, so
    process workers can pickle it.

    Args:
        processor: The processor for the member's bytes.
        exts: The member extensions to look for, in order.

    Raises:
        TypeError: When called, on something other than a tar sample (a dict).
        KeyError: When called, on a sample with none of `exts`.
    """

    def __init__(self, processor: Any, exts: Sequence[str] = ("png", "jpg", "jpeg", "webp")):
        self.processor = processor
        self.exts = tuple(exts)

    def __call__(self, sample: Any, opt: Any, out: Any) -> Any:
        if not isinstance(sample, dict):
            raise TypeError(
                f"SampleMember needs a tar sample (a dict), got {type(sample).__name__}"
            )
        for ext in self.exts:
            data = sample.get(ext)
            if data is not None:
                return self.processor(data, opt, out)
        raise KeyError(f"sample {sample.get('__key__')!r} has none of {self.exts}")
