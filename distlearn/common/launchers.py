"""Which launcher started this process, and its place in the job: one reading of the
launchers' variables for ``Dataset(partition="auto")`` and ``ipc.Tree.from_env()``.

The launchers, in the order they are asked:

- ``torchrun`` (and anything that sets ``RANK`` and ``WORLD_SIZE`` by hand, a "static"
  launch): rank ``RANK`` of ``WORLD_SIZE``; ``LOCAL_WORLD_SIZE`` says whether every
  rank runs on this host, ``MASTER_ADDR``/``MASTER_PORT`` where node 0 is. First,
  since torchrun inside a Slurm step sets its own ranks over Slurm's.
- Slurm: rank ``SLURM_PROCID`` of ``SLURM_NTASKS``, but only inside a job step that
  ``srun`` started (``SLURM_STEP_ID`` is set). A batch script's own shell and an
  ``salloc`` shell see ``SLURM_PROCID=0`` and the ``SLURM_NTASKS`` of the whole
  allocation without being one of its tasks (Slurm 22.05, checked): taken as a rank,
  a batch script's ``python train.py`` waited for peers that never come, or read one
  partition of N. There it is no launch: a single process.

Half a launcher's variables (``WORLD_SIZE`` without ``RANK``, ``SLURM_PROCID``
without ``SLURM_NTASKS`` in a step), values that are not integers and a rank outside
``[0, world)`` are a :class:`LaunchError`: a broken launch, never a single process
(which would train on 1/N of the job, or read the same partition on every rank).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .envvars import EnvError, env_int, env_str

__all__ = ["LAUNCHERS", "Launch", "LaunchError", "detect", "first_slurm_host"]

# Asked in this order (see the module's text).
LAUNCHERS = ("torchrun", "slurm")


class LaunchError(ValueError):
    """The launcher's variables describe no launch that can run: half of them, values
    that are not integers, a rank outside the world. The message names the variables."""


@dataclass(frozen=True)
class Launch:
    """What a launcher's variables say of this process.

    Attributes:
        launcher: ``"torchrun"`` (``TORCHELASTIC_RUN_ID`` is set), ``"static"``
            (``RANK``/``WORLD_SIZE`` without it) or ``"slurm"``.
        rank: This process's rank, in ``[0, world)``.
        world: How many processes the launch started.
        variables: The two variables that said so (``"RANK/WORLD_SIZE"``), for messages.
        one_host: Every rank runs on this host (torchrun's ``LOCAL_WORLD_SIZE`` equals
            ``WORLD_SIZE``, Slurm's step has one node); None where the launcher does not
            say (``RANK``/``WORLD_SIZE`` without ``LOCAL_WORLD_SIZE``).
        root: Node 0's host: ``MASTER_ADDR``, else (Slurm) the first host of the step's
            node list; None where neither is set.
        key: What tells this launch from another one on the same host (torchrun's
            store address, run id and restart; Slurm's job and step).
    """

    launcher: str
    rank: int
    world: int
    variables: str
    one_host: bool | None
    root: str | None
    key: str


def detect(
    env: Mapping[str, str] | None = None, launchers: tuple[str, ...] = LAUNCHERS
) -> Launch | None:
    """The launch this process is part of, or None when no launcher started it.

    Args:
        env: The environment to read (default ``os.environ``).
        launchers: Which of :data:`LAUNCHERS` count, asked in that order.

    Returns:
        The first launcher's :class:`Launch` whose variables are set, or None.

    Raises:
        LaunchError: Half a launcher's variables, values that are not integers, or a
            rank outside ``[0, world)``.
    """
    env = os.environ if env is None else env
    for name in launchers:
        found = _READERS[name](env)
        if found is not None:
            return found
    return None


def _torchrun(env: Mapping[str, str]) -> Launch | None:
    rank, world = _pair(env, "RANK", "WORLD_SIZE")
    if rank is None:
        return None
    local = _int(env, "LOCAL_WORLD_SIZE", low=1)
    port = env_str("MASTER_PORT", "", env=env)
    run_id = env_str("TORCHELASTIC_RUN_ID", "", env=env)
    root = env_str("MASTER_ADDR", env=env)
    restarts = env_str("TORCHELASTIC_RESTART_COUNT", "", env=env)
    return Launch(
        launcher="torchrun" if run_id else "static",
        rank=rank,
        world=world,
        variables="RANK/WORLD_SIZE",
        one_host=None if local is None else local == world,
        root=root,
        key=":".join(["torchrun", root or "127.0.0.1", port, run_id, restarts]),
    )


def _slurm(env: Mapping[str, str]) -> Launch | None:
    if env_str("SLURM_STEP_ID", env=env) is None:  # a batch script or salloc shell
        return None
    rank, world = _pair(env, "SLURM_PROCID", "SLURM_NTASKS")
    if rank is None:
        return None
    nodes = None
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        nodes = _int(env, name, low=1)
        if nodes is not None:
            break
    nodelist = env_str("SLURM_STEP_NODELIST", env=env) or env_str("SLURM_NODELIST", env=env)
    job, step = env_str("SLURM_JOB_ID", "0", env=env), env_str("SLURM_STEP_ID", env=env)
    return Launch(
        launcher="slurm",
        rank=rank,
        world=world,
        variables="SLURM_PROCID/SLURM_NTASKS",
        one_host=None if nodes is None else nodes == 1,
        root=env_str("MASTER_ADDR", env=env) or (first_slurm_host(nodelist) if nodelist else None),
        key=f"slurm:{job}:{step}",
    )


_READERS = {"torchrun": _torchrun, "slurm": _slurm}


def _pair(env: Mapping[str, str], rank_var: str, world_var: str):
    """(rank, world) from the two variables; (None, None) where neither is set."""
    have = [v for v in (rank_var, world_var) if env_str(v, env=env) is not None]
    if not have:
        return None, None
    if len(have) == 1:
        missing = world_var if have[0] == rank_var else rank_var
        raise LaunchError(
            f"${have[0]} is set without ${missing}: set both, or neither (torchrun sets "
            "RANK and WORLD_SIZE, srun SLURM_PROCID and SLURM_NTASKS); as it is, every "
            "process would take itself for the whole job"
        )
    rank, world = _int(env, rank_var, low=0), _int(env, world_var, low=1)
    if rank >= world:
        raise LaunchError(f"${rank_var}={rank} is not in [0, ${world_var}={world})")
    return rank, world


def _int(env: Mapping[str, str], name: str, low: int) -> int | None:
    try:
        return env_int(name, low=low, env=env)
    except EnvError as err:
        raise LaunchError(str(err)) from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm node list.

    Args:
        nodelist: Slurm's compressed list, such as ``gpu[03-05,07],cpu1``.

    Returns:
        Its first host (``gpu03``).

    Raises:
        LaunchError: The list is not one.
    """
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise LaunchError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]
