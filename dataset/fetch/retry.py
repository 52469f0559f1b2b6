"""Retries with exponential backoff and jitter, for every read of the world.

:func:`with_retries` runs an attempt until it succeeds, the error is not worth retrying,
or the tries run out; the last error names how many tries were made.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import FetchError

__all__ = ["after_tries", "backoff_delay", "with_retries"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def backoff_delay(attempt: int, backoff: float, max_backoff: float) -> float:
    """Seconds to wait before retry `attempt` (1-based): exponential, capped, with jitter."""
    return min(max_backoff, backoff * 2 ** (attempt - 1)) * (0.5 + random.random())


def with_retries(
    fn: Callable[[], T],
    what: str,
    *,
    retries: int = 3,
    backoff: float = 0.05,
    max_backoff: float = 2.0,
    final: tuple[type[BaseException], ...] = (FileNotFoundError,),
) -> T:
    """``fn()``, retried like a fetch for a synchronous read (an fsspec listing, a download).

    Exceptions of the ``final`` types are not retried (a missing file stays
    missing); any other is retried ``retries`` times, then raised as a
    :class:`FetchError` naming `what` and the number of tries.
    """
    attempt = 0
    while True:
        try:
            return fn()
        except final:
            raise
        except FetchError as err:
            if not err.retryable or attempt >= retries:
                raise after_tries(err, attempt) from None
            cause = err.cause
        except Exception as err:
            if attempt >= retries:
                raise FetchError(what, _tries(f"{type(err).__name__}: {err}", attempt)) from err
            cause = f"{type(err).__name__}: {err}"
        attempt += 1
        delay = backoff_delay(attempt, backoff, max_backoff)
        log.debug("retry %d of %s in %.3fs: %s", attempt, what, delay, cause)
        time.sleep(delay)


def _tries(cause: str, attempt: int) -> str:
    return f"{cause} (after {attempt + 1} tries)" if attempt else cause


def after_tries(err: FetchError, attempt: int) -> FetchError:
    """`err` with the number of tries in its message (when it was retried)."""
    if not attempt:
        return err
    return FetchError(err.url, _tries(err.cause, attempt), err.retryable, err.missing, err.wait,
                      err.unanswered)  # fmt: skip
