"""`from_env()`: the rendezvous handler a launcher's environment variables describe.

torchrun's (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or Slurm's
variables, mapped to one of the two handlers: all ranks on one host use `Localhost`
with a key unique to the launch, several hosts `Static` (the secret from $IPC_TOKEN or
$IPC_TOKEN_FILE); no launcher, a one-node `Localhost` (a single process).
"""

from __future__ import annotations

import logging
import os

from distlearn.common import launchers
from distlearn.common.envvars import env_int, env_str
from distlearn.common.net import is_loopback

from ..errors import IPCError
from .exchange import KEY_ENV
from .localhost import Localhost
from .static import Static

__all__ = ["PORT_ENV", "from_env"]

# Node 0's rendezvous port across hosts, where the default (beside torchrun's store,
# or from the Slurm job id) does not suit.
PORT_ENV = "IPC_PORT"

log = logging.getLogger(__name__)


def from_env(
    *, token: str | None = None, token_file: str | None = None, insecure: bool = False
) -> Localhost | Static:
    """The handler for a job started by torchrun (or anything that sets RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) or by Slurm's srun (SLURM_PROCID, SLURM_NTASKS, ...), as
    :func:`distlearn.common.launchers.detect` reads them (a LaunchError, a ValueError,
    for half a launch).

    All ranks on one host (torchrun's LOCAL_WORLD_SIZE == WORLD_SIZE, a loopback
    MASTER_ADDR, or one Slurm node): `Localhost`, keyed by the launch (torchrun's
    store port and run id, or Slurm's job and step), so nothing listens on TCP and the
    secret is random unless $IPC_TOKEN is set. Across hosts: `Static` with node 0 at
    MASTER_ADDR:$IPC_PORT (default MASTER_PORT + 1, as torchrun's store holds
    MASTER_PORT; under Slurm without MASTER_ADDR, the first host of the node list and a
    port from the job id), and the secret from $IPC_TOKEN or $IPC_TOKEN_FILE. No launcher
    at all (plain `python`): a one-node `Localhost`, logged at INFO."""
    try:
        launch = launchers.detect()
    except launchers.LaunchError as err:
        raise launchers.LaunchError(f"Tree.from_env: {err}") from None
    if launch is None:
        # `python train.py`: no launcher. One node, collectives are identities, nothing
        # listens on TCP (a one-node Localhost binds only its Unix socket).
        log.info(
            "Tree.from_env: no RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS "
            "(an srun step): running as a single process (rank 0 of 1)"
        )
        return Localhost(0, 1, key=f"single:{os.getpid()}", token=token, token_file=token_file)
    rank, world = launch.rank, launch.world
    root = launch.root or "127.0.0.1"
    port = env_int(PORT_ENV, low=1, high=65535)
    if launch.launcher == "slurm":
        local = bool(launch.one_host)
        if port is None:  # a port every task of the job computes alike
            port = 20000 + env_int("SLURM_JOB_ID", 0, low=0) % 20000
        nodes = env_str("SLURM_STEP_NUM_NODES", "unset")
        where = f"SLURM_PROCID={rank}, SLURM_NTASKS={world}, SLURM_STEP_NUM_NODES={nodes}"
    else:
        local = launch.one_host if launch.one_host is not None else is_loopback(root)
        if port is None:  # next to torchrun's store, which holds MASTER_PORT
            master = env_int("MASTER_PORT", low=1, high=65534)
            if master is None:
                raise IPCError(
                    "Tree.from_env: set MASTER_PORT (or IPC_PORT) with RANK and WORLD_SIZE"
                )
            port = master + 1
        lws = env_str("LOCAL_WORLD_SIZE", "unset")
        where = f"RANK={rank}, WORLD_SIZE={world}, LOCAL_WORLD_SIZE={lws}"
    if local:
        key = env_str(KEY_ENV) or launch.key
        return Localhost(rank, world, key=key, token=token, token_file=token_file)
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
