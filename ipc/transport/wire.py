"""What travels on a link: message kinds, headers, and the codec for nested values.

A message is a list of ZeroMQ frames. The first frame is the header, whose
first byte is the message kind: control messages carry a small JSON object
after it, data messages a fixed binary struct. Any further frames are raw
payload bytes (tensor memory), never interpreted as anything but numbers.

Every parse here is total: junk, wrong types, oversized or deeply nested
input raise `WireError` (a ValueError), never anything else, so a caller can
refuse a stranger's message and go on. Nothing received is unpickled or
executed, and dtype names from the wire go through an allow-list.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from enum import IntEnum

import torch

__all__ = [
    "DTYPES",
    "MAX_CONTROL",
    "MAX_FRAMES",
    "VERSION",
    "Kind",
    "WireError",
    "control",
    "data_header",
    "decode",
    "dtype_from_name",
    "encode",
    "hex_of",
    "kind_of",
    "pack_value",
    "parse_control",
    "parse_data",
    "small_int",
    "unpack_value",
]

# The layout of what travels (kinds, headers, value descriptions): bumped when one
# changes. Endpoints exchange it in their authenticated handshake info and refuse a
# peer of another version, naming both (a host left on an older distlearn), rather
# than misreading its messages.
VERSION = 1

# Control messages are small; a larger one is refused before it is parsed.
MAX_CONTROL = 16 << 10
MAX_DEPTH = 32  # nesting of JSON values and of encoded structures
MAX_FRAMES = 4096  # payload frames in one message


class Kind(IntEnum):
    """First byte of every header. Below 16: the link layer's own; 16 and up: its users'."""

    HELLO = 1  # dialer -> listener: name, nonce, info
    CHALLENGE = 2  # listener -> dialer: nonce, proof that it knows the secret
    AUTH = 3  # dialer -> listener: proof that it knows the secret
    WELCOME = 4  # listener -> dialer: accepted, with the listener's info
    REFUSED = 5  # either way: reason
    BYE = 6  # leaving; the peer acknowledges once everything sent before it was read
    ACK = 7  # acknowledges a BYE
    PROBE = 8  # liveness probe: ignored by the receiver
    # the tree
    UP = 16  # a chunk reduced over a subtree, to the parent
    DOWN = 17  # a chunk of the result, to a child
    ERROR = 18  # a node left a collective through an exception
    PROGRESS = 19  # which collective a subtree has reached (the stall inspector)
    JOIN = 20  # rendezvous: a node's addresses and options, to the root
    ROSTER = 21  # rendezvous: everyone's addresses, from the root
    # free for users of the link layer (client/server, queues): a JSON header and payload
    MESSAGE = 32


LINK_KINDS = frozenset(k for k in Kind if k < 16)


class WireError(ValueError):
    """A message that does not parse; says what is wrong with it."""


def control(kind: Kind, body: Mapping) -> bytes:
    """Header frame of a control message. One over MAX_CONTROL is refused here, where the
    sender can be told, rather than by every receiver (which drops the link)."""
    header = bytes([kind]) + json.dumps(body, separators=(",", ":")).encode()
    if len(header) > MAX_CONTROL:
        raise WireError(
            f"a message described in {len(header)} bytes of JSON (limit {MAX_CONTROL}): "
            f"too many values in one message (send fewer, larger tensors)"
        )
    return header


def kind_of(header: bytes | memoryview) -> int:
    if len(header) == 0:
        raise WireError("empty header")
    return header[0]


def _depth_ok(value: object) -> bool:
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > MAX_DEPTH:
            return False
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return True


def parse_control(header: bytes, fields: Mapping[str, object] | None = None) -> dict:
    """The JSON object of a control header; `fields` maps required keys to a type, a
    tuple of types, or a callable that returns True for valid values."""
    if len(header) > MAX_CONTROL:
        raise WireError(f"control message of {len(header)} bytes (limit {MAX_CONTROL})")
    try:
        body = json.loads(bytes(header[1:]).decode("utf-8"))
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise WireError(f"not JSON: {type(err).__name__}") from None
    if not isinstance(body, dict):
        raise WireError(f"expected a JSON object, got {type(body).__name__}")
    if not _depth_ok(body):
        raise WireError(f"nested deeper than {MAX_DEPTH}")
    for key, want in (fields or {}).items():
        if key not in body:
            raise WireError(f"no {key!r}")
        v = body[key]
        if isinstance(want, (type, tuple)):
            # bool is an int in Python, never what an int field means
            ok = isinstance(v, want) and not (isinstance(v, bool) and want is int)
        else:
            ok = bool(want(v))  # type: ignore[operator]
        if not ok:
            raise WireError(f"bad {key!r}: {str(v)[:40]!r}")
    return body


def hex_of(nbytes: int):
    """Validator for a lowercase hex string of exactly `nbytes` bytes."""
    digits = set("0123456789abcdef")

    def check(v: object) -> bool:
        return isinstance(v, str) and len(v) == 2 * nbytes and set(v) <= digits

    return check


def small_int(lo: int = 0, hi: int = 2**31 - 1):
    def check(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

    return check


# ---- data messages (the tree's chunks) -------------------------------------

# kind, collective sequence number, chunk index, contributing nodes, signature of the layout
DATA = struct.Struct("<BIII8s")


def data_header(kind: Kind, seq: int, chunk: int, count: int, sig: bytes) -> bytes:
    return DATA.pack(kind, seq, chunk, count, sig)


def parse_data(header: bytes) -> tuple[int, int, int, int, bytes]:
    if len(header) != DATA.size:
        raise WireError(f"data header of {len(header)} bytes, not {DATA.size}")
    return DATA.unpack(header)


# ---- nested values: tensors, containers and scalars ------------------------

# Every dtype a tensor may have on the wire, by name; nothing else is ever looked up.
DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


def dtype_from_name(name: object) -> torch.dtype:
    """The torch dtype called `name` on the wire; WireError for anything not allowed."""
    if not isinstance(name, str) or name not in DTYPES:
        raise WireError(f"dtype {str(name)[:40]!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def encode(obj: object, max_frame: int = 1 << 20) -> tuple[dict, list]:
    """(JSON-able description, payload buffers) of a tensor or nested list/tuple/dict of
    tensors, str, int, float, bool, None and bytes. CPU tensors are sent from their own
    memory (made contiguous if needed); CUDA tensors are copied to the host first. A
    tensor larger than `max_frame` bytes is cut into several frames (a link refuses
    frames above its `Limits.max_frame`)."""
    frames: list = []

    def walk(v: object, depth: int) -> object:
        if depth > MAX_DEPTH:
            raise WireError(f"nested deeper than {MAX_DEPTH}")
        if isinstance(v, torch.Tensor):
            if v.dtype not in DTYPE_NAMES:
                raise WireError(f"cannot send dtype {v.dtype}")
            # (a lazy conjugate or negation, x.conj(): its bytes are not its values)
            t = v.detach().resolve_conj().resolve_neg()
            if t.device.type != "cpu":
                t = t.to("cpu")
            t = t.contiguous()
            raw = t.view(-1).view(torch.uint8).numpy() if t.numel() else b""
            first = len(frames)
            for start in range(0, max(len(raw), 1), max_frame):
                frames.append(raw[start : start + max_frame])
            return {
                "t": [first, len(frames) - first],
                "dtype": DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
            }
        if isinstance(v, bytes):
            frames.append(v)
            return {"b": len(frames) - 1}
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"f": repr(v)}
        if isinstance(v, list):
            return [walk(x, depth + 1) for x in v]
        if isinstance(v, tuple):
            return {"u": [walk(x, depth + 1) for x in v]}
        if isinstance(v, dict):
            items = []
            for k, x in v.items():
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise WireError(f"dict key {k!r}: only str, int, float, bool, None")
                items.append([walk(k, depth + 1), walk(x, depth + 1)])
            return {"d": items}
        raise WireError(f"cannot send a {type(v).__name__}")

    desc = walk(obj, 0)
    if len(frames) > MAX_FRAMES:
        raise WireError(f"{len(frames)} tensors and bytes in one message (limit {MAX_FRAMES})")
    return {"v": desc}, frames


def _copy_into(dst: torch.Tensor, parts: list[memoryview]) -> None:
    """The frames of one tensor, end to end, into `dst` (of the same size), each copied
    once to its place. A contiguous CPU tensor takes plain memcpys: torch's copy_ wakes
    its thread pool, which costs several times more on a loaded host."""
    if dst.device.type == "cpu" and dst.is_contiguous():
        raw = memoryview(dst.view(-1).view(torch.uint8).numpy())
        at = 0
        for p in parts:
            raw[at : at + len(p)] = p
            at += len(p)
    else:
        buf = parts[0] if len(parts) == 1 else memoryview(bytearray().join(parts))
        src = torch.frombuffer(buf, dtype=torch.uint8).view(dst.dtype).view(dst.shape)
        dst.copy_(src)


def decode(meta: Mapping, frames: list, into: object = None) -> object:
    """The value `encode` described. Tensors are new (or, where `into` has a tensor at
    the same place, written into it: same shape and dtype required)."""
    used: set[int] = set()

    def frame(i: object) -> memoryview:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(frames):
            raise WireError(f"payload index {i!r} out of range")
        if i in used:
            raise WireError(f"payload {i} used twice")
        used.add(i)
        f = frames[i]
        return memoryview(f.buffer if hasattr(f, "buffer") else f)

    def walk(d: object, dst: object, path: str, depth: int) -> object:
        if depth > MAX_DEPTH:
            raise WireError(f"{path}: nested deeper than {MAX_DEPTH}")
        if d is None or isinstance(d, (bool, int, float, str)):
            return d
        if isinstance(d, list):
            sub = dst if isinstance(dst, list) and len(dst) == len(d) else [None] * len(d)
            pairs = enumerate(zip(d, sub, strict=True))
            return [walk(x, s, f"{path}[{k}]", depth + 1) for k, (x, s) in pairs]
        if not isinstance(d, dict) or len(d) == 0:
            raise WireError(f"{path}: unexpected {type(d).__name__}")
        if "t" in d:
            dtype = dtype_from_name(d.get("dtype"))
            shape = d.get("shape")
            if not isinstance(shape, list) or len(shape) > 32:
                raise WireError(f"{path}: bad shape")
            # (torch's sizes are int64: [0, 2**64] is empty, and no tensor torch can make)
            if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**63
                       for s in shape):  # fmt: skip
                raise WireError(f"{path}: bad shape {str(shape)[:80]}")
            span = d["t"]
            if (
                not (
                    isinstance(span, list)
                    and len(span) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in span)
                )
                or not 0 < span[1] <= MAX_FRAMES
            ):
                raise WireError(f"{path}: bad payload span {str(span)[:40]}")
            parts = [frame(span[0] + k) for k in range(span[1])]
            nbytes = sum(len(p) for p in parts)
            numel = math.prod(shape)
            itemsize = torch.empty(0, dtype=dtype).element_size()
            if numel * itemsize != nbytes:
                raise WireError(
                    f"{path}: {nbytes} bytes for {dtype} of shape {shape} "
                    f"({numel * itemsize} expected)"
                )
            if isinstance(dst, torch.Tensor):
                if dst.dtype != dtype or list(dst.shape) != shape:
                    raise WireError(
                        f"{path}: received {dtype} {shape}, `into` has {dst.dtype} "
                        f"{list(dst.shape)}"
                    )
                if numel:
                    _copy_into(dst.detach(), parts)
                return dst
            out = torch.empty(shape, dtype=dtype)
            if numel:
                _copy_into(out, parts)
            return out
        if "b" in d:
            return bytes(frame(d["b"]))
        if "f" in d:
            if d["f"] not in ("nan", "inf", "-inf"):
                raise WireError(f"{path}: bad float {str(d['f'])[:20]!r}")
            return float(d["f"])
        if "u" in d and isinstance(d["u"], list):
            items = d["u"]
            sub = dst if isinstance(dst, tuple) and len(dst) == len(items) else [None] * len(items)
            pairs = enumerate(zip(items, sub, strict=True))
            return tuple(walk(x, s, f"{path}[{k}]", depth + 1) for k, (x, s) in pairs)
        if "d" in d and isinstance(d["d"], list):
            out_d = {}
            for item in d["d"]:
                if not isinstance(item, list) or len(item) != 2:
                    raise WireError(f"{path}: bad dict item")
                k = walk(item[0], None, path, depth + 1)
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise WireError(f"{path}: bad dict key")
                sub = dst.get(k) if isinstance(dst, dict) else None
                out_d[k] = walk(item[1], sub, f"{path}[{k!r}]", depth + 1)
            return out_d
        raise WireError(f"{path}: unknown value {str(d)[:40]!r}")

    if not isinstance(meta, Mapping) or "v" not in meta:
        raise WireError("no value")
    if len(frames) > MAX_FRAMES:
        raise WireError(f"{len(frames)} payload frames (limit {MAX_FRAMES})")
    value = walk(meta["v"], into, "value", 0)
    if len(used) != len(frames):
        raise WireError(f"{len(frames) - len(used)} payload frames not described")
    return value


def pack_value(obj: object, kind: Kind = Kind.MESSAGE) -> list:
    """The frames of a message carrying `obj`: a header (kind and the JSON description),
    then the payloads. For `Link.send_frames`."""
    meta, frames = encode(obj)
    return [control(kind, meta), *frames]


def unpack_value(frames: list, into: object = None) -> object:
    """The value a message of `pack_value` carries (frames as received: bytes or
    zmq.Frame); tensors land in `into`'s tensors where it has them."""
    if not frames:
        raise WireError("no frames")
    first = frames[0]
    header = first.bytes if hasattr(first, "bytes") else bytes(first)
    return decode(parse_control(header), list(frames[1:]), into=into)
