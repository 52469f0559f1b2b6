"""Where the metrics go besides ``batcher.metrics()`` and the log: exporters, and ranges in
a PyTorch trace.

An exporter is any callable given each closed window's summary (a dict, see
:mod:`.loader`). :class:`TensorBoard` writes it to a ``SummaryWriter`` (or anything with
its ``add_scalar``); ``metrics_export=`` takes either. :func:`stage` is a
``torch.profiler.record_function`` range while a profiler records, and nothing (one
check) otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["TensorBoard", "exporters", "flatten", "stage"]


def flatten(summary: dict, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(name, number) for every number of a summary, nested keys joined with '/'."""
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from flatten(value, name + "/")
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int | float):
            yield name, float(value)


_VERDICTS = ("consumer", "source", "decode", "workers")


class TensorBoard:
    """Each window to a TensorBoard ``SummaryWriter``: every number under ``tag/...``,
    the step being the batcher's steps so far, and ``tag/bound_by/<verdict>`` as 1 for
    the window's verdict, 0 for the others (a chart per verdict)."""

    def __init__(self, writer: Any, tag: str = "loader"):
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"{writer!r} has no add_scalar(): want a SummaryWriter")
        self.writer, self.tag = writer, tag
        self.step = 0

    def __call__(self, summary: dict) -> None:
        self.step += summary.get("steps", 0)
        tag = f"{self.tag}/rank{summary.get('rank', 0)}"
        for name, value in flatten(summary):
            if name != "rank":
                self.writer.add_scalar(f"{tag}/{name}", value, self.step)
        for v in _VERDICTS:
            self.writer.add_scalar(f"{tag}/bound_by/{v}", float(summary["verdict"] == v), self.step)

    def __repr__(self) -> str:
        return f"TensorBoard({self.writer!r})"


def exporters(value: Any) -> list[Callable[[dict], Any]]:
    """``metrics_export=`` as a list of callables: None, a SummaryWriter, a callable, or a
    list of these; anything else raises, naming the option."""
    if value is None:
        return []
    items = value if isinstance(value, list | tuple) else [value]
    out = []
    for item in items:
        if callable(getattr(item, "add_scalar", None)):
            out.append(TensorBoard(item))
        elif callable(item):
            out.append(item)
        else:
            raise TypeError(
                f"metrics_export={item!r}: want a SummaryWriter (anything with add_scalar) "
                "or a callable taking each window's summary"
            )
    return out


_enabled = torch._C._autograd._profiler_enabled  # (about 0.1 us)


def stage(name: str) -> contextlib.AbstractContextManager:
    """A ``record_function(name)`` range while a profiler records; else a no-op."""
    if _enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
