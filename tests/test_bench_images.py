"""The image bench's parts on small data: photos from scikit-image's wheel, the shared
augmentation, rows over a real nginx, and the report's targets."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
import tarfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import REPO, repo_env
from PIL import Image

from bench import image_aug, images, photos
from bench.image_rows import Ctx
from bench.servers import Server, find_nginx


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """24 JPEGs in shards of 10, from the real photographs (the wheel is fetched once)."""
    root = tmp_path_factory.mktemp("photos")
    try:
        photos.skimage_wheel(root / "wheels")
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        pytest.skip(f"cannot pip download {photos.SKIMAGE}: {err}")
    return photos.prepare(root / "set", 24, shard_size=10)


def test_photos_are_imagenet_like_jpegs_with_labels(made):
    items = made.items()
    assert len(items) == 24 and len(made.shards) == 3
    assert {label for _, label in items} == set(range(16)) | set(range(8))
    for name, _ in items:
        with Image.open(made.root / name) as img:
            assert img.format == "JPEG" and img.mode == "RGB"
            assert 400 <= max(img.size) <= 500 and min(img.size) >= 260
    # the shards hold the same bytes, in order, as webdataset names them
    with tarfile.open(made.root / made.shards[1]) as tar:
        names = tar.getnames()
        assert names[:2] == ["000010.jpg", "000010.cls"]
        assert tar.extractfile("000010.jpg").read() == (made.root / items[10][0]).read_bytes()
        assert tar.extractfile("000010.cls").read() == str(items[10][1]).encode()
    again = photos.prepare(made.root, 24, shard_size=10)  # reused, not rebuilt
    assert again.bytes == made.bytes


def test_crop_box_is_torchvisions_draw():
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        h, w = random.randint(20, 600), random.randint(20, 600)
        top, left, ch, cw = image_aug.crop_box(h, w, g)
        assert 0 <= top <= h - ch and 0 <= left <= w - cw and ch > 0 and cw > 0
    out = image_aug.augment(torch.zeros(3, 50, 60, dtype=torch.uint8))
    assert out.shape == (3, 224, 224)
    # zeros normalise to -mean/std in every channel
    want = -torch.tensor(image_aug.IMAGENET_MEAN) / torch.tensor(image_aug.IMAGENET_STD)
    assert torch.allclose(out[:, 0, 0], want, atol=1e-5)


@pytest.mark.skipif(not find_nginx(), reason="nginx not installed")
@pytest.mark.parametrize(
    "row, params",
    [
        ("ceiling", {"procs": 2, "work": "scaled"}),
        ("dataloader-http", {"num_workers": 1}),
        ("webdataset", {"num_workers": 1}),
        ("distlearn-csv", {"workers": "process", "num_workers": 1, "work": "package"}),
        ("distlearn-shards", {"workers": "thread", "num_workers": 1, "work": "full"}),
    ],
)
def test_rows_give_two_epochs_of_every_image(made, tmp_path, row, params):
    """Each row, in a fresh process as the bench runs it, against a real nginx."""
    items = made.items()
    with Server(made.root, kind="nginx") as web:
        ctx = Ctx(base_url=web.url, root=str(made.root), files=[f for f, _ in items],
                  labels=[lab for _, lab in items], shards=made.shards, batch_size=8,
                  cache_dir=str(tmp_path))  # fmt: skip
        spec = {"row": row, "params": params, "ctx": asdict(ctx), "epochs": 2}
        res = images.run_child(sys.executable, spec, repo_env(), timeout=120)
    assert "error" not in res, res
    assert [e["samples"] for e in res["epochs"]] == [24, 24]
    assert all(e["s"] > 0 and e["cpu_s"] > 0 for e in res["epochs"])


def _row(loader, group, cold, warm, label=None):
    rate = lambda x: {"img_s": {"median": x, "min": x, "max": x}, "cpu_ms_per_img": 1.0}
    return {"kind": "row", "group": group, "loader": loader, "label": label or loader,
            "cold": rate(cold), "warm": rate(warm), "server_cpu_ms_per_img": 0.1}  # fmt: skip


def test_summary_picks_each_loaders_best_and_checks_the_targets():
    rows = [
        _row("ceiling-full-1p", "ceiling", 500, 500),
        _row("webdataset", "peer", 300, 400, "webdataset(1)"),
        _row("webdataset", "peer", 350, 380, "webdataset(2)"),
        _row("mosaic", "peer", 200, 450),
        _row("distlearn-csv", "distlearn", 430, 560),
    ]
    s = images.summary(rows, cores=2)
    assert s["best"]["webdataset"]["cold"]["label"] == "webdataset(2)"
    assert s["best"]["webdataset"]["warm"]["label"] == "webdataset(1)"
    by = {(t["epoch"], t["what"].split(" (")[0]): t for t in s["targets"]}
    cold = by[("cold", ">= 1.2x the best peer")]
    assert cold["ratio"] == pytest.approx(430 / 350) and cold["met"]
    warm = by[("warm", ">= 1.2x the best peer")]
    assert warm["ratio"] == pytest.approx(560 / 450) and warm["met"]
    ceiling = by[("warm", ">= 0.9x the full-decode ceiling")]
    assert ceiling["ratio"] == pytest.approx(560 / 1000) and not ceiling["met"]


def test_report_from_records(tmp_path):
    """The report and chart rebuild from the JSON lines alone."""
    records = [
        {"kind": "run", "argv": ["--quick"], "machine": {
            "date_utc": "today", "commit": "abc", "cpu": "x", "cores_usable": 2,
            "mem_gib": 1, "kernel": "k", "python": "3", "loadavg_start": [0, 0, 0]}},
        {"kind": "data", "n": 10, "bytes": 1000, "mean_side": 400, "labels": 2, "shards": 1},
        {"kind": "versions", "torch": "2.13.0"},
        _row("ceiling-full-1p", "ceiling", 500, 500),
        _row("webdataset", "peer", 300, 400),
        _row("distlearn-csv", "distlearn", 430, 560),
        {"kind": "done", "elapsed_s": 60},
    ]  # fmt: skip
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "RESULTS-images.md"
    images.main(["--report-from", str(jsonl), "--out", str(out)])
    text = out.read_text()
    assert "| webdataset | 300 (300-300)" in text and "torch 2.13.0" in text
    assert "warm: >= 1.2x the best peer (webdataset): distlearn-csv at 1.40x, met" in text
    png = tmp_path / "results-images.png"
    assert png.exists() and Image.open(io.BytesIO(png.read_bytes())).size[0] > 100


def test_quick_bench_command_runs_end_to_end(tmp_path):
    """`python -m bench.images --quick` on the ceilings and one peer: servers up and down,
    report written (the peers' venvs are not made here: --no-install)."""
    if not find_nginx():
        pytest.skip("nginx not installed")
    out = tmp_path / "RESULTS-images.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench.images", "--quick", "--samples", "32", "--no-install",
         "--rows", "ceiling(procs=1", "webdataset", "--data-dir", str(tmp_path), "--out", str(out)],
        cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "ceiling(procs=1, work=full)" in text and "webdataset(num_workers=2)" in text
    assert Path(tmp_path / "results-images.png").exists()
