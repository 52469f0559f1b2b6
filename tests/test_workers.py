"""Worker lifetime and adapters: a killed worker, clean shutdown, as_torch, tqdm, fsspec, cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import fsspec
import numpy as np
import pytest
import torch

from distlearn.dataset import Dataset, Fetcher, FetchError, WorkerDied
from distlearn.dataset.processors import Image, Raw
from tests.conftest import repo_env, shm_files
from tests.faulty_server import item_ids, make_pngs


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pngs")
    return make_pngs(root, 96, labels=2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.timeout(120)
def test_killed_worker_raises_and_nothing_is_left(pngs):
    ds = Dataset(str(pngs))
    b = ds.sampled_batcher(batch_size=8, input_dims=(1, 8, 8), processor=Image(),
                           workers="process", num_workers=2)  # fmt: skip
    procs = list(b.engine.workers._procs)
    b.next_batch()
    os.kill(procs[0].pid, signal.SIGKILL)
    with pytest.raises(WorkerDied, match=r"worker process 0 .* died"):
        for _ in range(20):
            b.next_batch()
    b.close()
    assert not any(_alive(p.pid) for p in procs)


def test_close_stops_workers_and_frees_shared_memory(pngs):
    ds = Dataset(str(pngs.parent / "train.csv"))
    with ds.sampled_batcher(batch_size=8, input_dims=(1, 8, 8), processor=Image(),
                            workers="process", num_workers=2) as b:  # fmt: skip
        procs = list(b.engine.workers._procs)
        kept = b.next_batch()  # closed mid-epoch, with batches in flight
    assert not any(_alive(p.pid) for p in procs)
    assert len(item_ids(kept.input)) == 8  # a batch handed out outlives the ring
    with pytest.raises(RuntimeError, match="closed"):
        b.next_batch()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_sigkilled_main_process_leaves_no_shared_memory(pngs, start, tmp_path):
    """The OOM killer's way out: SIGKILL mid-epoch leaves nothing in /dev/shm, no worker."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from distlearn.dataset import Dataset
        from distlearn.dataset.processors import Image
        b = Dataset({str(pngs)!r}).sampled_batcher(
            batch_size=8, input_dims=(1, 8, 8), processor=Image(), workers="process",
            num_workers=2, mp_context={start!r})
        b.next_batch()
        print(" ".join(str(p.pid) for p in b.engine.workers._procs), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env=repo_env(), stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2, "the batcher did not start"
        named = [shm_files(pid) for pid in (proc.pid, *workers)]
        assert not any(named), f"the ring has a name in /dev/shm: {named}"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)  # orphaned workers see their pipe close and exit
    orphans = [w for w in workers if _alive(w)]
    for w in orphans:  # never leave them behind, even when the test fails
        os.kill(w, signal.SIGKILL)
    assert not orphans, "workers outlived their main process"


@pytest.mark.timeout(120)
def test_a_dead_main_process_leaves_its_workers_quiet():
    """A rank that dies with batches in flight (os._exit, torchrun's SIGTERM): its
    workers answer into a closed pipe, and stop without a traceback per batch (asyncio's
    "Task exception was never retrieved ... BrokenPipeError") on the rank's stderr."""
    script = textwrap.dedent("""
        import os, time, torch
        from distlearn.dataset import Dataset

        class Slow:  # batches still decoding when the main process goes
            def __call__(self, row, opt, out):
                time.sleep(0.05)
                out.copy_(row)

        b = Dataset(torch.arange(256.0).reshape(64, 4)).sampled_batcher(
            batch_size=4, input_dims=(4,), processor=Slow(), workers="process",
            num_workers=2, prefetch=12)
        b.next_batch()
        print(" ".join(str(p.pid) for p in b.engine.workers._procs), flush=True)
        os._exit(3)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env=repo_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        # stdout and stderr end when the workers, which hold them too, have exited
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    workers = [int(p) for p in out.split()]
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    orphans = [w for w in workers if _alive(w)]
    for w in orphans:  # never leave them behind, even when the test fails
        os.kill(w, signal.SIGKILL)
    assert proc.returncode == 3 and len(workers) == 2, (out, err)
    assert not orphans, "workers outlived their main process"
    assert "BrokenPipeError" not in err and "never retrieved" not in err, err
    assert err.strip() == "", err


def test_as_torch_dataloader_and_progress(pngs, capsys):
    ds = Dataset(str(pngs))
    with ds.sampled_batcher(batch_size=32, input_dims=(1, 8, 8), processor=Image(),
                            workers="thread", progress=True) as b:  # fmt: skip
        loader = torch.utils.data.DataLoader(b.as_torch(), batch_size=None)
        assert len(loader) == 3
        got = [(x.shape, y.dtype) for x, y in loader]
    assert got == [((32, 1, 8, 8), torch.long)] * 3
    assert "3/3" in capsys.readouterr().err  # the tqdm bar went to stderr


def test_next_batch_rolls_over_epochs_and_reset(pngs):
    ds = Dataset(str(pngs.parent / "train.csv"), partition=0, partitions=2)
    with ds.sampled_batcher(batch_size=20, input_dims=(1, 8, 8), processor=Image(),
                            workers="thread") as b:  # fmt: skip
        sizes = [len(b.next_batch()) for _ in range(5)]
        assert sizes == [20, 20, 8, 20, 20] and b.epoch == 1
        b.reset()
        b.next_batch()
        assert b.epoch == 2


def test_fsspec_urls_and_a_plugged_in_cache():
    fs = fsspec.filesystem("memory")
    fs.pipe("/ds/a.bin", bytes([1, 2, 3, 4]))
    fs.pipe("/ds/b.bin", bytes([5, 6, 7, 8]))
    fs.pipe("/ds/index.csv", b"filename,label\na.bin,x\nb.bin,y\n")

    class DictCache:
        """The smallest real cache: keeps bytes in a dict, counts hits."""

        def __init__(self):
            self.data, self.hits = {}, 0

        def get(self, key):
            hit = self.data.get(key)
            self.hits += hit is not None
            return hit

        def put(self, key, data):
            self.data[key] = data

    cache = DictCache()
    ds = Dataset("memory://ds/index.csv")
    with ds.sampled_batcher(batch_size=2, input_dims=(4,), processor=Raw(), cache=cache,
                            workers="thread") as b:  # fmt: skip
        first = b.next_batch()
        second = b.next_batch()
    assert first.input.tolist() == second.input.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert first.urls == ["memory://ds/a.bin", "memory://ds/b.bin"]
    assert cache.hits == 2 and set(cache.data) == set(first.urls)
    # a missing fsspec file is a FetchError naming it
    with Fetcher() as f, pytest.raises(FetchError, match="memory://ds/none: no such file"):
        f.submit(f.fetch("memory://ds/none")).result(timeout=10)


class Augment:
    """Writes what each generator gives this item: torch, numpy, random, and item_rng()."""

    def __call__(self, data, opt, out):
        import random

        import numpy as np

        from distlearn.dataset import item_rng

        out[0] = float(torch.rand(1))
        out[1] = float(np.random.random())
        out[2] = random.random()
        out[3] = float(item_rng().random())
        out[4] = float(data[0])  # which item
        return True


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    root = tmp_path_factory.mktemp("numbered")
    for i in range(256):
        (root / f"{i:03d}.bin").write_bytes(bytes([i]))
    (root / "index.csv").write_text("filename\n" + "".join(f"{i:03d}.bin\n" for i in range(256)))
    return str(root / "index.csv")


def draws(index, epochs=1, **kw):
    opts = dict(batch_size=16, input_dims=(5,), processor=Augment(), sampler="permutation",
                seed=7)  # fmt: skip
    opts.update(kw)
    with Dataset(index).sampled_batcher(**opts) as b:
        return [row for _ in range(epochs) for batch in b for row in batch.input.tolist()]


@pytest.mark.timeout(180)
def test_process_workers_draw_their_own_random_numbers(numbered):
    """Two workers used to inherit one RNG state: every random crop was made twice."""
    rows = draws(numbered, epochs=2, workers="process", num_workers=2)
    for col in range(3):  # torch, numpy, random
        values = [r[col] for r in rows]
        assert len(set(values)) == len(values) == 512, f"column {col} repeats"
    # the per-item generator does not depend on the workers, and is exact on resume
    item = {int(r[4]): r[3] for r in rows[:256]}
    for kw in (dict(workers="thread"), dict(workers="process", num_workers=1)):
        assert {int(r[4]): r[3] for r in draws(numbered, **kw)} == item
    assert len(set(item.values())) == 256
    opts = dict(batch_size=16, input_dims=(5,), processor=Augment(), sampler="permutation",
                seed=7, workers="thread")  # fmt: skip
    with Dataset(numbered).sampled_batcher(**opts) as b:
        for _ in range(5):
            b.next_batch()
        state = b.state_dict()
    with Dataset(numbered).sampled_batcher(**opts) as b:
        b.load_state_dict(state)
        rest = [row for batch in b for row in batch.input.tolist()]
    assert {int(r[4]): r[3] for r in rest} == {int(r[4]): r[3] for r in rows[80:256]}


DATALOADER = textwrap.dedent("""
    import sys, torch
    from distlearn.dataset import Dataset
    from distlearn.dataset.processors import Image
    workers, context = sys.argv[1], sys.argv[2]
    b = Dataset(sys.argv[3]).sampled_batcher(batch_size=8, input_dims=(1, 8, 8),
        processor=Image(), workers=workers, num_workers=1)
    loader = torch.utils.data.DataLoader(b.as_torch(), batch_size=None, num_workers=2,
                                         multiprocessing_context=context)
    try:
        next(iter(loader))
    except Exception as err:
        print("RAISED", type(err).__name__, str(err).replace(chr(10), " "), flush=True)
    else:
        print("NO ERROR", flush=True)
    x, y = next(iter(torch.utils.data.DataLoader(b.as_torch(), batch_size=None)))
    print("WITHOUT WORKERS", tuple(x.shape), flush=True)
    b.close()
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", ["thread", "process"])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_get_a_clear_error_at_once(pngs, workers, context):
    proc = subprocess.run(
        [sys.executable, "-c", DATALOADER, workers, context, str(pngs)],
        env=repo_env(), capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "RAISED" in proc.stdout and "num_workers=0" in proc.stdout, proc.stdout + proc.stderr
    assert "WITHOUT WORKERS (8, 1, 8, 8)" in proc.stdout, "the batcher still works after it"
    assert "Exception ignored" not in proc.stderr and "AssertionError" not in proc.stderr


def test_decode_threads_take_what_was_fetched_in_runs_and_keep_each_items_outcome():
    # One decode thread, held on the first item while 9 more arrive: they go over in
    # one run (two hand-offs, not ten), each item keeps its own result or exception
    # (with the processor's frame in its traceback), and runs on the decode thread.
    import asyncio
    import threading
    import traceback

    from distlearn.dataset.workers.fill import Handoff

    release = threading.Event()
    threads = set()

    def processor(data, opt, row):
        threads.add(threading.get_ident())
        if data == 0:
            release.wait(10)
        if data == 7:
            raise ValueError("item 7 is broken")
        row.fill_(data)
        return data != 8  # the processor's own verdict travels too

    handoff = Handoff(1, processor, None)
    submits = []
    submit = handoff.executor.submit
    handoff.executor.submit = lambda *a: submits.append(1) or submit(*a)
    out = torch.zeros(10, 2)

    async def main():
        futures = [handoff.submit((0, 0, 0, i), i, out[i]) for i in range(10)]
        release.set()
        return await asyncio.gather(*futures, return_exceptions=True)

    try:
        results = asyncio.run(main())
    finally:
        handoff.close()
    assert len(submits) == 2
    assert threading.get_ident() not in threads and len(threads) == 1
    assert results[:7] == [True] * 7 and results[8:] == [False, True]
    assert isinstance(results[7], ValueError)
    assert "in processor" in "".join(traceback.format_exception(results[7]))
    assert out[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 8, 9]


def _verdicts(item, opt, out):
    """Keeps the even items, saying so one way or another (an item is one number)."""
    out.copy_(item)
    keep = int(item[0]) % 2 == 0
    how = int(item[0]) // 2 % 4
    if how == 0:
        return keep
    if how == 1:
        return out if keep else False  # the tensor out.copy_() returns keeps it
    if how == 2:
        return np.bool_(keep)
    return (out.sum() * 0 + int(keep)) > 0  # a one-element torch bool


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_processor_saying_false_in_numpy_or_torch_drops_the_item(workers):
    """`return out.sum() > 0` is a one-element torch bool, numpy's comparisons give
    numpy bools: their False dropped nothing before (only `is False` did)."""
    ds = Dataset({"x": torch.arange(16.0).view(16, 1), "y": torch.zeros(16, dtype=torch.long)})
    with ds.sampled_batcher(batch_size=16, input_dims=(1,), processor=_verdicts,
                            workers=workers) as b:  # fmt: skip
        batch = b.next_batch()
        assert sorted(batch.input.view(-1).tolist()) == [float(i) for i in range(0, 16, 2)]
        assert b.stats["dropped"] == 8


def test_a_processor_returning_a_malformed_tuple_is_a_bug_named_as_such():
    ds = Dataset({"x": torch.arange(4.0).view(4, 1), "y": torch.zeros(4, dtype=torch.long)})
    for ret, match in (((True,), "tuple of 1"), ((True, 1, 2), "tuple of 3")):
        with (
            ds.sampled_batcher(batch_size=4, input_dims=(1,), workers="thread",
                               processor=lambda item, opt, out, r=ret: r) as b,
            pytest.raises(TypeError, match=match),
        ):  # fmt: skip
            b.next_batch()


@pytest.mark.timeout(120)
def test_sys_exit_in_a_processor_is_raised_not_a_stuck_worker():
    """SystemExit escaped the item's handler and ended the fetch loop's thread: the
    batch waited for worker_timeout (600 s) and was then called stuck."""

    def gives_up(item, opt, out):
        sys.exit("decoder gave up")

    _first_batch_fails_at_once(gives_up, "thread", SystemExit, "decoder gave up")


def _first_batch_fails_at_once(processor, workers, error, match):
    """The first batch raises `error` within seconds, not after worker_timeout."""
    ds = Dataset({"x": torch.arange(4.0).view(4, 1), "y": torch.zeros(4, dtype=torch.long)})
    start = time.monotonic()
    with (
        ds.sampled_batcher(batch_size=4, input_dims=(1,), processor=processor,
                           workers=workers, num_workers=1, worker_timeout=60) as b,
        pytest.raises(error, match=match),
    ):  # fmt: skip
        b.next_batch()
    assert time.monotonic() - start < 30


@pytest.mark.timeout(180)
def test_process_workers_on_an_index_in_memory():
    """workers="process" on a tensor index started no process (the in-memory default
    is no worker) and the first batch failed with "min() arg is an empty sequence"."""
    ds = Dataset({"x": torch.arange(8.0).view(8, 1), "y": torch.arange(8) % 2})
    with ds.sampled_batcher(batch_size=4, input_dims=(1,), workers="process") as b:
        assert sorted(b.next_batch().input.view(-1).tolist()) == [0.0, 1.0, 2.0, 3.0]


def _lock_extra(item, opt, out):
    import threading

    out.copy_(item)
    return True, threading.Lock()  # cannot be pickled to the main process


@pytest.mark.timeout(120)
def test_an_extra_that_cannot_travel_from_a_worker_process_is_an_error_at_once():
    """The worker's send raised outside the batch's handler: the batch, and every one
    after it, waited for worker_timeout (600 s) and were then called stuck."""
    _first_batch_fails_at_once(
        _lock_extra, "process", RuntimeError, "cannot be sent to the main process"
    )


def _slow_copy(item, opt, out):
    time.sleep(0.3)
    out.copy_(item)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", ["thread", "process"])
def test_close_from_another_thread_during_iteration_says_so(workers):
    """The waiting iteration raised an internal error: a bare CancelledError (threads)
    or 'pop from an empty deque' (processes)."""
    import threading

    ds = Dataset({"x": torch.arange(64.0).view(64, 1), "y": torch.zeros(64, dtype=torch.long)})
    b = ds.sampled_batcher(batch_size=4, input_dims=(1,), processor=_slow_copy,
                           workers=workers, num_workers=1)  # fmt: skip
    it = iter(b)
    next(it)
    threading.Timer(0.2, b.close).start()
    with pytest.raises(RuntimeError, match="batcher is closed"):
        for _ in it:
            pass


def test_a_second_iteration_ends_the_first_with_an_error():
    """Two iter() over one batcher shared its pipeline: the first went on with the second's
    epoch, its batches split between the two loops, without a word."""
    ds = Dataset({"x": torch.arange(64.0).view(64, 1), "y": torch.zeros(64, dtype=torch.long)})
    with ds.sampled_batcher(batch_size=4, input_dims=(1,), sampler="linear") as b:
        first = iter(b)
        assert next(first).input[:, 0].tolist() == [0, 1, 2, 3]
        second = iter(b)
        assert next(second).input[:, 0].tolist() == [0, 1, 2, 3]  # the next epoch
        with pytest.raises(RuntimeError, match="ended by a newer iter"):
            next(first)
        assert len(list(second)) == 15  # the second one has the whole epoch
        for _ in b:  # a loop left with break, then the next epoch: fine
            break
        assert len(list(b)) == 16
        b.next_batch()
        third = iter(b)
        next(third)
        b.reset()
        with pytest.raises(RuntimeError, match="ended by a newer iter"):
            next(third)
