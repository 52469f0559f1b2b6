"""Image decoding and augmentation processors: RandomResizedCrop, Transform, scaled decoding,
reproducible per-item draws across worker counts and kinds, and batches to a device."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from distlearn.dataset import Dataset
from distlearn.dataset.processors import RandomResizedCrop, Transform

try:
    import simplejpeg
except ImportError:
    simplejpeg = None

NO_SIMPLEJPEG = "simplejpeg is not installed (pip install distlearn[jpeg])"
DECODERS = [
    "pil",
    pytest.param("simplejpeg", marks=pytest.mark.skipif(simplejpeg is None, reason=NO_SIMPLEJPEG)),
]


def photo(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A smooth picture with detail: gradients plus a few blobs (JPEG-friendly, not flat)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    chans = []
    for c in range(3):
        fx, fy = rng.uniform(2, 9, size=2)
        chans.append(127 + 60 * np.sin(x / width * fx + c) + 60 * np.cos(y / height * fy - c))
    arr = np.clip(np.stack(chans, -1), 0, 255).astype(np.uint8)
    return Image.fromarray(arr).convert(mode)


def jpeg(img: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Twelve JPEGs of assorted sizes in two label folders (a directory index)."""
    root = tmp_path_factory.mktemp("photos")
    for i in range(12):
        d = root / ("cat" if i % 2 else "dog")
        d.mkdir(exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(jpeg(photo(200 + 37 * i, 150 + 23 * i, seed=i)))
    return root


def epochs(folder, processor, n_epochs=2, seed=0, **opts) -> list[torch.Tensor]:
    ds = Dataset(str(folder))
    b = ds.sampled_batcher(batch_size=5, input_dims=(3, 32, 32), processor=processor,
                           seed=seed, **opts)  # fmt: skip
    try:
        return [torch.cat([batch.input for batch in b]) for _ in range(n_epochs)]
    finally:
        b.close()


WORKERS = [
    pytest.param({"workers": "thread", "num_workers": 0}, id="inline"),
    pytest.param({"workers": "thread", "num_workers": 1}, id="thread-1"),
    pytest.param({"workers": "thread", "num_workers": 3}, id="thread-3"),
    pytest.param({"workers": "process", "num_workers": 1}, id="process-1"),
    pytest.param({"workers": "process", "num_workers": 3}, id="process-3"),
]


# -- RandomResizedCrop ---------------------------------------------------------------------


def test_random_resized_crop_draws_follow_torchvision_rules():
    """Every draw lies inside the image, within the scale and ratio bounds, or is the
    centred fallback; flips come at about the asked rate."""
    import random

    p = RandomResizedCrop(scale=(0.2, 0.9), ratio=(0.5, 2.0), flip=0.3)
    rng = random.Random(1)
    flips = 0
    for _ in range(2000):
        w_img, h_img = rng.randint(10, 900), rng.randint(10, 900)
        top, left, h, w, flip = p.draw(w_img, h_img, rng)
        flips += flip
        assert top >= 0 and top + h <= h_img and left >= 0 and left + w <= w_img
        area = h * w / (h_img * w_img)
        inside = 0.2 - 0.05 <= area <= 0.9 + 0.05 and 0.45 <= w / h <= 2.2
        fallback = (top, left) == ((h_img - h) // 2, (w_img - w) // 2)
        assert inside or fallback
    assert 0.25 < flips / 2000 < 0.35


@pytest.mark.parametrize("decoder", DECODERS)
def test_random_resized_crop_is_the_crop_resized(decoder):
    """Full scale, no flip: the row is the drawn box of the image, resized and normalised
    (compared with Pillow's own crop + antialiased resize)."""
    img = photo(300, 200, seed=3)
    data = jpeg(img, quality=95)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    p = RandomResizedCrop(scale=(0.5, 0.5), ratio=(1.0, 1.0), flip=0.0, mean=mean, std=std,
                          decoder=decoder)  # fmt: skip
    torch.manual_seed(7)
    out = torch.empty(3, 64, 64)
    assert p(data, None, out) is True
    # the same draw, again from the same global seed (outside a batcher)
    import random

    torch.manual_seed(7)
    rng = random.Random(int(torch.randint(0, 2**62, ()).item()))
    top, left, h, w, _ = p.draw(300, 200, rng)
    decoded = Image.open(io.BytesIO(data)).convert("RGB")
    want = decoded.crop((left, top, left + w, top + h)).resize((64, 64), Image.BILINEAR)
    want = torch.from_numpy(np.asarray(want)).permute(2, 0, 1).float() / 255
    want = (want - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    err = (out - want).abs() * torch.tensor(std).view(3, 1, 1) * 255  # in grey levels
    assert err.mean() < 2.5, err.mean()  # decoders and resamplers differ by ~2 levels


@pytest.mark.parametrize("decoder", DECODERS)
def test_large_jpeg_decodes_at_reduced_scale(decoder, monkeypatch):
    """A 1600x1200 JPEG whose crop will shrink to 64 px decodes at 1/8 scale, and the row
    is close to the one from a full decode."""
    from distlearn.dataset import imagedecode

    data = jpeg(photo(1600, 1200, seed=5))
    sizes = []
    real = imagedecode.Decoded.decode

    def spy(self, min_size=None):
        arr = real(self, min_size)
        sizes.append(arr.shape[:2])
        return arr

    monkeypatch.setattr(imagedecode.Decoded, "decode", spy)
    p = RandomResizedCrop(scale=(0.9, 0.9), ratio=(4 / 3, 4 / 3), flip=0.0, decoder=decoder)
    scaled, full = torch.empty(3, 64, 64), torch.empty(3, 64, 64)
    torch.manual_seed(0)
    p(data, None, scaled)
    assert sizes[-1] == (150, 200)  # 1/8 of 1200x1600: the crop (~1140x1520) still >= 64 px
    monkeypatch.setattr(imagedecode.Decoded, "decode", lambda self, min_size=None: real(self))
    torch.manual_seed(0)
    p(data, None, full)
    assert (scaled - full).abs().mean() * 255 < 3.0


def test_grey_and_png_and_cmyk_inputs():
    """Mode L rows from a grey JPEG; PNGs go through Pillow; a CMYK JPEG (which
    libjpeg-turbo's RGB output refuses) is converted by Pillow."""
    torch.manual_seed(0)
    grey = torch.empty(1, 16, 16)
    assert RandomResizedCrop()(jpeg(photo(60, 40, mode="L")), None, grey)
    png = io.BytesIO()
    photo(60, 40).save(png, format="PNG")
    rgb = torch.empty(3, 16, 16)
    assert RandomResizedCrop()(png.getvalue(), None, rgb)
    assert RandomResizedCrop()(jpeg(photo(60, 40).convert("CMYK")), None, rgb)
    assert rgb.min() >= 0 and rgb.max() <= 1


def test_random_resized_crop_checks_its_options_and_input():
    with pytest.raises(ValueError, match="scale"):
        RandomResizedCrop(scale=(0.5, 0.1))
    with pytest.raises(ValueError, match="ratio"):
        RandomResizedCrop(ratio=(0, 1))
    with pytest.raises(ValueError, match="flip"):
        RandomResizedCrop(flip=2)
    with pytest.raises(ValueError, match="std"):
        RandomResizedCrop(std=(1, 0, 1))
    with pytest.raises(ValueError, match="decoder"):
        RandomResizedCrop(decoder="turbo")
    with pytest.raises(ValueError, match="mode"):
        RandomResizedCrop(mode="CMYK")
    with pytest.raises(ValueError, match="input_dims"):
        RandomResizedCrop()(jpeg(photo(40, 40)), None, torch.empty(2, 8, 8))
    with pytest.raises(Image.DecompressionBombError, match="max_pixels"):
        RandomResizedCrop(max_pixels=1000)(jpeg(photo(40, 40)), None, torch.empty(3, 8, 8))
    with pytest.raises(Exception):  # noqa: B017 - Pillow's own error for junk bytes
        RandomResizedCrop()(b"\xff\xd8\xff junk, not a JPEG", None, torch.empty(3, 8, 8))


@pytest.mark.parametrize("opts", WORKERS)
def test_random_resized_crop_draws_do_not_depend_on_workers(folder, opts):
    """The same crops and flips with 0, 1 or 3 workers, threads or processes; a new
    epoch or another seed draws anew."""
    p = RandomResizedCrop(mean=(0.5,), std=(0.25,))
    ref = epochs(folder, p, workers="thread", num_workers=0)
    got = epochs(folder, p, **opts)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(ref[0], ref[1])
    assert not torch.equal(ref[0], epochs(folder, p, n_epochs=1, seed=1, **opts)[0])


# -- Transform -------------------------------------------------------------------------------


class RandomCropFlip:
    """A pipeline written against torchvision.transforms.v2's convention, in plain torch:
    uint8 [C, H, W] in, float out, randomness from torch's default generator."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        assert img.dtype == torch.uint8 and img.dim() == 3
        _, h, w = img.shape
        top = int(torch.randint(0, h - self.size + 1, ()).item())
        left = int(torch.randint(0, w - self.size + 1, ()).item())
        out = img[:, top : top + self.size, left : left + self.size]
        if torch.rand(()) < 0.5:
            out = out.flip(-1)
        out = out.to(torch.float32) / 255  # ToDtype(float32, scale=True)
        return out + 0.01 * torch.randn(out.shape)  # noise: draws a lot from the generator


@pytest.mark.parametrize("opts", WORKERS)
def test_transform_draws_do_not_depend_on_workers(folder, opts):
    t = Transform(RandomCropFlip(32))
    ref = epochs(folder, t, workers="thread", num_workers=0)
    got = epochs(folder, t, **opts)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(ref[0], ref[1])


def test_transform_leaves_the_global_generator_as_it_was(folder):
    torch.manual_seed(123)
    before = torch.rand(4)
    torch.manual_seed(123)
    epochs(folder, Transform(RandomCropFlip(32)), n_epochs=1, workers="thread", num_workers=2)
    assert torch.equal(torch.rand(4), before)


def test_transform_outside_a_batcher_uses_torchs_generator():
    data = jpeg(photo(80, 60))
    t = Transform(RandomCropFlip(32))
    a, b = torch.empty(3, 32, 32), torch.empty(3, 32, 32)
    torch.manual_seed(5)
    t(data, None, a)
    torch.manual_seed(5)
    t(data, None, b)
    assert torch.equal(a, b)


def test_transform_checks_what_the_pipeline_returns():
    data = jpeg(photo(80, 60))
    with pytest.raises(TypeError, match="callable"):
        Transform("RandomCrop")
    with pytest.raises(TypeError, match="ToDtype"):
        Transform(lambda img: img[:, :8, :8])(data, None, torch.empty(3, 8, 8))
    with pytest.raises(ValueError, match=r"\(3, 8, 8\)"):
        Transform(lambda img: img.float())(data, None, torch.empty(3, 8, 8))
    with pytest.raises(TypeError, match="not a tensor"):
        Transform(lambda img: img.numpy())(data, None, torch.empty(3, 8, 8))


def test_transform_gets_a_writable_image():
    """Pillow's decoded arrays are read-only: the transform may still write in place."""

    def in_place(img):
        img[:, 0, 0] = 0
        return img[:, :8, :8].float() / 255

    out = torch.empty(3, 8, 8)
    assert Transform(in_place, decoder="pil")(jpeg(photo(40, 40)), None, out)
    assert torch.all(out[:, 0, 0] == 0)


# -- batches to a device ----------------------------------------------------------------------


def test_device_options_checked_where_given(folder):
    ds = Dataset(str(folder))
    with pytest.raises(ValueError, match="device='nowhere'"):
        ds.sampled_batcher(batch_size=4, input_dims=(3, 8, 8), device="nowhere")
    with pytest.raises(TypeError, match="pin_memory"):
        ds.sampled_batcher(batch_size=4, input_dims=(3, 8, 8), pin_memory="yes")
    with pytest.raises(TypeError, match="device"):
        ds.sampled_batcher(batch_size=4, input_dims=(3, 8, 8), devices="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="pin_memory=True needs CUDA"):
            ds.sampled_batcher(batch_size=4, input_dims=(3, 8, 8), pin_memory=True)
        with pytest.raises(RuntimeError, match="device='cuda' needs CUDA"):
            ds.sampled_batcher(batch_size=4, input_dims=(3, 8, 8), device="cuda")


def test_device_cpu_changes_nothing(folder):
    p = RandomResizedCrop()
    ref = epochs(folder, p, n_epochs=1, workers="thread", num_workers=0)
    got = epochs(folder, p, n_epochs=1, workers="thread", num_workers=0, device="cpu")
    assert torch.equal(ref[0], got[0])


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["thread", "process"])
def test_device_batches_arrive_on_the_gpu_equal_to_host_ones(folder, kind):
    if not _cuda():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False here")
    p = RandomResizedCrop()
    ds = Dataset(str(folder))
    host = epochs(folder, p, workers=kind, num_workers=2)
    b = ds.sampled_batcher(batch_size=5, input_dims=(3, 32, 32), processor=p, workers=kind,
                           num_workers=2, device="cuda")  # fmt: skip
    try:
        for ep in range(2):
            batches = list(b)
            assert all(x.input.is_cuda and x.target.is_cuda for x in batches)
            assert torch.equal(torch.cat([x.input for x in batches]).cpu(), host[ep])
        stats = b.stats
        assert stats["device_batches"] == 2 * math.ceil(12 / 5)
        assert stats["device_wait_s"] >= 0
    finally:
        b.close()


@pytest.mark.cuda
def test_pin_memory_batches_are_pinned(folder):
    if not _cuda():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False here")
    ds = Dataset(str(folder))
    b = ds.sampled_batcher(batch_size=5, input_dims=(3, 32, 32), processor=RandomResizedCrop(),
                           workers="thread", num_workers=0, pin_memory=True)  # fmt: skip
    try:
        assert all(x.input.is_pinned() for x in b)
    finally:
        b.close()
