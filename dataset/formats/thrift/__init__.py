"""Thrift records without generated code: decode any struct, encode given a schema.

    from distlearn.dataset.thrift import decode, encode

    value = decode(data, protocol="compact")      # {1: b"...", 2: b"a cat", 3: [640, 480]}
    data = encode({1: b"...", 3: [640, 480]}, {1: "binary", 2: "string", 3: ("list", "i32")})
    rec = decode(data, numpy=True)                 # numeric containers as arrays

Records are nested Python values keyed by field id: structs are dicts, lists
and sets are lists (sets become ``set`` when a schema says so), maps are
dicts, strings and binaries are ``bytes`` (the wire cannot tell them apart;
a schema's ``"string"`` makes them ``str``). Fields a schema does not know
are kept as they were read, so records from a newer writer lose nothing.
With ``numpy=True`` a list or set of numbers is a 1-D array (int8, int16,
int32, int64, float64 or bool) and a map from numbers to numbers is a
``(keys, values)`` pair of arrays (an empty map in the compact protocol carries
no types, so it stays ``{}``); ``encode`` takes both forms back.

No generated code: ``_binary`` and ``_compact`` hold the two decoders in Python
and numpy, ``_fast.c`` both in C (an optional part of the install, used where it
was built: :func:`built`; the same results, and a ThriftError for every record
either refuses), ``_encode`` the encoder,
``_records`` the ready processors (:class:`MediaRecord`, :class:`FeatureRecord`).

Every record is bounded by what it holds: counts and lengths are checked against
the bytes that remain before anything is allocated, nesting stops at
``max_depth``, and a record decodes into at most ``max_objects`` objects (see
:data:`MAX_OBJECTS`), so into at most about ``150 * max_objects + 8 * len(data)``
bytes, in time linear in the same; past it, a ThriftError naming the limit.

A schema is a type: ``"bool" "byte" "i8" "i16" "i32" "i64" "double"
"string" "binary" "uuid"``, ``("list", T)``, ``("set", T)``, ``("map", K, V)``
or a struct ``{field_id: T}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import _binary, _compact, _encode, _native
from ._records import FEATURE_FIELDS, MEDIA_SCHEMA, FeatureRecord, MediaRecord
from ._wire import MAX_DEPTH, MAX_OBJECTS, Schema, ThriftError

__all__ = [
    "FEATURE_FIELDS",
    "MAX_DEPTH",
    "MAX_OBJECTS",
    "MEDIA_SCHEMA",
    "FeatureRecord",
    "MediaRecord",
    "ThriftError",
    "built",
    "decode",
    "encode",
]

_DECODERS = {"binary": _binary.decode, "compact": _compact.decode}


def built() -> bool:
    """Whether the C decoder was built (else the pure-Python decoders decode, alike)."""
    return _native.decode is not None


def _check_protocol(protocol: str) -> None:
    if protocol not in _DECODERS:
        raise ValueError(f"protocol must be 'binary' or 'compact', got {protocol!r}")


def decode(
    data: bytes | bytearray | memoryview,
    protocol: str = "binary",
    schema: Mapping[int, Schema] | None = None,
    *,
    numpy: bool = False,
    max_depth: int = MAX_DEPTH,
    max_objects: int = MAX_OBJECTS,
) -> dict[int, Any]:
    """Decode one Thrift struct from ``data`` into a dict keyed by field id.

    Args:
        data: The whole struct, nothing after it.
        protocol: `"binary"` or `"compact"`.
        schema: Optional: it only turns `"string"` fields into `str` and
            `("set", T)` fields into `set`.
        numpy: Return numeric lists and sets as arrays, and maps of numbers as
            `(keys, values)` pairs of arrays.
        max_depth: The deepest nesting accepted.
        max_objects: The most objects (struct fields, list elements, map keys and
            values) one record may decode into (see `MAX_OBJECTS`).

    Returns:
        The struct: nested values keyed by field id.

    Raises:
        ThriftError: Bad input, naming the offset; a record nested deeper than
            `max_depth` or decoding into more than `max_objects` objects.
        ValueError: An unknown protocol, a schema that is not a struct, or a bad
            `max_depth`.
    """
    dec = _DECODERS.get(protocol)
    if dec is None:
        _check_protocol(protocol)
    if schema is not None and not isinstance(schema, Mapping):
        raise ValueError(f"decode() takes a struct schema {{field_id: type}}, got {schema!r}")
    if not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth must be a positive int, got {max_depth!r}")
    if not isinstance(max_objects, int) or max_objects < 1:
        raise ValueError(f"max_objects must be a positive int, got {max_objects!r}")
    if type(data) is not bytes:
        data = bytes(data)
    native = _native.decode
    try:
        if native is not None:
            return native(data, protocol == "compact", schema, bool(numpy), max_depth, max_objects)
        return dec(data, schema, bool(numpy), max_depth, max_objects)
    except ThriftError as err:
        why = str(err)
    except RecursionError:  # a max_depth raised past what the interpreter's stack takes
        why = f"nested deeper than Python's recursion limit allows (max_depth={max_depth})"
    # raised here, not in the except clause: the error must not hold the decoder's frames
    # (as its __context__), and with them what it had made before the fault
    raise ThriftError(f"not a valid {protocol} Thrift struct ({len(data)} bytes): {why}")


def encode(
    value: Mapping[int, Any], schema: Mapping[int, Schema], protocol: str = "binary"
) -> bytes:
    """Encode a struct (dict keyed by field id) given its ``schema``.

    Fields absent from ``value`` (or None) are left out, as optional fields
    are. The bytes are those Thrift's generated classes write.

    Args:
        value: The struct, keyed by field id.
        schema: Its fields' types, `{field_id: type}`.
        protocol: `"binary"` or `"compact"`.

    Returns:
        The encoded bytes.

    Raises:
        ThriftError: A field the schema does not name, or a value that does not fit
            its type.
        ValueError: An unknown protocol.
    """
    _check_protocol(protocol)
    return _encode.encode(value, schema, protocol)
