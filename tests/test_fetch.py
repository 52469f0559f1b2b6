"""Fetcher and batcher against a real fault-injecting HTTP server (500s, 404s, stalls, cuts)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter

import pytest

from distlearn.dataset import AllFailed, Dataset, Fetcher, FetchError
from distlearn.dataset.fetch.files import read_bytes
from distlearn.dataset.processors import Image
from tests.faulty_server import item_ids, make_pngs, running

N = 120


@pytest.fixture
def faulty(tmp_path):
    """start(plan, stall=...) -> base URL of a faulty server over a fresh PNG set."""
    root = tmp_path / "root"
    make_pngs(root, N, labels=3)
    with contextlib.ExitStack() as stack:

        def start(plan: dict, stall: float = 5.0) -> str:
            base, start.hits = stack.enter_context(running(root, plan, stall))
            return base

        start.root = root
        yield start


# linear order of make_pngs' index: by label (c0, c1, c2), then by filename
LINEAR = sorted(range(N), key=lambda i: (i % 3, i))


def name(i: int) -> str:
    return f"c{i % 3}/{i:05d}.png"


def test_fetcher_retries_transient_faults_not_404(faulty):
    base = faulty(
        {
            name(0): ["500", "503", "ok"],
            name(1): ["cut", "ok"],
            name(2): ["stall", "ok"],
            name(3): ["404"],
            name(4): ["403"],
            name(5): ["500"],
        },
        stall=3.0,
    )
    fetcher = Fetcher(timeout=0.5, retries=3, backoff=0.01)
    stats = {"fetched": 0, "retried": 0, "bytes": 0}
    want = {i: (faulty.root / name(i)).read_bytes() for i in range(6)}

    async def get(i):
        try:
            return await fetcher.fetch(base + name(i), stats)
        except FetchError as err:
            return err

    try:
        got = {i: fetcher.submit(get(i)).result(timeout=30) for i in range(6)}
    finally:
        fetcher.close()
    assert got[0] == want[0] and got[1] == want[1] and got[2] == want[2]
    assert "404" in got[3].cause and got[3].url == base + name(3)
    assert "403" in got[4].cause
    assert "500" in got[5].cause
    hits = faulty.hits()
    assert hits[name(0)] == 3 and hits[name(1)] == 2 and hits[name(2)] == 2
    assert hits[name(3)] == 1 and hits[name(4)] == 1, "no retry on 404/403"
    assert hits[name(5)] == 4, "a persistent 500 is tried 1 + retries times"
    assert stats["retried"] == 2 + 1 + 1 + 3
    assert stats["fetched"] == 3


def test_range_reads(faulty):
    base = faulty({})
    data = (faulty.root / name(7)).read_bytes()
    with Fetcher() as f:
        got = f.submit(f.fetch((base + name(7), 3, 10))).result(timeout=30)
        local = f.submit(f.fetch((str(faulty.root / name(7)), 3, 10))).result(timeout=30)
        whole = f.submit(f.fetch("file://" + str(faulty.root / name(7)))).result(timeout=30)
    assert got == local == data[3:13]
    assert whole == data


def test_a_range_answered_with_other_bytes_is_refused(faulty):
    """A 206 must carry the bytes asked for: a Content-Range that starts elsewhere (same
    length: the length check alone let it through, other bytes came back as the
    record) or none at all is a fault, retried, then named."""
    base = faulty({name(7): ["shifted", "ok"], name(8): ["shifted"], name(9): ["unranged"]})
    data = (faulty.root / name(7)).read_bytes()
    with Fetcher(retries=2, backoff=0.01) as f:
        assert f.submit(f.fetch((base + name(7), 3, 10))).result(timeout=30) == data[3:13]
        with pytest.raises(FetchError, match=r"Content-Range 'bytes 4-13/\d+' for bytes 3-12"):
            f.submit(f.fetch((base + name(8), 3, 10))).result(timeout=30)
        with pytest.raises(FetchError, match=r"Content-Range None for bytes 3-12"):
            f.submit(f.fetch((base + name(9), 3, 10))).result(timeout=30)
    assert faulty.hits()[name(7)] == 2 and faulty.hits()[name(8)] == 3


def test_a_rate_limit_s_retry_after_is_honoured(faulty):
    """A 429 (or 503) with Retry-After: the next try waits that long (up to a minute),
    not the backoff's milliseconds, which met the limit again and ran out of tries."""
    base = faulty({name(7): ["ratelimit"]})
    data = (faulty.root / name(7)).read_bytes()
    t0 = time.monotonic()
    with Fetcher(retries=2, backoff=0.01) as f:
        assert f.submit(f.fetch(base + name(7))).result(timeout=30) == data
    assert time.monotonic() - t0 >= 1.0 and faulty.hits()[name(7)] == 2


def test_bytes_come_as_stored_from_a_server_that_compresses(faulty):
    """aiohttp asks for "gzip, deflate" unless told otherwise, and the fetcher does not
    inflate (bytes as stored): a server that compresses on the way (nginx's gzip on
    text/csv, a CDN) handed back gzip, so an index read as 'not UTF-8 text' and an
    item's bytes were gzip's. The fetcher asks for identity; a header given wins."""
    base = faulty({"train.csv": ["compress"], name(7): ["compress"]})
    data = (faulty.root / name(7)).read_bytes()
    with Fetcher() as f:
        assert f.submit(f.fetch(base + name(7))).result(timeout=30) == data
    ds = Dataset(base + "train.csv")
    assert len(ds.index) == N
    with Fetcher(headers={"accept-encoding": "gzip"}) as f:  # asked for: as the server sends it
        assert f.submit(f.fetch(base + name(7))).result(timeout=30)[:2] == b"\x1f\x8b"


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_faults_exactly_once_counted_and_named(faulty, caplog, workers):
    perm_fail = {3: "404", 10: "500", 50: "403", 77: "404"}
    plan = {name(i): [code] for i, code in perm_fail.items()}
    plan.update({name(i): ["500", "ok"] for i in range(20, 30)})
    plan.update({name(i): ["cut", "ok"] for i in range(30, 35)})
    plan.update({name(i): ["stall", "ok"] for i in (40, 41)})
    base = faulty(plan, stall=2.0)
    seen: Counter = Counter()
    stats: Counter = Counter()
    caplog.set_level(logging.WARNING, logger="distlearn.dataset")
    for rank in range(2):
        ds = Dataset(base + "train.csv", partition=rank, partitions=2)
        with ds.sampled_batcher(
            batch_size=16, input_dims=(1, 8, 8), sampler="permutation", processor=Image(),
            workers=workers, num_workers=2, timeout=0.5, retries=2, backoff=0.01,
        ) as b:  # fmt: skip
            for batch in b:
                seen.update(item_ids(batch.input))
            stats.update(b.stats)
    assert seen == Counter(i for i in range(N) if i not in perm_fail)
    assert stats["failed"] == len(perm_fail)
    assert stats["fetched"] == N - len(perm_fail)
    assert stats["retried"] >= 10 + 5 + 2 + 2  # each transient once, the 500 twice
    # the log names the URL and the cause (rate-limited: at least the first one per batcher)
    text = caplog.text
    assert "dropped http://127.0.0.1" in text
    assert any(code in text for code in ("HTTP 404", "HTTP 500", "HTTP 403"))


def test_all_failing_source_raises_instead_of_spinning(faulty):
    base = faulty({name(i): ["404"] for i in range(N)})
    ds = Dataset(base + "train.csv")
    with (
        ds.sampled_batcher(batch_size=10, input_dims=(1, 8, 8), processor=Image(),
                           workers="thread", max_failed_batches=3) as b,
        pytest.raises(AllFailed, match=r"3 consecutive batches.*HTTP 404"),
    ):  # fmt: skip
        list(b)
    assert b.stats["failed"] == 30


def test_processor_failure_drops_item_and_counts(faulty):
    base = faulty({})
    ds = Dataset(base + "train.csv")

    def picky(data, opt, out):
        Image()(data, opt, out)
        i = item_ids(out.unsqueeze(0))[0]
        if i % 7 == 0:
            return False
        if i % 11 == 0:
            raise ValueError(f"bad item {i}")
        return True, {"i": i}

    with ds.sampled_batcher(batch_size=20, input_dims=(1, 8, 8), processor=picky,
                            workers="thread") as b:  # fmt: skip
        got = []
        for batch in b:
            ids = item_ids(batch.input)
            assert [e["i"] for e in batch.extra] == ids
            got += ids
    bad = {i for i in range(N) if i % 7 == 0 or i % 11 == 0}
    assert got == [i for i in LINEAR if i not in bad]
    assert b.stats["dropped"] == len(bad) and b.stats["failed"] == 0


def test_missing_index_names_url(faulty):
    base = faulty({})
    with pytest.raises(FileNotFoundError, match=r"nope\.csv"):
        Dataset(base + "nope.csv")


def test_a_local_index_that_is_not_a_regular_file_is_refused_unread(tmp_path):
    """A FIFO (whose open would block), a character device (``/dev/zero`` would read
    forever; ``/dev/null``, read here, is one too) and a folder given where a file is
    read are each refused by name, nothing read."""
    fifo = tmp_path / "index.csv"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/null", str(tmp_path)):
        done: list = []
        worker = threading.Thread(
            target=lambda p=path, out=done: out.append(_refusal(read_bytes, p)), daemon=True
        )  # (a blocked open must fail the test, not hang it)
        worker.start()
        worker.join(10)
        assert done == [f"{path}: not a regular file"], (path, done)
    with pytest.raises(FetchError, match="not a regular file"):
        Dataset(str(fifo))
    (tmp_path / "real.csv").write_text("filename,label\na.png,x\n")
    assert read_bytes(str(tmp_path / "real.csv")) == b"filename,label\na.png,x\n"


def _refusal(read, path: str) -> str:
    try:
        read(path)
    except FetchError as err:
        return str(err)
    return "read"


@pytest.mark.timeout(30)
def test_a_fetcher_whose_loop_thread_fails_raises_instead_of_hanging(monkeypatch):
    """The event-loop thread dies before its loop runs (here: set_event_loop fails in
    it): the caller gets the error, where it used to wait for the loop forever."""
    import asyncio

    real = asyncio.set_event_loop
    seen: list[BaseException] = []

    def fails_in_the_fetcher(loop):
        if threading.current_thread().name == "dataset-fetcher":
            raise OSError("no event loop here")
        return real(loop)

    monkeypatch.setattr(asyncio, "set_event_loop", fails_in_the_fetcher)
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    fetcher = Fetcher()
    with pytest.raises(RuntimeError, match="event-loop thread failed") as info:
        fetcher.loop  # noqa: B018 (the property starts the thread)
    assert isinstance(info.value.__cause__, OSError)
    fetcher._thread.join(timeout=5)
    assert [type(e) for e in seen] == [OSError]  # and the thread's own report
    monkeypatch.undo()
    assert fetcher.loop.is_running()  # a later call starts a loop that works
    fetcher.close()
