"""Every dataset.thrift test runs on both decoders: the compiled one and the pure-Python one.

    from thrift_decoders import decoder  # noqa: F401 (an autouse fixture)

The C decoder (``_fast.c``) is an optional part of the install; where it was not
built its runs skip, saying so, and the Python ones still run.
"""

from __future__ import annotations

import pytest

from distlearn.dataset.formats.thrift import _native


@pytest.fixture(autouse=True, params=["C", "Python"])
def decoder(request, monkeypatch):
    """Which decoder ``decode`` uses in this test: "C" or "Python"."""
    if request.param == "C" and _native.decode is None:
        pytest.skip("the C decoder (dataset/formats/thrift/_fast.c) is not built")
    if request.param == "Python":
        monkeypatch.setattr(_native, "decode", None)
    return request.param
