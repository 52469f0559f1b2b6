"""The benchmark harness end to end on tiny data: real servers, loaders and processes."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, repo_env

from bench import netns, report
from bench.data import prepare
from bench.servers import Server, find_nginx


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read()


@pytest.mark.parametrize("kind", ["nginx", "serve"])
def test_server_serves_files_and_stops_every_process(tmp_path, kind):
    if kind == "nginx" and not find_nginx():
        pytest.skip("nginx not installed")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"\x00\x01payload")
    server = Server(tmp_path, kind=kind)
    with server:
        assert _get(server.url + "sub/a.bin") == b"\x00\x01payload"
        pids = server.pids()
        assert pids
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(server.url + "missing.bin")
        assert err.value.code == 404
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)]  # master and workers are gone, not orphaned


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_prepare_synthetic_files_index_and_shards_agree(tmp_path):
    import webdataset as wds

    data = prepare(tmp_path / "www", 250, synthetic=True, shard_size=100)
    assert data.n == 250 and len(data.shards) == 3
    items = data.items()
    assert [lab for _, lab in items[:12]] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    # the shards hold the same bytes and labels as the files, in index order
    samples = list(wds.WebDataset([str(data.root / s) for s in data.shards], shardshuffle=False))
    assert len(samples) == 250
    for (name, label), sample in zip(items, samples, strict=True):
        assert sample["png"] == (data.root / name).read_bytes()
        assert int(sample["cls"]) == label
    # a second call with the same request reuses the folder
    stamp = (data.root / "meta.json").stat().st_mtime_ns
    again = prepare(tmp_path / "www", 250, synthetic=True, shard_size=100)
    assert again.n == 250 and (data.root / "meta.json").stat().st_mtime_ns == stamp


def test_prepare_from_a_folder_and_from_a_csv(tmp_path):
    from bench.data import synthetic_digits

    src = tmp_path / "src"
    for i, (png, label) in enumerate(synthetic_digits(30)):
        (src / f"digit{label}").mkdir(parents=True, exist_ok=True)
        (src / f"digit{label}" / f"{i:03d}.png").write_bytes(png)
    data = prepare(tmp_path / "a", 20, source=src, shard_size=1000)
    labels = [lab for _, lab in data.items()]
    assert data.n == 20 and sorted(set(labels)) == list(range(10))  # spread over all labels

    with open(src / "index.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["filename", "label"])
        w.writerows([(f"digit3/{i:03d}.png", "three") for i in (3, 13, 23)])
    data = prepare(tmp_path / "b", 3, source=src / "index.csv")
    assert [lab for _, lab in data.items()] == [0, 0, 0]

    (src / "bad.csv").write_text("name,label\nx.png,1\n")
    with pytest.raises(ValueError, match=r"bad\.csv.*filename"):
        prepare(tmp_path / "c", 3, source=src / "bad.csv")


def _loader(row, rate, group="distlearn", params=None):
    s = {"median": rate, "min": rate, "max": rate}
    return {"kind": "loader", "row": row, "group": group, "params": params or {},
            "label": row, "rate_excl": s, "rate_incl": s}  # fmt: skip


def test_targets_compare_against_the_peer_at_its_best():
    records = [
        _loader("dataset-csv", 5000),
        _loader("dataloader-requests", 1000, "peer"),
        _loader("dataloader-requests", 2000, "peer"),  # the best setting counts
        _loader("webdataset", 4000, "peer"),
        _loader("aiohttp", 6000, "ceiling", {"procs": 2, "decode": True}),
        {"kind": "allreduce", "world": 4, "impl": "gloo", "size": "1 MiB", "bytes": 1 << 20,
         "median_s": 0.006},
        {"kind": "allreduce", "world": 4, "impl": "tree", "size": "1 MiB", "bytes": 1 << 20,
         "median_s": 0.002},
    ]  # fmt: skip
    checks = {c["target"]: c for c in report.check_targets(records)}
    dl = checks["per-file HTTP loader vs DataLoader+requests (best)"]
    assert dl["ratio"] == pytest.approx(2.5) and dl["status"] == "missed"
    ceiling = checks["per-file HTTP loader vs 2-process aiohttp+PIL ceiling"]
    assert ceiling["ratio"] == pytest.approx(5000 / 6000) and ceiling["status"] == "met"
    assert checks["tar-shard loader vs WebDataset (best)"]["status"] == "not measured"
    ar = [c for c in report.check_targets(records) if c["target"].startswith("allreduce 1 MiB")]
    assert [(c["want"], c["status"]) for c in ar] == [(1.0, "met"), (2.0, "met")]
    assert "targets (checked, not asserted)" in report.targets_text(list(checks.values()))


@pytest.mark.slow  # (51 s of benchmark harness: the default suite keeps under 15 minutes)
@pytest.mark.timeout(400)
def test_quick_run_end_to_end(tmp_path):
    """A tiny full pipeline: data, server, loader rows in fresh processes, gloo, report, chart."""
    out = tmp_path / "out"
    rows = [
        "pil-decode",
        "aiohttp(procs=2, decode=True)",
        "dataloader-requests(num_workers=2)",
        "webdataset(num_workers=2)",
        "dataset-csv(defaults)",
        "dataset-shards(defaults)",
    ]
    cmd = [
        sys.executable, "-m", "bench", "--no-install", "--synthetic", "--samples", "300",
        "--reps", "1", "--rows", *rows, "--worlds", "2", "--allreduce-sizes", "1 elem", "64 KiB",
        "--allreduce-target-s", "0.02", "--only", "loaders", "allreduce",
        "--data-dir", str(tmp_path / "data"), "--out-dir", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=360
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "targets (checked, not asserted)" in proc.stdout
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    loaders = {r["label"]: r for r in recs if r["kind"] == "loader"}
    assert set(rows[:4]) <= set(loaders)
    for label, r in loaders.items():
        assert "error" not in r, (label, r["error"])
        assert r["samples"] == 300
        assert r["rate_excl"]["median"] > 0 and r["ttfb_s"]["median"] > 0
        assert r["peak_pss_mib"]["median"] > 10  # a python process with torch, measured
    gloo = [r for r in recs if r["kind"] == "allreduce" and r.get("impl") == "gloo"]
    assert [r["size"] for r in gloo] == ["1 elem", "64 KiB"]
    assert all(r["median_s"] > 0 and len(r["times_s"]) == 1 for r in gloo)
    md = (out / "RESULTS.md").read_text()
    assert "## Loaders" in md and "## Allreduce" in md and "| target |" in md
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert os.path.getsize(out / "results.png") > 10_000
    # the report can be rebuilt from the raw figures alone
    again = tmp_path / "again"
    cmd = [sys.executable, "-m", "bench", "--report-from", str(out / "results.jsonl"),
           "--out-dir", str(again)]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, env=repo_env(), capture_output=True, timeout=120, check=True)
    assert (again / "RESULTS.md").read_text() == md


@pytest.mark.slow  # (22 s of benchmark harness: the default suite keeps under 15 minutes)
@pytest.mark.timeout(200)
def test_gloo_root_prints_both_ways_side_by_side():
    """bench.gloo_root: the all-reduce at the root and gloo's ring, one row a size."""
    cmd = [sys.executable, "-m", "bench.gloo_root", "--nodes", "2", "--sizes-kib", "4", "2048",
           "--rounds", "2"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 2 ")]
    assert [int(r[1]) for r in rows] == [4, 2048]
    for row in rows:
        ring, root = (float(cell.split()[0]) for cell in row[2:4])
        assert ring > 0 and root > 0
        assert row[4].strip().endswith(")") and "x (" in row[4]
    # one size alone: the bound still admits it (it once left the count slot out)
    cmd = [sys.executable, "-m", "bench.gloo_root", "--nodes", "2", "--sizes-kib", "4",
           "--rounds", "1"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# What bench/netns.py names: namespaces dl<tag>-<k>, host-side veths vd<tag>-<k>, the
# bridge bd<tag>, and each host's temporary folder dl<tag>-<k>-tmp. Only those are
# compared: other tests beside this one (another pytest worker) make and remove
# namespaces of their own.
BENCH_NETNS = re.compile(r"(dl|vd)\d+-\d+(-tmp)?|bd\d+")


def _bench_netns() -> set[str]:
    spaces = Path("/run/netns")
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    links = {line.split(":")[1].strip().split("@")[0] for line in out.stdout.splitlines()}
    names = links | (set(os.listdir(spaces)) if spaces.exists() else set())
    names |= {p.name for p in Path(tempfile.gettempdir()).glob("dl*-tmp")}
    return {name for name in names if BENCH_NETNS.fullmatch(name)}


@pytest.mark.slow  # (19 s of benchmark harness: the default suite keeps under 15 minutes)
@pytest.mark.timeout(200)
@pytest.mark.skipif(netns.missing() is not None, reason=f"{netns.missing()}")
def test_gloo_root_between_namespaces_is_rate_limited_and_leaves_nothing_behind():
    """bench.gloo_root --hosts: each rank in a namespace of its own, its link shaped."""
    before = _bench_netns()
    cmd = [sys.executable, "-m", "bench.gloo_root", "--nodes", "2", "--sizes-kib", "64",
           "--rounds", "1", "--hosts", "100mbit"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "each process a host on a 100mbit link" in proc.stdout
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 2 ")]
    assert len(rows) == 1
    ring, root = (float(cell.split()[0]) for cell in rows[0][2:4])
    # 64 KiB at 100 Mbit/s takes 5.2 ms on the wire (on loopback both are under 1 ms)
    assert ring > 4 and root > 4, rows
    deadline = time.monotonic() + 10  # the kernel frees a deleted namespace's veth later
    while _bench_netns() != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _bench_netns() == before
    bad = subprocess.run([*cmd[:-1], "100kbps"], cwd=REPO, env=repo_env(),
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "rate must be a number ending in" in bad.stderr


def test_elastic_lost_steps_count_from_the_kill_not_from_the_retaken_step():
    """bench.elastic's kill figures: with a restart, the killed step is taken again later
    by the restarted rank; the seconds to the next step count from the first attempt's
    last step (the kill), so they hold the restart, and the steps taken twice are those
    since the checkpoint."""
    from bench.elastic import _lost

    def process(rank, steps, t0):
        start = {"rank": rank, "t": t0, "start": True}
        return [start] + [{"rank": rank, "step": n, "t": t0 + n, "ids": [n]} for n in steps]

    # rank 1 killed after step 5 (rank 0's line for step 5 written just after it), then
    # both restarted from a save at step 3
    first = [process(0, range(1, 6), 0.01), process(1, range(1, 6), 0.0)]
    again = [process(r, range(4, 9), 100.0) for r in (0, 1)]
    taken, seconds = _lost(first + again)
    assert taken == 2  # steps 4 and 5, twice
    assert seconds == 104.0 - 5.0  # the restart's first step, not the step after its step 5
