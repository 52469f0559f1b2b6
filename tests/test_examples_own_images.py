"""examples/own_images.sh as a user runs it: a folder of JPEGs, one sub-folder per class,
becomes a CSV index, and 2 processes under torchrun train on it with a random crop and flip."""

from __future__ import annotations

import contextlib
import csv
import os
import re
import signal
import subprocess

import pytest
import torch
from conftest import REPO, repo_env

PIL = pytest.importorskip("PIL.Image")
np = pytest.importorskip("numpy")

SCRIPT = REPO / "examples" / "own_images.sh"
EPOCH = re.compile(
    r"^epoch (\d+): train loss ([\d.]+), accuracy ([\d.]+)% over (\d+) images; "
    r"val accuracy ([\d.]+)% over (\d+) images",
    re.M,
)
PER_CLASS = 40


def _photos(root):
    """Two classes of JPEGs of assorted sizes on a noisy ground: a bright square at the
    centre ("square") or none ("plain"); a few are PNGs, one is in a nested folder."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in ("plain", "square"):
        for i in range(PER_CLASS):
            w, h = int(rng.integers(60, 120)), int(rng.integers(60, 120))
            arr = (rng.random((h, w, 3)) * 80).astype(np.uint8)
            if label == "square":
                s = min(w, h) // 3
                arr[h // 2 - s : h // 2 + s, w // 2 - s : w // 2 + s] = 230
            folder = root / label / ("nested" if i == 0 else "")
            folder.mkdir(parents=True, exist_ok=True)
            ext = "png" if i % 10 == 3 else "jpg"
            Image.fromarray(arr).save(folder / f"{i:03d}.{ext}")
    (root / ".hidden").mkdir()  # not a class


@pytest.mark.slow
def test_own_images_end_to_end(tmp_path):
    photos, out = tmp_path / "photos", tmp_path / "out"
    _photos(photos)
    cmd = [str(SCRIPT), str(photos), "--out", str(out), "--epochs", "4", "--size", "32"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=repo_env(PYTHONUNBUFFERED="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun's workers too, on a timeout
        proc.wait()
    assert proc.returncode == 0, text

    # the index: every image once, every 10th of a class in val.csv, absolute paths
    rows = {}
    for split in ("train", "val"):
        with open(out / f"{split}.csv", newline="") as f:
            rows[split] = list(csv.DictReader(f))
    assert len(rows["train"]) == 2 * (PER_CLASS - PER_CLASS // 10)
    assert len(rows["val"]) == 2 * (PER_CLASS // 10)
    names = [r["filename"] for r in rows["train"] + rows["val"]]
    assert len(set(names)) == 2 * PER_CLASS and all(os.path.isabs(n) for n in names)

    # training: every image of the epoch once over the 2 ranks, printed once, learning
    epochs = [(float(loss), float(acc), int(n), float(vacc), int(vn))
              for _, loss, acc, n, vacc, vn in EPOCH.findall(text)]  # fmt: skip
    assert len(epochs) == 4, text
    assert all(n == len(rows["train"]) and vn == len(rows["val"]) for *_, n, _, vn in epochs)
    assert epochs[-1][0] < epochs[0][0], text
    assert "2 processes" in text
    said = re.findall(r"distlearn\.dataset: .*: partition (\d) of (\d) \(from arguments\)", text)
    assert sorted(said) == [("0", "2"), ("1", "2")], text  # one line per rank
    saved = torch.load(out / "model.pt", weights_only=True)
    assert saved["labels"] == ["plain", "square"]


def test_crop_and_flip_are_drawn_per_image():
    """RandomCropFlip: crops and mirrors vary from image to image, the same image at the
    same place of the same epoch gets the same ones, and evaluation takes the centre."""
    import importlib.util
    import io

    from PIL import Image

    from distlearn.dataset.seeding import call_with_item

    spec = importlib.util.spec_from_file_location("own_images", REPO / "examples" / "own_images.py")
    own = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(own)

    arr = np.arange(40 * 60 * 3, dtype=np.uint32).reshape(40, 60, 3) % 251
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, format="PNG")  # lossless: exact pixels
    data = buf.getvalue()

    def row(proc, key):
        out = torch.empty(3, 32, 32)
        assert call_with_item(key, proc, data, None, out) is True
        return out

    train = own.RandomCropFlip(32, 40)
    rows = [row(train, (0, 0, 0, i)) for i in range(16)]
    assert len({r.numpy().tobytes() for r in rows}) > 8  # crops and flips differ
    assert torch.equal(row(train, (0, 0, 0, 5)), rows[5])  # the same draw again
    assert float(rows[0].min()) >= 0.0 and float(rows[0].max()) <= 1.0
    centre = own.RandomCropFlip(32, 40, train=False)
    assert torch.equal(row(centre, (0, 0, 0, 1)), row(centre, (0, 0, 0, 2)))
