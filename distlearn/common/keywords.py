"""Misspelt keywords: a ``TypeError`` that names the closest valid one.

Python's own error says only "unexpected keyword argument 'chunk_byte'", and for
options passed on through ``**options`` it names the inner function. Every check of
a keyword, option or option key in distlearn (``Dataset(num_worker=4)``, a sampler's
``sampler_opt``, ``ipc.Tree(heartbeat=...)``) raises through :func:`unknown`: a
``TypeError``, as Python raises for a keyword argument a function does not take.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["check", "checked", "closest", "keyword_names", "unknown"]

F = TypeVar("F", bound=Callable)


def closest(name: str, valid: Iterable[str]) -> str | None:
    """The valid name `name` most likely misspells, or None where none is close.

    Args:
        name: What was given.
        valid: The names that would have been accepted.

    Returns:
        The closest of `valid` (difflib's ratio of 0.6 or more), or None.
    """
    found = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return found[0] if found else None


def unknown(what: str, name: str, valid: Iterable[str], noun: str = "keyword argument"):
    """The error for `name`, which `what` does not take.

    Args:
        what: Who was given it, as the user wrote the call ("Dataset()").
        name: The misspelt name.
        valid: The names `what` takes.
        noun: What the names are ("keyword argument", "option").

    Returns:
        A ``TypeError`` to raise: "{what} got an unknown {noun} {name!r}; did you mean
        {closest!r}?", or the valid names where none is close.
    """
    valid = sorted(valid)
    near = closest(str(name), valid)
    hint = f"did you mean {near!r}?" if near else f"valid: {', '.join(valid) or 'none'}"
    return TypeError(f"{what} got an unknown {noun} {name!r}; {hint}")


def check(what: str, given: Iterable[str], *groups: Iterable[str], noun: str = "keyword argument"):
    """Raise :func:`unknown`'s error for the first name of `given` that no group has.

    Args:
        what: Who was given them ("Tree()").
        given: The names given.
        *groups: The names accepted, in groups (a function's and the options it passes on).
        noun: What the names are.

    Raises:
        TypeError: A name of `given` is in no group.
    """
    valid = {name for group in groups for name in group}
    for name in given:
        if name not in valid:
            raise unknown(what, name, valid, noun)


def keyword_names(fn: Callable) -> frozenset[str]:
    """The arguments of `fn` that may be passed by keyword (``self`` left out)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(fn).parameters.values()
    return frozenset(p.name for p in params if p.kind in kinds) - {"self"}


def checked(fn: F) -> F:
    """`fn`, checking the names of its keyword arguments first (a set lookup a call).

    Args:
        fn: A function or ``__init__`` with no ``**kwargs`` of its own.

    Returns:
        `fn` wrapped: a misspelt keyword raises :func:`unknown`'s ``TypeError``.
    """
    valid = keyword_names(fn)
    what = fn.__qualname__.removesuffix(".__init__") + "()"

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not valid.issuperset(kwargs):
            check(what, kwargs, valid)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
