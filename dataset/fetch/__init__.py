"""fetch: every read of the world (items, index, meta, ``.pt`` and part files), one policy.

The :class:`Fetcher` owns one asyncio loop and HTTP session (keep-alive, bounded
concurrency, retries with backoff, Range reads, bounded bodies); local paths and other
fsspec URLs are read on threads. :mod:`.sources` says what a source is; :mod:`.cache`
is the host's disk cache of fetched bytes. Below the index: nothing here knows of
indexes, samplers or batches.

Importing this package imports none of its modules (each stage is loaded by what
uses it); import the modules by name.
"""

__all__: list[str] = []
