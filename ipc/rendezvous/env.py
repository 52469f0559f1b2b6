"""`from_env()`: the rendezvous handler a launcher's environment variables describe.

torchrun's (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or Slurm's
variables, mapped to one of the two handlers: all ranks on one host use `Localhost`
with a key unique to the launch, several hosts `Static` (the secret from $IPC_TOKEN or
$IPC_TOKEN_FILE); no launcher, a one-node `Localhost` (a single process).
"""

from __future__ import annotations

import logging
import os
import re

from ..errors import IPCError
from .exchange import KEY_ENV
from .localhost import Localhost
from .static import Static, is_loopback

__all__ = ["from_env"]

log = logging.getLogger(__name__)


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as `gpu[03-05,07],cpu1`."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_NODELIST {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def from_env(
    *, token: str | None = None, token_file: str | None = None, insecure: bool = False
) -> Localhost | Static:
    """The handler for a job started by torchrun (or anything that sets RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) or by Slurm (SLURM_PROCID, SLURM_NTASKS, ...).

    All ranks on one host (torchrun's LOCAL_WORLD_SIZE == WORLD_SIZE, a loopback
    MASTER_ADDR, or one Slurm node): `Localhost`, keyed by the launch (torchrun's
    store port and run id, or Slurm's job and step), so nothing listens on TCP and the
    secret is random unless $IPC_TOKEN is set. Across hosts: `Static` with node 0 at
    MASTER_ADDR:$IPC_PORT (default MASTER_PORT + 1, as torchrun's store holds
    MASTER_PORT; under Slurm without MASTER_ADDR, the first host of the node list and a
    port from the job id), and the secret from $IPC_TOKEN or $IPC_TOKEN_FILE. No launcher
    at all (plain `python`): a one-node `Localhost`, logged at INFO."""
    env = os.environ

    def num(name: str) -> int:
        try:
            return int(env[name])
        except ValueError:
            raise IPCError(f"Tree.from_env: ${name}={env[name]!r} is not an integer") from None

    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = num("RANK"), num("WORLD_SIZE")
        root = env.get("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env and "IPC_PORT" not in env:
            raise IPCError("Tree.from_env: set MASTER_PORT (or IPC_PORT) with RANK and WORLD_SIZE")
        port = num("IPC_PORT") if "IPC_PORT" in env else num("MASTER_PORT") + 1
        local = num("LOCAL_WORLD_SIZE") == world if "LOCAL_WORLD_SIZE" in env else is_loopback(root)
        key = ":".join(
            [
                "torchrun",
                root,
                env.get("MASTER_PORT", ""),
                env.get("TORCHELASTIC_RUN_ID", ""),
                env.get("TORCHELASTIC_RESTART_COUNT", ""),
            ]
        )
        lws = env.get("LOCAL_WORLD_SIZE", "unset")
        where = f"RANK={rank}, WORLD_SIZE={world}, LOCAL_WORLD_SIZE={lws}"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = num("SLURM_PROCID"), num("SLURM_NTASKS")
        nodes = (
            env.get("SLURM_STEP_NUM_NODES")
            or env.get("SLURM_JOB_NUM_NODES")
            or env.get("SLURM_NNODES")
        )
        local = nodes == "1"
        root = env.get("MASTER_ADDR") or _first_slurm_host(
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "localhost"
        )
        job = env.get("SLURM_JOB_ID", "0")
        port = num("IPC_PORT") if "IPC_PORT" in env else 20000 + int(job) % 20000
        key = f"slurm:{job}:{env.get('SLURM_STEP_ID', '')}"
        where = f"the Slurm job's {nodes or '?'} nodes"
    elif launched := [v for v in ("RANK", "WORLD_SIZE", "SLURM_PROCID") if v in env]:
        # Half a launcher's variables is a broken launch, not a single process: running
        # alone would silently train on 1/N of the job.
        raise IPCError(
            f"Tree.from_env: ${launched[0]} is set but not the rest: set RANK and WORLD_SIZE "
            "(torchrun) or run under Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_NODELIST)"
        )
    else:
        # `python train.py`: no launcher. One node, collectives are identities, nothing
        # listens on TCP (a one-node Localhost binds only its Unix socket).
        log.info(
            "Tree.from_env: no RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS "
            "(Slurm): running as a single process (rank 0 of 1)"
        )
        return Localhost(0, 1, key=f"single:{os.getpid()}", token=token, token_file=token_file)
    if local:
        return Localhost(
            rank, world, key=env.get(KEY_ENV) or key, token=token, token_file=token_file
        )
    return Static(
        rank,
        world,
        root,
        port,
        token=token,
        token_file=token_file,
        insecure=insecure,
        what=f"the ranks run on more than one host ({where})",
    )
