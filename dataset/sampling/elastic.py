"""The loader's position at any world size: what a job had not consumed, and each rank's share.

A rank's place in the data is a few integers (see :class:`Position`): the ordinary epoch
it is in and how many of that epoch's items it handed out, plus, after a resume at
another world size, the *pieces* of an interrupted epoch still to hand out before it. A
piece names a run of one order that anybody can regenerate: items ``lo..hi`` of the
order that partition ``p`` of ``P`` gets in epoch ``e`` (``hi`` -1: to its end), or, for
part files, the records from ``lo`` on of one part file in that order's permutation of
it. Orders are never stored: the sampler regenerates them from (seed, p, e).

The functions here are pure (integers in, integers out), so exactly-once is checked on
them alone (tests/test_elastic.py):

- :func:`pool`: the list of every old rank's :class:`Position` -> the pieces the old job
  had not handed out, and the first epoch that is ordinary again;
- :func:`split`: those pieces -> each new rank's share (whole batches, balanced);
- :func:`resume`: both, for one new rank, or its own position at the same world size;
- :func:`check_states`: a list of saved states refused by name when it cannot be honoured;
- :func:`take_over` and :func:`admit`, for a job that goes on without a restart
  (distlearn.survivors): a dead rank's rest shared by the survivors; ranks that come back
  given a share of the rest of the ranks still in their epoch.

The epoch geometry (how long an order is, which part files it walks) comes from the
stream, through a :class:`Geometry`.

Format of a saved position (``batcher.state_dict()``, JSON-able integers and strings)::

    {"format": 2, "seed": 0, "sampler": "permutation", "index": <63-bit digest>,
     "items": <examples in the whole index>, "partition": 1, "partitions": 4,
     "batch_size": 32, "epoch": 3, "consumed": 640, "length": 15000,
     "part": 0, "record": 0, "rest": [[P, p, e, part, lo, hi], ...]}

``length`` is the current epoch's item count (-1 unknown); ``part``/``record`` locate
the position inside a part-file epoch (parts of its order done, records of the next
handed out); ``rest`` holds pieces (``part`` -1 for positions).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

__all__ = [
    "FORMAT",
    "Geometry",
    "Piece",
    "Position",
    "admit",
    "advance",
    "check_states",
    "pool",
    "resume",
    "split",
    "take_over",
]

FORMAT = 2
# What the order depends on: a state that differs in one of these is refused.
IDENTITY = ("seed", "sampler", "items", "index")


@dataclass(frozen=True, order=True)
class Piece:
    """Items ``lo..hi`` (``hi`` -1: to the end) of the order of partition ``partition`` of
    ``partitions`` in ``epoch``; for part files (``part`` >= 0), the records ``lo..`` of
    part file ``part`` (a number in the whole listing) in that order's permutation."""

    partitions: int
    partition: int
    epoch: int
    part: int
    lo: int
    hi: int

    @property
    def known(self) -> bool:
        return self.hi >= 0

    def __len__(self) -> int:
        if self.hi < 0:
            raise TypeError(f"{self} runs to the end of a stream: its length is not known")
        return self.hi - self.lo

    def as_list(self) -> list[int]:
        return [self.partitions, self.partition, self.epoch, self.part, self.lo, self.hi]

    @classmethod
    def parse(cls, raw: Any, where: str) -> Piece:
        if not isinstance(raw, list | tuple) or len(raw) != 6 or not all(_is_int(x) for x in raw):
            raise ValueError(f"{where}: a piece is 6 integers [P, p, epoch, part, lo, hi], "
                             f"got {raw!r}")  # fmt: skip
        P, p, e, part, lo, hi = (int(x) for x in raw)
        if not (P >= 1 and 0 <= p < P and e >= 0 and part >= -1 and lo >= 0 and hi >= -1):
            raise ValueError(f"{where}: piece {list(raw)} is out of range")
        if hi >= 0 and (hi < lo or part >= 0):
            raise ValueError(f"{where}: piece {list(raw)} ends before it starts, or is a "
                             "part file's with an end")  # fmt: skip
        return cls(P, p, e, part, lo, hi)


@dataclass
class Position:
    """Where one rank stands (see the module docstring)."""

    partitions: int
    partition: int
    epoch: int  # the ordinary epoch (after `rest`)
    consumed: int = 0  # items of `epoch` handed out
    length: int = -1  # items in `epoch`'s order; -1: not known (a stream)
    part: int = 0  # part files: parts of `epoch`'s part order done
    record: int = 0  # ... and records of the next one handed out
    rest: list[Piece] = field(default_factory=list)

    @property
    def begun(self) -> bool:
        """Whether anything of `epoch` was handed out."""
        return self.consumed > 0 or self.part > 0 or self.record > 0

    def state(self) -> dict:
        return {
            "partition": self.partition,
            "partitions": self.partitions,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "length": self.length,
            "part": self.part,
            "record": self.record,
            "rest": [p.as_list() for p in self.rest],
        }

    @classmethod
    def parse(cls, state: Mapping, where: str = "state_dict") -> Position:
        """The position of a saved state (format 2, or 1: today's `epoch`/`consumed` only)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"{where} must be a dict, got {type(state).__name__}")
        for key in ("epoch", "consumed"):
            _need_int(state, key, where)
        fmt = state.get("format", 1)
        if fmt == 1:
            p = state.get("partition", 0)
            return cls(0, int(p) if _is_int(p) else 0, int(state["epoch"]),
                       int(state["consumed"]))  # fmt: skip
        if fmt != FORMAT:
            raise ValueError(f"{where} has format {fmt!r}; this version reads 1 and {FORMAT}")
        for key in ("partition", "partitions", "part", "record"):
            _need_int(state, key, where)
        length = state.get("length", -1)
        if not _is_int(length) or length < -1:
            raise ValueError(f"{where}['length'] must be an int >= -1, got {length!r}")
        P, p = int(state["partitions"]), int(state["partition"])
        if not (P >= 1 and 0 <= p < P):
            raise ValueError(f"{where}: partition {p} of {P} is out of range")
        rest = state.get("rest", [])
        if not isinstance(rest, list | tuple):
            raise ValueError(f"{where}['rest'] must be a list of pieces, got {rest!r}")
        pieces = [Piece.parse(x, f"{where}['rest'][{i}]") for i, x in enumerate(rest)]
        return cls(P, p, int(state["epoch"]), int(state["consumed"]), int(length),
                   int(state["part"]), int(state["record"]), pieces)  # fmt: skip


class Geometry(Protocol):
    """What pooling needs to know of an epoch's order, from the stream that makes them."""

    def length(self, partitions: int, partition: int, epoch: int) -> int:
        """Items in the order of (partitions, partition, epoch); -1 when not known."""
        ...

    def part_order(self, partitions: int, partition: int, epoch: int) -> list[int] | None:
        """The part files (numbers in the whole listing) that order walks, in its order;
        None when the source is not part files."""
        ...


# ----------------------------------------------------------------------------- checks


def check_states(states: Sequence[Any], identity: Mapping[str, Any]) -> list[Position]:
    """The positions of a list of every old rank's state, or ValueError naming what cannot be
    honoured: a state of another order (``identity``: seed, sampler, index, items), of
    format 1, of another world size than the others, a partition missing or repeated."""
    if not states:
        raise ValueError("load_state_dict got an empty list: pass every old rank's state")
    positions = []
    for i, state in enumerate(states):
        where = f"state_dict[{i}]"
        if isinstance(state, Mapping) and state.get("format", 1) == 1:
            raise ValueError(
                f"{where} is a format-1 state (saved before world-size-independent "
                "positions): it resumes its own partition only; pass it alone, at the "
                "same world size"
            )
        pos = Position.parse(state, where)
        check_identity(state, identity, f"{where} (partition {pos.partition} of "
                                        f"{pos.partitions})")  # fmt: skip
        positions.append(pos)
    sizes = sorted({p.partitions for p in positions})
    if len(sizes) > 1:
        raise ValueError(
            f"the states come from jobs of different world sizes ({sizes}): pass the "
            "states of one checkpoint, every rank's once"
        )
    (world,) = sizes
    seen: dict[int, int] = {}
    for i, pos in enumerate(positions):
        if pos.partition in seen:
            raise ValueError(
                f"partition {pos.partition} of {world} appears twice (state_dict["
                f"{seen[pos.partition]}] and state_dict[{i}]): pass every rank's state once"
            )
        seen[pos.partition] = i
    missing = sorted(set(range(world)) - set(seen))
    if missing:
        raise ValueError(
            f"the list holds {len(seen)} of the {world} states of the old job: partition"
            f"{'s' if len(missing) > 1 else ''} {_names(missing)} missing; without every "
            "rank's state what they had not handed out is unknown"
        )
    return sorted(positions, key=lambda p: p.partition)


def check_identity(state: Mapping, identity: Mapping[str, Any], where: str) -> None:
    for key in IDENTITY:
        if key in state and key in identity and state[key] != identity[key]:
            raise ValueError(
                f"{where} was saved with {key}={state[key]!r}, this batcher has "
                f"{key}={identity[key]!r}: its order would not be the one resumed"
            )


# ----------------------------------------------------------------------------- pooling


def pool(positions: Sequence[Position], geometry: Geometry) -> tuple[list[Piece], int]:
    """What the old job (every rank's position, in partition order) had not handed out,
    and the first epoch after it, ordinary in any partitioning.

    That epoch is M + 1, M the newest epoch any old rank had begun: ranks of a job run at
    most an epoch apart (uneven partitions), and every epoch up to M is finished, piece by
    piece, in the old job's orders."""
    newest = _newest(positions)
    pieces: list[Piece] = []
    for pos in positions:
        pieces += _left(pos, newest, geometry)
    return pieces, newest + 1


def _newest(positions: Sequence[Position]) -> int:
    """The newest epoch any of `positions` had begun."""
    return max((p.epoch if p.begun else p.epoch - 1) for p in positions)


def _left(pos: Position, newest: int, geometry: Geometry) -> list[Piece]:
    """What `pos` had not handed out: its pieces, then its orders up to epoch `newest`."""
    pieces = list(pos.rest)
    for e in range(pos.epoch, newest + 1):
        pieces += _unread(pos, e, geometry)
    return pieces


def _unread(pos: Position, epoch: int, geometry: Geometry) -> list[Piece]:
    """The pieces of `pos`'s order in `epoch` not yet handed out."""
    P, p = pos.partitions, pos.partition
    current = epoch == pos.epoch
    order = geometry.part_order(P, p, epoch)
    if order is not None:
        k, j = (pos.part, pos.record) if current else (0, 0)
        return [Piece(P, p, epoch, f, j if i == k else 0, -1)
                for i, f in enumerate(order) if i >= k]  # fmt: skip
    lo = pos.consumed if current else 0
    n = pos.length if current and pos.length >= 0 else geometry.length(P, p, epoch)
    if n < 0:  # a stream of unknown length: the rest of it, from `lo`
        return [Piece(P, p, epoch, -1, lo, -1)]
    return [Piece(P, p, epoch, -1, lo, n)] if n > lo else []


# ----------------------------------------------------------------------------- splitting


def split(
    pieces: Sequence[Piece],
    ranks: int,
    batch_size: int,
    weight: Callable[[Piece], float] | None = None,
) -> list[list[Piece]]:
    """Each of `ranks` new ranks' share of `pieces`, in order.

    Pieces of known length are one sequence cut into batches of `batch_size` (the last
    short), dealt in runs of whole batches: shares differ by one batch at most, a piece
    is cut where a share ends. Where a piece's length is unknown (part files, a stream)
    pieces are dealt whole, each to the rank with the least so far (by `weight`, else
    length, an unknown one counting as the mean of the known)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if all(p.known for p in pieces):
        return _cut(pieces, ranks, batch_size)
    return _deal(pieces, ranks, weight)


def _cut(pieces: Sequence[Piece], ranks: int, batch_size: int) -> list[list[Piece]]:
    total = sum(len(p) for p in pieces)
    batches = -(-total // batch_size)
    bounds = [min(total, (q * batches // ranks) * batch_size) for q in range(ranks + 1)]
    shares: list[list[Piece]] = [[] for _ in range(ranks)]
    at, q = 0, 0  # `at`: where the current piece starts in the sequence
    for piece in pieces:
        lo, hi = at, at + len(piece)
        while lo < hi:
            while bounds[q + 1] <= lo:
                q += 1
            end = min(hi, bounds[q + 1])
            shares[q].append(replace(piece, lo=piece.lo + lo - at, hi=piece.lo + end - at))
            lo = end
        at = hi
    return shares


def _deal(pieces: Sequence[Piece], ranks: int, weight) -> list[list[Piece]]:
    known = [len(p) for p in pieces if p.known]
    mean = sum(known) / len(known) if known else 1.0

    def w(p: Piece) -> float:
        if weight is not None:
            got = weight(p)
            if got is not None:
                return float(got)
        return float(len(p)) if p.known else mean

    shares: list[list[Piece]] = [[] for _ in range(ranks)]
    load = [0.0] * ranks
    for piece in pieces:
        q = min(range(ranks), key=lambda r: (load[r], r))
        shares[q].append(piece)
        load[q] += w(piece)
    return shares


# ----------------------------------------------------------------------------- resuming


def resume(
    states: Any,
    partition: int,
    partitions: int,
    batch_size: int,
    geometry: Geometry,
    identity: Mapping[str, Any],
    weight: Callable[[Piece], float] | None = None,
) -> Position:
    """The position of new rank `partition` of `partitions`, from one saved state (its own)
    or the list of every old rank's (any world size)."""
    if isinstance(states, Mapping):
        pos = Position.parse(states)
        check_identity(states, identity, "state_dict")
        if pos.partitions == 0:  # format 1: the partition it was saved for
            if pos.partition != partition:
                raise ValueError(
                    f"state_dict was saved with partition={pos.partition}, this batcher "
                    f"has partition={partition}: its order would not be the one resumed"
                )
            return replace(pos, partitions=partitions)
        if (pos.partition, pos.partitions) != (partition, partitions):
            raise ValueError(
                f"state_dict is partition {pos.partition} of {pos.partitions}, this batcher "
                f"is partition {partition} of {partitions}: to resume at another world "
                "size, pass the list of every old rank's state"
            )
        return pos
    if not isinstance(states, list | tuple):
        raise TypeError(
            f"load_state_dict takes a state (dict) or the list of every old rank's states, "
            f"got {type(states).__name__}"
        )
    positions = check_states(states, identity)
    if positions[0].partitions == partitions:
        return positions[partition]  # the same partitioning: each rank its own, bit for bit
    pieces, epoch = pool(positions, geometry)
    share = split(pieces, partitions, batch_size, weight)[partition]
    return Position(partitions, partition, epoch, rest=share)


def take_over(
    own: Position,
    dead: Sequence[Position],
    everyone: Sequence[Position],
    partition: int,
    partitions: int,
    batch_size: int,
    geometry: Geometry,
    weight: Callable[[Piece], float] | None = None,
    share: tuple[int, int] | None = None,
) -> Position:
    """A survivor's new position when the ranks of `dead` died (no restart).

    The survivor keeps its own rest and the remainder of its epoch (in its old
    partitioning, as pieces: nothing it prefetched changes), then takes its share of
    what the dead had not handed out, and goes on with ordinary epochs of the new
    partitioning (`partition` of `partitions`) after the newest epoch anyone had begun.
    `everyone`: every old rank's position (the dead's included), which sets that epoch.
    `share`: (i, n): this survivor is sharer i of n (default: `partition` of
    `partitions`); (0, 0): it takes no share (it has left its epoch already).
    """
    newest = _newest(everyone)
    theirs = [piece for pos in dead for piece in _left(pos, newest, geometry)]
    mine = _left(own, newest, geometry)
    i, n = share if share is not None else (partition, partitions)
    taken = split(theirs, n, batch_size, weight)[i] if n else []
    return Position(partitions, partition, newest + 1, rest=mine + taken)


def admit(
    old: Sequence[Position],
    sharers: Sequence[int],
    partition: int,
    partitions: int,
    batch_size: int,
    geometry: Geometry,
    weight: Callable[[Piece], float] | None = None,
) -> Position:
    """A rank's new position when returning ranks are taken in (no restart).

    `old`: the position of every rank already there, in rank order; the returning ranks
    are ranks ``len(old)`` to ``partitions - 1``. The old ranks of `sharers` (those still
    in their epoch) pool what they had not handed out and split it with the returning
    ones, in runs of whole batches; the other old ranks (their epoch done) keep their
    own rest. Then every rank goes on with ordinary epochs of the new partitioning
    (`partition` of `partitions`) after the newest epoch anyone had begun: each example
    still once."""
    if not len(old) < partitions:
        raise ValueError(f"admit: {len(old)} old ranks leave no room in {partitions}")
    newest = _newest(old)
    takers = [*sharers, *range(len(old), partitions)]
    if partition in takers:
        pooled = [piece for r in sharers for piece in _left(old[r], newest, geometry)]
        mine = split(pooled, len(takers), batch_size, weight)[takers.index(partition)]
    else:
        mine = _left(old[partition], newest, geometry)
    return Position(partitions, partition, newest + 1, rest=mine)


def advance(pos: Position, n: int, geometry: Geometry) -> Position:
    """Where `pos` stands after `n` more items are handed out (what another rank reached,
    from its position at a known time and its count since): through its pieces, then its
    ordinary epochs. Orders of unknown length (part files, streams) cannot be advanced by
    count: ValueError."""
    rest, epoch, consumed = list(pos.rest), pos.epoch, pos.consumed
    while n > 0 and rest:
        piece = rest[0]
        if not piece.known:
            raise ValueError(f"{piece}: a piece of unknown length cannot be advanced by count")
        take = min(n, len(piece))
        n -= take
        if take == len(piece):
            rest.pop(0)
        else:
            rest[0] = replace(piece, lo=piece.lo + take)
    if rest:
        return replace(pos, rest=rest)
    if pos.part or pos.record:
        raise ValueError("a part-file position cannot be advanced by count")
    P, p = pos.partitions, pos.partition
    length = pos.length if pos.length >= 0 and not pos.rest else geometry.length(P, p, epoch)
    while True:
        if length < 0:
            raise ValueError(f"the order of partition {p} of {P} in epoch {epoch} has no "
                             "known length: it cannot be advanced by count")  # fmt: skip
        if consumed + n < length:
            return Position(P, p, epoch, consumed + n, length)
        n -= length - consumed
        epoch, consumed = epoch + 1, 0
        length = geometry.length(P, p, epoch)
        if n == 0:
            return Position(P, p, epoch, 0, length)


# ----------------------------------------------------------------------------- helpers


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _need_int(state: Mapping, key: str, where: str) -> None:
    value = state.get(key)
    if not _is_int(value) or value < 0:
        raise ValueError(f"{where}[{key!r}] must be an int >= 0, got {value!r}")


def _names(numbers_: list[int]) -> str:
    text = ", ".join(str(n) for n in numbers_[:10])
    return (
        text
        + (f" and {len(numbers_) - 10} more" if len(numbers_) > 10 else "")
        + (" are" if len(numbers_) > 1 else " is")
    )
