"""The world-size-independent position as pure functions: pooling and splitting checked
for exactly-once against simulated jobs that resize again and again.

A simulated rank hands out items as the stream does: its rest pieces first, then ordinary
epochs of its partitioning. An item is named by the order that holds it and its place
there; the order of (P, p, e) is a permutation of partition p of P (example i to i % P),
so the check is on examples: every finished epoch holds every example exactly once,
summed over every job that took part in it.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from distlearn.dataset.sampling.elastic import (
    Piece,
    Position,
    admit,
    advance,
    check_states,
    pool,
    resume,
    split,
    take_over,
)

IDENT = {"seed": 0, "sampler": "permutation", "index": 7, "items": 0}


class Sized:
    """Orders of N examples partitioned round robin, one permutation per (P, p, e)."""

    def __init__(self, n: int, with_replacement: bool = False):
        self.n, self.replace = n, with_replacement
        self._orders: dict = {}

    def order(self, P: int, p: int, e: int) -> np.ndarray:
        key = (P, p, e)
        if key not in self._orders:
            mine = np.arange(p, self.n, P)
            rng = np.random.default_rng([P, p, e, 99])
            if self.replace:  # len(partition) draws with replacement
                self._orders[key] = mine[rng.integers(0, len(mine), len(mine))]
            else:
                self._orders[key] = rng.permutation(mine)
        return self._orders[key]

    def length(self, P: int, p: int, e: int) -> int:
        return len(self.order(P, p, e))

    def part_order(self, P: int, p: int, e: int):
        return None


def run(pos: Position, n: int, geo: Sized, out: list) -> Position:
    """Hand out `n` items from `pos` (appending (epoch, example, draw id) to `out`)."""
    rest = list(pos.rest)
    epoch, consumed = pos.epoch, pos.consumed
    while n > 0 and rest:
        piece = rest[0]
        take = min(n, len(piece))
        order = geo.order(piece.partitions, piece.partition, piece.epoch)
        for i in range(piece.lo, piece.lo + take):
            out.append((piece.epoch, int(order[i]), (piece.partitions, piece.partition, i)))
        n -= take
        if take == len(piece):
            rest.pop(0)
        else:
            rest[0] = Piece(piece.partitions, piece.partition, piece.epoch, -1,
                            piece.lo + take, piece.hi)  # fmt: skip
    P, p = pos.partitions, pos.partition
    while n > 0:
        order = geo.order(P, p, epoch)
        take = min(n, len(order) - consumed)
        for i in range(consumed, consumed + take):
            out.append((epoch, int(order[i]), (P, p, i)))
        consumed += take
        n -= take
        if consumed == len(order):
            epoch, consumed = epoch + 1, 0
    return Position(P, p, epoch, consumed, geo.length(P, p, epoch), rest=rest)


def finish(positions: list[Position], geo: Sized, out: list, epoch: int) -> None:
    """Run every rank until its ordinary epoch is `epoch`, nothing of it handed out."""
    for pos in positions:
        while pos.rest or pos.epoch < epoch:
            pos = run(pos, 1, geo, out)


def check_epochs(out: list, n: int, upto: int, replace: bool) -> None:
    by_epoch: dict[int, list] = {}
    for epoch, example, draw in out:
        by_epoch.setdefault(epoch, []).append((example, draw))
    for e in range(upto):
        got = by_epoch.get(e, [])
        if replace:  # draws are the unit: each draw once, len(index) of them
            draws = Counter((d, x) for x, d in got)
            assert len(got) == n and max(draws.values()) == 1, f"epoch {e}"
        else:
            counts = Counter(x for x, _ in got)
            dup = [x for x, c in counts.items() if c > 1]
            missing = sorted(set(range(n)) - set(counts))
            assert not dup and not missing, f"epoch {e}: repeated {dup[:9]}, missing {missing[:9]}"


def states(positions: list[Position]) -> list[dict]:
    return [{"format": 2, **IDENT, **pos.state()} for pos in positions]


@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_chains_of_resizes_hold_every_example_exactly_once(seed, replace):
    rnd = random.Random(seed)
    n = rnd.randint(1, 120)
    geo = Sized(n, replace)
    worlds = [rnd.randint(1, 9) for _ in range(rnd.randint(2, 5))]
    batch = rnd.randint(1, 9)
    out: list = []
    positions = [Position(worlds[0], p, 0, 0, geo.length(worlds[0], p, 0))
                 for p in range(worlds[0])]  # fmt: skip
    for world in worlds[1:]:
        positions = [run(pos, rnd.randint(0, 3 * n // len(positions) + 2), geo, out)
                     for pos in positions]  # fmt: skip
        saved = states(positions)
        rnd.shuffle(saved)  # any order
        positions = [resume(saved, q, world, batch, geo, IDENT) for q in range(world)]
    last = max(p.epoch for p in positions) + 1
    finish(positions, geo, out, last)
    check_epochs(out, n, last, replace)


def test_four_three_five_one():
    geo, out = Sized(1000), []
    positions = [Position(4, p, 0, 0, 250) for p in range(4)]
    for world, steps in [(3, 170), (5, 90), (1, 333)]:
        positions = [run(pos, steps + 7 * i, geo, out) for i, pos in enumerate(positions)]
        positions = [resume(states(positions), q, world, 32, geo, IDENT) for q in range(world)]
    finish(positions, geo, out, positions[0].epoch + 1)
    check_epochs(out, 1000, positions[0].epoch + 1, False)


def test_the_same_world_size_resumes_each_rank_as_it_was():
    geo = Sized(100)
    positions = [Position(4, p, 2, 5 * p, 25) for p in range(4)]
    saved = states(positions)
    assert [resume(saved[::-1], q, 4, 8, geo, IDENT) for q in range(4)] == positions
    assert resume(saved[2], 2, 4, 8, geo, IDENT) == positions[2]


def test_shares_are_whole_batches_and_differ_by_one_batch_at_most():
    pieces = [Piece(4, p, 3, -1, 10 * p, 97) for p in range(4)]  # 97 + 87 + 77 + 67 = 328
    for ranks in range(1, 12):
        shares = split(pieces, ranks, 16)
        sizes = [sum(len(x) for x in s) for s in shares]
        assert sum(sizes) == 328
        ends = np.cumsum(sizes)
        assert all(s % 16 == 0 for s, end in zip(sizes, ends, strict=True) if end < 328)
        full = [s // 16 + (s % 16 > 0) for s in sizes]
        assert max(full) - min(full) <= 1
        flat = [(x.partition, i) for s in shares for x in s for i in range(x.lo, x.hi)]
        assert flat == [(p.partition, i) for p in pieces for i in range(p.lo, p.hi)]


def test_an_epoch_boundary_is_a_plain_start_and_spread_epochs_are_finished():
    geo = Sized(40)
    at_boundary = [Position(2, p, 3, 0, 20) for p in range(2)]
    assert pool(at_boundary, geo) == ([], 3)
    # rank 0 finished epoch 3 and began 4; rank 1 is still in 3
    spread = [Position(2, 0, 4, 5, 20), Position(2, 1, 3, 15, 20)]
    pieces, epoch = pool(spread, geo)
    assert epoch == 5
    assert pieces == [Piece(2, 0, 4, -1, 5, 20), Piece(2, 1, 3, -1, 15, 20),
                      Piece(2, 1, 4, -1, 0, 20)]  # fmt: skip


class Parts:
    """Part files: file f of F belongs to partition f % P; each has `records[f]` records."""

    def __init__(self, records: list[int]):
        self.records = records

    def part_order(self, P: int, p: int, e: int) -> list[int]:
        mine = list(range(p, len(self.records), P))
        random.Random(hash((P, p, e))).shuffle(mine)
        return mine

    def length(self, P, p, e) -> int:
        return -1


def test_part_files_a_half_read_part_is_finished_once():
    geo = Parts([5, 7, 3, 8, 6, 2, 9])
    # 3 old ranks: rank 0 read 1 part and 2 records of the next; rank 1 nothing; rank 2 all
    positions = [Position(3, 0, 1, part=1, record=2), Position(3, 1, 1),
                 Position(3, 2, 2)]  # fmt: skip
    pieces, epoch = pool(positions, geo)
    assert epoch == 2
    order0, order1 = geo.part_order(3, 0, 1), geo.part_order(3, 1, 1)
    assert pieces == ([Piece(3, 0, 1, f, 2 if i == 1 else 0, -1)
                       for i, f in enumerate(order0) if i >= 1]
                      + [Piece(3, 1, 1, f, 0, -1) for f in order1])  # fmt: skip
    for ranks in (1, 2, 5):
        shares = split(pieces, ranks, 4, weight=lambda x: geo.records[x.part] - x.lo)
        assert sorted(x for s in shares for x in s) == sorted(pieces)  # each piece once, whole


def test_refusals_name_what_differs():
    geo = Sized(40)
    good = states([Position(2, p, 1, 3, 20) for p in range(2)])
    with pytest.raises(ValueError, match=r"state_dict\[1\] \(partition 1 of 2\) was saved "
                                         r"with seed=4, this batcher has seed=0"):  # fmt: skip
        resume([good[0], {**good[1], "seed": 4}], 0, 3, 4, geo, IDENT)
    with pytest.raises(ValueError, match="partition 1 is missing"):
        resume(good[:1], 0, 3, 4, geo, IDENT)
    with pytest.raises(ValueError, match=r"partition 0 of 2 appears twice"):
        resume([good[0], good[0]], 0, 3, 4, geo, IDENT)
    with pytest.raises(ValueError, match="different world sizes"):
        resume([good[0], states([Position(3, 1, 1)])[0]], 0, 3, 4, geo, IDENT)
    with pytest.raises(ValueError, match="format-1 state"):
        resume([{"epoch": 1, "consumed": 3}], 0, 3, 4, geo, IDENT)
    with pytest.raises(ValueError, match="to resume at another world size, pass the list"):
        resume(good[0], 0, 3, 4, geo, IDENT)
    with pytest.raises(ValueError, match=r"rest'\]\[0\]: a piece is 6 integers"):
        resume([{**good[0], "rest": [[1, 2]]}, good[1]], 0, 3, 4, geo, IDENT)
    with pytest.raises(ValueError, match="sampler='linear'"):
        check_states(good, {**IDENT, "sampler": "linear"})


def test_a_format_1_state_resumes_its_own_partition():
    geo = Sized(40)
    pos = resume({"epoch": 2, "consumed": 8, "partition": 1, "seed": 0}, 1, 2, 4, geo, IDENT)
    assert (pos.partition, pos.partitions, pos.epoch, pos.consumed) == (1, 2, 2, 8)
    with pytest.raises(ValueError, match="saved with partition=1"):
        resume({"epoch": 2, "consumed": 8, "partition": 1}, 0, 2, 4, geo, IDENT)


@pytest.mark.parametrize("seed", range(20))
def test_survivors_take_over_the_dead_ranks_rest(seed):
    rnd = random.Random(seed)
    n = rnd.randint(10, 150)
    geo, out = Sized(n), []
    world = rnd.randint(2, 8)
    positions = [Position(world, p, 0, 0, geo.length(world, p, 0)) for p in range(world)]
    positions = [run(pos, rnd.randint(0, 2 * n // world), geo, out) for pos in positions]
    dead = sorted(rnd.sample(range(world), rnd.randint(1, world - 1)))
    alive = [p for p in range(world) if p not in dead]
    batch = rnd.randint(1, 8)
    new = [take_over(positions[p], [positions[d] for d in dead], positions, q, len(alive),
                     batch, geo) for q, p in enumerate(alive)]  # fmt: skip
    last = max(p.epoch for p in new) + 1
    finish(new, geo, out, last)
    check_epochs(out, n, last, False)


@pytest.mark.parametrize("seed", range(20))
def test_ranks_that_come_back_share_the_rest_of_those_in_their_epoch(seed):
    rnd = random.Random(seed)
    n = rnd.randint(10, 150)
    geo, out = Sized(n), []
    world = rnd.randint(1, 6)
    positions = [Position(world, p, 0, 0, geo.length(world, p, 0)) for p in range(world)]
    positions = [run(pos, rnd.randint(0, 2 * n // world), geo, out) for pos in positions]
    back = rnd.randint(1, 3)
    sharers = sorted(rnd.sample(range(world), rnd.randint(0, world)))
    batch = rnd.randint(1, 8)
    new = [admit(positions, sharers, q, world + back, batch, geo) for q in range(world + back)]
    assert all(p.partitions == world + back for p in new)
    for q in range(world):  # the others keep what they had, in their old order
        if q not in sharers:
            assert new[q].rest == admit(positions, [], q, world + back, batch, geo).rest
    if sharers:  # the rest is shared in whole batches: shares differ by a batch at most
        sizes = [sum(len(x) for x in new[q].rest) for q in [*sharers, *range(world, world + back)]]
        assert max(sizes) - min(sizes) <= batch
    last = max(p.epoch for p in new) + 1
    finish(new, geo, out, last)
    check_epochs(out, n, last, False)


def test_admit_needs_room_for_those_that_come_back():
    geo = Sized(20)
    with pytest.raises(ValueError, match="no room"):
        admit([Position(2, 0, 0), Position(2, 1, 0)], [0], 0, 2, 4, geo)


@pytest.mark.parametrize("seed", range(10))
def test_advance_is_where_handing_out_n_items_leads(seed):
    rnd = random.Random(seed)
    geo = Sized(rnd.randint(30, 60))
    pos = Position(3, 1, 2, rnd.randint(0, 3), geo.length(3, 1, 2))
    if seed % 2:  # with pieces first
        pos = Position(3, 1, 4, rest=[Piece(2, 0, 3, -1, 2, 9), Piece(5, 4, 3, -1, 0, 4)])
    for n in (0, 1, 7, 40, 123):
        want = run(pos, n, geo, [])
        got = advance(pos, n, geo)
        assert (got.epoch, got.consumed, got.rest) == (want.epoch, want.consumed, want.rest)
