"""Typed readers of environment variables: one rule for every variable distlearn reads.

The rule:

- unset and set to the empty string are the same: the default (``FOO= cmd`` is how a
  shell unsets a variable for one command);
- a value is parsed whole, as the reader's type: a number (finite; within the bounds
  given), a flag (``1``/``0``; ``true``/``false``, ``yes``/``no``, ``on``/``off`` in
  any case), or text;
- a value that does not parse is an :class:`EnvError` (a ``ValueError``) that names the
  variable, its value and what it must be, never a bare ``float()`` error or a
  silent default.

The caller decides when a variable is read: at import for settings fixed for the
process (``$IPC_TIMEOUT``), at each use for switches a test or a user may flip
(``$IPC_BULK``); each module says which. Every reader takes ``env=``, a mapping read
instead of ``os.environ`` (a launcher's environment, a test's).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

__all__ = ["EnvError", "env_flag", "env_float", "env_int", "env_str"]

_INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class EnvError(ValueError):
    """An environment variable whose value is not what it must be.

    Args:
        name: The variable.
        value: Its value.
        want: What it must be, as a phrase ("an integer >= 1").

    Attributes:
        name: The variable.
        value: Its value.
    """

    def __init__(self, name: str, value: str, want: str):
        super().__init__(f"${name}={value!r}: must be {want}")
        self.name, self.value = name, value


def env_str(name: str, default: str | None = None, *, env: Mapping[str, str] | None = None):
    """``$name`` as text.

    Args:
        name: The variable.
        default: What an unset or empty variable reads as.
        env: The mapping to read (default ``os.environ``).

    Returns:
        The value, or `default`.
    """
    value = (os.environ if env is None else env).get(name)
    return value or default


def env_int(
    name: str,
    default: int | None = None,
    *,
    low: int | None = None,
    high: int | None = None,
    env: Mapping[str, str] | None = None,
) -> int | None:
    """``$name`` as an integer (decimal digits, an optional sign and surrounding spaces).

    Args:
        name: The variable.
        default: What an unset or empty variable reads as.
        low: The smallest value allowed, if any.
        high: The largest value allowed, if any.
        env: The mapping to read (default ``os.environ``).

    Returns:
        The value, or `default`.

    Raises:
        EnvError: The value is not an integer, or not within [`low`, `high`].
    """
    raw = env_str(name, env=env)
    if raw is None:
        return default
    value = int(raw) if _INTEGER.fullmatch(raw) else None
    if value is None or (low is not None and value < low) or (high is not None and value > high):
        raise EnvError(name, raw, "an integer" + _bounds(low, high))
    return value


def env_float(
    name: str,
    default: float | None = None,
    *,
    low: float | None = None,
    env: Mapping[str, str] | None = None,
) -> float | None:
    """``$name`` as a finite number.

    Args:
        name: The variable.
        default: What an unset or empty variable reads as.
        low: The smallest value allowed, if any.
        env: The mapping to read (default ``os.environ``).

    Returns:
        The value, or `default`.

    Raises:
        EnvError: The value is not a finite number, or is below `low`.
    """
    raw = env_str(name, env=env)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (low is not None and value < low):
        raise EnvError(name, raw, "a finite number" + _bounds(low, None))
    return value


def env_flag(name: str, default: bool, *, env: Mapping[str, str] | None = None) -> bool:
    """``$name`` as on or off: ``1``/``0`` (or ``true``/``false``, ``yes``/``no``,
    ``on``/``off``, in any case).

    Args:
        name: The variable.
        default: What an unset or empty variable reads as.
        env: The mapping to read (default ``os.environ``).

    Returns:
        Whether it is on.

    Raises:
        EnvError: The value is none of those.
    """
    raw = env_str(name, env=env)
    if raw is None:
        return default
    word = raw.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise EnvError(name, raw, "1 or 0 (true/false, yes/no, on/off)")


def _bounds(low, high) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    return f" <= {high}" if high is not None else ""
