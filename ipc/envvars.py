"""The $IPC_* tuning variables: read once, where a module is imported, and a value that
is not a finite number is an error naming the variable (not float()'s bare one)."""

from __future__ import annotations

import math
import os

__all__ = ["env_float"]


def env_float(name: str, default: float) -> float:
    """$`name` as a finite float, or `default` when it is not set."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"${name}={raw!r} is not a finite number")
    return value
