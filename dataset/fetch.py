"""The Fetcher: one asyncio event loop in a background thread that gets item bytes.

http(s) goes through one ``aiohttp.ClientSession`` (keep-alive, at most
``pool_size`` requests in flight, a timeout per attempt, retries with
exponential backoff and jitter on connection errors, timeouts, 5xx/429 and
truncated bodies; never on other 4xx). ``file://`` and plain paths are read
directly; any other scheme goes through fsspec. ``(url, offset, length)``
sources become HTTP Range requests or seek+read.

A cache plugs in with ``Fetcher(cache=obj)``: ``obj.get(key) -> bytes | None``
before fetching and ``obj.put(key, data)`` after, where key is the source
(a URL, or a ``(url, offset, length)`` tuple). Both are called on the loop
thread, so they should be quick (local disk).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import threading
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp

from . import sources as src

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class FetchError(Exception):
    """An item could not be fetched; ``url`` and ``cause`` say which and why."""

    def __init__(self, url: str, cause: str, retryable: bool = False):
        super().__init__(f"{url}: {cause}")
        self.url, self.cause, self.retryable = url, cause, retryable


class Stats(dict):
    """Counters: fetched, retried, failed, bytes, dropped (by the processor)."""

    KEYS = ("fetched", "retried", "failed", "bytes", "dropped")

    def __init__(self, **kw: int):
        super().__init__({k: 0 for k in self.KEYS})
        self.update(kw)

    def add(self, other: dict) -> None:
        for k, v in other.items():
            self[k] = self.get(k, 0) + v


class RateLimitedLog:
    """Log at most one line per `interval` seconds; says how many were suppressed."""

    def __init__(self, logger: logging.Logger, interval: float = 5.0):
        self.logger, self.interval = logger, interval
        self._last = -float("inf")
        self._suppressed = 0
        self._lock = threading.Lock()

    def warning(self, msg: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval:
                self._suppressed += 1
                return
            n, self._suppressed, self._last = self._suppressed, 0, now
        if n:
            msg += f" (and {n} similar since the last message)"
        self.logger.warning(msg, *args)


class Fetcher:
    """Fetches sources concurrently on its own event loop thread (started lazily).

    ``await fetcher.fetch(source)`` from coroutines on ``fetcher.loop``;
    ``fetcher.submit(coro)`` from any thread gives a ``concurrent.futures.Future``.
    """

    def __init__(
        self,
        pool_size: int = 64,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        cache: Any = None,
        headers: dict[str, str] | None = None,
    ):
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        self.pool_size, self.timeout, self.retries = pool_size, timeout, retries
        self.backoff, self.max_backoff = backoff, max_backoff
        self.cache, self.headers = cache, headers or {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    # -- loop management -------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid():
            raise RuntimeError("a Fetcher cannot be used across fork; create one per process")
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=run, name="dataset-fetcher", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
        return self._loop

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run `coro` on the fetcher's loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Close the HTTP session and stop the loop thread (idempotent)."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None or self._pid != os.getpid():
            return

        async def shutdown() -> None:
            # batches still in flight are abandoned: cancel them rather than leak them
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            await self.aclose()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=5)
        except Exception as err:  # closing must not mask the caller's error
            log.debug("fetcher shutdown: %s", err)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not loop.is_running():
            loop.close()

    async def aclose(self) -> None:
        """Close the HTTP session when the Fetcher was used on the caller's own loop."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def __enter__(self) -> Fetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- fetching (on the loop) ------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._sem = asyncio.Semaphore(self.pool_size)
            connector = aiohttp.TCPConnector(limit=self.pool_size, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers=self.headers,
                auto_decompress=False,  # item bytes as stored, never re-encoded
            )
        return self._session

    async def fetch(self, source: Any, stats: dict | None = None) -> Any:
        """The bytes (or in-memory payload) of one source; raises FetchError when it fails.

        Counts ``fetched``, ``retried``, ``bytes`` into `stats` (``failed`` is the
        caller's to count, since a list of joined sources fails as one item).
        """
        if isinstance(source, bytes | bytearray | memoryview) or not isinstance(
            source, str | tuple
        ):
            return source  # already in memory: a tensor row or a record's payload
        if isinstance(source, src.Joined):
            return [await self.fetch(s, stats) for s in source]
        key = source
        if self.cache is not None:
            data = self.cache.get(key)
            if data is not None:
                if stats is not None:
                    stats["fetched"] += 1
                    stats["bytes"] += len(data)
                return data
        url, offset, length = source if isinstance(source, tuple) else (source, None, None)
        data = await self._fetch_with_retries(url, offset, length, stats)
        if stats is not None:
            stats["fetched"] += 1
            stats["bytes"] += len(data)
        if self.cache is not None:
            self.cache.put(key, data)
        return data

    async def _fetch_with_retries(self, url, offset, length, stats) -> bytes:
        attempt = 0
        while True:
            try:
                return await self._fetch_once(url, offset, length)
            except FetchError as err:
                if not err.retryable or attempt >= self.retries:
                    raise
                cause = err.cause
            attempt += 1
            if stats is not None:
                stats["retried"] += 1
            delay = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
            log.debug("retry %d of %s in %.3fs: %s", attempt, url, delay, cause)
            await asyncio.sleep(delay * (0.5 + random.random()))

    async def _fetch_once(self, url: str, offset: int | None, length: int | None) -> bytes:
        path = src.local_path(url)
        if path is not None:
            return _read(path, offset, length, _open_local, remote=False)
        if src.is_http(url):
            return await self._fetch_http(url, offset, length)
        return await asyncio.get_running_loop().run_in_executor(
            None, _read, url, offset, length, _open_fsspec, True
        )

    async def _fetch_http(self, url: str, offset: int | None, length: int | None) -> bytes:
        session = self._get_session()
        assert self._sem is not None
        headers = None
        if offset is not None and length is not None:
            if length == 0:
                return b""
            headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
        try:
            async with self._sem, session.get(url, headers=headers) as resp:
                if resp.status >= 400:
                    raise FetchError(
                        url, f"HTTP {resp.status} {resp.reason}", resp.status in RETRY_STATUS
                    )
                body = await resp.read()
                expected = resp.content_length
                status = resp.status
        except FetchError:
            raise
        except asyncio.TimeoutError:
            raise FetchError(url, f"timed out after {self.timeout}s", True) from None
        except aiohttp.ClientError as err:
            # connection refused/reset, server disconnected, payload cut short
            raise FetchError(url, f"{type(err).__name__}: {err}", True) from None
        if expected is not None and len(body) != expected:
            raise FetchError(url, f"truncated body: {len(body)} of {expected} bytes", True)
        if headers is not None:
            if status == 200:  # the server ignored Range: cut the record out ourselves
                body = body[offset : offset + length]
            if len(body) != length:
                raise FetchError(url, f"short range read: {len(body)} of {length} bytes", True)
        return body


def _read(name: str, offset: int | None, length: int | None, opener: Any, remote: bool) -> bytes:
    """All of `name`, or `length` bytes at `offset`, read through ``opener(name)``.

    A remote store's errors and short reads are retried (they may be transient,
    and fsspec backends raise their own error types); a local file's are not.
    """
    try:
        with opener(name) as f:
            if offset is None:
                return f.read()
            f.seek(offset)
            data = f.read(length)
    except FileNotFoundError:
        raise FetchError(name, "no such file") from None
    except Exception as err:
        if not (remote or isinstance(err, OSError)):
            raise  # a local read fails with OSError; anything else is a bug to see
        raise FetchError(name, f"{type(err).__name__}: {err}", remote) from None
    if len(data) != length:
        raise FetchError(
            name, f"short read: {len(data)} of {length} bytes at offset {offset}", remote
        )
    return data


def _open_local(path: str) -> Any:
    return open(path, "rb")


def _open_fsspec(url: str) -> Any:
    import fsspec

    return fsspec.open(url, "rb")
