"""Misspelt keyword arguments of the public API: a TypeError that names the closest one.

Python's own error says only "unexpected keyword argument 'chunk_byte'"; for options
passed through `**options` (LocalhostTree to Tree) it names the inner function.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["check", "checked", "keyword_names"]

F = TypeVar("F", bound=Callable)


def keyword_names(fn: Callable) -> frozenset[str]:
    """The arguments of `fn` that may be passed by keyword."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(fn).parameters.values()
    return frozenset(p.name for p in params if p.kind in kinds) - {"self"}


def check(what: str, given: Iterable[str], *groups: Iterable[str]) -> None:
    """Raise TypeError for a name in `given` that no group has, naming the closest one."""
    valid = sorted({name for group in groups for name in group})
    for name in given:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(valid)}"
            raise TypeError(f"{what} got an unknown keyword argument {name!r}; {hint}")


def checked(fn: F) -> F:
    """`fn`, checking the names of its keyword arguments first (a set lookup a call)."""
    valid = keyword_names(fn)
    what = fn.__qualname__.removesuffix(".__init__") + "()"

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not valid.issuperset(kwargs):
            check(what, kwargs, valid)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
