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

    Attributes:
        source: What to fetch (a URL, `(url, offset, length)`) or the payload itself
            (bytes, a tensor) when it is already in memory, e.g. a record read from a
            part file.
        labels: Label ids into `index.labels`.
        name: For `batch.urls` and logs.
        target: The label this example stands for (default: the first label, -1 if
            none).
    """

    source: Any
    labels: tuple[int, ...] = ()
    name: str = ""
    target: int | None = None


@dataclass
class Batch:
    """One batch of n items; `len(batch)` is n.

    Rows whose fetch or processor failed are left out, so n may be less than the
    batch size, never 0. A batch owns its tensors: keeping it is safe.

    Attributes:
        input: Float `[n, *input_dims]`.
        target: Long `[n]`: the label example i stands for, as its place in
            `index.labels` (-1: unlabeled); an item with several labels is one
            example per label. With `multi_hot=True` a float `[n, len(labels)]`
            tensor with a 1 for each label of the item.
        labels: The names of all labels of item i (a tuple; empty when unlabeled).
        urls: Where item i came from.
        extra: What the processor returned beside its verdict (None when nothing).
        source: A mix's batch: long `[n]`, the source each example came from (its
            index in the mix's sources); None for a batch of one dataset.
    """

    input: torch.Tensor
    target: torch.Tensor
    labels: list[tuple[str, ...]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)
    source: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.input)
