"""Mixing sources (issue 53): exact at every prefix, the same at any world size, each source
walking its own epochs once, weights that change, and a position that resumes anywhere."""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

import pytest
import torch

from distlearn.dataset import Dataset, Mix, item_source
from distlearn.dataset.sampling.mix import SCALE, Allocator, Policy, Schedule, scale_weights

# ----------------------------------------------------------------------------- the allocation


def exact_share(schedule, names, step_size, k):
    """T_i(k) as Fractions, straight from the schedule's scaled weights."""
    sched = Schedule(schedule, names)
    out = [Fraction(0)] * len(names)
    for n in range(k):
        w = sched.weights(n // step_size)
        out = [o + Fraction(x, SCALE) for o, x in zip(out, w, strict=True)]
    return out


def fresh(schedule, names, step_size):
    zero = [0] * len(names)
    return Allocator(Schedule(schedule, names), step_size, 0, zero, zero)


@pytest.mark.parametrize("trial", range(40))
def test_every_prefix_is_within_one_example(trial):
    rng = random.Random(trial)
    S = rng.randint(1, 6)
    names = [str(i) for i in range(S)]
    weights = [rng.choice([0, rng.random(), rng.randint(1, 100), 1e-3]) for _ in range(S)]
    weights[rng.randrange(S)] += 0.5  # a positive sum
    step = rng.randint(1, 64)
    alloc = fresh(weights, names, step)
    seq = alloc.take(3000)
    counts = [0] * S
    exact = [Fraction(w).limit_denominator(10**9) / sum(map(Fraction, weights)) for w in weights]
    for k, i in enumerate(seq, 1):
        counts[i] += 1
        for j in range(S):
            # the scaled weights' rounding (2**-24 each) is far below an example here
            assert abs(counts[j] - exact[j] * k) < 1 + Fraction(k, SCALE), (trial, k, j)
    assert sum(alloc.targets) == 3000 * SCALE


@pytest.mark.parametrize("trial", range(15))
def test_a_schedule_keeps_every_prefix_within_one_example(trial):
    rng = random.Random(100 + trial)
    S = rng.randint(2, 5)
    names = [f"s{i}" for i in range(S)]
    steps = sorted(rng.sample(range(1, 60), rng.randint(1, 6)))
    table = [(0, [rng.random() for _ in range(S)])]
    table += [(s, [rng.choice([0.0, rng.random(), 3.0]) + 1e-9 for _ in range(S)]) for s in steps]
    step = rng.randint(1, 16)
    for spec in (table, lambda s, t=table: next(w for at, w in reversed(t) if at <= s)):
        alloc = fresh(spec, names, step)
        seq = alloc.take(60 * step + 37)
        share = [Fraction(0)] * S
        sched, counts = Schedule(spec, names), [0] * S
        for k, i in enumerate(seq):
            w = sched.weights(k // step)
            share = [x + Fraction(y, SCALE) for x, y in zip(share, w, strict=True)]
            counts[i] += 1
            assert all(abs(c - t) < 1 for c, t in zip(counts, share, strict=True)), (trial, k)


def test_a_deadline_far_beyond_the_lookahead_is_still_met():
    """A function schedule is looked ahead a few thousand steps; a source whose next
    example is due further than that (weight 1e-4 with one example a step) is looked
    for again on the way, and stays within one example (it drifted to 1.33 when not)."""
    names = ["a", "b", "c"]
    sched = Schedule(lambda s: [1.0, 1e-4 if s < 30000 else 0.3, 2e-4], names)
    alloc = Allocator(sched, 1, 0, [0] * 3, [0] * 3)
    share, counts = [0] * 3, [0] * 3
    for k, i in enumerate(alloc.take(60000)):
        share = [x + y for x, y in zip(share, sched.weights(k), strict=True)]
        counts[i] += 1
        assert all(abs(c * SCALE - t) < SCALE for c, t in zip(counts, share, strict=True)), k


def test_the_allocation_is_a_function_of_the_example_number():
    """Taken in any chunks, resumed from its integers at any k: the same sequence."""
    names = ["a", "b", "c"]
    w = [0.5, 0.3, 0.2]
    whole = fresh(w, names, 24).take(2000)
    for chunk in (1, 7, 24, 100):
        alloc, got = fresh(w, names, 24), []
        while len(got) < 2000:
            got += alloc.take(min(chunk, 2000 - len(got)))
        assert got == whole
    for k in (0, 1, 13, 999):
        a = fresh(w, names, 24)
        a.take(k)
        again = Allocator(Schedule(w, names), 24, a.n, a.counts, a.targets)
        assert whole[:k] + again.take(2000 - k) == whole


def test_weights_are_checked_where_given():
    assert sum(scale_weights([1, 1, 1])) == SCALE
    with pytest.raises(ValueError, match="positive sum"):
        scale_weights([0, 0])
    with pytest.raises(ValueError, match=r"weights\[1\] must be a finite number"):
        scale_weights([1, -1])
    with pytest.raises(ValueError, match="want 2 weights"):
        Schedule([1, 2, 3], ["a", "b"])
    with pytest.raises(ValueError, match=r"names \['c'\], not sources"):
        Schedule({"a": 1, "c": 2}, ["a", "b"])
    with pytest.raises(ValueError, match="give the weights of step 0 first"):
        Schedule([(5, [1, 1])], ["a", "b"])
    with pytest.raises(ValueError, match="exhausted="):
        Policy.parse("stopp")
    with pytest.raises(ValueError, match="exhausted="):
        Policy.parse(("repeat", 0))


# ----------------------------------------------------------------------------- mixes of datasets

SIZES = {"a": 50, "b": 23, "c": 31}
BASE = {"a": 0, "b": 1000, "c": 2000}  # x of item j of source s: BASE[s] + j


def data(name, n=None):
    n = SIZES[name] if n is None else n
    return {"x": BASE[name] + torch.arange(float(n))[:, None], "y": torch.arange(n) % 3}


def mix_of(weights, partition=0, partitions=1, exhausted="cycle", schedule=None, **own):
    entries = {
        name: (Dataset(data(name), partition=partition, partitions=partitions), w, own.get(name))
        for name, w in weights.items()
    }
    return Mix(entries, exhausted=exhausted, schedule=schedule)


def origin(x):
    x = int(x)
    return ("a", "b", "c")[x // 1000], x % 1000


def batchers(weights, world, batch_size, **kw):
    opts = {k: kw.pop(k) for k in ("sampler", "seed", "workers", "num_workers") if k in kw}
    opts.setdefault("sampler", "permutation")
    return [
        mix_of(weights, r, world, **kw).sampled_batcher(
            batch_size=batch_size, input_dims=(1,), **opts
        )
        for r in range(world)
    ]


def lockstep(bs, steps):
    """`steps` global batches: every rank's next batch, each row (source, j), in the global
    order (rank r holds slice (r + step) mod W of global batch `step`)."""
    out = []
    world = len(bs)
    for _ in range(steps):
        step = bs[0].state_dict()["mix"]["examples"] // (world * bs[0].batch_size)
        slices = {}
        for r, b in enumerate(bs):
            batch = b.next_batch()
            rows = [origin(x) for x in batch.input[:, 0]]
            names = [b.index.sources[int(s)] for s in batch.source]
            assert [r[0] for r in rows] == names, "batch.source names each row's source"
            slices[(r + step) % world] = rows
        out += [slices[q] for q in range(world)]
    return [r for rows in out for r in rows]


def test_batches_say_their_sources_and_stay_exact_per_rank_order():
    weights = {"a": 0.6, "b": 0.3, "c": 0.1}
    bs = batchers(weights, 1, 8)
    rows = lockstep(bs, 40)
    counts = Counter()
    for k, (src, _) in enumerate(rows, 1):
        counts[src] += 1
        for s, w in weights.items():
            assert abs(counts[s] - w * k) < 1 + 1e-6, (k, s)
    for b in bs:
        b.close()


@pytest.mark.parametrize("trial", range(6))
def test_the_same_global_batches_at_one_three_and_eight_ranks(trial):
    rng = random.Random(trial)
    weights = {s: rng.random() + 0.05 for s in rng.sample(["a", "b", "c"], rng.randint(2, 3))}
    per8 = rng.randint(1, 4)
    G = 24 * per8
    runs = {}
    for world in (1, 3, 8):
        bs = batchers(weights, world, G // world, seed=trial)
        runs[world] = lockstep(bs, 12)
        for b in bs:
            b.close()
    assert runs[1] == runs[3] == runs[8]


def per_source(rows):
    out = {}
    for src, j in rows:
        out.setdefault(src, []).append(j)
    return out


def check_epochs(rows, complete=True):
    """Each source's items, cut into its epochs, are each epoch a permutation of it."""
    for src, items in per_source(rows).items():
        n = SIZES[src]
        whole = len(items) // n * n
        for lo in range(0, whole, n):
            assert sorted(items[lo : lo + n]) == list(range(n)), (src, lo)
        assert len(set(items[whole:])) == len(items[whole:]), src


@pytest.mark.parametrize("trial", range(5))
def test_each_source_walks_its_own_epochs_exactly_once(trial):
    rng = random.Random(10 + trial)
    weights = {"a": rng.random() + 0.1, "b": rng.random() + 0.1, "c": rng.random() + 0.1}
    world = rng.choice([1, 2, 3])
    bs = batchers(weights, world, rng.randint(1, 9), seed=trial)
    rows = lockstep(bs, 30)
    check_epochs(rows)
    for b in bs:
        b.close()


@pytest.mark.parametrize(
    ("old", "new", "b_old", "b_new"), [(3, 2, 4, 6), (1, 8, 8, 1), (8, 3, 2, 5)]
)
def test_a_resume_at_another_world_size_loses_and_repeats_nothing(old, new, b_old, b_new):
    weights = {"a": 0.5, "b": 0.2, "c": 0.3}
    whole = lockstep(batchers(weights, 1, 10, seed=4), 40)
    bs = batchers(weights, old, b_old, seed=4)
    first = lockstep(bs, 7)
    states = [b.state_dict() for b in bs]
    for b in bs:
        b.close()
    bs = batchers(weights, new, b_new, seed=4)
    for b in bs:
        b.load_state_dict(states)
    rest = lockstep(bs, (400 - len(first)) // (new * b_new))
    for b in bs:
        b.close()
    # per source: what the old job and the new one gave is the uninterrupted order
    got, want = per_source(first + rest), per_source(whole)
    for src in got:
        assert got[src] == want[src][: len(got[src])], src
    assert first == whole[: len(first)]  # the global order up to the stop
    assert first + rest == whole[: len(first + rest)]  # and on: no G in the allocation


def test_a_schedule_change_at_a_resume_neither_loses_nor_repeats():
    """Weights 0.9/0.1 for 20 steps, then a resume with a schedule of 0.1/0.9 (at another
    world size): each source goes on with its next example."""
    weights = {"a": 0.9, "b": 0.1}
    bs = batchers(weights, 2, 3, seed=1)
    first = lockstep(bs, 20)
    states = [b.state_dict() for b in bs]
    for b in bs:
        b.close()
    bs = batchers(weights, 3, 2, seed=1, schedule=[(0, {"a": 0.9, "b": 0.1}),
                                                  (20, {"a": 0.1, "b": 0.9})])  # fmt: skip
    for b in bs:
        b.load_state_dict(states)
    rest = lockstep(bs, 30)
    for b in bs:
        b.close()
    check_epochs(first + rest)
    got = per_source(first + rest)
    assert len(got["b"]) > 2 * len(per_source(first)["b"])
    # within one example of the share: 120 examples at 0.9/0.1, then 180 at 0.1/0.9
    assert abs(len(got["a"]) - (0.9 * 120 + 0.1 * 180)) < 1
    # the same with the schedule from the start: the same sequence
    bs = batchers(weights, 1, 6, seed=1, schedule=[(0, [0.9, 0.1]), (20, [0.1, 0.9])])
    assert lockstep(bs, 50) == first + rest
    for b in bs:
        b.close()


def test_passes_end_by_the_policy_and_sources_are_never_rewound():
    weights = {"a": 0.5, "b": 0.5}  # b (23 items) runs out first
    for policy, ends in [("stop", {"b": 1}), (("repeat", 2), {"b": 2}), ("cycle", {"a": 1})]:
        (b,) = batchers(weights, 1, 4, exhausted=policy, seed=2)
        planned = len(b)
        first = [origin(x) for batch in b for x in batch.input[:, 0]]
        n = len(first)
        counts = Counter(s for s, _ in first)
        src, times = next(iter(ends.items()))
        # the pass ends with the batch in which that source finished its `times`-th epoch
        assert counts[src] >= times * SIZES[src] and counts[src] - times * SIZES[src] < 4
        assert planned == n // 4 and n % 4 == 0  # whole global batches, as len() said
        planned = len(b)
        second = [origin(x) for batch in b for x in batch.input[:, 0]]
        assert len(second) == 4 * planned
        check_epochs(first + second)  # the second pass goes on where the first stood
        b.close()


def test_real_process_workers_and_a_processor_per_source(tmp_path):
    """Files on disk fetched by process workers, each source decoded by its own processor
    (the other's negates); item_source() inside a processor names the source."""
    for name in ("a", "b"):
        for j in range(SIZES[name]):
            folder = tmp_path / name / f"L{j % 2}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{j:03d}.txt").write_text(str(BASE[name] + j))
    entries = {
        "a": (Dataset(str(tmp_path / "a")), 2, {"processor": decode}),
        "b": (Dataset(str(tmp_path / "b")), 1, {"processor": negated, "processor_opt": -1.0}),
    }
    seen = []
    with Mix(entries, exhausted="stop").sampled_batcher(
        batch_size=5, input_dims=(2,), sampler="permutation", workers="process",
        num_workers=2, worker_timeout=60,
    ) as b:  # fmt: skip
        assert b.workers_kind == "process"
        for batch in b:
            for row, s in zip(batch.input, batch.source.tolist(), strict=True):
                value, which = row.tolist()
                assert which == s
                seen.append(("a", "b")[s] if value >= 0 else "b")
                assert (value >= 0) == (s == 0)
    counts = Counter(seen)
    assert counts["b"] >= SIZES["b"] or counts["a"] >= SIZES["a"]


def decode(data, opt, out):
    out[0] = float(data.decode())
    out[1] = item_source()
    return True


def negated(data, opt, out):
    out[0] = opt * float(data.decode())
    out[1] = item_source()
    return True


def test_a_source_smaller_than_the_world_is_opened_whole():
    """Four examples cannot be cut into 8 partitions; opened whole, the source joins the
    mix of rank 5 of 8, or any rank a Mix is told."""
    tiny = {"x": 3000 + torch.arange(4.0)[:, None], "y": torch.zeros(4, dtype=torch.long)}
    mix = Mix({"a": (Dataset(data("a"), 5, 8), 3), "tiny": (Dataset(tiny, 0, 1), 1)})
    assert (mix.partition, mix.partitions) == (5, 8)
    mix = Mix({"a": (Dataset(data("a")), 3), "tiny": (Dataset(tiny), 1)}, partition=2,
              partitions=3)  # fmt: skip
    assert (mix.partition, mix.partitions) == (2, 3)
    with pytest.raises(ValueError, match="together"):
        Mix({"a": (Dataset(data("a")), 3)}, partition=2)


def test_refusals_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"partition 0 of 2, source 'b' partition 1 of 2.*same"):
        Mix({"a": (Dataset(data("a"), 0, 2), 1), "b": (Dataset(data("b"), 1, 2), 1)})
    with pytest.raises(TypeError, match="did you mean 'sampler'"):
        Mix({"a": (Dataset(data("a")), 1, {"samplr": "linear"})})
    with pytest.raises(ValueError, match="no weight"):
        Mix({"a": (Dataset(data("a")),)})
    with pytest.raises(ValueError, match="drop_last"):
        mix_of({"a": 1, "b": 1}).sampled_batcher(batch_size=2, input_dims=(1,), drop_last=True)
    (b,) = batchers({"a": 1, "b": 1}, 1, 4)
    with Dataset(data("a")).sampled_batcher(batch_size=4, input_dims=(1,)) as single:
        state = single.state_dict()
    with pytest.raises(ValueError, match="single source, not of a mix"):
        b.load_state_dict(state)
    (other,) = batchers({"a": 1, "c": 1}, 1, 4)
    with pytest.raises(ValueError, match=r"mix of sources \['a', 'c'\]"):
        b.load_state_dict(other.state_dict())
    (reseeded,) = batchers({"a": 1, "b": 1}, 1, 4, seed=9)
    with pytest.raises(ValueError, match="source 'a' was saved with seed="):
        b.load_state_dict(reseeded.state_dict())
    bs = batchers({"a": 1, "b": 1}, 2, 4)
    lockstep(bs, 2)
    bs[0].next_batch()  # rank 0 one step ahead
    with pytest.raises(ValueError, match="saved after the same step"):
        b.load_state_dict([x.state_dict() for x in bs])
    for x in [b, other, reseeded, *bs]:
        x.close()


def write_csv(root, name, values):
    """`name`.csv listing files that each hold one of `values`, labelled by parity."""
    root.mkdir(parents=True, exist_ok=True)
    rows = ["filename,label"]
    for v in values:
        (root / f"{name}-{v}.txt").write_text(str(v))
        rows.append(f"{name}-{v}.txt,{'odd' if v % 2 else 'even'}")
    (root / f"{name}.csv").write_text("\n".join(rows) + "\n")
    return str(root / f"{name}.csv")


def one_number(data, opt, out):
    out[0], out[1] = float(data.decode()), -1.0
    return True


def two_numbers(data, opt, out):
    """A joined item: one value per index."""
    out[0], out[1] = (float(d.decode()) for d in data)
    return True


def test_csv_joined_and_tensor_sources_partitioned_over_two_ranks(tmp_path):
    """A CSV of files, a joined index (its second member drawn) and tensors, over two
    ranks: every rank's rows decoded by their source's processor, each source once per
    epoch (the joined one's driver), labels mapped into the mix's union."""
    csv = write_csv(tmp_path, "csv", range(300, 317))
    images = write_csv(tmp_path, "img", range(400, 411))
    backgrounds = write_csv(tmp_path, "bg", range(500, 503))
    tensors = {"x": torch.arange(600.0, 613.0)[:, None].repeat(1, 2), "y": torch.arange(13) % 2}

    def ranks(world):
        out = []
        for r in range(world):
            mix = Mix({
                "csv": (Dataset(csv, r, world), 1, {"processor": one_number}),
                "joined": (Dataset([images, backgrounds], r, world), 1,
                           {"processor": two_numbers, "sampler": ["permutation", "uniform"]}),
                "tensor": (Dataset(tensors, r, world), 2, {"sampler": "linear"}),
            }, exhausted="cycle")  # fmt: skip
            assert mix.labels == ["0", "1", "even", "odd"]
            out.append(mix.sampled_batcher(batch_size=3, input_dims=(2,), sampler="permutation",
                                           workers="thread", num_workers=2))  # fmt: skip
        return out

    rows = {1: [], 2: []}
    for world in (1, 2):
        bs = ranks(world)
        for step in range(60 // world):
            order = sorted(range(world), key=lambda r, s=step: (r + s) % world)  # slice order
            for b in [bs[r] for r in order]:
                batch = b.next_batch()
                for row, s, t in zip(batch.input.tolist(), batch.source.tolist(),
                                     batch.target.tolist(), strict=True):  # fmt: skip
                    name = ("csv", "joined", "tensor")[s]
                    rows[world].append((name, *row))
                    label = ["0", "1", "even", "odd"][t]
                    if name == "csv":
                        assert row[1] == -1 and label == ("odd" if row[0] % 2 else "even")
                    elif name == "joined":
                        assert 400 <= row[0] < 411 and 500 <= row[1] < 503
                    else:
                        assert row[0] == row[1] and label == str(int(row[0] - 600) % 2)
        for b in bs:
            b.close()
    assert rows[1] == rows[2], "the same global order at one and two ranks"
    firsts = {}
    for name, first, _ in rows[1]:
        firsts.setdefault(name, []).append(int(first))
    for name, n in (("csv", 17), ("joined", 11), ("tensor", 13)):
        got = firsts[name]
        for lo in range(0, len(got) // n * n, n):
            assert len(set(got[lo : lo + n])) == n, name
    assert firsts["tensor"][:13] == list(range(600, 613)), "its own sampler: linear"
    assert abs(len(firsts["tensor"]) - 180 / 2) < 1


def test_a_source_of_weight_zero_does_not_hold_a_cycle_pass_open():
    (b,) = batchers({"a": 1, "b": 0}, 1, 5, seed=3)
    assert len(b) == 10  # a's 50 items, then the pass ends: b is not drawn from
    rows = [origin(x) for batch in b for x in batch.input[:, 0]]
    assert Counter(s for s, _ in rows) == {"a": 50}
    b.close()


def test_a_checkpoint_saves_and_restores_the_mix_position(tmp_path):
    """distlearn.Checkpoint gathers the batcher's state into its manifest (JSON) and hands
    it back: the restored mix goes on with the next example of each source."""
    import uuid

    from distlearn import Checkpoint, ipc

    weights = {"a": 0.5, "b": 0.25, "c": 0.25}
    whole = lockstep(batchers(weights, 1, 6, seed=8), 30)
    tree = ipc.LocalhostTree(0, 1, key=f"mix-{uuid.uuid4().hex}")
    try:
        (b,) = batchers(weights, 1, 6, seed=8)
        first = lockstep([b], 11)
        Checkpoint(tmp_path, tree, signals=()).save(11, {"data": b})
        b.close()
        (b,) = batchers(weights, 1, 6, seed=8)
        assert Checkpoint(tmp_path, tree, signals=()).restore({"data": b}) == 11
        rest = lockstep([b], 19)
        b.close()
    finally:
        tree.close()
    assert first + rest == whole


def draw_and_source(data, opt, out):
    """A row: its tensor value, the item's own random draw, and its source."""
    from distlearn.dataset import item_rng

    out[0] = float(data[0])
    out[1] = float(item_rng().random())
    out[2] = item_source()
    return True


def test_item_rng_of_a_mixed_item_is_the_same_with_any_workers():
    """item_rng() is keyed by (seed, source, its epoch, its place): thread and process
    workers, any number, draw the same for each row; two sources never share draws."""
    got = []
    for workers, num in (("thread", 0), ("thread", 2), ("process", 2)):
        entries = {name: (Dataset(data(name)), w) for name, w in (("a", 1), ("b", 1))}
        with Mix(entries, exhausted="cycle").sampled_batcher(
            batch_size=7, input_dims=(3,), sampler="permutation", processor=draw_and_source,
            workers=workers, num_workers=num, worker_timeout=60, seed=5,
        ) as b:  # fmt: skip
            got.append(torch.cat([b.next_batch().input for _ in range(12)]))
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    rows = got[0]
    assert rows[:, 2].tolist() == [0.0 if x < 1000 else 1.0 for x in rows[:, 0].tolist()]
    assert len(set(rows[:, 1].tolist())) == len(rows), "every item its own draw"


# ----------------------------------------------------------------------------- part files


def write_parts(root, parts=6, per=10):
    """Part files of lines: line i of part k holds 100 k + i."""
    root.mkdir(parents=True, exist_ok=True)
    for k in range(parts):
        (root / f"part-{k:03d}.txt").write_text("".join(f"{100 * k + i}\n" for i in range(per)))
    return str(root)


def line_value(data, opt, out):
    out[0] = float(bytes(data).decode())
    return True


def part_batchers(folder, world, batch_size, workers="thread"):
    out = []
    for r in range(world):
        entries = {
            "t": (Dataset(data("a"), r, world), 1),
            "p": (Dataset(folder, r, world, record_format="lines", cache_parts=False), 1,
                  {"processor": line_value, "sampler": "part-linear"}),
        }  # fmt: skip
        out.append(Mix(entries, exhausted="cycle").sampled_batcher(
            batch_size=batch_size, input_dims=(1,), sampler="permutation", seed=6,
            workers=workers, num_workers=1 if workers == "process" else 2, worker_timeout=60,
        ))  # fmt: skip
    return out


def part_rows(b, steps):
    """(rank's) part-file records of `steps` batches, as values 100 k + i."""
    got = []
    for _ in range(steps):
        batch = b.next_batch()
        got += [int(x) for x, s in zip(batch.input[:, 0], batch.source, strict=True) if s == 1]
    return got


def test_part_files_each_rank_its_own_parts_once_per_epoch(tmp_path):
    """A part-file source is read by partition: each rank walks its own parts' records,
    epoch after epoch, each once per epoch; the mix's proportions hold."""
    folder = write_parts(tmp_path / "parts")
    bs = part_batchers(folder, 2, 4, workers="process")
    for r, b in enumerate(bs):
        got = part_rows(b, 30)
        assert b.stats["parts"] >= 3 and b.stats["part_bytes"] > 0  # its own parts' reads
        mine = [100 * k + i for k in range(r, 6, 2) for i in range(10)]
        assert abs(len(got) - 60) < 4  # half of each global batch, within the step's rounding
        full = len(got) // 30 * 30
        for lo in range(0, full, 30):
            assert got[lo : lo + 30] == mine, "part-linear: its parts in order, once an epoch"
        assert got[full:] == mine[: len(got) - full]
        b.close()


def test_part_files_resume_at_the_same_and_at_another_world_size(tmp_path):
    folder = write_parts(tmp_path / "parts")
    whole = [part_rows(b, 20) for b in part_batchers(folder, 2, 3)]
    bs = part_batchers(folder, 2, 3)
    first = [part_rows(b, 4) for b in bs]
    states = [b.state_dict() for b in bs]
    for b in bs:
        b.close()
    # the same world size, from each rank's own state or from the list: bit for bit
    for form in ("own", "list"):
        bs = part_batchers(folder, 2, 3)
        for r, b in enumerate(bs):
            b.load_state_dict(states[r] if form == "own" else states)
            assert first[r] + part_rows(b, 16) == whole[r], (form, r)
            b.close()
    # another world size: the old epoch's rest, pooled and dealt by part, comes first
    bs = part_batchers(folder, 3, 2)
    for b in bs:
        b.load_state_dict(states)
    shares = []
    for b in bs:
        rest = b.state_dict()["parts"]["p"]["rest"]
        share = [100 * part + i for _, _, _, part, lo, _ in rest for i in range(lo, 10)]
        assert part_rows(b, 40)[: len(share)] == share
        shares += share
        b.close()
    seen = [x for rows in first for x in rows]
    assert sorted(seen + shares) == [100 * k + i for k in range(6) for i in range(10)]


def test_labels_part_files_read_join_the_mix_label_list(tmp_path):
    """Tar shards whose labels are class ids 5-7 read as they come ("cls"), beside tensors
    labelled 0/1: each row's target names its own label in the batcher's list."""
    import io

    import numpy as np
    import webdataset as wds
    from PIL import Image as PILImage

    from distlearn.dataset.index.parts import SampleMember
    from distlearn.dataset.processors import Image

    root = tmp_path / "shards"
    root.mkdir()
    n = 0
    for p in range(2):
        with wds.TarWriter(str(root / f"train-{p:04d}.tar")) as sink:
            for _ in range(12):
                buf = io.BytesIO()
                PILImage.fromarray(np.full((4, 4), n, dtype=np.uint8)).save(buf, format="PNG")
                sink.write({"__key__": f"{n:06d}", "png": buf.getvalue(), "cls": str(n % 3 + 5)})
                n += 1
    tensors = {"x": torch.full((10, 1, 4, 4), 200 / 255), "y": torch.arange(10) % 2}
    mix = Mix({
        "shards": (Dataset(str(root), label_key="cls"), 1,
                   {"processor": SampleMember(Image(mode="L"))}),
        "tensors": (Dataset(tensors), 1),
    }, exhausted="cycle")  # fmt: skip
    with mix.sampled_batcher(batch_size=6, input_dims=(1, 4, 4), workers="thread") as b:
        for _ in range(10):
            batch = b.next_batch()
            names = b.index.labels
            for row, s, t in zip(batch.input, batch.source, batch.target, strict=True):
                value = round(float(row[0, 0, 0]) * 255)
                if int(s) == 0:
                    assert names[int(t)] == str(value % 3 + 5)
                else:
                    assert value == 200 and names[int(t)] in ("0", "1")
    assert {"0", "1", "5", "6", "7"} <= set(names)
