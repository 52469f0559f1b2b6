"""Errors a user can act on: processor bugs with the worker's traceback, on_error, options
checked at once, no empty batch, stuck workers and part loaders, Ctrl-C mid-batch."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback

import pytest

import distlearn.dataset as dataset
from distlearn.dataset import AllFailed, Dataset, DatasetError, FetchError, PartError, WorkerDied
from distlearn.dataset.errors import RemoteTraceback
from distlearn.dataset.processors import Image
from tests.faulty_server import item_ids, make_pngs, running

N = 140
DIMS = (1, 8, 8)


class Buggy:
    """An image processor with a bug on 1 item in 14 (about 7%): a NameError."""

    def __call__(self, data, opt, out):
        Image()(data, opt, out)
        if item_ids(out.unsqueeze(0))[0] % 14 == 3:
            return undefined_name  # noqa: F821 - the bug
        return True


BAD = {i for i in range(N) if i % 14 == 3}


@pytest.fixture(scope="module")
def pngs(tmp_path_factory):
    root = tmp_path_factory.mktemp("failures") / "root"
    make_pngs(root, N, labels=2)
    return root


@pytest.fixture(scope="module")
def base(pngs):
    with running(pngs) as (url, _):
        yield url


def batcher(url, **kw):
    opts = dict(batch_size=16, input_dims=DIMS, processor=Image(), workers="thread")
    opts.update(kw)
    return Dataset(url).sampled_batcher(**opts)


@pytest.mark.parametrize("workers", ["thread", "process"])
def test_a_processor_bug_raises_with_the_workers_traceback(base, workers):
    seen = []
    b = batcher(base + "train.csv", processor=Buggy(), workers=workers, num_workers=1)
    with b, pytest.raises(NameError, match="undefined_name") as info:
        for batch in b:
            seen += item_ids(batch.input)
    err = info.value
    assert not BAD & set(seen), "no batch holding a failed item was handed out"
    if workers == "process":  # the worker's frames travel as the cause
        assert isinstance(err.__cause__, RemoteTraceback)
        text = str(err.__cause__)
    else:
        text = "".join(traceback.format_tb(err.__traceback__))
    assert "in __call__" in text and "return undefined_name" in text
    assert any("decoding http://127.0.0.1" in note for note in err.__notes__)


def test_on_error_drop_and_callable(base):
    with batcher(base + "train.csv", processor=Buggy(), on_error="drop") as b:
        seen = [i for batch in b for i in item_ids(batch.input)]
        stats = b.stats
    assert sorted(seen) == sorted(set(range(N)) - BAD) and stats["dropped"] == len(BAD)
    caught = []
    with batcher(base + "train.csv", processor=Buggy(), on_error=caught.append) as b:
        seen = [i for batch in b for i in item_ids(batch.input)]
    assert len(seen) == N - len(BAD) and len(caught) == len(BAD)
    assert all(isinstance(e, NameError) for e in caught)


def test_on_error_raise_stops_at_a_fetch_fault(pngs):
    with running(pngs, {"c1/00005.png": ["404"]}) as (url, _):
        b = batcher(url + "train.csv", on_error="raise", retries=0)
        with b, pytest.raises(FetchError, match=r"c1/00005\.png: HTTP 404"):
            list(b)
    with pytest.raises(ValueError, match="on_error must be"):
        batcher(str(pngs / "train.csv"), on_error="sometimes")


def test_a_processor_that_cannot_work_raises_at_once(base):
    """Wrong input_dims: every item of the first batch fails alike: that error, no empty batch."""
    handed = []
    b = batcher(base + "train.csv", input_dims=(1, 4, 4))
    with b, pytest.raises(ValueError, match=r"pass Image\(size=\(4, 4\)\)"):
        for batch in b:
            handed.append(batch)
    assert handed == []


def test_no_empty_batch_reaches_the_user(pngs):
    # every item of the second batch (linear order: c0 items 16..31 of 70) is missing
    order = sorted(range(N), key=lambda i: (i % 2, i))
    plan = {f"c{i % 2}/{i:05d}.png": ["404"] for i in order[16:32]}
    with running(pngs, plan) as (url, _), batcher(url + "train.csv", retries=0) as b:
        sizes = [len(batch) for batch in b]
        stats = b.stats
    assert sizes == [16] * 7 + [12] and stats["failed"] == 16  # 9 batches, 1 skipped
    # a server that goes away: AllFailed after 3 batches, not 0-item batches
    with running(pngs) as (url, _):
        ds = Dataset(url + "train.csv")
    handed = []
    b = ds.sampled_batcher(batch_size=16, input_dims=DIMS, processor=Image(), workers="thread",
                           retries=0)  # fmt: skip
    with b, pytest.raises(AllFailed, match=r"3 consecutive batches.*Connect") as info:
        for batch in b:
            handed.append(batch)
    assert handed == [] and isinstance(info.value.__cause__, FetchError)


def test_an_index_nobody_answers_for_names_the_server_and_the_retry_options(pngs):
    """Connection refused: the error asks whether the server runs, with the retry
    options it was read with; an answer that is an error (503) is left as it was."""
    with running(pngs) as (url, _):
        pass  # the server has stopped: its port refuses connections now
    with pytest.raises(FetchError) as info:
        Dataset(url + "train.csv", retries=1, backoff=0.01)
    port = url.split(":")[2].split("/")[0]
    said = str(info.value)
    assert f"is a server running at 127.0.0.1:{port}, and reachable from this host?" in said
    assert "retries=1 (backoff=0.01 s doubling up to max_backoff=2 s)" in said
    assert "timeout=30 s a try" in said and info.value.unanswered
    with (
        running(pngs, {"train.csv": ["503"]}) as (url, _),
        pytest.raises(FetchError, match=r"HTTP 503") as info,
    ):
        Dataset(url + "train.csv", retries=1, backoff=0.01)
    assert "Nothing answered" not in str(info.value) and not info.value.unanswered


def test_misspelt_options_fail_at_once_naming_the_closest(base):
    url = base + "train.csv"
    with pytest.raises(TypeError, match=r"unknown option 'num_worker'; did you mean 'num_workers'"):
        Dataset(url, num_worker=2)
    with pytest.raises(TypeError, match=r"'cache_item'; did you mean 'cache_items'"):
        Dataset(url, cache_item=True)
    with pytest.raises(TypeError, match=r"'batch_size': pass it to sampled_batcher"):
        Dataset(url, batch_size=3)
    ds = Dataset(url)
    with pytest.raises(TypeError, match=r"'batch_sise'; did you mean 'batch_size'"):
        ds.sampled_batcher(batch_sise=4)
    with pytest.raises(TypeError, match=r"'retrys'; did you mean 'retries'"):
        ds.sampled_batcher(retrys=4)
    # the named arguments of either call are candidates too: not 'part_timeout'
    with pytest.raises(TypeError, match=r"'partiton'; did you mean 'partition'\?$"):
        Dataset(url, partiton=0)
    with pytest.raises(TypeError, match=r"'batchsize'; did you mean 'batch_size' \(an argument "
                       r"of sampled_batcher\(\)\)\?"):  # fmt: skip
        Dataset(url, batchsize=3)
    with pytest.raises(TypeError, match=r"'partition': pass it to Dataset\(\)"):
        ds.sampled_batcher(partition=1)
    with pytest.raises(TypeError, match=r"'partitons'; did you mean 'partitions' \(an argument "
                       r"of Dataset\(\)\)\?"):  # fmt: skip
        ds.sampled_batcher(partitons=2)


def test_one_base_exception_for_the_package():
    for name in ("BadIndex", "IndexNotFound", "FetchError", "AllFailed", "WorkerDied",
                 "PartError"):  # fmt: skip
        assert name in dataset.__all__ and issubclass(getattr(dataset, name), DatasetError)
    assert "DatasetError" in dataset.__all__
    assert issubclass(dataset.BadIndex, ValueError) and issubclass(FetchError, OSError)
    assert PartError is dataset.PartError


@pytest.mark.timeout(120)
def test_a_stopped_worker_is_reported_not_waited_for(base):
    b = batcher(base + "train.csv", workers="process", num_workers=1, worker_timeout=3)
    pid = b.engine.workers._procs[0].pid
    try:
        b.next_batch()
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerDied, match=r"worker process 0 .* finished no batch in "
                                             r"worker_timeout=3"):  # fmt: skip
            for _ in range(20):
                b.next_batch()
        assert time.monotonic() - t0 < 60
    finally:
        os.kill(pid, signal.SIGCONT)
        b.close()


@pytest.mark.timeout(120)
def test_a_stuck_part_loader_is_reported(tmp_path):
    # a download that never ends (a server that holds the answer). A FIFO part used to
    # stand in for one: it is refused unread now, as not a regular file.
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "part-00000").write_text("1\n2\n")
    (folder / "part-00001").write_text("3\n")
    with running(folder, {"part-00001": ["hold"]}) as (url, _):
        ds = Dataset(url + "part-{00000..00001}", part_timeout=2, record_format="lines")

        def number(data, opt, out):
            out.fill_(int(data))
            return True

        stuck = r"part-00001: the part loader finished nothing in part_timeout=2"
        try:
            b = ds.sampled_batcher(batch_size=1, input_dims=(1,), processor=number,
                                   workers="thread", sampler="part-linear")  # fmt: skip
            with b, pytest.raises(PartError, match=stuck):
                list(b)
        finally:
            (tmp_path / "release").touch()  # (the server lets the held answer go)


def _interrupt_soon(delay: float = 0.5) -> threading.Timer:
    main = threading.main_thread().ident
    timer = threading.Timer(delay, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    return timer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", ["thread", "process"])
def test_ctrl_c_in_next_batch_leaves_the_batcher_usable(pngs, workers):
    order = sorted(range(N), key=lambda i: (i % 2, i))
    stalled = order[16]  # the second batch waits on this item
    plan = {f"c{stalled % 2}/{stalled:05d}.png": ["hold", "ok"]}
    release = pngs.parent / "release"  # held until the interrupt has landed, however slow
    release.unlink(missing_ok=True)
    with (
        running(pngs, plan) as (url, _),
        batcher(url + "train.csv", workers=workers, num_workers=1, timeout=60) as b,
    ):
        seen = item_ids(b.next_batch().input)
        with pytest.raises(KeyboardInterrupt):
            timer = _interrupt_soon()
            b.next_batch()
        timer.join()
        release.touch()
        for _ in range(len(b) - 1):
            seen += item_ids(b.next_batch().input)
    assert seen == order, "the interrupted batch came next; nothing lost, nothing twice"


def test_one_info_line_per_rank(base, monkeypatch, caplog):
    """A rank's first Dataset of a partition says which at INFO; its others (a test set)
    at DEBUG; another partition is said again."""
    monkeypatch.setattr(dataset, "_PARTITIONS_SAID", set())  # a fresh process's
    caplog.set_level(logging.DEBUG, logger="distlearn.dataset")
    url = base + "train.csv"
    for partition in (1, 1, 0):
        Dataset(url, partition=partition, partitions=2)
    Dataset(url, partition=0, partitions=1)  # the whole index, by name: nothing to say
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "partition" in r.getMessage()]
    assert said == [
        ("INFO", f"{url}: partition 1 of 2 (from arguments)"),
        ("DEBUG", f"{url}: partition 1 of 2 (from arguments)"),
        ("INFO", f"{url}: partition 0 of 2 (from arguments)"),
    ]


def test_torchrun_environment_picks_the_partition(base, monkeypatch, caplog):
    url = base + "train.csv"
    whole = len(Dataset(url))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(dataset, "_PARTITIONS_SAID", set())  # a fresh process's
    caplog.set_level(logging.INFO, logger="distlearn.dataset")
    ds = Dataset(url)
    per_label = sum(1 for k in range(1, N // 2 + 1) if k % 4 == 1)  # k-th of a label: k % 4
    assert (ds.partition, ds.partitions) == (1, 4) and len(ds) == 2 * per_label
    assert "partition 1 of 4 (from RANK/WORLD_SIZE)" in caplog.text
    ds = Dataset(url, partition=0, partitions=1)  # explicit: everything
    assert (ds.partition, ds.partitions, len(ds)) == (0, 1, whole)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert len(Dataset(url)) == whole
