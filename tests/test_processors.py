"""Processors: images (PNG/JPEG, modes, resize, normalisation), raw bytes, JSON."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from distlearn.dataset.processors import Image, Json, Raw, default_processor


def encode(arr: np.ndarray, fmt: str = "PNG", mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(arr, mode).save(buf, format=fmt)
    return buf.getvalue()


def test_png_grey_to_unit_range():
    arr = np.arange(64, dtype=np.uint8).reshape(8, 8) * 4
    out = torch.empty(1, 8, 8)
    assert Image(mode="L")(encode(arr), None, out) is True
    assert torch.allclose(out[0], torch.from_numpy(arr).float() / 255)


def test_rgb_channels_first_and_mode_from_dims():
    arr = np.zeros((4, 6, 3), dtype=np.uint8)
    arr[..., 0], arr[..., 1], arr[..., 2] = 255, 128, 0
    out = torch.empty(3, 4, 6)
    Image()(encode(arr), None, out)  # mode inferred: 3 channels -> RGB
    assert out[0].eq(1).all() and out[2].eq(0).all()
    assert torch.allclose(out[1], torch.full((4, 6), 128 / 255))
    grey = torch.empty(1, 4, 6)
    Image()(encode(arr), None, grey)  # RGB file into a 1-channel row: converted to L
    assert grey.shape == (1, 4, 6)


def test_jpeg_resize_and_normalise():
    arr = np.full((64, 48, 3), 200, dtype=np.uint8)
    out = torch.empty(3, 16, 12)
    Image(size=(16, 12), mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])(
        encode(arr, "JPEG"), None, out
    )
    assert torch.allclose(out, torch.full_like(out, (200 / 255 - 0.5) / 0.25), atol=0.05)


def test_size_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"input_dims \(1, 4, 4\).*Image\(size=\(4, 4\)\)"):
        Image()(encode(np.zeros((8, 8), np.uint8)), None, torch.empty(1, 4, 4))
    with pytest.raises(OSError):  # Pillow: cannot identify image file
        Image()(b"not an image", None, torch.empty(1, 4, 4))


def test_raw_and_json():
    out = torch.empty(2, 2)
    assert Raw(scale=0.5)(bytes([2, 4, 6, 8]), None, out)
    assert out.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    Raw(dtype="<f4")(np.arange(4, dtype="<f4").tobytes(), None, out)
    assert out.view(-1).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="3 uint8 values, input_dims needs 4"):
        Raw()(b"abc", None, out)
    doc = {"v": [1, 2, 3, 4], "name": "x"}
    ok, extra = Json(field="v")(json.dumps(doc).encode(), None, out)
    assert ok and extra == doc and out.view(-1).tolist() == [1, 2, 3, 4]
    ok, extra = Json()(b'{"a": "text"}', None, out)
    assert ok and extra == {"a": "text"} and out.eq(0).all()


def test_default_processor():
    out = torch.empty(2, 2)
    default_processor(torch.arange(4.0), None, out)
    assert out.tolist() == [[0, 1], [2, 3]]
    img = torch.empty(1, 2, 2)
    default_processor(encode(np.full((2, 2), 255, np.uint8)), None, img)
    assert img.eq(1).all()
    with pytest.raises(TypeError, match="default processor"):
        default_processor([b"a", b"b"], None, out)


@pytest.mark.parametrize(
    "image, dims, hint",
    [
        (np.zeros((8, 8, 3), np.uint8), (1, 8, 8), r"3 channels, input_dims \(1, 8, 8\) has 1: "
         r"pass Image\(mode='L'\)"),
        (np.zeros((8, 8, 3), np.uint8), (1, 4, 4), r"pass Image\(mode='L', size=\(4, 4\)\)"),
        (np.zeros((28, 28), np.uint8), (784,), r"flat input_dims \(784,\): give "
         r"input_dims=\(1, 28, 28\)"),
        (np.zeros((6, 8), np.uint8), (1, 8, 6), r"is 6x8 \(HxW\), input_dims \(1, 8, 6\) "
         r"wants 8x6: pass Image\(size=\(8, 6\)\)"),
        (np.zeros((8, 8, 3), np.uint8), (8, 8), r"input_dims \(8, 8\): pass Image\(mode='L'\) "
         r"for one channel, or input_dims=\(C, H, W\) such as \(3, 8, 8\)"),
    ],
)  # fmt: skip
def test_mismatch_hint_names_the_dimension_that_differs(image, dims, hint):
    mode = "RGB" if image.ndim == 3 else "L"
    with pytest.raises(ValueError, match=hint):
        Image(mode=mode)(encode(image), None, torch.empty(dims))


def test_max_image_pixels_is_an_error_not_a_warning(monkeypatch):
    import warnings

    from PIL import Image as PILImage

    data = encode(np.zeros((40, 40), np.uint8))
    with pytest.raises(PILImage.DecompressionBombError, match="1600 pixels exceeds the limit"):
        Image(max_pixels=1000)(data, None, torch.empty(1, 40, 40))
    # Pillow only warns between MAX_IMAGE_PIXELS and twice that: we refuse
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
        with pytest.raises(PILImage.DecompressionBombError, match="limit of 1000"):
            Image()(data, None, torch.empty(1, 40, 40))
        assert Image(max_pixels=0)(data, None, torch.empty(1, 40, 40))  # 0: no limit of ours


def test_16_bit_grey_keeps_its_depth():
    """PIL's convert("L") clips 16-bit values at 255: a 0..63000 ramp came out as
    0, 1, 1, 1, ... with no error."""
    arr = np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000
    out = torch.empty(1, 8, 8)
    assert Image(mode="L")(encode(arr), None, out) is True
    torch.testing.assert_close(out[0], torch.from_numpy(arr.astype(np.float32)) / 65535)
    small = torch.empty(1, 4, 4)
    Image(size=4)(encode(arr), None, small)  # resized in float, not clipped first
    assert 0.3 < float(small.max()) < 1.0
    with pytest.raises(ValueError, match=r"16-bit grey image .* cannot become mode RGB"):
        Image()(encode(arr), None, torch.empty(3, 8, 8))


# ------------------------------------------- a processor that writes the wrong shape


class _Resizes:
    """Writes through a torch op's out=, which resizes out rather than failing."""

    def __call__(self, data, opt, out):
        torch.add(torch.zeros(3, 224, 224), 1, out=out)


class _Copies:
    def __call__(self, data, opt, out):
        out.copy_(torch.zeros(3, 224, 224))


class _Assigns:
    def __call__(self, data, opt, out):
        out[:] = torch.zeros(3, 224, 224)


class _NumpyCopies:
    def __call__(self, data, opt, out):
        np.copyto(out.numpy(), np.zeros((3, 224, 224), np.float32))


WROTE = "out is [1, 28, 28] (input_dims) but the processor wrote"


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("workers", ["thread", "process"])
@pytest.mark.parametrize(
    ("processor", "error", "wrote"),
    [
        (_Resizes(), (ValueError, RuntimeError), "[3, 224, 224]"),
        (_Copies(), RuntimeError, "a tensor whose dimension 2 is 224"),
        (_Assigns(), RuntimeError, "[3, 224, 224]"),
        (_NumpyCopies(), ValueError, "[3, 224, 224]"),
    ],
)
def test_a_processor_writing_the_wrong_shape_is_told_what_out_is(processor, error, wrote, workers):
    """The first batch raises (every item failed alike), saying what out is and what was
    written, whether the processor's write failed or silently resized out."""
    from distlearn.dataset import Dataset

    ds = Dataset(torch.zeros(8, 784))
    b = ds.sampled_batcher(batch_size=4, input_dims=(1, 28, 28), processor=processor,
                           workers=workers, num_workers=1)  # fmt: skip
    with b, pytest.raises(error) as info:
        b.next_batch()
    said = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
    if isinstance(processor, _Resizes) and workers == "process":  # out is in shared memory
        wrote = "a larger tensor through a torch op's out=, which resizes out"
    assert f"{WROTE} {wrote}" in said, said


def test_shape_notes_only_for_shape_errors():
    from distlearn.dataset.workers.fill import shape_note

    assert shape_note(KeyError("Tensor sizes: [3]"), (1, 28, 28)) is None
    assert shape_note(ValueError("cannot identify image file"), (1, 28, 28)) is None
    same = RuntimeError("... Target sizes: [1, 28, 28].  Tensor sizes: [1, 28, 28]")
    assert shape_note(same, (1, 28, 28)) is None
