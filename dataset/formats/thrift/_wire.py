"""What both protocols share: type ids, the error, limits and the schema's type names.

Type ids here are the binary protocol's (``TType``); the compact protocol maps
its own ids onto them. A schema is a type: a name from ``TYPE_NAMES``,
``("list", T)``, ``("set", T)``, ``("map", K, V)`` or a struct ``{field_id: T}``.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import DatasetError

__all__ = [
    "INTEGERS",
    "MAX_DEPTH",
    "MAX_OBJECTS",
    "NAME_OF",
    "NUMPY_DTYPE",
    "SHARED_HASH_LIMIT",
    "TYPE_NAMES",
    "Schema",
    "ThriftError",
    "as_string",
    "element_schema",
    "field_schema",
    "finish_list",
    "make_map",
    "over_budget",
    "too_deep",
    "truncated",
    "wire_type",
]

Schema = Any  # str | tuple | Mapping[int, Schema]

STOP, BOOL, BYTE, DOUBLE, I16, I32, I64, STRING, STRUCT, MAP, SET, LIST, UUID = (
    0, 2, 3, 4, 6, 8, 10, 11, 12, 13, 14, 15, 16,
)  # fmt: skip

TYPE_NAMES = {
    "bool": BOOL,
    "byte": BYTE,
    "i8": BYTE,
    "i16": I16,
    "i32": I32,
    "i64": I64,
    "double": DOUBLE,
    "string": STRING,
    "binary": STRING,
    "uuid": UUID,
}
NAME_OF = {
    BOOL: "bool", BYTE: "byte", I16: "i16", I32: "i32", I64: "i64", DOUBLE: "double",
    STRING: "binary", STRUCT: "struct", MAP: "map", SET: "set", LIST: "list", UUID: "uuid",
}  # fmt: skip
INTEGERS = {BYTE: 1 << 7, I16: 1 << 15, I32: 1 << 31, I64: 1 << 63}  # bound of abs value

# Numeric element types: what `numpy=True` returns them as (native byte order).
NUMPY_DTYPE = {
    BOOL: np.dtype(np.bool_),
    BYTE: np.dtype(np.int8),
    I16: np.dtype(np.int16),
    I32: np.dtype(np.int32),
    I64: np.dtype(np.int64),
    DOUBLE: np.dtype(np.float64),
}

MAX_DEPTH = 64
"""Structs and containers nested deeper than this are refused (a crafted record
could otherwise recurse until Python's stack gives out)."""


MAX_OBJECTS = 1_000_000
"""The most objects one record may decode into (``decode(max_objects=)``): the record's
own dict, and each struct field, list or set element, map key and map value are one;
a container that ``numpy=True`` returns as an array is two, as a (keys, values) pair
of arrays four, however long. Each is charged before it is made, so a count that
would exceed the budget is refused before anything is allocated.

What that bounds: an object costs at most about 150 bytes (measured, in both
decoders: 148 for the costliest shape, a list of structs of one field holding an
empty struct; 72 for an empty struct in a list), and arrays at most 8 bytes per byte
of the record (a one-byte varint as an int64), so a record of B bytes decodes into
at most about ``150 * min(max_objects, B) + 8 * B`` bytes (the pure-Python compact
decoder takes up to 48 bytes per byte of varints more while it decodes them), and
in time linear in the same. Without the budget, a 16 MiB list of empty structs took
72x its size (1.2 GB) and 9 s; it is now refused at its count."""

SHARED_HASH_LIMIT = 16
"""Most distinct uuids in one map's keys or one set that may share a hash: uuid.UUID hashes
as its int does (mod 2**61 - 1), so a record could hold uuids crafted to share one,
and building a dict of n of them would take n**2 / 2 comparisons in Python (8,000:
5 s). Random uuids share a hash with a chance of about n**2 / 2**62."""


class ThriftError(DatasetError, ValueError):
    """A record that is not valid Thrift, or a value that does not fit its schema."""


def truncated(pos: int, what: str) -> ThriftError:
    return ThriftError(f"truncated: {what} at offset {pos} runs past the end")


def too_deep(pos: int) -> ThriftError:
    return ThriftError(f"nesting too deep at offset {pos} (limit max_depth)")


def over_budget(max_objects: int, pos: int) -> ThriftError:
    return ThriftError(f"more than {max_objects} objects by offset {pos} (limit max_objects)")


def wire_type(schema: Schema) -> int:
    """The type id a schema stands for; ValueError naming the valid forms if it is none."""
    if isinstance(schema, str):
        try:
            return TYPE_NAMES[schema]
        except KeyError:
            raise ValueError(
                f"unknown Thrift type {schema!r}; one of {sorted(TYPE_NAMES)}"
            ) from None
    if isinstance(schema, Mapping):
        return STRUCT
    if isinstance(schema, tuple) and schema:
        kind = {"list": LIST, "set": SET, "map": MAP}.get(schema[0])
        arity = 3 if schema[0] == "map" else 2
        if kind is not None and len(schema) == arity:
            return kind
    raise ValueError(
        f"bad Thrift schema {schema!r}: a type name, ('list', T), ('set', T), "
        "('map', K, V) or a struct {field_id: T}"
    )


def element_schema(schema: Schema | None, wire: int, pos: int) -> Schema | None:
    """The schema of a container's element at ``pos`` (1: element or key, 2: value),
    or None when the schema does not say or disagrees with the wire (the writer wins)."""
    if isinstance(schema, tuple) and len(schema) > pos:
        sub = schema[pos]
        if wire_type(sub) == wire:
            return sub
    return None


def field_schema(schema: Mapping[int, Schema] | None, fid: int, wire: int) -> Schema | None:
    """The schema of struct field ``fid`` if it agrees with the wire type, else None."""
    if schema is None:
        return None
    sub = schema.get(fid)
    if sub is not None and wire_type(sub) == wire:
        return sub
    return None


def as_string(raw: bytes, pos: int) -> str:
    """A ``"string"`` field's bytes as text; ThriftError naming the offset if not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ThriftError(f"a 'string' at offset {pos} is not UTF-8: {err}") from None


def _refuse_hash_flood(items: list, pos: int) -> None:
    """ThriftError if more than SHARED_HASH_LIMIT distinct uuids in ``items`` share a hash."""
    if len(items) <= SHARED_HASH_LIMIT or not isinstance(items[0], uuid.UUID):
        return
    distinct = {u.bytes: u for u in items}  # bytes hash with a per-process key: no flood
    shared = max(Counter(hash(u) for u in distinct.values()).values())
    if shared > SHARED_HASH_LIMIT:
        raise ThriftError(
            f"{len(items)} uuids at offset {pos}, {shared} of them on one hash "
            f"(limit {SHARED_HASH_LIMIT}): crafted to make building a dict take quadratic time"
        )


def finish_list(items: Any, schema: Schema | None, pos: int) -> Any:
    """A decoded list (its elements start at ``pos``): a ``set`` when the schema says
    ``("set", T)``."""
    if isinstance(schema, tuple) and schema[0] == "set" and not isinstance(items, np.ndarray):
        _refuse_hash_flood(items, pos)
        try:
            return set(items)
        except TypeError:  # elements that cannot be hashed (structs, lists) stay a list
            return items
    return items


def make_map(keys: list, values: list, pos: int) -> dict | list:
    """A decoded map (its entries start at ``pos``): a dict, or a list of (key, value) pairs
    when keys cannot be hashed."""
    _refuse_hash_flood(keys, pos)
    try:
        return dict(zip(keys, values, strict=False))
    except TypeError:  # struct, list or array keys
        return list(zip(keys, values, strict=False))
