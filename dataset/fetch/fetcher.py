"""The Fetcher: one asyncio event loop in a background thread that reads the world.

Every read goes through it, with one policy: items, and also index, meta and
``.pt`` files (:func:`read_bytes`) and part files. http(s) goes through one
``aiohttp.ClientSession`` (keep-alive, at most ``pool_size`` requests in
flight, a timeout per attempt, retries with exponential backoff and jitter on
connection errors, timeouts, 5xx/429 and truncated bodies; never on other 4xx:
404/410 mean "no such file"). ``file://`` and plain paths are read directly;
any other scheme goes through fsspec. ``(url, offset, length)`` sources become
HTTP Range requests or seek+read. After the last try the error names the URL.

Bounds, because a server is not trusted: a body larger than ``max_item_bytes``
is refused (by its Content-Length, or once that many bytes arrived); a server
that ignores Range is read only up to the record's end, never to the file's;
redirects are followed only to the same host unless ``redirects="any"``.

Whom credentials go to, and which hosts a remote index may send it to, is its
:class:`dataset.fetch.scope.Scope`: headers only to the origins the user named (a
redirect elsewhere drops them), and, for a remote index, no loopback, link-local or
private address outside its own origin (checked at the addresses a name resolves to).

A cache plugs in with ``Fetcher(cache=obj)``: ``obj.get(key) -> bytes | None``
before fetching and ``obj.put(key, data)`` after (on a thread: a put syncs to
disk), where key is the source (a URL, or a ``(url, offset, length)`` tuple).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import urllib.parse
from collections.abc import Coroutine
from typing import Any

import aiohttp

from ..errors import FetchError
from ..options import FetchOptions
from . import scope as scopes
from . import sources as src
from .local import open_fsspec, open_local, read_blocking
from .responses import content_range, payload_size, read_capped, retry_after, too_big
from .retry import after_tries, backoff_delay
from .stats import count_status

log = logging.getLogger(__name__)


__all__ = ["Fetcher"]


# The read policy's defaults: FetchOptions' (what Dataset() and open_index() pass on).
_POLICY = FetchOptions()


RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


MISSING_STATUS = frozenset({404, 410})


REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})


MAX_REDIRECTS = 10


# The longest wait a server's Retry-After gets before a retry (a rate limit's "come back
# in N seconds", honoured up to this; the backoff's own delays stay below max_backoff).
MAX_RETRY_AFTER = 60.0


class Fetcher:
    """Fetches sources concurrently on its own event loop thread (started lazily).

    ``await fetcher.fetch(source)`` from coroutines on ``fetcher.loop``;
    ``fetcher.submit(coro)`` from any thread gives a ``concurrent.futures.Future``;
    ``fetcher.read(url)`` is the blocking form for one whole file.

    ``timeout`` bounds one attempt (``idle_timeout``, when given, bounds the
    wait for each chunk instead, for large files); ``retries``/``backoff``/
    ``max_backoff`` the retry policy; ``max_item_bytes`` the size of one body;
    ``redirects``: ``"same-host"`` (default: the same host name, never from https to
    http), ``"any"`` or ``"none"``. ``headers`` go to the origins `scope` names
    (:class:`dataset.fetch.scope.Scope`; by default the origin (scheme, host, port)
    of each URL asked for), never to another one a redirect leads to; a scope that
    guards (a remote index) also refuses hosts at addresses it may not reach.

    Args:
        pool_size: Fetches in flight at once.
        timeout: Seconds one attempt may take (None: no limit).
        retries: Retries after a fault that may pass (connection, timeout, 5xx, 429).
        backoff: The first retry's wait in seconds; it doubles, with jitter.
        max_backoff: The longest wait between retries.
        cache: A cache with `get`/`put` for fetched remote items, or None.
        headers: HTTP headers, for the origins of `scope`.
        redirects: Which redirects to follow.
        max_item_bytes: A larger body is refused.
        idle_timeout: Seconds to wait for each chunk of a body, instead of `timeout`
            for the whole attempt.
        scope: Whom the headers go to and which addresses may be reached (a
            Dataset's: what its user named); None: the origin of each URL asked
            for, any address.

    Raises:
        ValueError: A `pool_size` or `max_item_bytes` below 1, negative `retries`, or
            another `redirects`.
    """

    def __init__(
        self,
        pool_size: int = 64,
        timeout: float | None = _POLICY.timeout,
        retries: int = _POLICY.retries,
        backoff: float = _POLICY.backoff,
        max_backoff: float = _POLICY.max_backoff,
        cache: Any = None,
        headers: dict[str, str] | None = None,
        redirects: str = _POLICY.redirects,
        max_item_bytes: int = _POLICY.max_item_bytes,
        idle_timeout: float | None = None,
        scope: scopes.Scope | None = None,
    ):
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        # the read policy's values, checked as Dataset() checks them
        FetchOptions(
            timeout=timeout,
            retries=retries,
            backoff=backoff,
            max_backoff=max_backoff,
            headers=headers,
            redirects=redirects,
            max_item_bytes=max_item_bytes,
        )
        self.pool_size, self.timeout, self.retries = pool_size, timeout, retries
        self.backoff, self.max_backoff = backoff, max_backoff
        self.cache, self.headers = cache, headers or {}
        self.redirects, self.max_item_bytes = redirects, max_item_bytes
        self.idle_timeout = idle_timeout
        self.scope = scope if scope is not None else scopes.Scope()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: aiohttp.ClientSession | None = None
        self._own_headers: dict[str, str] = {}  # self.headers but Accept-Encoding (per request)
        self._sem: asyncio.Semaphore | None = None
        self._hands: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._no_range_hosts: set[str] = set()

    # -- loop management -------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid():
            raise RuntimeError("a Fetcher cannot be used across fork; create one per process")
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()
                failed: list[BaseException] = []

                def run() -> None:
                    try:
                        asyncio.set_event_loop(loop)
                        loop.call_soon(ready.set)
                        loop.run_forever()
                    except BaseException as exc:
                        failed.append(exc)
                        raise
                    finally:
                        ready.set()  # a thread that ends before its loop runs: no hang

                self._thread = threading.Thread(target=run, name="dataset-fetcher", daemon=True)
                self._thread.start()
                ready.wait()
                if failed:
                    loop.close()
                    raise RuntimeError("the dataset fetcher's event-loop thread failed") from (
                        failed[0]
                    )
                self._loop = loop
        return self._loop

    def hands(self) -> asyncio.Semaphore:
        """``pool_size`` slots for items held from their fetch to the end of their
        decoding (see :func:`dataset.workers.fill.fill`); on the running loop."""
        loop = asyncio.get_running_loop()
        if self._hands is None or self._hands[0] is not loop:
            self._hands = (loop, asyncio.Semaphore(self.pool_size))
        return self._hands[1]

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Run `coro` on the fetcher's loop, from any thread.

        Args:
            coro: A coroutine, such as `fetch(source)`.

        Returns:
            A thread-safe `concurrent.futures.Future` of its result.
        """
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def read(self, source: Any) -> bytes:
        """The bytes of one source, blocking, retried by the policy.

        Args:
            source: A path or URL, or `(url, offset, length)`.

        Returns:
            The bytes.

        Raises:
            FetchError: The read failed after its retries, naming the source.
        """
        return self.submit(self.fetch(source)).result()

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
            # (a guarding scope resolves names through itself: it connects only to
            # addresses it may reach, whatever a name resolves to, redirects included)
            guard = scopes.resolver(self.scope) if self.scope.guard else None
            connector = aiohttp.TCPConnector(
                limit=self.pool_size, ttl_dns_cache=300, resolver=guard
            )
            # bytes as stored: aiohttp's default "Accept-Encoding: gzip, deflate" let a server
            # (nginx's gzip, a CDN) compress them on the way, and they came back compressed
            # The user's other headers (credentials, often) go per request, to the
            # origins of the scope only: never to where an index or a redirect leads.
            headers, self._own_headers = {}, {}
            for k, v in self.headers.items():
                (headers if k.lower() == "accept-encoding" else self._own_headers)[k] = v
            if not headers:
                headers["Accept-Encoding"] = "identity"
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout, sock_read=self.idle_timeout),
                headers=headers,
                auto_decompress=False,  # item bytes as stored, never re-encoded (nor inflated)
            )
        return self._session

    async def fetch(self, source: Any, stats: dict | None = None) -> Any:
        """The bytes (or in-memory payload) of one source, on the fetcher's loop.

        Counts ``fetched``, ``retried``, ``bytes`` into `stats` (``failed`` is the
        caller's to count, since a list of joined sources fails as one item).
        A payload already in memory (a record of a part file, a tensor row)
        counts as fetched too, with its size.

        Args:
            source: A path or URL, `(url, offset, length)`, a list of sources (joined
                indexes), or a payload already in memory.
            stats: Counters to add to, or None.

        Returns:
            The bytes, the payload, or a list of them for a list.

        Raises:
            FetchError: The read failed after its retries, naming the source.
        """
        if isinstance(source, bytes | bytearray | memoryview) or not isinstance(
            source, str | tuple
        ):
            if stats is not None:  # already in memory: a tensor row or a record's payload
                stats["fetched"] += 1
                stats["bytes"] += payload_size(source)
            return source
        if isinstance(source, src.Joined):
            return [await self.fetch(s, stats) for s in source]
        key = source
        url, offset, length = source if isinstance(source, tuple) else (source, None, None)
        # A local file is read where it lies: a copy in the cache (keyed by its name
        # alone) would only go stale when the file changes.
        cached = self.cache is not None and src.local_path(url) is None
        if cached:
            data = self.cache.get(key)
            if stats is not None:  # (keys that appear once they count something)
                hit = "cache_hits" if data is not None else "cache_misses"
                stats[hit] = stats.get(hit, 0) + 1
            if data is not None:
                if stats is not None:
                    stats["fetched"] += 1
                    stats["bytes"] += len(data)
                return data
        data = await self._fetch_with_retries(url, offset, length, stats)
        if stats is not None:
            stats["fetched"] += 1
            stats["bytes"] += len(data)
        if cached:
            # off the loop: a put writes and syncs a file. A cache that cannot take it (a
            # full disk) costs the entry, not the item fetched (dataset's Cache says so
            # itself and returns False; another cache object may raise)
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.cache.put, key, data)
            except OSError as err:
                log.warning("cache: %s not stored (%s); the item is used all the same", url, err)
        return data

    async def _fetch_with_retries(self, url, offset, length, stats) -> bytes:
        attempt = 0
        while True:
            try:
                return await self._fetch_once(url, offset, length)
            except FetchError as err:
                if stats is not None and err.status is not None:
                    count_status(stats, err.status)
                if not err.retryable or attempt >= self.retries:
                    raise after_tries(err, attempt) from None
                cause, wait = err.cause, err.wait
            attempt += 1
            if stats is not None:
                stats["retried"] += 1
            delay = backoff_delay(attempt, self.backoff, self.max_backoff)
            if wait is not None:  # (the server said when: no sooner, within reason)
                delay = max(delay, min(wait, MAX_RETRY_AFTER))
            log.debug("retry %d of %s in %.3fs: %s", attempt, url, delay, cause)
            await asyncio.sleep(delay)

    async def _fetch_once(self, url: str, offset: int | None, length: int | None) -> bytes:
        path = src.local_path(url)
        cap = self.max_item_bytes
        if path is not None:
            data = read_blocking(path, offset, length, open_local, remote=False, cap=cap)
        elif src.is_http(url):
            return await self._fetch_http(url, offset, length)
        else:
            data = await asyncio.get_running_loop().run_in_executor(
                None, read_blocking, url, offset, length, open_fsspec, True, cap
            )
        if len(data) > self.max_item_bytes:
            # (read up to one byte past the bound: the file may be far larger)
            raise FetchError(url, f"larger than max_item_bytes={self.max_item_bytes}")
        return data

    async def _fetch_http(self, url: str, offset: int | None, length: int | None) -> bytes:
        session = self._get_session()
        assert self._sem is not None
        ranged = {}
        if offset is not None and length is not None:
            if length == 0:
                return b""
            ranged = {"Range": f"bytes={offset}-{offset + length - 1}"}
        scope = self.scope
        current = url
        try:
            for _ in range(MAX_REDIRECTS + 1):
                # Authorization, cookies, API keys: for the origins the user named only
                # (as requests and browsers do), not one an index or a redirect names.
                own = self._own_headers if scope.sends_credentials(current, url) else None
                headers = {**own, **ranged} if own else ranged
                scope.refuse_literal(current)
                async with (
                    self._sem,
                    session.get(current, headers=headers or None, allow_redirects=False) as resp,
                ):
                    if resp.status in REDIRECT_STATUS:
                        current = self._redirect(url, current, resp)
                        continue
                    if resp.status >= 400:
                        retry = resp.status in RETRY_STATUS
                        wait = retry_after(resp.headers.get("Retry-After")) if retry else None
                        raise FetchError(
                            url,
                            f"HTTP {resp.status} {resp.reason}",
                            retry,
                            resp.status in MISSING_STATUS,
                            wait,
                            status=resp.status,
                        )
                    return await self._body(url, resp, offset, length)
            raise FetchError(url, f"more than {MAX_REDIRECTS} redirects")
        except FetchError:
            raise
        except scopes.TargetRefused as err:  # a literal address, or a name resolved
            raise FetchError(url, str(err)) from None
        except aiohttp.ClientConnectorDNSError as err:
            if isinstance(err.os_error, scopes.TargetRefused):
                raise FetchError(url, str(err.os_error)) from None
            raise FetchError(url, f"{type(err).__name__}: {err}", True) from None
        except asyncio.TimeoutError:
            raise FetchError(
                url, f"timed out after {self.timeout}s", True, unanswered=True
            ) from None
        except aiohttp.ClientError as err:
            # connection refused/reset, server disconnected, payload cut short
            unanswered = isinstance(err, aiohttp.ClientConnectorError)  # refused, no such host
            raise FetchError(
                url, f"{type(err).__name__}: {err}", True, unanswered=unanswered
            ) from None

    def _redirect(self, url: str, current: str, resp: aiohttp.ClientResponse) -> str:
        """Where a redirect leads, if the policy allows following it."""
        location = resp.headers.get("Location")
        if not location:
            raise FetchError(url, f"HTTP {resp.status} redirect without a Location")
        target = urllib.parse.urljoin(current, location)
        if self.redirects == "none":
            raise FetchError(url, f"HTTP {resp.status} redirect to {target} (redirects='none')")
        if not src.is_http(target):
            raise FetchError(url, f"redirect to {target} refused: not http(s)")
        if self.redirects == "same-host":
            here, there = urllib.parse.urlsplit(current), urllib.parse.urlsplit(target)
            if here.hostname != there.hostname:
                raise FetchError(
                    url,
                    f"redirect to {target} refused: another host than {here.hostname} "
                    "(redirects='any' follows it)",
                )
            if here.scheme == "https" and there.scheme != "https":
                raise FetchError(
                    url,
                    f"redirect to {target} refused: from https to plain http "
                    "(redirects='any' follows it)",
                )
        return target

    async def _body(
        self, url: str, resp: aiohttp.ClientResponse, offset: int | None, length: int | None
    ) -> bytes:
        """The body of a successful response, within the size bounds."""
        expected = resp.content_length
        if offset is not None and resp.status == 206:
            # the bytes asked for, or fewer (then "short" below): a cache that answers
            # with a range that starts elsewhere would hand back another record's bytes
            value = resp.headers.get("Content-Range")
            got = content_range(value)
            if got is None or got[0] != offset or got[1] > offset + length - 1:
                raise FetchError(url, f"Content-Range {value!r} for bytes {offset}-"
                                      f"{offset + length - 1}", True)  # fmt: skip
        if offset is None or resp.status == 206:
            cap = self.max_item_bytes if offset is None else length
            if expected is not None and expected > cap:
                raise FetchError(url, too_big(expected, cap, offset is None))
            body = await (resp.read() if expected is not None else read_capped(resp, cap))
            if len(body) > cap:
                raise FetchError(url, too_big(len(body), cap, offset is None))
            if expected is not None and len(body) != expected:
                raise FetchError(url, f"truncated body: {len(body)} of {expected} bytes", True)
        else:
            # The server ignored Range (200, the whole file): read up to the record's
            # end only, then drop the connection instead of downloading the rest.
            end = offset + length
            if end > self.max_item_bytes:
                raise FetchError(
                    url,
                    f"the server ignores Range requests, and the record ends at byte {end}, "
                    f"beyond max_item_bytes={self.max_item_bytes}",
                )
            self._warn_no_range(url)
            head = await read_capped(resp, end, exact=True)
            resp.close()
            body = head[offset:end]
        if offset is not None and len(body) != length:
            raise FetchError(url, f"short range read: {len(body)} of {length} bytes", True)
        return body

    def _warn_no_range(self, url: str) -> None:
        host = urllib.parse.urlsplit(url).netloc
        if host not in self._no_range_hosts:
            self._no_range_hosts.add(host)
            log.warning(
                "%s ignores HTTP Range requests: each record reads its file up to the "
                "record's end (serve the files with Range support, or as separate items)",
                host,
            )
