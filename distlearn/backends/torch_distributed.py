"""The communicator protocol over an initialised `torch.distributed` process group."""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import socket

import torch
import torch.distributed as dist

from ..common.envvars import env_int
from ._flat import FlatCommunicator

log = logging.getLogger(__name__)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_MiB = 1 << 20


def _machine_id() -> int:
    """This machine as an int64: its kernel's boot id (shared by every container on
    it, which reach each other at memory speed too), else its host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            name = f.read().strip()
    except OSError:
        name = socket.gethostname().encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little", signed=True)


def _check_timeout(timeout: object) -> datetime.timedelta:
    """A positive number of seconds or timedelta, as a timedelta (what torch takes)."""
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        seconds = None
    if seconds is None or not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}"
        )
    return datetime.timedelta(seconds=seconds)


def _cores() -> int:
    """The cores this process may run on (its affinity, as taskset or a cgroup set it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _from_slurm(env) -> None:
    """Under `srun` without torchrun's variables: set them from Slurm's (see from_env)."""
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return
    from ..common.launchers import first_slurm_host

    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or "1"
    if "MASTER_ADDR" not in env:
        hosts = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "localhost"
        env["MASTER_ADDR"] = "127.0.0.1" if nodes == "1" else first_slurm_host(hosts)
    if "MASTER_PORT" not in env:
        env["MASTER_PORT"] = str(30000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)


def _warn_shared_store(env) -> None:
    """A worker torchrun restarted, with the agent's store shared (torch's default): its
    init_process_group may read the key of the worker it replaces and dial a dead
    address (pytorch#135712; gloo: "connectFullMesh failed ... Connection refused")."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get(
        "TORCHELASTIC_RESTART_COUNT", "0"
    ) not in ("", "0"):
        log.warning(
            "TorchDistributed.from_env: a restarted torchrun worker on the agent's shared "
            "store; if init_process_group fails to connect, launch torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch#135712)"
        )


class TorchDistributed(FlatCommunicator):
    """`torch.distributed` (gloo for CPU tensors, NCCL for CUDA tensors) as a communicator.

    Tensors are packed into one flat buffer per (device, dtype), so a model's many
    parameters cost one collective per dtype; the contributor count rides in the first
    buffer. `all_reduce(..., async_op=True)` returns a handle at once (torch's
    `async_op=True` underneath). `group` defaults to the world group. Node 0 is the
    group's rank 0.

    `gather_bytes`: when every node is on one machine and the nodes outnumber half its
    cores (a node in a collective keeps two threads busy, its caller and gloo's), an
    all-reduce of a CPU buffer whose copies from the other nodes come to at most this
    many bytes (size x (nodes - 1)) is reduced at node 0 instead: gather, sum,
    broadcast. That is two steps where the process group's ring takes 2 x (nodes - 1),
    and where the nodes take turns on the cores each step waits for one: within the
    bound gloo's ring took 1.3-6.7x as long on 2-8 processes on 2 cores
    (bench/RESULTS-gloo-root.md). With a core for each thread the ring's steps are
    cheap and it wins: the root took 1.05-2.7x as long on 2 and 4 processes on 16
    cores. It runs in the calling thread, so it does not overlap with the caller even
    with `async_op=True`. Between machines the ring stays: there node 0's link, which
    carries (nodes - 1) x size each way where the ring sends 2 x size from each node,
    is what costs. Whether the root applies (one machine, and its cores: the fewest
    any node may run on) is asked once, in the first all-reduce of a CPU buffer, which
    also checks that every node was given the same `gather_bytes` (ValueError on every
    node if not). `0` turns it off.

    Args:
        group: The process group; None for the default (world) group.
        gather_bytes: The most bytes (size x (nodes - 1)) an all-reduce of a CPU buffer
            may hold to be reduced at node 0 on one crowded machine; 0: never.

    Raises:
        RuntimeError: No process group is initialised (see `from_env`).
        ValueError: `gather_bytes` is not an int >= 0, or (at the first all-reduce of
            a CPU buffer) differs between nodes.
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, gather_bytes: int = 1 * _MiB
    ) -> None:
        super().__init__()
        if isinstance(gather_bytes, bool) or not isinstance(gather_bytes, int) or gather_bytes < 0:
            raise ValueError(f"gather_bytes must be an int >= 0, got {gather_bytes!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistributed needs an initialised process group: call "
                "torch.distributed.init_process_group(...) first, or use "
                "TorchDistributed.from_env()"
            )
        self.group = group
        self.node_index = dist.get_rank(group)
        self.num_nodes = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0) if group is not None else 0
        self._owns_group = False
        # What the asynchronous all-reduce calls the process group with (see below).
        self._pg = group if group is not None else dist.group.WORLD
        self._async_opts = {}
        for name, op in _REDUCE_OPS.items():
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            opts.asyncOp = True
            self._async_opts[name] = opts
        self.gather_bytes = gather_bytes
        self._root_path: bool | None = None  # asked on first need (see _agree)

    @classmethod
    def from_env(
        cls,
        backend: str | None = None,
        *,
        timeout: float | datetime.timedelta | None = None,
        **options,
    ) -> TorchDistributed:
        """Initialise the default process group from torchrun's environment
        (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or Slurm's (under `srun`: the task's
        SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; the first host of the step's node
        list, or 127.0.0.1 on one node, at port 30000 + the job id mod 20000, unless
        MASTER_ADDR/MASTER_PORT say otherwise) and wrap it; `close()` destroys it.

        `backend` defaults to NCCL when CUDA is available, else gloo. `timeout` (seconds,
        or a timedelta) is how long a collective waits for the other nodes before it
        raises; torch's default is 30 minutes for gloo and 10 for NCCL. A peer that died
        is noticed at once (its connection closes), but one that stopped (SIGSTOP, a
        debugger, a machine swapping) is waited for that long.

        Args:
            backend: `"nccl"` or `"gloo"`; None: NCCL when CUDA is available, else gloo.
            timeout: Seconds, or a timedelta, a collective waits for the other nodes.
            **options (Any): For the constructor (`gather_bytes`).

        Returns:
            A TorchDistributed over the new default group; `close()` destroys the group.

        Raises:
            RuntimeError: RANK, WORLD_SIZE, MASTER_ADDR or MASTER_PORT is not set.
            ValueError: `timeout` is not a positive number of seconds or a timedelta.
        """
        kwargs = {} if timeout is None else {"timeout": _check_timeout(timeout)}
        _from_slurm(os.environ)
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise RuntimeError(
                f"TorchDistributed.from_env: {', '.join(missing)} not set (launch with "
                "torchrun, or srun)"
            )
        _warn_shared_store(os.environ)
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(env_int("LOCAL_RANK", 0, low=0))
        dist.init_process_group(backend=backend, init_method="env://", **kwargs)
        comm = cls(**options)
        comm._owns_group = True
        return comm

    def _at_root(self, buf: torch.Tensor) -> bool:
        """Whether `buf` is reduced at node 0 (see `gather_bytes`). Decided from what
        every node has alike (the buffer's size, device and dtype, and what `_agree`
        found out in the first all-reduce of a CPU buffer)."""
        if self.num_nodes == 1 or buf.device.type != "cpu":
            return False
        if self._root_path is None:
            self._root_path = self._agree()
        return (
            self._root_path
            and buf.dtype != torch.bool
            and buf.numel() * buf.element_size() * (self.num_nodes - 1) <= self.gather_bytes
        )

    def _agree(self) -> bool:
        """Whether small all-reduces go to the root: every node on this machine, and more
        than half as many nodes as the cores the fewest-cored node may run on. Also
        that every node has the same `gather_bytes`, since one that reduced at the root
        while another took the ring would meet it in the wrong collective. Every node
        raises alike if not, and every node decides alike from the gathered values."""
        mine = torch.tensor([_machine_id(), self.gather_bytes, _cores()], dtype=torch.int64)
        nodes = [torch.empty_like(mine) for _ in range(self.num_nodes)]
        dist.all_gather(nodes, mine, group=self.group)
        sizes = [int(n[1]) for n in nodes]
        if len(set(sizes)) > 1:
            raise ValueError(
                "TorchDistributed: gather_bytes differs between nodes (node: value) "
                + ", ".join(f"{i}: {v}" for i, v in enumerate(sizes))
                + "; give every node the same"
            )
        one_machine = all(int(n[0]) == int(nodes[0][0]) for n in nodes)
        return one_machine and 2 * self.num_nodes > min(int(n[2]) for n in nodes)

    def _reduce_at_root(self, buf: torch.Tensor, op: str) -> None:
        """Gather every node's `buf` at node 0, reduce there in node order, broadcast."""
        if self.node_index == 0:
            flat = self._take(buf, self.num_nodes * buf.numel())  # (the reused buffers)
            rows = flat.view(self.num_nodes, buf.numel())
            dist.gather(buf, list(rows.unbind(0)), dst=self._root, group=self.group)
            if op == "sum":
                torch.sum(rows, 0, dtype=buf.dtype, out=buf)  # (integers would widen)
            else:
                (torch.amax if op == "max" else torch.amin)(rows, 0, out=buf)
            self._give_back(flat)
        else:
            dist.gather(buf, None, dst=self._root, group=self.group)
        dist.broadcast(buf, src=self._root, group=self.group)

    def _all_reduce_flat(self, buf: torch.Tensor, op: str) -> None:
        work = self._start_all_reduce_flat(buf, op)
        if work is not None:
            work.wait()

    def _start_all_reduce_flat(self, buf: torch.Tensor, op: str) -> dist.Work | None:
        # gloo runs it on its own threads, NCCL on its own stream (after the work
        # already queued on the current one): the caller's thread goes on at once.
        # Straight to the process group: `dist.all_reduce`'s checks and logging wrapper
        # cost a third of the call, once per gradient bucket (the buffers are ours:
        # flat, dense, and this node is in the group).
        if buf.is_complex():
            buf = torch.view_as_real(buf).view(-1)  # as dist.all_reduce does
        if self._at_root(buf):
            self._reduce_at_root(buf, op)
            return None  # done
        return self._pg.allreduce([buf], self._async_opts[op])

    def _all_gather_flat(self, buf: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(buf) for _ in range(self.num_nodes)]
        dist.all_gather(out, buf.contiguous(), group=self.group)
        return out

    def _broadcast_flat(self, buf: torch.Tensor) -> None:
        dist.broadcast(buf, src=self._root, group=self.group)

    def barrier(self) -> None:
        """Wait until every node of the group reaches this point."""
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Drop the cached buffers, and destroy the process group if `from_env` made it."""
        super().close()
        # Our references would keep the group alive past destroy_process_group(), its
        # gloo threads running until the interpreter shuts down: one that then frees a
        # failed all-reduce (a peer died) needs the GIL, which a finalizing interpreter
        # refuses by ending the thread, and the process aborts (std::terminate).
        self._pg = self._async_opts = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def __repr__(self) -> str:
        backend = dist.get_backend(self.group) if dist.is_initialized() else "closed"
        return f"TorchDistributed({backend}, node {self.node_index} of {self.num_nodes})"
