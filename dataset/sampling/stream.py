"""The item stream: which items each batch holds, epoch after epoch, and where we are.

:class:`ItemStream` is a plain iterator of :class:`Work` (one batch of items:
what to fetch, their targets, labels and names), with no worker, ring or
tensor in sight, so it is tested alone. It owns what decides the order of
items and nothing else:

- the sampler and its options, run once per epoch in the main process with a
  generator seeded by (seed, partition, epoch);
- joined indexes: aligned members (item i of the first fetches item i of each)
  and drawn ones (each with its own sampler, seeded by the member's position);
- the position, a few integers (:class:`dataset.sampling.elastic.Position`): the
  epoch and how much of it was handed out, and after a resume at another world size
  the *pieces* of an interrupted epoch still to hand out first. Orders are regenerated
  from (seed, partition, epoch), never stored; a piece names another partitioning's
  order, which the stream regenerates from the whole index it is given.

A sampler's epoch that is a numpy array of positions is cut into batches by
slicing: 10M items cost no Python object until their batch is dispatched, and a
resume anywhere in it is a slice. Part files (a :class:`dataset.index.parts.PartEpoch`)
resume at (part, record) reading only that part.

Each :class:`Work` carries where the stream stands once it is handed out (``end``);
``consumed()`` moves the position there, so items dispatched but not handed out are
never counted, whatever the workers.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BadIndex
from ..fetch.sources import Joined
from ..index.joined import JoinedIndex
from ..items import Record
from . import elastic
from .elastic import Piece, Position
from .samplers import check_options, endless, epoch_rng, get_sampler

__all__ = ["Dispatcher", "ItemStream", "Work"]


@dataclass
class Work:
    """One batch of items, in sampler order: ``first`` is the first item's place in its epoch.

    ``keys``: per item, ``(partition, epoch, place)`` that its per-item generator is keyed
    by, where that is not this stream's (partition, epoch, first + i): items of another
    partitioning's order, part-file records. ``end``: the stream's cursor once this batch
    is handed out. ``tags``: in a mix, the source of each item."""

    sources: list[Any]
    targets: list[int]
    labels: list[tuple[int, ...]]
    names: list[str]
    epoch: int
    first: int
    keys: list[tuple[int, ...]] | None = None
    end: Any = field(default=(), repr=False)
    tags: list[int] | None = None  # a mix: the source of each item (batch.source)

    def __len__(self) -> int:
        return len(self.sources)


@dataclass
class Draw:
    """How member k of a joined index is drawn: its sampler and options."""

    k: int
    sampler: Any
    opt: dict


class Dispatcher:
    """What ItemStream and MixStream share: Works handed out of ``self._batches`` one by
    one, each remembered as (end, count) until :meth:`consumed` says it was handed out.
    A subclass sets ``_batches``, ``_dispatched`` (a deque), ``_cursor``, ``handed_out``
    and ``ended``, and may hook :meth:`_dispatching` and :meth:`_handed_out`."""

    _batches: Iterator[Work] | None
    _dispatched: deque
    _cursor: Any
    handed_out: int
    ended: bool

    def stop(self) -> None:
        """Forget the rest of this epoch (``next()`` ends it)."""
        self._batches = None
        self._dispatched.clear()

    def __iter__(self) -> Dispatcher:
        return self

    def __next__(self) -> Work:
        if self._batches is None:
            raise StopIteration
        work = next(self._batches, None)
        if work is None:
            self._batches, self.ended = None, True
            raise StopIteration
        self._dispatched.append((work.end, len(work)))
        self._dispatching(work)
        return work

    def consumed(self, n: int | None = None) -> None:
        """The oldest batches dispatched were handed out (or dropped: every item failed):
        `n` items of them (None: one batch). The position moves to the end of the last."""
        if n == 0:
            return
        left = n
        while True:
            self._cursor, count = self._dispatched.popleft()
            self.handed_out += count
            self._handed_out()
            left = 0 if left is None else left - count
            if left <= 0 or not self._dispatched:
                return

    def _dispatching(self, work: Work) -> None:
        """Called with each Work as it is handed to the workers."""

    def _handed_out(self) -> None:
        """Called once for each dispatched batch that :meth:`consumed` retires."""


class ItemStream(Dispatcher):
    """Batches of `index`'s items in `sampler` order; ``next()`` ends with each epoch.

    ``start(epoch, skip)`` begins an epoch (skipping its first `skip` items);
    ``resume(position)`` begins where a :class:`Position` says (pieces of an
    interrupted epoch first, then its ordinary epoch); ``consumed()`` records that the
    oldest dispatched batch was handed out (or failed), which is what
    :meth:`state_dict` saves: an item dispatched but not handed out is seen again after
    a resume.

    `whole` (default `index`) is the index before partitioning and `partitions` the
    count it was cut into: the stream regenerates other partitions' orders from it when
    it resumes the position of a job of another world size.
    """

    def __init__(
        self,
        index: Any,
        *,
        sampler: Any = "linear",
        sampler_opt: Any = None,
        batch_size: int = 32,
        seed: int = 0,
        partition: int = 0,
        partitions: int = 1,
        whole: Any = None,
        drop_last: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.index = index
        self.whole = whole if whole is not None else index
        self.batch_size, self.drop_last = batch_size, drop_last
        self.seed, self.partition, self.partitions = int(seed), int(partition), int(partitions)
        if not 0 <= self.partition < self.partitions:
            raise ValueError(f"partition {partition} is not in [0, partitions={partitions})")
        sampler, opt, self.draws = split_samplers(index, sampler, sampler_opt)
        self.sampler_name = (
            sampler if isinstance(sampler, str) else getattr(sampler, "__name__", "")
        )
        self.sampler = get_sampler(sampler)
        check_options(self.sampler, opt, self.sampler_name)
        self.sampler_opt = opt
        self.epoch = -1  # the epoch being read; -1 before the first
        self.ended = False  # the epoch has no more items to dispatch
        self._batches: Iterator[Work] | None = None
        self._rest: list[Piece] = []  # the pieces being handed out (see resume)
        self._cursor: tuple = ("o", 0, 0)  # where the items handed out end (see Work.end)
        self._dispatched: deque[tuple] = deque()  # (`end`, items) of each batch in flight
        self.handed_out = 0  # items handed out over this stream's life (never reset)
        self._last_end: tuple = self._cursor  # the `end` of the last batch dispatched
        self._orders: dict[tuple[int, int, int], Any] = {}  # (P, p, e) -> its order
        self._indexes: dict[tuple[int, int], Any] = {}  # (P, p) -> that partition's index
        self._identity: dict | None = None

    # -- orders --------------------------------------------------------------------------

    def items(self, epoch: int) -> Any:
        """The sampler's items for `epoch`: positions (best a numpy array) or records."""
        return self.order(self.partitions, self.partition, epoch)

    def index_of(self, partitions: int, partition: int) -> Any:
        """The index of `partition` of `partitions` (this stream's own, or cut from `whole`)."""
        if (partitions, partition) == (self.partitions, self.partition):
            return self.index
        key = (partitions, partition)
        if key not in self._indexes:
            self._indexes[key] = self.whole.partition(partition, partitions)
        return self._indexes[key]

    def order(self, partitions: int, partition: int, epoch: int) -> Any:
        """The order partition `partition` of `partitions` gets in `epoch`: what the sampler
        gives with the generator of (seed, partition, epoch). Sized orders are kept while
        they are read (a few: this epoch's, and the pieces' of a resume)."""
        key = (partitions, partition, epoch)
        if key in self._orders:
            return self._orders[key]
        index = self.index_of(partitions, partition)
        rng = epoch_rng(self.seed, partition, epoch)
        items = self.sampler(index, epoch, rng, **self.sampler_opt)
        if self.draws:
            sized = hasattr(items, "__len__")
            items = (SizedDrawnJoin if sized else DrawnJoin)(self, epoch, items, index, partition)
        if hasattr(items, "__len__") or hasattr(items, "walk"):
            if len(self._orders) >= 3:  # (10M positions are 80 MB: keep few)
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = items
        return items

    def _known_length(self, partitions: int, partition: int, epoch: int) -> int:
        """`length` if that order was made already, else -1 (pooling asks for it then)."""
        return self.length(partitions, partition, epoch) if (
            partitions, partition, epoch) in self._orders else -1  # fmt: skip

    # -- the elastic.Geometry protocol: what pooling needs of an order -------------------

    def length(self, partitions: int, partition: int, epoch: int) -> int:
        """Items of that order handed out in an epoch (its kept length); -1: unknown."""
        items = self.order(partitions, partition, epoch)
        if hasattr(items, "walk") or not hasattr(items, "__len__"):
            return -1
        return self._kept(len(items))

    def part_order(self, partitions: int, partition: int, epoch: int) -> list[int] | None:
        if not hasattr(self.whole, "parts"):  # (not part files: no order made to say so)
            return None
        items = self.order(partitions, partition, epoch)
        return items.order if hasattr(items, "walk") else None

    def piece_weight(self, piece: Piece) -> float | None:
        """What a piece of unknown length weighs when pieces are dealt: a part file's
        bytes (by the listing), else None (its length, or the mean)."""
        sizes = getattr(self.whole, "sizes", None)
        if piece.part >= 0 and sizes is not None and sizes[piece.part] is not None:
            return float(sizes[piece.part])
        return None

    def _kept(self, n: int) -> int:
        return n - n % self.batch_size if self.drop_last else n

    # -- starting ------------------------------------------------------------------------

    def start(self, epoch: int, skip: int = 0) -> None:
        """Begin `epoch` after its first `skip` items."""
        self.resume(Position(self.partitions, self.partition, epoch, consumed=skip))

    def resume(self, pos: Position) -> None:
        """Begin at `pos`: its pieces first (an epoch of their own, numbered `pos.epoch` -
        1), else its ordinary epoch after what it had handed out."""
        self.ended = False
        self._dispatched.clear()
        if (pos.partitions, pos.partition) != (self.partitions, self.partition):
            # another partitioning from now on (survivors taking over a dead rank's rest)
            self.index = self.index_of(pos.partitions, pos.partition)
            self.partitions, self.partition = pos.partitions, pos.partition
        if pos.rest:
            self.epoch = pos.epoch - 1
            self._rest = list(pos.rest)
            self._cursor = self._last_end = ("r", 0, 0)
            self._batches = self._pieces(self._rest)
            return
        self.epoch, self._rest = pos.epoch, []
        items = self.items(pos.epoch)
        if hasattr(items, "walk"):
            c = pos.consumed
            self._cursor = self._last_end = ("p", pos.epoch, c, pos.part, pos.record)
            self._batches = self._parts(items, c, pos.part, pos.record)
        elif isinstance(items, np.ndarray):
            self._cursor = self._last_end = ("o", pos.epoch, pos.consumed)
            self._batches = self._slices(items, pos.consumed)
        else:
            self._cursor = self._last_end = ("o", pos.epoch, pos.consumed)
            if isinstance(items, DrawnJoin):
                it = items.iterate(pos.consumed)
            else:
                it = itertools.islice(iter(items), pos.consumed, None)
            self._batches = self._chunks(it, pos.consumed)

    def _dispatching(self, work: Work) -> None:
        self._last_end = work.end

    # -- batches of an ordinary epoch ----------------------------------------------------

    def _slices(self, items: np.ndarray, skip: int) -> Iterator[Work]:
        """Batches of positions, sliced out of the epoch's array."""
        n, bs, epoch = len(items), self.batch_size, self.epoch
        for lo in range(skip, n, bs):
            chunk = items[lo : lo + bs]
            if self.drop_last and len(chunk) < bs:
                return
            sources, names, labels, targets = self.index.describe(chunk.astype(np.int64))
            end = ("o", epoch, lo + len(chunk))
            yield Work(sources, targets, labels, names, epoch, lo, end=end)

    def _chunks(self, it: Iterator[Any], at: int) -> Iterator[Work]:
        """Batches of a stream of positions and records."""
        while True:
            chunk = list(itertools.islice(it, self.batch_size))
            if not chunk or (self.drop_last and len(chunk) < self.batch_size):
                return
            work = self._work(chunk, self.index, at)
            at += len(chunk)
            work.end = ("o", self.epoch, at)
            yield work

    def _parts(self, items: Any, at: int, k: int, j: int) -> Iterator[Work]:
        """Batches of a part-file epoch from its k-th part's j-th record; each record is
        keyed by its part and place (the same in any partitioning)."""
        walk = items.walk(k, j)
        p, epoch = self.partition, self.epoch
        while True:
            chunk = list(itertools.islice(walk, self.batch_size))
            if not chunk or (self.drop_last and len(chunk) < self.batch_size):
                return
            work = self._work([rec for rec, _, _ in chunk], self.index, at)
            work.keys = [(p, epoch, key) for _, _, key in chunk]
            at += len(chunk)
            work.end = ("p", epoch, at, *chunk[-1][1])
            yield work

    def _work(self, chunk: list, index: Any, first: int) -> Work:
        sources, targets, labels, names = [], [], [], []
        for item in chunk:
            if isinstance(item, Record):
                labs = tuple(item.labels)
                target = item.target if item.target is not None else (labs[0] if labs else -1)
                sources.append(item.source)
                names.append(item.name)
            else:
                i = int(item)
                sources.append(index.source(i))
                labs = index.item_labels(i)
                names.append(index.name(i))
                target = index.target(i)
            labels.append(labs)
            targets.append(target)
        return Work(sources, targets, labels, names, self.epoch, first)

    # -- batches of pieces ---------------------------------------------------------------

    def _pieces(self, pieces: list[Piece]) -> Iterator[Work]:
        """Batches of the pieces of an interrupted epoch, in order, `batch_size` items each
        whatever the pieces' bounds (the last may be short); every item keyed as it was
        in the order it comes from. A batch ends at ("r", i, n): n items of piece i."""
        bs = self.batch_size
        buf: list[list] = [[], [], [], [], []]  # sources, targets, labels, names, keys
        at = 0  # items of the pieces dispatched
        for i, piece in enumerate(pieces):
            done = 0  # items of piece i in batches so far
            for run in self._piece_items(piece):
                start = 0
                while start < len(run[0]):
                    take = min(bs - len(buf[0]), len(run[0]) - start)
                    for b, x in zip(buf, run, strict=True):
                        b += x[start : start + take]
                    start += take
                    done += take
                    if len(buf[0]) == bs:
                        yield self._piece_work(buf, at, ("r", i, done))
                        at += bs
                        buf = [[], [], [], [], []]
            # (a piece's last items wait in `buf` for the next piece's first)
        if buf[0]:
            yield self._piece_work(buf, at, ("r", len(pieces), 0))

    def _piece_work(self, buf: list[list], at: int, end: tuple) -> Work:
        sources, targets, labels, names, keys = buf
        return Work(sources, targets, labels, names, self.epoch, at, keys=keys, end=end)

    def piece_items(self, piece: Piece) -> Iterator[tuple[list, ...]]:
        """A piece's items in runs of at most a batch: (sources, targets, labels, names,
        keys); what a mix reads of each of its sources."""
        return self._piece_items(piece)

    def _piece_items(self, piece: Piece) -> Iterator[tuple[list, ...]]:
        """A piece's items in runs: (sources, targets, labels, names, keys)."""
        P, p, e = piece.partitions, piece.partition, piece.epoch
        index, items = self.index_of(P, p), self.order(P, p, e)
        step = self.batch_size  # (a batch at a time, as an ordinary epoch is described)
        if piece.part >= 0:
            if not hasattr(items, "part"):
                raise ValueError(f"{piece} names a part file, and {self.whole.origin!r} is "
                                 "not a folder of part files")  # fmt: skip
            recs = items.part(piece.part, piece.lo)
            while chunk := list(itertools.islice(recs, step)):
                work = self._work([r for r, _ in chunk], index, 0)
                yield (work.sources, work.targets, work.labels, work.names,
                       [(p, e, key) for _, key in chunk])  # fmt: skip
            return
        if isinstance(items, np.ndarray):
            hi = piece.hi if piece.hi >= 0 else len(items)
            for lo in range(piece.lo, hi, step):
                chunk = items[lo : min(hi, lo + step)].astype(np.int64)
                sources, names, labels, targets = index.describe(chunk)
                yield sources, targets, labels, names, [(p, e, lo + i) for i in range(len(chunk))]
            return
        it = items.iterate(piece.lo) if isinstance(items, DrawnJoin) else itertools.islice(
            iter(items), piece.lo, None)  # fmt: skip
        at, left = piece.lo, (piece.hi - piece.lo if piece.hi >= 0 else None)
        while left is None or left > 0:
            n = step if left is None else min(step, left)
            chunk = list(itertools.islice(it, n))
            if not chunk:
                return
            work = self._work(chunk, index, at)
            yield (work.sources, work.targets, work.labels, work.names,
                   [(p, e, at + i) for i in range(len(chunk))])  # fmt: skip
            at += len(chunk)
            if left is not None:
                left -= len(chunk)

    # -- sizes -----------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches in one epoch; TypeError for a stream of unknown length."""
        items = self.items(max(self.epoch, 0))
        if not hasattr(items, "__len__"):
            raise TypeError(
                f"sampler {self.sampler_name!r} yields a stream of unknown length; "
                "use batcher.num_batches() for an estimate"
            )
        return self.batches_for(len(items))

    def batches_for(self, n: int) -> int:
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    # -- resume ----------------------------------------------------------------------

    @property
    def identity(self) -> dict:
        """What the order depends on, beside the partitioning: a state saved with other
        values is refused (seed, sampler, the index's digest and size)."""
        if self._identity is None:
            whole = self.whole
            parts = getattr(whole, "parts", None)
            if parts is not None:  # part files: the listing (len() would read parts)
                what = ["parts", [str(p).rsplit("/", 1)[-1] for p in parts]]
                items = len(parts)
            else:
                members = getattr(whole, "members", None) or [whole]
                what = ["index", [len(m) for m in members], [m.num_rows for m in members]]
                items = len(whole)
            what.append(list(getattr(whole, "labels", []) if parts is None else []))
            digest = hashlib.blake2b(repr(what).encode(), digest_size=8).digest()
            self._identity = {
                "seed": self.seed,
                "sampler": self.sampler_name,
                "index": int.from_bytes(digest, "little") >> 1,
                "items": items,
            }
        return self._identity

    def position(self) -> Position:
        """Where the items handed out end (see the module docstring)."""
        P, p, cur = self.partitions, self.partition, self._cursor
        if self.epoch < 0:
            return Position(P, p, 0, length=self._known_length(P, p, 0))
        if cur[0] == "r":  # in the pieces: those not finished, then the ordinary epoch
            _, i, done = cur
            rest = list(self._rest[i:])
            if rest and done:
                rest[0] = _advance(rest[0], done)
                if rest[0].known and rest[0].lo >= rest[0].hi:
                    rest.pop(0)
            after = self.epoch + 1
            return Position(P, p, after, length=self._known_length(P, p, after), rest=rest)
        epoch, consumed = cur[1], cur[2]
        part, record = (cur[3], cur[4]) if cur[0] == "p" else (0, 0)
        length = self._known_length(P, p, epoch)
        drained = self.ended and cur == self._last_end and not self._dispatched
        if (length >= 0 and consumed >= length) or (drained and epoch == self.epoch):
            # every item handed out: where it stands is the start of the next epoch
            return Position(P, p, epoch + 1, length=self._known_length(P, p, epoch + 1))
        return Position(P, p, epoch, consumed, length, part, record)

    def state_dict(self) -> dict:
        """The position and what the order depends on (see
        :mod:`dataset.sampling.elastic` for the format): a few integers.

        Once every item of an epoch is handed out, where it stands is the start of the
        next one: a job resumed from there trains on, rather than over an empty epoch."""
        return self.state_of(self.position())

    def state_of(self, pos: Position) -> dict:
        return {"format": elastic.FORMAT, **self.identity, "batch_size": self.batch_size,
                **pos.state()}  # fmt: skip

    def check_state(self, state: Any) -> tuple[int, int]:
        """``(epoch, consumed)`` of this partition's saved state (no pieces), refused if it
        was saved for another order; see :meth:`resume_position` for the general case."""
        pos = self.resume_position(state)
        if pos.rest:
            raise ValueError("this state has pieces of an interrupted epoch: use resume_position")
        return pos.epoch, pos.consumed

    def resume_position(self, state: Any) -> Position:
        """The position to resume from `state` (this partition's own) or from the list of
        every old rank's states (any world size): see :func:`dataset.sampling.elastic.resume`.
        A format-1 state (epoch and consumed only) is checked as it was saved: its
        ``items`` counted this partition's examples."""
        identity = self.identity
        if isinstance(state, Mapping) and state.get("format", 1) == 1 and "items" in state:
            n = getattr(self.index, "parts", None)
            here = len(n) if n is not None else len(self.index)
            identity = {**identity, "items": here, "index": state.get("index")}
        return elastic.resume(state, self.partition, self.partitions, self.batch_size, self,
                              identity, self.piece_weight)  # fmt: skip


def _advance(piece: Piece, n: int) -> Piece:
    return Piece(piece.partitions, piece.partition, piece.epoch, piece.part, piece.lo + n,
                 piece.hi)  # fmt: skip


# ----------------------------------------------------------------------------- joined indexes


def split_samplers(index: Any, sampler: Any, sampler_opt: Any) -> tuple[Any, dict, list[Draw]]:
    """(the driver's sampler, its options, the drawn members) from ``sampler``/``sampler_opt``.

    A list/tuple ``sampler`` has one entry per joined index: entry 0 drives the
    epoch, entry k > 0 is None (aligned: item i of the first fetches item i of
    index k) or a sampler that draws index k's item for each driven item. A
    plain sampler drives with every other index aligned. Aligned members must
    have the first's length: BadIndex here, before anything is fetched.
    """
    members = index.members if isinstance(index, JoinedIndex) else None
    if isinstance(sampler, list | tuple):
        if members is None:
            raise ValueError(
                f"sampler={list(sampler)!r} is a list (one sampler per joined index), "
                f"but {index.origin} is a single index; pass one sampler"
            )
        if len(sampler) != len(members):
            raise ValueError(
                f"sampler={list(sampler)!r} has {len(sampler)} entries for "
                f"{len(members)} joined indexes ({index.origin}); give one per index"
            )
        if sampler[0] is None:
            raise ValueError("sampler[0] drives the epoch and cannot be None")
        samplers = list(sampler)
    else:
        samplers = [sampler] + [None] * (len(members) - 1 if members else 0)
    if isinstance(sampler_opt, list | tuple):
        if not isinstance(sampler, list | tuple):
            raise ValueError("a list of sampler_opt goes with a list of samplers (one per index)")
        if len(sampler_opt) != len(samplers):
            raise ValueError(
                f"sampler_opt has {len(sampler_opt)} entries for {len(samplers)} samplers"
            )
        opts = [dict(o or {}) for o in sampler_opt]
    else:
        opts = [dict(sampler_opt or {})] + [{} for _ in samplers[1:]]
    draws = []
    for k in range(1, len(samplers)):
        member = members[k]
        if samplers[k] is None:
            if opts[k]:
                raise ValueError(f"sampler_opt[{k}] given for {member.origin}, which is aligned")
            first = members[0]
            if member.num_rows != first.num_rows:
                raise BadIndex(
                    f"joined indexes differ in length: {first.origin} has {first.num_rows} "
                    f"items, {member.origin} has {member.num_rows}; item i of the first can "
                    f"only fetch item i of an index of the same length. To draw from "
                    f"{member.origin} instead, give it a sampler: sampler=[..., 'uniform'] "
                    f"(entry {k})"
                )
        else:
            fn = get_sampler(samplers[k])
            check_options(fn, opts[k], f"{samplers[k]!r} (index {k})")
            draws.append(Draw(k, fn, opts[k]))
    return samplers[0], opts[0], draws


class DrawnJoin:
    """One epoch of a joined index with drawn members: a :class:`Record` per driven item.

    Each iteration restarts the draws (each member's generator is seeded by
    (seed, partition, epoch, k)), so an epoch regenerated to resume it draws
    exactly what it drew before.
    """

    def __init__(
        self, stream: ItemStream, epoch: int, items: Iterable[Any], index: Any, partition: int
    ):
        self.index, self.draws = index, stream.draws
        self.seed, self.partition, self.name = stream.seed, partition, stream.sampler_name
        self.epoch, self.items = epoch, items

    def __iter__(self) -> Iterator[Record]:
        return self.iterate(0)

    def iterate(self, skip: int = 0) -> Iterator[Record]:
        """The epoch's records after its first `skip`: the driver's items sliced, each
        drawn member's draws skipped by whole epochs of its sampler (no walk)."""
        index = self.index
        members = index.members
        streams: list[Iterator[Any] | None] = [None] * len(members)
        for d in self.draws:
            rng = epoch_rng(self.seed, self.partition, self.epoch, stream=d.k)
            streams[d.k] = endless(d.sampler, members[d.k], rng, d.opt, skip=skip)
        items = self.items
        if skip:
            if isinstance(items, np.ndarray):
                items = items[skip:]
            else:
                items = itertools.islice(iter(items), skip, None)
        for item in _flat(items):
            if isinstance(item, Record):
                if any(s is None for s in streams[1:]):
                    raise ValueError(
                        f"sampler {self.name!r} yields records, which have no position "
                        f"to align the other indexes of {index.origin} with; draw them instead"
                    )
                labels, target = tuple(item.labels), item.target
                slots, names = [item.source], [item.name]
            else:
                p = int(index.positions[item])
                labels, target = index.item_labels(item), index.target(item)
                row = members[0].row(p)
                slots, names = [members[0].source(p)], [members[0].name(p)]
            for k in range(1, len(members)):
                stream, member = streams[k], members[k]
                if stream is None:  # aligned: the member's item on the same row
                    slots.append(member.row_source(row))
                    names.append(member.row_name(row))
                    continue
                drawn = next(stream)
                if isinstance(drawn, Record):
                    slots.append(drawn.source)
                    names.append(drawn.name)
                else:
                    j = int(drawn)
                    slots.append(member.source(j))
                    names.append(member.name(j))
            yield Record(Joined(slots), labels, " + ".join(names), target)


class SizedDrawnJoin(DrawnJoin):
    """A :class:`DrawnJoin` whose driver has a length, so ``len(batcher)`` still works."""

    def __len__(self) -> int:
        return len(self.items)  # type: ignore[arg-type]


def _flat(items: Iterable[Any], step: int = 4096) -> Iterator[Any]:
    """Items one by one; a numpy array as Python ints, a slice at a time (not all at once)."""
    if isinstance(items, np.ndarray):
        for lo in range(0, len(items), step):
            yield from items[lo : lo + step].tolist()
    else:
        yield from items
