"""The item stream of a mix: this rank's share of each global batch, source by source.

:class:`MixStream` is what :class:`dataset.sampling.stream.ItemStream` is for one index,
for a mix (see :mod:`dataset.sampling.mix` for the contract): a plain iterator of
:class:`Work`, one per batch of this rank, with ``consumed()``, ``state_dict()`` and
``resume_position()``. Each source is an :class:`ItemStream` over its *whole* index
(its sampler's epochs are the same whatever the world size); this stream asks it for
runs of its order (``piece_items``: items lo..hi of epoch e), never for batches.

Every rank computes the allocation of the whole global batch (W B examples) and keeps
its slice, so the ranks agree without talking. A batch's rows say where they came from:
``Work.tags`` (the source of each row, which becomes ``batch.source``) and the per-item
keys ``(MIX_KEY, source, epoch, place)``, from which ``item_rng()`` and
:func:`dataset.seeding.item_source` derive.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..seeding import MIX_KEY
from . import elastic
from .elastic import Piece, Position
from .mix import Allocator, MixPosition, Policy, Schedule
from .samplers import for_index
from .stream import Dispatcher, ItemStream, Work

__all__ = ["MixSource", "MixStream"]


@dataclass
class MixSource:
    """One source of a mix: its name, whole index, sampler and options."""

    name: str
    index: Any
    sampler: Any = "linear"
    sampler_opt: Any = None


class MixStream(Dispatcher):
    """This rank's batches of a mix; ``next()`` ends with each pass (module docstring)."""

    def __init__(
        self,
        sources: Sequence[MixSource],
        *,
        weights: Any,
        exhausted: Any = "stop",
        batch_size: int = 32,
        seed: int = 0,
        partition: int = 0,
        partitions: int = 1,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= partition < partitions:
            raise ValueError(f"partition {partition} is not in [0, partitions={partitions})")
        self.names = [s.name for s in sources]
        self.policy = Policy.parse(exhausted)
        self.schedule = Schedule(weights, self.names)
        self.batch_size, self.seed = batch_size, int(seed)
        self.partition, self.partitions = int(partition), int(partitions)
        self.sampler_name = "mix"
        self.drop_last = False
        self.streams: list[ItemStream] = []
        self._lengths: dict[tuple[int, int], int] = {}
        # part-file sources: read by partition (each rank its own parts), endless
        self._parted: dict[int, ItemStream] = {}
        self._sources = list(sources)
        for i, src in enumerate(sources):
            # each source its own generator stream: two sources never share an order
            seq = np.random.SeedSequence([self.seed, i], spawn_key=(MIX_KEY,))
            own_seed = int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1))
            sampler = for_index(src.index, src.sampler)
            if hasattr(src.index, "parts"):
                mine = src.index.partition(self.partition, self.partitions)
                stream = ItemStream(mine, sampler=sampler, sampler_opt=src.sampler_opt,
                                    batch_size=1, seed=own_seed, partition=self.partition,
                                    partitions=self.partitions, whole=src.index)  # fmt: skip
                self._parted[i] = stream
                self.streams.append(stream)
                continue
            stream = ItemStream(src.index, sampler=sampler, sampler_opt=src.sampler_opt,
                                batch_size=batch_size, seed=own_seed)  # fmt: skip
            length = stream.length(1, 0, 0)
            if length < 0:
                raise ValueError(
                    f"source {src.name!r} ({src.index.origin}): a mix takes sources whose "
                    "epochs have a length (CSV, directory, tensor and joined indexes with "
                    "any sized sampler) or part files; a custom stream of unknown length "
                    "is not mixable yet"
                )
            if length == 0:
                raise ValueError(f"source {src.name!r} ({src.index.origin}): its sampler's "
                                 "epoch 0 is empty")  # fmt: skip
            self.streams.append(stream)
        self.sized = [i for i in range(len(sources)) if i not in self._parted]
        # one label list for the batch: the union (sorted), then the labels part files
        # name as they are read, appended; each source's label ids mapped into it
        self.labels = sorted({lab for s in sources for lab in s.index.labels})
        self._label_ids = {lab: i for i, lab in enumerate(self.labels)}
        self._maps: list[list[int]] = [[] for _ in sources]
        self.epoch = -1  # the pass being read
        self.ended = False
        self.handed_out = 0
        self._cursor = MixPosition.fresh(len(sources))  # where the batches handed out end
        self._cursor.parts = {i: Position(self.partitions, self.partition, 0)
                              for i in self._parted}  # fmt: skip
        self._dispatched: deque[tuple[MixPosition, int]] = deque()
        self._batches: Iterator[Work] | None = None
        self._in_pass = 0  # batches handed out in the pass being read

    def read_counters(self) -> dict[str, int]:
        """What reading the part-file sources' parts produced (``batcher.stats``), summed."""
        out: dict[str, int] = {}
        for stream in self._parted.values():
            for key, value in stream.index.read_counters().items():
                out[key] = out.get(key, 0) + value
        return out

    def _label(self, i: int, local: int) -> int:
        """Source i's label id `local` in the mix's label list (part files name labels as
        they are read: the list grows, in place, so the batch's label names follow)."""
        m = self._maps[i]
        if local >= len(m):
            names = self._sources[i].index.labels
            for name in names[len(m) : local + 1]:
                if name not in self._label_ids:
                    self._label_ids[name] = len(self.labels)
                    self.labels.append(name)
                m.append(self._label_ids[name])
        return m[local]

    # -- geometry ------------------------------------------------------------------------

    @property
    def step_size(self) -> int:
        """G: the examples of one global batch (every rank's batch)."""
        return self.batch_size * self.partitions

    def epoch_length(self, i: int, epoch: int) -> int:
        """Items in source i's epoch `epoch` (asked once: the allocation asks per example)."""
        n = self._lengths.get((i, epoch))
        if n is None:
            n = self.streams[i].length(1, 0, epoch)
            if n <= 0:
                raise ValueError(f"source {self.names[i]!r}: its sampler's epoch {epoch} is empty")
            if len(self._lengths) > 1024:
                self._lengths.clear()
            self._lengths[(i, epoch)] = n
        return n

    def _allocator(self, pos: MixPosition) -> Allocator:
        return Allocator(self.schedule, self.step_size, pos.examples, pos.counts, pos.targets)

    def _counter(self, pos: MixPosition):
        """A callback for Allocator.take that moves `pos` (each source's epoch, place, and
        epochs done in the pass) with each example."""

        parted = self._parted

        def count(i: int) -> bool:
            if i in parted:  # (a part-file source's epochs are its partition's, unknown ahead)
                return False
            pos.offsets[i] += 1
            if pos.offsets[i] >= self.epoch_length(i, pos.epochs[i]):
                pos.epochs[i] += 1
                pos.offsets[i] = 0
                pos.done[i] += 1
            return False  # a pass ends with a whole global batch, never inside one

        return count

    def _ended(self, pos: MixPosition) -> bool:
        """Whether the pass is over after the global batch that ends at `pos`: by the
        sources whose epochs have a length (a mix of part files only never ends one)."""
        if not self.sized:
            return False
        w = self.schedule.weights((pos.examples - 1) // self.step_size)
        return self.policy.ended([pos.done[i] for i in self.sized], [w[i] for i in self.sized])

    # -- starting ------------------------------------------------------------------------

    def start(self, epoch: int, skip: int = 0) -> None:
        """Begin pass `epoch` where the mix stands (nothing of a pass left early is lost)."""
        if skip:
            raise ValueError("a mix's pass starts where the mix stands; it has no skip")
        pos = self.position()
        if pos.pass_ != epoch or any(pos.done):
            pos = pos.next_pass(epoch)
        self.resume(pos)

    def resume(self, pos: Any) -> None:
        if not isinstance(pos, MixPosition):
            raise TypeError(
                f"a mix resumes from a mix position, not {type(pos).__name__} (a survivor's "
                "take-over of a single source does not apply to a mix)"
            )
        self.ended = False
        self._dispatched.clear()
        for i, stream in self._parted.items():  # from what was handed out of each
            stream.resume(pos.parts[i])
        self.epoch, self._cursor, self._in_pass = pos.pass_, _copy(pos), 0
        self._batches = self._global_batches(_copy(pos))

    def _handed_out(self) -> None:
        self._in_pass += 1

    # -- batches -------------------------------------------------------------------------

    def _global_batches(self, gen: MixPosition) -> Iterator[Work]:
        """This rank's slice of each global batch from `gen` to the end of its pass: the
        global batch in which the policy is met (every rank has as many batches)."""
        B, r = self.batch_size, self.partition
        alloc = self._allocator(gen)
        count = self._counter(gen)
        while True:
            before = _copy(gen)
            seq = alloc.take(self.step_size, count)
            gen.examples, gen.counts, gen.targets = alloc.n, list(alloc.counts), list(alloc.targets)
            ended = self._ended(gen)
            # this rank's slice: the r-th, turned by one each step so that over W steps
            # every rank has had every slice (part-file partitions drain evenly)
            q = (r + before.examples // self.step_size) % self.partitions
            work = self._work(before, seq[: q * B], seq[q * B : (q + 1) * B])
            gen.parts = {i: stream.position() for i, stream in self._parted.items()}
            work.end = gen.next_pass() if ended else _copy(gen)
            yield work
            if ended:
                return

    def _work(self, before: MixPosition, ahead: list[int], mine: list[int]) -> Work:
        """The Work of this rank's slice `mine`, after `ahead` (the ranks before it): each
        source's items read as runs of its order, then laid out in the slice's order."""
        n = len(mine)
        sources: list[Any] = [None] * n
        targets: list[int] = [0] * n
        labels: list[tuple[int, ...]] = [()] * n
        names: list[str] = [""] * n
        keys: list[tuple[int, ...]] = [()] * n
        tags = np.asarray(mine)
        for i in np.unique(tags).tolist():
            rows = np.flatnonzero(tags == i).tolist()
            if i in self._parted:
                src, tgt, labs, nms, kys = self._records(i, len(rows))
            else:
                epoch, offset = self._advance(i, before.epochs[i], before.offsets[i],
                                              ahead.count(i))  # fmt: skip
                src, tgt, labs, nms, kys = self._items(i, epoch, offset, len(rows))
            for row, a, t, lab, name, key in zip(rows, src, tgt, labs, nms, kys, strict=True):
                sources[row], targets[row], labels[row] = a, t, lab
                names[row], keys[row] = name, key
        first = before.examples + len(ahead)
        return Work(sources, targets, labels, names, before.pass_, first, keys=keys,
                    tags=list(mine))  # fmt: skip

    def _advance(self, i: int, epoch: int, offset: int, n: int) -> tuple[int, int]:
        while n > 0:
            left = self.epoch_length(i, epoch) - offset
            if n < left:
                return epoch, offset + n
            n -= left
            epoch, offset = epoch + 1, 0
        return epoch, offset

    def _items(self, i: int, epoch: int, offset: int, n: int) -> tuple[list, ...]:
        """Source i's next `n` items from (epoch, offset): (sources, targets, labels, names,
        keys), targets and labels in the mix's label list."""
        stream, label = self.streams[i], self._label
        out: tuple[list, ...] = ([], [], [], [], [])
        while n > 0:
            take = min(n, self.epoch_length(i, epoch) - offset)
            piece = Piece(1, 0, epoch, -1, offset, offset + take)
            for sources, targets, labels, names, _ in stream.piece_items(piece):
                out[0].extend(sources)
                out[1].extend(label(i, t) if t >= 0 else -1 for t in targets)
                out[2].extend(tuple(label(i, x) for x in lab) for lab in labels)
                out[3].extend(names)
                out[4].extend((MIX_KEY, i, epoch, offset + j) for j in range(len(sources)))
                offset += len(sources)
            n -= take
            if offset >= self.epoch_length(i, epoch):
                epoch, offset = epoch + 1, 0
        return out

    def _records(self, i: int, n: int) -> tuple[list, ...]:
        """The next `n` records of part-file source i's partition (its epochs end to end):
        taken as handed out at once (the mix's position keeps the part stream's as of
        each of its own batches, and a resume regenerates from there)."""
        stream, label = self._parted[i], self._label
        out: tuple[list, ...] = ([], [], [], [], [])
        empty = 0
        while len(out[0]) < n:
            work = next(stream, None)
            if work is None:  # the partition's epoch is over: its next one
                empty += 1
                if empty > 1:
                    where = f"partition {self.partition} of {self.partitions}"
                    raise ValueError(f"source {self.names[i]!r}: an epoch of {where} has no "
                                     "record")  # fmt: skip
                stream.start(stream.epoch + 1)
                continue
            empty = 0
            stream.consumed(len(work))
            out[0].extend(work.sources)
            out[1].extend(label(i, t) if t >= 0 else -1 for t in work.targets)
            out[2].extend(tuple(label(i, x) for x in lab) for lab in work.labels)
            out[3].extend(work.names)
            keys = work.keys or [(self.partition, work.epoch, work.first + j)
                                 for j in range(len(work))]  # fmt: skip
            out[4].extend((MIX_KEY, i, e, place) for _, e, place in keys)
        return out

    # -- sizes ---------------------------------------------------------------------------

    def __len__(self) -> int:
        """This rank's batches in the pass being read (or the next one): the allocation is
        simulated to the pass's end (no item is read), a few microseconds an example.
        TypeError for a mix of part files only: its pass never ends."""
        if not self.sized:
            raise TypeError("a mix of part files only has no end to its passes (their "
                            "epochs are each rank's partition's): use next_batch()")  # fmt: skip
        pos = self.position()
        if self.epoch < 0 or pos.pass_ != self.epoch:
            return self._simulate(pos.next_pass(pos.pass_) if any(pos.done) else pos)
        return self._in_pass + self._simulate(pos)

    def _simulate(self, pos: MixPosition) -> int:
        pos = _copy(pos)
        alloc, count = self._allocator(pos), self._counter(pos)
        batches = 0
        while True:
            alloc.take(self.step_size, count)
            batches += 1
            if self._ended(pos):
                return batches

    def batches_for(self, n: int) -> int:
        return math.ceil(n / self.batch_size)

    # -- the position --------------------------------------------------------------------

    def position(self) -> MixPosition:
        """Where the batches handed out end: the same on every rank after the same step."""
        return _copy(self._cursor)

    @property
    def identity(self) -> dict:
        """What the orders depend on: per source, its seed, sampler, index digest and size."""
        return {name: s.identity for name, s in zip(self.names, self.streams, strict=True)}

    def state_dict(self) -> dict:
        return self.state_of(self.position())

    def state_of(self, pos: MixPosition) -> dict:
        """The state of `pos`: the mix's position (the same on every rank) and, for
        part-file sources, this rank's position in its partition of each."""
        parts = {self.names[i]: stream.state_of(pos.parts[i])
                 for i, stream in self._parted.items()}  # fmt: skip
        return {"format": elastic.FORMAT, "kind": "mix", "seed": self.seed,
                "partition": self.partition, "partitions": self.partitions,
                "batch_size": self.batch_size, "exhausted": str(self.policy),
                "sources": self.identity, "mix": pos.state(), "parts": parts}  # fmt: skip

    def resume_position(self, state: Any) -> MixPosition:
        """The position to resume from one rank's state or the list of every rank's (any
        world size, any batch size: the position is the job's, not the rank's)."""
        if isinstance(state, Mapping):
            pos = self._parse(state, "state_dict")
            pos.parts = {i: stream.resume_position(self._part_state(state, i, "state_dict"))
                         for i, stream in self._parted.items()}  # fmt: skip
            return pos
        if not isinstance(state, list | tuple) or not state:
            raise TypeError("load_state_dict takes a mix's state (dict) or the non-empty list "
                            f"of every rank's, got {type(state).__name__}")  # fmt: skip
        positions = [self._parse(s, f"state_dict[{i}]") for i, s in enumerate(state)]
        # part-file sources: every old rank's position in its partition, pooled and split
        # as for one source (dataset.sampling.elastic)
        parts = {i: stream.resume_position([self._part_state(s, i, f"state_dict[{k}]")
                                            for k, s in enumerate(state)])
                 for i, stream in self._parted.items()}  # fmt: skip
        for i, pos in enumerate(positions[1:], 1):
            if pos != positions[0]:
                raise ValueError(
                    f"state_dict[{i}] (partition {state[i].get('partition')}) stands at mix "
                    f"example {pos.examples} (pass {pos.pass_}), state_dict[0] at "
                    f"{positions[0].examples} (pass {positions[0].pass_}): a mix's ranks "
                    "resume from states saved after the same step (distlearn.Checkpoint "
                    "saves them so)"
                )
        positions[0].parts = parts
        return positions[0]

    def _part_state(self, state: Mapping, i: int, where: str) -> Any:
        parts = state.get("parts")
        name = self.names[i]
        if not isinstance(parts, Mapping) or name not in parts:
            raise ValueError(f"{where} has no position for part-file source {name!r}")
        return parts[name]

    def _parse(self, state: Any, where: str) -> MixPosition:
        if not isinstance(state, Mapping):
            raise TypeError(f"{where} must be a dict, got {type(state).__name__}")
        if state.get("kind") != "mix":
            raise ValueError(f"{where} is the state of a single source, not of a mix: it "
                             "cannot resume a mix")  # fmt: skip
        if state.get("format") != elastic.FORMAT:
            raise ValueError(f"{where} has format {state.get('format')!r}; this version "
                             f"reads {elastic.FORMAT}")  # fmt: skip
        saved = state.get("sources")
        if not isinstance(saved, Mapping) or list(saved) != self.names:
            got = list(saved) if isinstance(saved, Mapping) else saved
            raise ValueError(f"{where} is a mix of sources {got}, this batcher mixes "
                             f"{self.names}")  # fmt: skip
        for name, stream in zip(self.names, self.streams, strict=True):
            elastic.check_identity(saved[name], stream.identity, f"{where}, source {name!r}")
        return MixPosition.parse(state.get("mix"), len(self.names), where)


def _copy(pos: MixPosition) -> MixPosition:
    lists = ("counts", "targets", "epochs", "offsets", "done")
    return replace(pos, **{k: list(getattr(pos, k)) for k in lists}, parts=dict(pos.parts))
