"""The options of each stage, as typed groups checked where they are given.

``Dataset(...)`` and ``sampled_batcher(...)`` take flat keywords, the
convenient surface; each name belongs to one group below, the stage that
reads it. :func:`split` sorts flat keywords into their groups, so
``Dataset(url, num_worker=4)`` raises ``TypeError`` naming ``num_workers``,
and building a group checks its values (``retries=-1`` raises at once, naming
the option), before any file is read or any worker started.

    fetch     every read of the world: items, index/meta/.pt files, parts
    index     CSV/TSV and other index files
    cache     the local disk cache of items and index files
    parts     folders of part files
    workers   who fetches and decodes, how much is in flight, what a failure does
    sampling  the batcher's sampler options and epoch shape
"""

from __future__ import annotations

import dataclasses
import ipaddress
import operator
import os
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from distlearn.common.keywords import closest, unknown

__all__ = [
    "BATCHER_ARGS",
    "CACHE",
    "DEFAULT_MAX_ITEM_BYTES",
    "DEFAULT_MAX_PART_BYTES",
    "DEFAULT_PART_TIMEOUT",
    "DEFAULT_WORKER_TIMEOUT",
    "ERROR_POLICIES",
    "FETCH",
    "GROUPS",
    "INDEX",
    "PARTS",
    "REDIRECT_POLICIES",
    "CacheOptions",
    "DeviceOptions",
    "FetchOptions",
    "Group",
    "IndexOptions",
    "Options",
    "PartOptions",
    "SamplingOptions",
    "WorkerOptions",
    "check",
    "check_batcher_args",
    "check_networks",
    "check_origins",
    "origin_of",
    "spell_origin",
    "split",
]

DEFAULT_MAX_ITEM_BYTES = 1 << 30
DEFAULT_MAX_PART_BYTES = 4 << 30
DEFAULT_WORKER_TIMEOUT = 600.0
DEFAULT_PART_TIMEOUT = 600.0
REDIRECT_POLICIES = ("same-host", "any", "none")
ERROR_POLICIES = (None, "drop", "raise")


def _positive(name: str, value: Any, allow_none: bool = False, zero: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name} must be {'>= 0' if zero else '> 0'}, got {value!r}")


# -- options naming origins and networks (dataset.fetch.scope uses them) --------------

_DEFAULT_PORT = {"http": 80, "https": 443}


def origin_of(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) URL (host lower-cased, port spelled out); None
    for anything else."""
    if not url.startswith(("http://", "https://", "HTTP://", "HTTPS://")):
        return None
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return scheme, parts.hostname, port or _DEFAULT_PORT[scheme]


def check_origins(values: Any, name: str = "credential_origins") -> tuple[str, ...]:
    """``credential_origins`` checked where given: each an http(s) origin such as
    ``"https://data.example.com"`` or ``"http://10.0.0.5:8080"`` (no path, query or
    user name); returned as written, normalised (``scheme://host:port``)."""
    if values is None:
        return ()
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise TypeError(f"{name} is a list of origins such as ['https://host'], got {values!r}")
    out = []
    for value in values:
        if not isinstance(value, str):
            raise TypeError(f"{name}: {value!r} is not a string")
        parts = urllib.parse.urlsplit(value)
        origin = origin_of(value)
        if (
            origin is None
            or parts.path not in ("", "/")
            or parts.query
            or parts.fragment
            or parts.username is not None
        ):
            raise ValueError(
                f"{name}: {value!r} is not an origin: write scheme://host[:port] with "
                "http or https and nothing after the host, such as 'https://data.example.com'"
            )
        out.append(spell_origin(origin))
    return tuple(out)


def check_networks(values: Any, name: str = "allow_networks") -> tuple[str, ...]:
    """``allow_networks`` checked where given: addresses or CIDR networks (``"10.0.0.0/8"``,
    ``"127.0.0.1"``, ``"fd00::/8"``); returned normalised."""
    if values is None:
        return ()
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise TypeError(f"{name} is a list of networks such as ['10.0.0.0/8'], got {values!r}")
    out = []
    for value in values:
        try:
            out.append(str(ipaddress.ip_network(value, strict=False)))
        except (TypeError, ValueError):
            raise ValueError(
                f"{name}: {value!r} is not an address or network such as '10.0.0.0/8' "
                "or '127.0.0.1'"
            ) from None
    return tuple(out)


def spell_origin(origin: tuple[str, str, int]) -> str:
    """An origin as ``scheme://host:port`` (an IPv6 host in brackets)."""
    scheme, host, port = origin
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


class Group:
    """A typed option group: a frozen dataclass whose fields are the flat keywords."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    def given(self) -> dict[str, Any]:
        """The options that differ from the defaults (what a user passed)."""
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            default = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
            value = getattr(self, f.name)
            if value is not default and value != default:
                out[f.name] = value
        return out

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore


@dataclass(frozen=True)
class FetchOptions(Group):
    """Every read: ``timeout`` per attempt, ``retries`` with exponential ``backoff`` up to
    ``max_backoff``, extra ``headers``, which ``redirects`` to follow, ``max_item_bytes``.

    ``headers`` go only to the origins the user named: an http(s) index's own, and
    those in ``credential_origins`` (``["https://host[:port]"]``); see
    :mod:`dataset.fetch.scope`."""

    timeout: float | None = 30.0
    retries: int = 3
    backoff: float = 0.05
    max_backoff: float = 2.0
    headers: Mapping[str, str] | None = None
    redirects: str = "same-host"
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES
    credential_origins: Sequence[str] = ()

    def __post_init__(self) -> None:
        _positive("timeout", self.timeout, allow_none=True)
        _positive("retries", self.retries, zero=True)
        _positive("backoff", self.backoff, zero=True)
        _positive("max_backoff", self.max_backoff, zero=True)
        _positive("max_item_bytes", self.max_item_bytes)
        if self.redirects not in REDIRECT_POLICIES:
            raise ValueError(
                f"redirects must be one of {REDIRECT_POLICIES}, got {self.redirects!r}"
            )
        if self.headers is not None and not isinstance(self.headers, Mapping):
            raise TypeError(f"headers must be a dict, got {self.headers!r}")
        object.__setattr__(self, "credential_origins", check_origins(self.credential_origins))

    def fetcher_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :class:`dataset.fetch.fetcher.Fetcher` (its ``scope``,
        which ``credential_origins`` goes into, is the caller's to add)."""
        return {
            "timeout": self.timeout,
            "retries": self.retries,
            "backoff": self.backoff,
            "max_backoff": self.max_backoff,
            "headers": dict(self.headers or {}),
            "redirects": self.redirects,
            "max_item_bytes": self.max_item_bytes,
        }


@dataclass(frozen=True)
class IndexOptions(Group):
    """CSV/TSV indexes: ``sep``, ``meta`` file, ``url_params``, ``multi_hot`` targets,
    ``allow_schemes`` and ``allow_networks`` (non-public addresses) a remote index may
    name; ``cache_index`` keeps index files on disk."""

    sep: str | None = None
    meta: str | None = None
    url_params: str | Mapping | None = None
    multi_hot: bool = False
    allow_schemes: Sequence[str] = ()
    allow_networks: Sequence[str] = ()
    cache_index: bool = False

    def __post_init__(self) -> None:
        if self.sep is not None and (not isinstance(self.sep, str) or len(self.sep) != 1):
            raise ValueError(f"sep must be one character, got {self.sep!r}")
        if isinstance(self.allow_schemes, str):
            raise TypeError(f"allow_schemes is a list of schemes, got {self.allow_schemes!r}")
        object.__setattr__(self, "allow_schemes", tuple(s.lower() for s in self.allow_schemes))
        object.__setattr__(self, "allow_networks", check_networks(self.allow_networks))


@dataclass(frozen=True)
class CacheOptions(Group):
    """The local disk cache (``cache_dir``, ``max_cache_bytes``): of fetched items with
    ``cache_items=True``; ``cache`` an explicit cache object for items."""

    cache_items: bool = False
    cache_dir: str | os.PathLike | None = None
    max_cache_bytes: int | None = None
    cache: Any = None

    def __post_init__(self) -> None:
        _positive("max_cache_bytes", self.max_cache_bytes, allow_none=True)
        # an object with get(key) and put(key, data), such as dataset.fetch.cache.Cache;
        # a folder given here instead would fail every item, one AttributeError at a time
        has = [callable(getattr(self.cache, name, None)) for name in ("get", "put")]
        if self.cache is not None and not all(has):
            folder = isinstance(self.cache, (str, os.PathLike))
            hint = " (a folder? use cache_dir=)" if folder else ""
            raise TypeError(
                f"cache must be a cache object with get(key) and put(key, data), got "
                f"{self.cache!r}{hint}"
            )


@dataclass(frozen=True)
class PartOptions(Group):
    """Folders of part files (see :mod:`dataset.index.parts`)."""

    record_format: str | None = None
    resident_parts: int = 3
    label_key: str | None = None
    labels: Sequence[str] | None = None
    check_crc: bool = True
    storage_options: Mapping[str, Any] | None = None
    part_retries: int = 3
    cache_parts: bool = True
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES
    part_timeout: float | None = DEFAULT_PART_TIMEOUT

    def __post_init__(self) -> None:
        if self.record_format not in (None, "tar", "tfrecord", "lines"):
            raise ValueError(
                f"record_format must be 'tar', 'tfrecord' or 'lines', got {self.record_format!r}"
            )
        if not isinstance(self.resident_parts, int) or self.resident_parts < 2:
            raise ValueError(
                f"resident_parts must be >= 2 (one read, one loading), got {self.resident_parts}"
            )
        _positive("part_retries", self.part_retries, zero=True)
        _positive("max_part_bytes", self.max_part_bytes)
        _positive("part_timeout", self.part_timeout, allow_none=True)


@dataclass(frozen=True)
class WorkerOptions(Group):
    """Who fetches and decodes (``workers``, ``num_workers``, ``pool_size`` fetches each),
    ``prefetch`` batches in flight, ``worker_timeout``, ``mp_context``, the failure policy
    (``on_error``, ``max_failed_batches``), a ``progress`` bar, and the loader's metrics
    (``metrics`` on or off, ``metrics_window`` seconds, ``metrics_export``: see
    :mod:`dataset.metrics`)."""

    workers: str | None = None
    num_workers: int | None = None
    pool_size: int | None = None
    prefetch: int = 2
    worker_timeout: float | None = DEFAULT_WORKER_TIMEOUT
    mp_context: str | None = None
    on_error: str | Callable[[BaseException], Any] | None = None
    max_failed_batches: int = 3
    progress: bool = False
    metrics: bool = True
    metrics_window: float = 10.0
    metrics_export: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.metrics, bool):
            raise TypeError(f"metrics must be True or False, got {self.metrics!r}")
        _positive("metrics_window", self.metrics_window)
        if self.metrics_export is not None:
            if not self.metrics:
                raise ValueError("metrics_export needs metrics=True")
            export = self.metrics_export
            for item in export if isinstance(export, list | tuple) else [export]:
                if not (callable(item) or callable(getattr(item, "add_scalar", None))):
                    raise TypeError(
                        f"metrics_export={item!r}: want a SummaryWriter (anything with "
                        "add_scalar) or a callable taking each window's summary"
                    )
        if self.workers not in (None, "thread", "process"):
            raise ValueError(f"workers must be 'thread' or 'process', got {self.workers!r}")
        if self.num_workers is not None:
            _positive("num_workers", self.num_workers, zero=True)
        _positive("pool_size", self.pool_size, allow_none=True)
        if not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {self.prefetch}")
        if self.worker_timeout is not None and not self.worker_timeout > 0:
            raise ValueError(f"worker_timeout must be > 0 or None, got {self.worker_timeout}")
        if self.on_error not in ERROR_POLICIES and not callable(self.on_error):
            raise ValueError(
                f"on_error must be 'drop', 'raise', None or a callable, got {self.on_error!r}"
            )
        if not isinstance(self.max_failed_batches, int) or self.max_failed_batches < 1:
            raise ValueError(f"max_failed_batches must be >= 1, got {self.max_failed_batches}")


@dataclass(frozen=True)
class SamplingOptions(Group):
    """The sampler's options (``sampler_opt``: a dict, or one per joined index) and
    ``drop_last`` (an epoch ends before a short last batch)."""

    sampler_opt: Any = None
    drop_last: bool = False

    def __post_init__(self) -> None:
        opt = self.sampler_opt
        if opt is not None and not isinstance(opt, Mapping | list | tuple):
            raise TypeError(f"sampler_opt must be a dict (or a list, one per index), got {opt!r}")


@dataclass(frozen=True)
class DeviceOptions(Group):
    """Batches to an accelerator (see :mod:`dataset.device`): ``pin_memory`` (page-locked
    host batches) and ``device`` (batches copied there one ahead, on a side stream)."""

    pin_memory: bool = False
    device: Any = None

    def __post_init__(self) -> None:
        if self.device is None and self.pin_memory is False:
            return  # the default: nothing to check, and no torch to import
        from .device import check_device

        check_device(self.device, self.pin_memory)


GROUPS: dict[str, type[Group]] = {
    "fetch": FetchOptions,
    "index": IndexOptions,
    "cache": CacheOptions,
    "parts": PartOptions,
    "workers": WorkerOptions,
    "sampling": SamplingOptions,
    "device": DeviceOptions,
}
# flat names, for messages and the README
FETCH = FetchOptions.names()
INDEX = IndexOptions.names()
CACHE = CacheOptions.names()
PARTS = PartOptions.names()
# Dataset's own named arguments, and the batcher's (Dataset.sampled_batcher's signature)
DATASET_ARGS = ("index", "partition", "partitions")
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


def check(where: str, given: Iterable[str], *groups: Iterable[str]) -> None:
    """Raise TypeError for a name in `given` that no group has, naming the closest valid one.

    The closest is sought among the named arguments of Dataset() and sampled_batcher()
    too (``partiton`` is ``partition``, not ``part_timeout``), and one that belongs to
    the other call says so.

    Args:
        where: The call, for the message (`"Dataset()"`).
        given: The names given.
        *groups (Iterable[str]): The valid names, in groups.

    Raises:
        TypeError: A name no group has, naming the closest valid one.
    """
    valid = sorted({name for group in groups for name in group})
    for name in given:
        if name in valid:
            continue
        for args, call in ((BATCHER_ARGS, "sampled_batcher()"), (DATASET_ARGS, "Dataset()")):
            if name in args:
                raise TypeError(f"{where} got {name!r}: pass it to {call}")
        near = closest(name, [*valid, *BATCHER_ARGS, *DATASET_ARGS])
        if near is None:
            raise unknown(where, name, valid, noun="option")
        call = "sampled_batcher()" if near in BATCHER_ARGS else "Dataset()"
        other = f" (an argument of {call})" if near not in valid and call != where else ""
        raise TypeError(f"{where} got an unknown option {name!r}; did you mean {near!r}{other}?")


def _count(value: Any, name: str, low: int) -> int:
    """`value` as an int >= `low` (numpy's ints too), or a ValueError naming `name`."""
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}") from None
    if n < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return n


def check_batcher_args(batch_size: Any, seed: Any, input_dims: Any) -> None:
    """sampled_batcher()'s own arguments, checked where they are given (not at the first
    batch, with numpy's or torch's message)."""
    _count(batch_size, "batch_size", 1)
    _count(seed, "seed", 0)
    if isinstance(input_dims, int):
        input_dims = (input_dims,)
    try:
        dims = list(input_dims)
    except TypeError:
        raise ValueError(
            f"input_dims must be a sequence of ints >= 1, got {input_dims!r}"
        ) from None
    for d in dims:
        _count(d, f"input_dims {tuple(dims)}: each size", 1)


@dataclass(frozen=True)
class Options:
    """One typed group per stage, built from flat keywords by :func:`split`."""

    fetch: FetchOptions = field(default_factory=FetchOptions)
    index: IndexOptions = field(default_factory=IndexOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    parts: PartOptions = field(default_factory=PartOptions)
    workers: WorkerOptions = field(default_factory=WorkerOptions)
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    device: DeviceOptions = field(default_factory=DeviceOptions)

    def update(self, where: str, flat: Mapping[str, Any], groups: Sequence[str]) -> Options:
        """These options with `flat` keywords of `groups` laid over them (checked)."""
        check(where, flat, *(GROUPS[g].names() for g in groups))
        changes = {}
        for g in groups:
            mine = {k: v for k, v in flat.items() if k in GROUPS[g].names()}
            if mine:
                changes[g] = getattr(self, g).replace(**mine)
        return dataclasses.replace(self, **changes) if changes else self


def split(where: str, flat: Mapping[str, Any], groups: Sequence[str] = tuple(GROUPS)) -> Options:
    """Flat keywords sorted into typed groups: an unknown name or a bad value raises here.

    Args:
        where: The call, for messages.
        flat: The keywords.
        groups: The groups they may belong to.

    Returns:
        The `Options`, defaults where not given.

    Raises:
        TypeError: A misspelt name, naming the closest.
        ValueError: A bad value, naming the option.
    """
    return Options().update(where, flat, groups)
