"""`python -m bench.index`: opening a CSV index of 1M and 10M rows, against pandas and pyarrow.

    python -m bench.index                     # 1M and 10M rows, 3 reps -> bench/RESULTS-index.md
    python -m bench.index --rows 100000 --reps 1 --out-dir bench/out   # smoke

Data: ImageNet-like indexes made here (never committed), in bench/data/index/:
1,000 labels (WordNet-like ids ``n01234567``), each item
``n01234567/n01234567_<k>.JPEG,n01234567``, rows sorted by filename as
ImageNet's own lists are; three variants of the smaller size: the rows
shuffled (the full sort an unsorted file needs), every field quoted with CRLF
line ends (what Python's ``csv.writer`` writes with ``QUOTE_ALL``), and ragged
rows (a multi-label index: ``filename,label1,label2``, a second label on every
fourth row, the other rows stopping after their first). A meta file beside the index
points the names at a local HTTP server that answers every path with 16
bytes, so the time to the first batch includes real fetches.

Every measurement runs in a fresh process, after its imports; the rows of a
size take turns, repetition after repetition, so a loaded machine slows them
alike. Figures: median (min-max) of the repetitions; ratios are to
``pandas.read_csv`` of the same file in the same run.

Rows: ``pandas.read_csv`` (its C parser), ``pyarrow.csv.read_csv`` (threads
on), a bare ``csv.reader`` pass (1M only); ``Dataset(path)`` (a plain file read
by the C reader, ``lines``), the same with the C reader left out through the readers'
seam (``$DISTLEARN_CSV_READERS=arrow,csv``: pyarrow's split, the choice of reader,
measured; 1M),
``Dataset(path, partition=0, partitions=8)``, ``Dataset(path,
cache_index=True)`` with the parsed index already in the cache (memory-mapped),
and the time from ``Dataset(path)`` to the first batch of 128 (``permutation``
sampler, thread workers). Bytes per row: what the index's arrays hold
(``index.nbytes``) and what the process's resident memory grew by (peers:
the growth only). Then, on the largest size, every sampler's epoch and the
size of ``state_dict()``; and 8 processes opening one partition each, with and
without the shared cache, their resident (RSS) and proportional (PSS) memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
LABELS = 1000
PAYLOAD = bytes(range(16))


# ----------------------------------------------------------------------------- data


# The files of one size: ImageNet's sorted list, and its variants (the suffix of their names).
VARIANTS = {
    "sorted": "",
    "shuffled": " (rows shuffled)",
    "quoted": " (every field quoted, CRLF: csv.writer's QUOTE_ALL)",
    "ragged": " (1-2 labels a row: ragged rows)",
}


def make_csv(path: Path, rows: int, variant: str = "sorted", seed: int = 0) -> None:
    """An ImageNet-like index of `rows` items over 1,000 labels, sorted by filename.

    Variants: ``shuffled`` rows; ``quoted``, every field quoted and CRLF line ends
    (what ``csv.writer(f, quoting=csv.QUOTE_ALL)`` writes); ``ragged``, columns
    ``filename,label1,label2`` with a second label on every fourth row, the others
    stopping after their first (a multi-label index)."""
    rng = random.Random(seed)
    wnids = sorted({f"n{rng.randrange(1_000_000, 15_000_000):08d}" for _ in range(LABELS * 2)})
    wnids = sorted(rng.sample(wnids, LABELS))
    per = [rows // LABELS + (i < rows % LABELS) for i in range(LABELS)]
    lines = []
    for wnid, k in zip(wnids, per, strict=True):
        ids = sorted(str(i) for i in rng.sample(range(1, 3 * k + 10), k))
        lines += [f"{wnid}/{wnid}_{i}.JPEG,{wnid}\n" for i in ids]
    lines.sort()
    header = "filename,label\n"
    if variant == "shuffled":
        rng.shuffle(lines)
    elif variant == "quoted":
        header = '"filename","label"\r\n'
        lines = ['"' + line[:-1].replace(",", '","') + '"\r\n' for line in lines]
    elif variant == "ragged":
        header = "filename,label1,label2\n"
        lines = [line if r % 4 else f"{line[:-1]},{wnids[r % LABELS]}\n"
                 for r, line in enumerate(lines)]  # fmt: skip
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        f.write(header)
        f.writelines(lines)
    os.replace(tmp, path)


def ensure_data(folder: Path, rows: int, variant: str, port: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"imagenet-{rows}{'' if variant == 'sorted' else '-' + variant}.csv"
    if not path.exists():
        make_csv(path, rows, variant)
    # the meta file points names at this run's server
    meta = path.with_name(path.stem + "-meta.csv")
    meta.write_text(f"url_prefix\nhttp://127.0.0.1:{port}/\n")
    return path


# ----------------------------------------------------------------------------- the server


async def _serve(port_file: str) -> None:
    """Answer every GET with 16 bytes, keep-alive: a CDN that has every item."""

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head:
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\n\r\n" + PAYLOAD)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(client, "127.0.0.1", 0)
    Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
    async with server:
        await server.serve_forever()


def start_server() -> tuple[subprocess.Popen, int]:
    port_file = Path(tempfile.mkdtemp()) / "port"
    proc = subprocess.Popen([sys.executable, "-m", "bench.index", "--serve", str(port_file)])
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("bench.index: the item server did not start")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


# ----------------------------------------------------------------------------- children


def _memory() -> dict[str, int]:
    """This process's resident and proportional memory, in bytes (smaps_rollup)."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if parts and parts[0].rstrip(":") in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def child(kind: str, path: str, cache_dir: str, rows: int) -> dict:
    """One measurement, in this fresh process: imports first, then the timed call."""
    if kind in ("pandas", "pandas-sorted", "pyarrow", "csv"):
        import csv

        import pandas
        import pyarrow.csv
    else:
        from distlearn.dataset import Dataset, batcher  # noqa: F401 (not timed)
        from distlearn.dataset.index import kinds  # noqa: F401 (not timed)
        from distlearn.dataset.index.csv import reader
        from distlearn.dataset.processors import Raw

        if kind == "dataset-arrow":  # the reader the C one stands in front of
            os.environ[reader.READERS_ENV] = "arrow,csv"
    before = _memory()
    t0 = time.perf_counter()
    out: dict = {}
    if kind == "pandas":
        obj = pandas.read_csv(path)
        n = len(obj)
    elif kind == "pandas-sorted":  # the order an index gives: by label, then by name
        obj = pandas.read_csv(path).sort_values(["label", "filename"], kind="stable")
        n = len(obj)
    elif kind == "pyarrow":
        obj = pyarrow.csv.read_csv(path)
        n = obj.num_rows
    elif kind == "csv":
        with open(path, newline="") as f:
            obj = list(csv.reader(f))
        n = len(obj) - 1
    else:
        opts = {"cache_index": True, "cache_dir": cache_dir} if kind == "mapped" else {}
        part = {"partition": 0, "partitions": 8} if kind == "partition" else {}
        ds = Dataset(path, **part, **opts)
        n = ds.index.num_rows
        if kind == "first-batch":
            b = ds.sampled_batcher(batch_size=128, input_dims=(16,), processor=Raw(),
                                   sampler="permutation", workers="thread")  # fmt: skip
            batch = b.next_batch()
            assert len(batch) == 128, batch
            state = b.state_dict()
            out["state_dict_bytes"] = len(json.dumps(state))
            b.close()
        out["nbytes_per_row"] = ds.index.nbytes / n
        obj = ds
    out["seconds"] = time.perf_counter() - t0
    after = _memory()
    out["rss_per_row"] = (after["Rss"] - before["Rss"]) / n
    private = after["Private_Clean"] + after["Private_Dirty"]
    out["private_per_row"] = (private - before["Private_Clean"] - before["Private_Dirty"]) / n
    assert n == rows, (n, rows)
    del obj
    return out


def samplers_child(path: str, cache_dir: str) -> dict:
    """Each sampler's epoch over the whole index (numpy end to end), and a state_dict."""
    from distlearn.dataset import Dataset
    from distlearn.dataset.sampling.samplers import epoch_rng, get_sampler

    ds = Dataset(path, cache_index=True, cache_dir=cache_dir)
    out = {}
    for name in ("linear", "permutation", "uniform", "label-uniform", "label-permutation"):
        t0 = time.perf_counter()
        items = get_sampler(name)(ds.index, 0, epoch_rng(0, 0, 0))
        out[name] = {"seconds": time.perf_counter() - t0, "items": len(items)}
    return out


def share_child(path: str, cache_dir: str, rank: int, world: int, sync: str, mapped: bool) -> None:
    """Open partition `rank` of `world`, wait for every peer, then report memory."""
    from distlearn.dataset import Dataset

    before = _memory()
    opts = {"cache_index": True, "cache_dir": cache_dir} if mapped else {}
    ds = Dataset(path, partition=rank, partitions=world, **opts)
    after = _memory()
    Path(sync, f"ready-{rank}").touch()
    while len(list(Path(sync).glob("ready-*"))) < world:
        time.sleep(0.05)
    time.sleep(0.5)
    now = _memory()  # every peer has the mapping now: PSS splits its pages among them
    print(json.dumps({"rss": after["Rss"] - before["Rss"], "pss": now["Pss"] - before["Pss"],
                      "examples": len(ds.index)}), flush=True)  # fmt: skip
    Path(sync, f"done-{rank}").touch()
    while len(list(Path(sync).glob("done-*"))) < world:
        time.sleep(0.05)


def run_child(args: list[str], timeout: float = 900, tree: Path | None = None) -> dict:
    """One child of this checkout, or of the checkout `tree` (with its own .venv)."""
    python = sys.executable if tree is None else str(tree / ".venv" / "bin" / "python")
    res = subprocess.run([python, "-m", "bench.index", *args], capture_output=True,
                         text=True, timeout=timeout, cwd=tree or REPO)  # fmt: skip
    if res.returncode:
        raise RuntimeError(f"bench.index {args}: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def share(path: Path, cache_dir: str, world: int, mapped: bool) -> list[dict]:
    sync = tempfile.mkdtemp()
    cmd = [sys.executable, "-m", "bench.index", "--share", str(path), cache_dir]
    procs = [
        subprocess.Popen(
            [*cmd, str(r), str(world), sync, str(int(mapped))],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for r in range(world)
    ]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=900)
        if p.returncode:
            raise RuntimeError("bench.index: a sharing process failed")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


# ----------------------------------------------------------------------------- the run


def _fmt(values: list[float], unit: str = "s") -> str:
    med = statistics.median(values)
    if unit == "s":
        return f"{med:.2f} ({min(values):.2f}-{max(values):.2f})"
    return f"{med:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--share-rows", type=int, default=2_000_000)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--data", default=str(BENCH / "data" / "index"))
    p.add_argument("--out-dir", default=str(BENCH))
    p.add_argument("--child", nargs=4, metavar=("KIND", "CSV", "CACHE", "ROWS"))
    p.add_argument("--samplers", nargs=2, metavar=("CSV", "CACHE"))
    p.add_argument("--share", nargs=6)
    p.add_argument("--serve")
    p.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                   help="also run every distlearn row from this checkout (its own .venv), "
                   "interleaved with ours, and add a before/after table")  # fmt: skip
    a = p.parse_args(argv)
    if a.serve:
        asyncio.run(_serve(a.serve))
        return 0
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.child[2], int(a.child[3]))))
        return 0
    if a.samplers:
        print(json.dumps(samplers_child(*a.samplers)))
        return 0
    if a.share:
        path, cache, rank, world, sync, mapped = a.share
        share_child(path, cache, int(rank), int(world), sync, bool(int(mapped)))
        return 0

    server, port = start_server()
    cache_dir = tempfile.mkdtemp(prefix="bench-index-cache-")
    base_cache = tempfile.mkdtemp(prefix="bench-index-cache-base-")
    compared: list[str] = []  # the before/after table's lines
    lines = [
        "# Opening a CSV index: distlearn against pandas and pyarrow",
        "",
        f"`python -m bench.index {' '.join(argv if argv is not None else sys.argv[1:])}`"
        f" — {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores; {a.reps} repetitions,"
        " each in a fresh process; median (min-max) seconds.",
        "",
        "| rows | row | open s | vs pandas | index bytes/row | RSS growth bytes/row |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    results: dict = {}
    try:
        sizes = [(n, "sorted") for n in a.rows]
        sizes += [(min(a.rows), v) for v in VARIANTS if v != "sorted"]
        for rows, variant in sizes:
            path = ensure_data(Path(a.data), rows, variant, port)
            # (pyarrow's reader refuses ragged rows: "Expected 3 columns, got 2")
            kinds = (
                ["pandas", "dataset"] if variant == "ragged" else ["pandas", "pyarrow", "dataset"]
            )
            if variant == "shuffled":  # (the rows of the other files are in that order)
                kinds.insert(1, "pandas-sorted")
            if rows <= 1_000_000 and variant != "quoted":  # (quotes: pyarrow's anyway)
                kinds.append("dataset-arrow")
            if variant == "sorted":
                kinds += ["partition", "mapped", "first-batch"]
                if rows <= 1_000_000:
                    kinds.insert(2, "csv")
                run_child(["--child", "mapped", str(path), cache_dir, str(rows)])  # warm
                if a.baseline:
                    run_child(["--child", "mapped", str(path), base_cache, str(rows)],
                              tree=a.baseline)  # fmt: skip
            got: dict[str, list[dict]] = {k: [] for k in kinds}
            ours = [k for k in kinds if k in BASELINE_KINDS] if a.baseline else []
            base: dict[str, list[dict]] = {k: [] for k in ours}
            for rep in range(a.reps):
                order = kinds if rep % 2 == 0 else kinds[::-1]
                for kind in order:
                    args = ["--child", kind, str(path), cache_dir, str(rows)]
                    if kind not in base:
                        got[kind].append(run_child(args))
                        continue
                    runs = [(got, args, None), (base, [*args[:3], base_cache, args[4]], a.baseline)]
                    for into, child_args, tree in runs if rep % 2 == 0 else runs[::-1]:
                        into[kind].append(run_child(child_args, tree=tree))  # (turn about)
            results[(rows, variant)] = got
            for kind in ours:
                before = statistics.median(r["seconds"] for r in base[kind])
                after = statistics.median(r["seconds"] for r in got[kind])
                compared.append(
                    f"| {rows:,} | {ROW_LABELS[kind] + VARIANTS[variant]} | "
                    f"{_fmt([r['seconds'] for r in base[kind]])} | "
                    f"{_fmt([r['seconds'] for r in got[kind]])} | {before / after:.2f}x |"
                )
            pandas_med = statistics.median(r["seconds"] for r in got["pandas"])
            for kind in kinds:
                secs = [r["seconds"] for r in got[kind]]
                ratio = pandas_med / statistics.median(secs)
                nb = [r["nbytes_per_row"] for r in got[kind] if "nbytes_per_row" in r]
                rss = [r["rss_per_row"] for r in got[kind]]
                label = ROW_LABELS[kind] + VARIANTS[variant]
                lines.append(
                    f"| {rows:,} | {label} | {_fmt(secs)} | {ratio:.2f}x | "
                    f"{_fmt(nb, '') if nb else '-'} | {_fmt(rss, '')} |"
                )
            print("\n".join(lines[-len(kinds) :]), flush=True)
        lines += ["", "`pandas.read_csv` then `sort_values([\"label\", \"filename\"])`: the "
                  "order an index gives its examples (torch-dataset's: by label, then name), "
                  "which an unsorted file costs a sort."]  # fmt: skip
        lines += ["", "`pyarrow.csv.read_csv` refuses ragged rows (\"Expected 3 columns, got "
                  "2\"): no pyarrow row for them."]  # fmt: skip
        first = results[(max(a.rows), "sorted")]["first-batch"]
        lines += ["", f"`state_dict()` after the first batch of a {max(a.rows):,}-row epoch: "
                  f"{first[0]['state_dict_bytes']} bytes of JSON.", ""]  # fmt: skip
        mapped = results[(max(a.rows), "sorted")]["mapped"]
        lines += [f"Mapped index ({max(a.rows):,} rows): private memory "
                  f"{_fmt([r['private_per_row'] for r in mapped], '')} bytes/row.", ""]  # fmt: skip
        # samplers on the largest index
        big = ensure_data(Path(a.data), max(a.rows), "sorted", port)
        sam = run_child(["--samplers", str(big), cache_dir])
        lines += [f"## Samplers over {max(a.rows):,} items (one epoch, numpy end to end)", "",
                  "| sampler | seconds | items |", "|---|---:|---:|"]  # fmt: skip
        lines += [f"| {k} | {v['seconds']:.2f} | {v['items']:,} |" for k, v in sam.items()]
        # one copy per host
        srows = a.share_rows
        spath = ensure_data(Path(a.data), srows, "sorted", port)
        run_child(["--child", "mapped", str(spath), cache_dir, str(srows)])  # warm the cache
        lines += ["", f"## {a.world} processes, one partition each, {srows:,} rows", "",
                  "| index | RSS growth per process (MB) | PSS growth per process (MB) |"
                  " sum of PSS (MB) |", "|---|---:|---:|---:|"]  # fmt: skip
        for mapped_ in (False, True):
            got = share(spath, cache_dir, a.world, mapped_)
            rss = [g["rss"] / 2**20 for g in got]
            pss = [g["pss"] / 2**20 for g in got]
            what = "cached (memory-mapped, shared)" if mapped_ else "parsed by each process"
            lines.append(f"| {what} | {statistics.median(rss):.1f} | "
                         f"{statistics.median(pss):.1f} | {sum(pss):.1f} |")  # fmt: skip
        print("\n".join(lines[-4:]), flush=True)
        if compared:
            lines += ["", f"## Against the checkout {a.baseline} (same run, turn about)", "",
                      "| rows | row | baseline s | this checkout s | speed vs baseline |",
                      "|---:|---|---:|---:|---:|", *compared]  # fmt: skip
            print("\n".join(lines[-len(compared) - 4 :]), flush=True)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(cache_dir, ignore_errors=True)
        shutil.rmtree(base_cache, ignore_errors=True)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "RESULTS-index.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'RESULTS-index.md'}")
    return 0


# The rows that run distlearn: the ones a --baseline checkout runs too.
BASELINE_KINDS = ("dataset", "dataset-arrow", "partition", "mapped", "first-batch")

ROW_LABELS = {
    "pandas": "`pandas.read_csv`",
    "pandas-sorted": "`pandas.read_csv`, then sorted as an index",
    "pyarrow": "`pyarrow.csv.read_csv`",
    "csv": "`list(csv.reader(f))`",
    "dataset": "`Dataset(path)`",
    "dataset-arrow": "`Dataset(path)`, the C reader refused (pyarrow's split)",
    "partition": "`Dataset(path, partition=0, partitions=8)`",
    "mapped": "`Dataset(path, cache_index=True)`, cached",
    "first-batch": "`Dataset(path)` to the first batch",
}

if __name__ == "__main__":
    sys.exit(main())
