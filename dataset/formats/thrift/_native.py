"""The compiled decoder (``_fast.c``) where it was built, else None.

``decode(buf, compact, schema, numpy, max_depth, max_objects)`` gives what
``_binary.decode`` / ``_compact.decode`` give, and refuses what they refuse
(a ThriftError), in C: no interpreter step per element, and with ``numpy=True``
no Python object per element either (each array is written straight from the
bytes). It is an optional part of the install (setup.py); without a C compiler
the pure-Python decoders decode every record.
"""

from __future__ import annotations

import uuid

import numpy as np

from . import _wire

__all__ = ["decode"]

try:
    from . import _fast
except ImportError:  # pragma: no cover - built by setup.py where a C compiler is at hand
    _fast = None


def _uuid(raw: bytes) -> uuid.UUID:
    return uuid.UUID(bytes=raw)


if _fast is not None:
    # what C leaves to Python: schemas, UTF-8 errors, sets, uuid keys, and making arrays
    _fast.setup(
        _wire.ThriftError,
        _wire.field_schema,
        _wire.element_schema,
        _wire.finish_list,
        _wire.as_string,
        _wire.make_map,
        _uuid,
        np.empty,
        dict(_wire.NUMPY_DTYPE),
    )
    decode = _fast.decode
else:  # pragma: no cover
    decode = None
