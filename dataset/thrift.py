"""Thrift records without generated code: decode any struct, encode given a schema.

    from distlearn.dataset.thrift import decode, encode

    value = decode(data, protocol="compact")      # {1: b"...", 2: b"a cat", 3: [640, 480]}
    data = encode({1: b"...", 3: [640, 480]}, {1: "binary", 2: "string", 3: ("list", "i32")})

Records are nested Python values keyed by field id: structs are dicts, lists
and sets are lists (sets become ``set`` when a schema says so), maps are
dicts, strings and binaries are ``bytes`` (the wire cannot tell them apart;
a schema's ``"string"`` makes them ``str``). Fields a schema does not know
are kept as they were read, so records from a newer writer lose nothing.
Built on the ``thrift`` package's protocol classes (``pip install thrift``).

A schema is a type: ``"bool" "byte" "i8" "i16" "i32" "i64" "double"
"string" "binary" "uuid"``, ``("list", T)``, ``("set", T)``, ``("map", K, V)``
or a struct ``{field_id: T}``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

try:
    from thrift.protocol.TBinaryProtocol import TBinaryProtocol
    from thrift.protocol.TCompactProtocol import TCompactProtocol
    from thrift.Thrift import TType
    from thrift.transport.TTransport import TMemoryBuffer
except ImportError as _err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dataset.thrift needs the `thrift` package: pip install 'distlearn[thrift]'"
    ) from _err

__all__ = ["MEDIA_SCHEMA", "MediaRecord", "ThriftError", "decode", "encode"]

Schema = Any  # str | tuple | Mapping[int, Schema]

_SCALARS = {
    "bool": TType.BOOL,
    "byte": TType.BYTE,
    "i8": TType.BYTE,
    "i16": TType.I16,
    "i32": TType.I32,
    "i64": TType.I64,
    "double": TType.DOUBLE,
    "string": TType.STRING,
    "binary": TType.STRING,
    "uuid": TType.UUID,
}
_INT_RANGE = {
    TType.BYTE: 1 << 7,
    TType.I16: 1 << 15,
    TType.I32: 1 << 31,
    TType.I64: 1 << 63,
}


class ThriftError(ValueError):
    """A record that is not valid Thrift, or a value that does not fit its schema."""


def _protocol(name: str, trans: TMemoryBuffer, limit: int):
    if name == "binary":
        return TBinaryProtocol(trans, string_length_limit=limit, container_length_limit=limit)
    if name == "compact":
        return TCompactProtocol(trans, string_length_limit=limit, container_length_limit=limit)
    raise ValueError(f"protocol must be 'binary' or 'compact', got {name!r}")


# ---------------------------------------------------------------- decode


def decode(
    data: bytes | bytearray | memoryview,
    protocol: str = "binary",
    schema: Mapping[int, Schema] | None = None,
) -> dict[int, Any]:
    """Decode one Thrift struct from ``data`` into a dict keyed by field id.

    ``schema`` is optional; it only turns ``"string"`` fields into ``str`` and
    ``("set", T)`` fields into ``set``. Raises :class:`ThriftError` on bad input.
    """
    data = bytes(data)
    trans = TMemoryBuffer(data)
    # No string or container in a valid record is longer than the record itself:
    # the limit stops a corrupt length from allocating gigabytes.
    proto = _protocol(protocol, trans, max(len(data), 1))
    try:
        return _read_struct(proto, schema)
    except ThriftError:
        raise
    except Exception as err:  # EOFError, TProtocolException, struct.error, ...
        raise ThriftError(
            f"not a valid {protocol} Thrift struct ({len(data)} bytes): {err!r}"
        ) from err


def _read_struct(proto, schema: Mapping[int, Schema] | None) -> dict[int, Any]:
    out: dict[int, Any] = {}
    proto.readStructBegin()
    while True:
        _name, ttype, fid = proto.readFieldBegin()
        if ttype == TType.STOP:
            break
        sub = schema.get(fid) if schema is not None else None
        if sub is not None and _ttype(sub) != ttype:
            sub = None  # the writer's type wins; keep the value as read
        out[fid] = _read_value(proto, ttype, sub)
        proto.readFieldEnd()
    proto.readStructEnd()
    return out


def _read_value(proto, ttype: int, schema: Schema | None) -> Any:
    if ttype == TType.STRING:
        raw = proto.readBinary()
        if schema == "string":
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ThriftError(f"a 'string' field is not UTF-8: {err}") from None
        return raw
    if ttype == TType.I32:
        return proto.readI32()
    if ttype == TType.I64:
        return proto.readI64()
    if ttype == TType.BOOL:
        return proto.readBool()
    if ttype == TType.BYTE:
        return proto.readByte()
    if ttype == TType.I16:
        return proto.readI16()
    if ttype == TType.DOUBLE:
        return proto.readDouble()
    if ttype == TType.STRUCT:
        return _read_struct(proto, schema if isinstance(schema, Mapping) else None)
    if ttype == TType.LIST or ttype == TType.SET:
        is_set = ttype == TType.SET
        etype, size = proto.readSetBegin() if is_set else proto.readListBegin()
        esub = _elem(schema, etype, 1)
        items = [_read_value(proto, etype, esub) for _ in range(size)]
        proto.readSetEnd() if is_set else proto.readListEnd()
        if is_set and isinstance(schema, tuple) and schema[0] == "set":
            return set(items)
        return items
    if ttype == TType.MAP:
        ktype, vtype, size = proto.readMapBegin()
        ksub, vsub = _elem(schema, ktype, 1), _elem(schema, vtype, 2)
        pairs = [
            (_read_value(proto, ktype, ksub), _read_value(proto, vtype, vsub)) for _ in range(size)
        ]
        proto.readMapEnd()
        try:
            return dict(pairs)
        except TypeError:  # struct or list keys cannot be dict keys
            return pairs
    if ttype == TType.UUID:
        return proto.readUuid()
    raise ThriftError(f"unknown Thrift type id {ttype}")


def _elem(schema: Schema | None, wire_type: int, pos: int) -> Schema | None:
    """The element schema at ``pos`` of a container schema, if it matches the wire."""
    if isinstance(schema, tuple) and len(schema) > pos:
        sub = schema[pos]
        if _ttype(sub) == wire_type:
            return sub
    return None


def _ttype(schema: Schema) -> int:
    if isinstance(schema, str):
        try:
            return _SCALARS[schema]
        except KeyError:
            raise ValueError(f"unknown Thrift type {schema!r}; one of {sorted(_SCALARS)}") from None
    if isinstance(schema, Mapping):
        return TType.STRUCT
    if isinstance(schema, tuple) and schema:
        kind = {"list": TType.LIST, "set": TType.SET, "map": TType.MAP}.get(schema[0])
        arity = 3 if schema[0] == "map" else 2
        if kind is not None and len(schema) == arity:
            return kind
    raise ValueError(
        f"bad Thrift schema {schema!r}: a type name, ('list', T), ('set', T), "
        "('map', K, V) or a struct {field_id: T}"
    )


# ---------------------------------------------------------------- encode


def encode(
    value: Mapping[int, Any], schema: Mapping[int, Schema], protocol: str = "binary"
) -> bytes:
    """Encode a struct (dict keyed by field id) given its ``schema``.

    Fields absent from ``value`` (or None) are left out, as optional fields
    are; a field the schema does not name raises :class:`ThriftError`.
    """
    if not isinstance(schema, Mapping):
        raise ValueError(f"encode() needs a struct schema {{field_id: type}}, got {schema!r}")
    trans = TMemoryBuffer()
    proto = _protocol(protocol, trans, 1 << 31)
    _write_struct(proto, value, schema, "struct")
    return trans.getvalue()


def _write_struct(proto, value: Any, schema: Mapping[int, Schema], where: str) -> None:
    if not isinstance(value, Mapping):
        raise ThriftError(
            f"{where}: expected a dict of field id to value, got {type(value).__name__}"
        )
    unknown = set(value) - set(schema)
    if unknown:
        raise ThriftError(f"{where}: fields {sorted(unknown)} are not in the schema")
    proto.writeStructBegin("")
    for fid in sorted(schema):
        v = value.get(fid)
        if v is None:
            continue
        sub = schema[fid]
        proto.writeFieldBegin("", _ttype(sub), fid)
        _write_value(proto, v, sub, f"{where}.{fid}")
        proto.writeFieldEnd()
    proto.writeFieldStop()
    proto.writeStructEnd()


def _write_value(proto, v: Any, schema: Schema, where: str) -> None:
    ttype = _ttype(schema)
    if ttype in _INT_RANGE:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ThriftError(f"{where}: expected an int for {schema}, got {type(v).__name__}")
        bound = _INT_RANGE[ttype]
        if not -bound <= v < bound:
            raise ThriftError(f"{where}: {v} does not fit in {schema}")
        {
            TType.BYTE: proto.writeByte,
            TType.I16: proto.writeI16,
            TType.I32: proto.writeI32,
            TType.I64: proto.writeI64,
        }[ttype](v)
    elif ttype == TType.STRING:
        if isinstance(v, str):
            v = v.encode("utf-8")
        if not isinstance(v, (bytes, bytearray, memoryview)):
            raise ThriftError(f"{where}: expected str or bytes, got {type(v).__name__}")
        proto.writeBinary(bytes(v))
    elif ttype == TType.BOOL:
        if not isinstance(v, bool):
            raise ThriftError(f"{where}: expected a bool, got {type(v).__name__}")
        proto.writeBool(v)
    elif ttype == TType.DOUBLE:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ThriftError(f"{where}: expected a float, got {type(v).__name__}")
        proto.writeDouble(float(v))
    elif ttype == TType.UUID:
        proto.writeUuid(v if isinstance(v, uuid.UUID) else uuid.UUID(str(v)))
    elif ttype == TType.STRUCT:
        _write_struct(proto, v, schema, where)
    elif ttype in (TType.LIST, TType.SET):
        items = list(v)
        et = _ttype(schema[1])
        if ttype == TType.SET:
            proto.writeSetBegin(et, len(items))
        else:
            proto.writeListBegin(et, len(items))
        for i, item in enumerate(items):
            _write_value(proto, item, schema[1], f"{where}[{i}]")
        proto.writeSetEnd() if ttype == TType.SET else proto.writeListEnd()
    elif ttype == TType.MAP:
        items = list(v.items()) if isinstance(v, Mapping) else list(v)
        proto.writeMapBegin(_ttype(schema[1]), _ttype(schema[2]), len(items))
        for k, item in items:
            _write_value(proto, k, schema[1], f"{where}[key]")
            _write_value(proto, item, schema[2], f"{where}[{k!r}]")
        proto.writeMapEnd()


# ---------------------------------------------------------------- media records

MEDIA_SCHEMA: dict[int, Schema] = {1: "binary", 2: "string", 3: ("list", "i32")}
"""A media record: 1: binary image, 2: optional string caption, 3: optional list<i32> resolution."""


class MediaRecord:
    """Processor for Thrift media records: the image goes into the batch slot.

    ``processor(fetched, opt, out) -> (True, {"caption": str | None,
    "resolution": list[int] | None})``. The image (PNG, JPEG, ... anything
    Pillow reads) is decoded by :class:`dataset.processors.Image`, which
    ``image_opts`` configure (``mode``, ``size``, ``mean``, ``std``).
    """

    def __init__(self, protocol: str = "binary", **image_opts: Any):
        from .processors import Image

        self.protocol = protocol
        self.image = Image(**image_opts)

    def __call__(self, fetched: bytes, opt: Any, out) -> tuple[bool, dict[str, Any]]:
        rec = decode(fetched, self.protocol, MEDIA_SCHEMA)
        image = rec.get(1)
        if not isinstance(image, bytes):
            raise ThriftError("media record has no binary image in field 1")
        ret = self.image(image, opt, out)
        ok = ret[0] if isinstance(ret, tuple) else ret
        return ok is not False, {"caption": rec.get(2), "resolution": rec.get(3)}
