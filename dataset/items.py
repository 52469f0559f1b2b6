"""Types shared by the stages of the pipeline, below every module that uses them.

A sampler yields, for one epoch, positions into an index or :class:`Record`
objects (items that carry their payload, such as records read from part
files); the item stream turns both into the same batches of work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Batch", "Record"]


@dataclass
class Record:
    """An item handed over by a sampler instead of an index position.

    ``source``: what to fetch (a URL, ``(url, offset, length)``) or the payload
    itself (bytes, a tensor) when it is already in memory, e.g. a record read
    from a part file. ``labels``: label ids into ``index.labels``. ``target``:
    the label this example stands for (default: the first label, -1 if none).
    ``name``: for ``batch.urls`` and logs.
    """

    source: Any
    labels: tuple[int, ...] = ()
    name: str = ""
    target: int | None = None


@dataclass
class Batch:
    """One batch: ``input`` [n, *input_dims] float, ``target`` [n] long (-1: unlabeled).

    ``target[i]`` is the label example i stands for (an item with several
    labels is one example per label); with ``multi_hot`` datasets it is a float
    [n, len(labels)] tensor with a 1 for each label of the item.
    ``labels[i]``: the names of all labels of item i (a tuple; empty when
    unlabeled), ``urls[i]``: where it came from, ``extra[i]``: what the
    processor returned (None when nothing). Rows whose fetch or processor
    failed are left out, so n may be less than the batch size, never 0.
    """

    input: torch.Tensor
    target: torch.Tensor
    labels: list[tuple[str, ...]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input)
