"""What tells the processes of one launch from those of another, without a key.

Processes that one parent (a shell script, a Python driver) starts side by side meet
under a key derived from the parent's pid (see `ipc.rendezvous.Localhost`). The same
parent may run several launches, so node 0 admits a process only if it looks like one of
its own: started within LAUNCH_WINDOW_S of node 0, with the same command line up to its
node index (`same_command_line`), and, when the parent runs more processes like these
than the launch has nodes (`twin_launch`: two launches of one script at once, a sweep
told apart by environment variables), with the same environment and working directory:
equal, but for the variables that name the node (RANK=0 and RANK=2) and those that a
launcher or the devices set per process (`environment_digests`, `environment_differs`).
Two launches that differ in nothing else are not told apart, nor is a twin launch whose
processes start only after this one's rendezvous has taken one of them.

Linux's /proc (see ipc.procs); elsewhere no siblings are found, which only turns the
twin-launch check off.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterable

from ..procs import _cmdline, _stat

__all__ = [
    "LAUNCH_WINDOW_S",
    "environment_differs",
    "environment_digests",
    "same_command_line",
    "twin_launch",
]

# Processes of one launch by a shell or a Python parent start within this many seconds
# of each other; a node 0 that started further away belongs to another launch.
LAUNCH_WINDOW_S = 30.0

# Variables left out of the environments compared: a launcher's own in each process
# (Slurm's, MPI's, torchrun's), the devices a node sees (CUDA_VISIBLE_DEVICES=0 and =1, or
# =0,1 and =2,3: which hardware, not what is computed), and `_`, which a shell sets to
# the command's path or last argument.
_LEFT_OUT = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "HYDRA_", "I_MPI_", "MV2_", "TORCHELASTIC_")
_DEVICES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
            "NVIDIA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ZE_AFFINITY_MASK", "_")  # fmt: skip
# Variables that name the node: compared with its index blanked (RANK=0 and RANK=2).
# Every other variable must be equal: blanking the index everywhere would also blank
# what tells two launches apart (JOB=0 for node 0 of one, JOB=1 for node 1 of the other).
_NODE_ENV = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "NODE_RANK"})
_NAMED_MAX = 800  # variables named one by one in a JOIN (6 hex each); past that, a count


# ---- command lines ------------------------------------------------------------------


def _blank(text: str, index: int) -> str:
    """`text` with the number `index` blanked where it stands whole ("w-1.log", not "10")."""
    return re.sub(rf"(?<!\d){index}(?!\d)", "#", text)


def same_command_line(root: list[str], other: list[str], index: int) -> bool:
    """True when two command lines differ only where each names its own node index.

    `w.py 0 4 out` and `w.py 2 4 out` are one launch; `w.py 0 4 outA` and
    `w.py 1 4 outB` are two. Only positions that differ are compared, after
    the node's own index (as a whole number) is blanked in each."""
    if len(root) != len(other):
        return False
    return all(a == b or _blank(a, 0) == _blank(b, index) for a, b in zip(root, other, strict=True))


def _shape(argv: list[str]) -> list[str]:
    """A command line with every number blanked: what the nodes of one launch share."""
    return [re.sub(r"\d+", "#", a) for a in argv]


def twin_launch(start: int, hz: int, num_nodes: int) -> bool:
    """Whether this process's parent runs more processes with a command line like this
    one's (numbers aside), started within LAUNCH_WINDOW_S of `start`, than a launch of
    `num_nodes` has: another launch of it beside this one.

    One look at every process's /proc entry (about 2 ms for 65 processes)."""
    mine = _cmdline("self")
    if mine is None:
        return False
    ppid, shape, count = os.getppid(), _shape(mine), 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        stat = _stat(pid)
        if stat is None or stat[1] != ppid or abs(stat[2] - start) / hz > LAUNCH_WINDOW_S:
            continue
        argv = _cmdline(pid)
        count += argv is not None and _shape(argv) == shape
    return count > num_nodes


# ---- environments -------------------------------------------------------------------


def _environment() -> dict[str, str]:
    """This process's environment and working directory, as a launch's nodes share them
    (less what is left out, see _LEFT_OUT)."""
    env = {k: v for k, v in os.environ.items() if k not in _DEVICES and not k.startswith(_LEFT_OUT)}
    with contextlib.suppress(OSError):  # (a directory removed under us)
        env["(cwd)"] = os.getcwd()
    return env


def _hash(items: Iterable[str], size: int) -> str:
    h = hashlib.blake2b(digest_size=size)
    for item in sorted(items):
        h.update(item.encode(errors="replace") + b"\0")
    return h.hexdigest()


def _split(env: dict[str, str], index: int) -> tuple[list[str], list[str]]:
    """NAME=value of the variables compared as they are, and of those that name the node,
    with its index blanked."""
    same = [f"{k}={v}" for k, v in env.items() if k not in _NODE_ENV]
    node = [f"{k}={_blank(v, index)}" for k, v in env.items() if k in _NODE_ENV]
    return same, node


def environment_digests(index: int) -> dict[str, str]:
    """What a joiner tells node 0 of its environment (see `environment_differs`): a
    digest of the variables that must be equal, one of those that name the node (with
    its index blanked), and, to name what differs, 6 hex of each variable (up to
    _NAMED_MAX of them; a JOIN stays under its 16 KiB)."""
    same, node = _split(_environment(), index)
    named = "".join(_hash([v], 3) for v in same) if len(same) <= _NAMED_MAX else ""
    return {"same": _hash(same, 16), "node": _hash(node, 16), "named": named, "count": len(same)}


def environment_differs(theirs: object) -> str | None:
    """Why a joiner's environment (its `environment_digests`) is not node 0's (this
    process's), or None: every variable must be equal but those that name the node
    (equal up to the node index) and those left out (a launcher's, the devices')."""
    if not (
        isinstance(theirs, dict)
        and all(isinstance(theirs.get(k), str) for k in ("same", "node", "named"))
        and isinstance(theirs.get("count"), int)
        and re.fullmatch(r"[0-9a-f]*", theirs["named"])
        and len(theirs["named"]) % 6 == 0
    ):
        return "it sent no environment"
    env = _environment()
    same, node = _split(env, 0)
    if theirs["same"] == _hash(same, 16):
        if theirs["node"] == _hash(node, 16):
            return None
        names = ", ".join(sorted(_NODE_ENV & set(env))) or "a variable that names the node"
        return f"its environment differs from node 0's in {names} (beyond the node index)"
    named = {theirs["named"][i : i + 6] for i in range(0, len(theirs["named"]), 6)}
    if not named and theirs["count"] > _NAMED_MAX:
        return f"its environment ({theirs['count']} variables) differs from node 0's"
    differ = sorted(v.split("=", 1)[0] for v in same if _hash([v], 3) not in named)
    extra = theirs["count"] - (len(same) - len(differ))
    what = ", ".join(differ[:5]) + (" ..." if len(differ) > 5 else "")
    if extra > len(differ):
        what += f"{' and ' if differ else ''}{extra - len(differ)} variable(s) node 0 has not"
    return f"its environment differs from node 0's in {what or 'a variable'}"
