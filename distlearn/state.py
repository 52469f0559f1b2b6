"""Broadcast a `state_dict` (an optimizer's Adam moments, a scheduler's counters) from
the root (or another node) to every node, even to nodes whose state is still empty.

The structure travels as JSON inside a uint8 tensor and the tensors travel through the
communicator's `scatter`, so nothing received is unpickled or executed.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from .comm import Communicator, check_communicator

__all__ = ["broadcast_state_dict", "gather_bytes", "share_bytes", "synchronize_optimizer"]


def _encode(x: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        dtype = str(x.dtype).removeprefix("torch.")
        return {
            "x": len(tensors) - 1,
            "dtype": dtype,
            "shape": list(x.shape),
            "device": x.device.type,
        }
    if isinstance(x, dict):
        for key in x:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise TypeError(f"state_dict{path}: key {key!r} is not a str or an int")
        return {"d": [[k, _encode(v, tensors, f"{path}[{k!r}]")] for k, v in x.items()]}
    if isinstance(x, list):
        return {"l": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, tuple):
        return {"t": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(x)]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"v": x}
    raise TypeError(
        f"state_dict{path}: cannot broadcast a {type(x).__name__} (tensors, numbers, "
        "strings, None, and lists/tuples/dicts of them can travel)"
    )


def _decode(node: dict, tensors: list[torch.Tensor]) -> Any:
    if "x" in node:
        return tensors[node["x"]]
    if "d" in node:
        return {k: _decode(v, tensors) for k, v in node["d"]}
    if "l" in node:
        return [_decode(v, tensors) for v in node["l"]]
    if "t" in node:
        return tuple(_decode(v, tensors) for v in node["t"])
    return node["v"]


def _allocate(node: Any, out: list[tuple[int, torch.Tensor]], device: torch.device | None) -> None:
    if isinstance(node, dict):
        if "x" in node:
            dev = device or torch.device(node["device"])
            t = torch.empty(node["shape"], dtype=getattr(torch, node["dtype"]), device=dev)
            out.append((node["x"], t))
            return
        for value in node.values():
            _allocate(value, out, device)
    elif isinstance(node, list):
        for value in node:
            _allocate(value, out, device)


def from_node(comm: Communicator, x: torch.Tensor | list[torch.Tensor], src: int) -> None:
    """`src`'s values of `x` on every node, in place: the communicator's scatter from the
    root; from another node, a sum all-reduce to which every other node gives zeros
    (exact: v + 0 == v)."""
    if src == 0:
        comm.scatter(x)
        return
    if comm.node_index != src:
        for t in x if isinstance(x, list) else [x]:
            t.zero_()
    comm.all_reduce(x)


def broadcast_state_dict(
    comm: Communicator,
    state_dict: dict | None,
    device: torch.device | str | None = None,
    src: int = 0,
) -> dict:
    """Node `src`'s `state_dict` on every node (`src` gets its own back).

    The structure travels as JSON in a uint8 tensor, then the tensors, so nodes with
    empty state (a fresh optimizer) receive it whole.

    Args:
        comm: The communicator.
        state_dict: Node `src`'s state; other nodes may pass None or a state of another
            shape, which is ignored.
        device: Where new tensors go; by default where `src`'s tensors are (with NCCL,
            pass a CUDA device: it reduces only CUDA tensors).
        src: The node whose state travels: the root by default. From another node the
            tensors travel in a sum all-reduce (the others give zeros), not a scatter.

    Returns:
        Node `src`'s state, with tensors of this node.

    Raises:
        TypeError: Node `src` passed something other than a dict.
        ValueError: `src` is not a node of the communicator.
    """
    comm = check_communicator(comm)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < comm.num_nodes:
        raise ValueError(f"src must be a node index in [0, {comm.num_nodes}), got {src!r}")
    wire = torch.device(device) if device is not None else torch.device("cpu")
    is_src = comm.node_index == src
    tensors: list[torch.Tensor] = []
    if is_src:
        if not isinstance(state_dict, dict):
            raise TypeError(f"node {src} must pass a dict, got {type(state_dict).__name__}")
        skeleton = json.dumps(_encode(state_dict, tensors, "")).encode()
        length = torch.tensor([len(skeleton)], dtype=torch.int64, device=wire)
    else:
        length = torch.zeros(1, dtype=torch.int64, device=wire)
    from_node(comm, length, src)
    blob = torch.zeros(int(length.item()), dtype=torch.uint8, device=wire)
    if is_src:
        blob.copy_(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8))
    from_node(comm, blob, src)
    tree = json.loads(bytes(blob.cpu().numpy()))
    if is_src:
        if device is not None:
            tensors = [t.to(device) for t in tensors]
        if src != 0:  # the all-reduce writes into them: not into the caller's own state
            tensors = [t.clone() for t in tensors]
    else:
        found: list[tuple[int, torch.Tensor]] = []
        _allocate(tree, found, torch.device(device) if device is not None else None)
        tensors = [t for _, t in sorted(found, key=lambda it: it[0])]
    if tensors:
        from_node(comm, tensors, src)
    return _decode(tree, tensors)


def synchronize_optimizer(comm: Communicator, optimizer: torch.optim.Optimizer) -> None:
    """Load the root's optimizer state (e.g. Adam moments and step counts) on every node.

    Call it after `synchronize_parameters` when resuming from a checkpoint loaded on the
    root only, or to restart replicas from identical optimizer state.

    Args:
        comm: The communicator.
        optimizer: This node's optimizer, over the same parameters as the root's.
    """
    state = broadcast_state_dict(comm, optimizer.state_dict() if comm.node_index == 0 else None)
    if comm.node_index != 0:
        optimizer.load_state_dict(state)


def gather_bytes(comm: Communicator, data: bytes, device: Any = None) -> list[bytes]:
    """Every node's `data`, on every node, in node order: rows of one sum all-reduce (the
    protocol has no gather), after a max all-reduce of the lengths. For small things
    (positions, checksums): W x the longest, in int32s."""
    dev = device or torch.device("cpu")
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    comm.all_reduce(n, op="max")
    rows = torch.zeros(comm.num_nodes, int(n[0]) + 1, dtype=torch.int32, device=dev)
    if data:
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int32)
        rows[comm.node_index, 1 : 1 + len(data)] = mine.to(dev)
    rows[comm.node_index, 0] = len(data)
    comm.all_reduce(rows)
    host = rows.cpu()
    return [bytes(host[r, 1 : 1 + int(host[r, 0])].to(torch.uint8).numpy())
            for r in range(comm.num_nodes)]  # fmt: skip


def share_bytes(comm: Communicator, data: bytes | None, device: Any = None) -> bytes:
    """The root's `data` on every node (the others pass None)."""
    dev = device or torch.device("cpu")
    root = comm.node_index == 0
    n = torch.tensor([len(data) if root else 0], dtype=torch.int64, device=dev)
    comm.scatter(n)
    blob = torch.zeros(int(n[0]), dtype=torch.uint8, device=dev)
    if root and len(data):
        blob.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if len(blob):
        comm.scatter(blob)
    return bytes(blob.cpu().numpy())
