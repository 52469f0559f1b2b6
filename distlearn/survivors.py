"""Survivors: when a rank dies, the others go on from the same step, and still see every
example exactly once. No process restarts, no checkpoint is read.

    tree = ipc.Tree.from_env()
    job = Survivors(tree, model, optimizer, batcher)   # instead of AllReduceSGD(tree)
    for epoch in range(epochs):
        for batch in batcher:
            def closure():
                optimizer.zero_grad()
                loss = loss_fn(model(batch.input), batch.target)
                loss.backward()
                return loss
            job.step(closure)          # the gradient all-reduce and the optimizer step
        job.end_epoch()                # AllReduceSGD.synchronize_parameters, and survives

How (see /work/notes/elastic-design.md, item 5):

- Every rank's data position is known to all: each keeps the states every rank had when
  the tree was (re)formed, and every step's gradient all-reduce carries, for each rank,
  the items its batcher handed out since (AllReduceSGD's ``rider``: two float32 elements
  a rank), so a rank's position is computed, never asked of it.
- A death: the step's all-reduce raises PeerError naming the dead rank (the tree notices
  in well under a second). The survivors re-form the tree among themselves
  (``Tree.reform``), agree on how many steps each completed (an all-reduce is not all or
  nothing: the root sums only once every share arrived, so if any survivor got the
  failed step's sum, it held the dead rank's share too, and the others take that
  survivor's parameters and optimizer state instead of redoing the step; else everyone
  redoes it, the dead rank's batch going back to the pool), work out the dead rank's
  position, split what it had not handed out over themselves (after their own epoch:
  ``batcher.take_over``), and redo the step on the new tree, running the closure again on
  the same batch (a failed all-reduce of ``.grad`` in place leaves nothing to reuse).
  The next epoch is an ordinary epoch of the new world size.

A rank that comes back: its process, started again with the same launcher variables
(a launcher that restarts what died, or by hand), finds in ``Tree.from_env`` that its
launch's tree still runs (node 0 keeps a lobby open in the private runtime directory,
ipc.rendezvous.lobby), knocks, and waits. Node 0 says so on the next step's all-reduce
(one more rider element), and after that step every rank takes it in: the tree grows by
a generation with it as the last node (``Tree.admit``), it gets the root's parameters
and optimizer state and the job's step count, and the ranks still in their epoch pool
what they had not handed out and split it with it (``elastic.admit``), so it trains from
that step on and every example is still seen once. Its loader must be the others'
(index, seed, sampler), else it is turned away with an error naming what differs. On
one host only: across hosts a process started again has no lobby to find (it starts a
launch of its own, which waits for peers that never come).

The tree only: torch.distributed cannot make a group without the dead rank's part in
it (``new_group`` needs every rank of the world), and the default store lives in rank
0's process; gloo and NCCL jobs survive through a restart instead (Checkpoint, torchrun
``--max-restarts``, ``sbatch --requeue``). Under torchrun's agent nothing survives a
death either way: the agent stops every worker; launch with srun (its default keeps the
other tasks running), ``examples/launch.py --survive`` or your own launcher.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .sgd import AllReduceSGD
from .state import broadcast_state_dict, gather_bytes, share_bytes, synchronize_optimizer

__all__ = ["Survivors"]

log = logging.getLogger(__name__)

_LOW = 1 << 20  # a count travels as (high, low) float32s: exact up to 2**44 items


class _Admit(Exception):
    """Raised out of a finished rank's end-of-epoch wait: ranks are coming back."""


class _Positions:
    """The rider: each rank's items handed out since the tree was formed, + 1 (0: the rank
    did not contribute to that round, its last known count stands); then, from node 0,
    how many processes wait in the lobby to come back."""

    def __init__(self, owner: Survivors):
        self.owner = owner
        self.size = 2 * owner.comm.num_nodes + 1

    def fill(self, view: torch.Tensor) -> None:
        me = self.owner.comm.node_index
        value = self.owner.batcher.handed_out - self.owner.base + 1
        view.zero_()
        view[2 * me].fill_(value // _LOW)
        view[2 * me + 1].fill_(value % _LOW)
        view[-1].fill_(len(self.owner.comm.knocks()))  # [] but on node 0

    def read(self, values: list[float]) -> None:
        known = self.owner.known
        for r in range(len(known)):
            v = round(values[2 * r]) * _LOW + round(values[2 * r + 1])
            if v > 0:
                known[r] = v - 1
        self.owner.waiting = round(values[-1])
        if self.owner.waiting and self.owner.draining:
            raise _Admit  # out of AllReduceSGD's wait: take them in, then wait again


class Survivors:
    """AllReduceSGD over an ipc tree that survives the death of ranks (see the module
    docstring). `sgd_options` go to AllReduceSGD (not ``grad_dtype``: the positions
    ride in the gradients' dtype and need float32's exact integers)."""

    def __init__(self, tree: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
                 batcher: Any, **sgd_options: Any):  # fmt: skip
        if not hasattr(tree, "reform"):
            raise TypeError(
                f"Survivors needs an ipc tree (it re-forms it without the dead), got "
                f"{type(tree).__name__}; torch.distributed jobs survive through a restart "
                "(distlearn.Checkpoint)"
            )
        if sgd_options.get("grad_dtype") is not None:
            raise ValueError("Survivors: grad_dtype cannot carry the ranks' positions exactly")
        self.comm, self.model, self.optimizer, self.batcher = tree, model, optimizer, batcher
        self.sgd_options = sgd_options
        self.deaths: list[dict] = []  # what happened at each death (for logs and tests)
        self.comebacks: list[dict] = []  # and at each time ranks came back
        self.steps = 0  # steps whose all-reduce this rank completed, over the whole job
        self.waiting = 0  # processes in the lobby, as node 0 said at the last step
        self.draining = False  # in end_epoch's wait for the ranks still stepping
        self.came_back = bool(getattr(tree, "came_back", False))
        if self.came_back:  # a process started again: the running job takes it in
            self._welcome(time.monotonic(), stepping=False, old_world=None)
        else:
            self._form()
            self.sgd.synchronize_parameters(model, optimizer)

    def _form(self, states: list[dict] | None = None) -> None:
        """After the tree is (re)formed: every rank's state (gathered, unless every rank
        computed them alike), and counts from zero."""
        if states is None:
            mine = json.dumps(self.batcher.state_dict()).encode()
            states = [json.loads(b) for b in gather_bytes(self.comm, mine)]
        self.states = states
        self.base = self.batcher.handed_out
        self.known = [0] * self.comm.num_nodes
        self.sgd = AllReduceSGD(self.comm, **self.sgd_options)
        self.sgd.rider = _Positions(self)
        self.waiting = 0
        self.comm.open_lobby()  # node 0, on one host: ranks started again knock there

    # -- the loop ------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any]) -> Any:
        """One training step: `closure()` (zero the gradients, forward, backward: returns
        the loss), the gradients' mean over the ranks, the optimizer's step. Returns the
        loss; None when this rank took the step's result from a survivor that had it."""
        loss = closure()
        try:
            self.sgd.sum_and_normalize_gradients(self.model)
        except Exception as err:
            dead = self._dead(err)
            if dead is None:
                raise
            log.warning("survivors: %s", err)
            return self._recover(dead, closure, in_step=True, fallback=loss)
        self.steps += 1
        self.optimizer.step()
        if self.waiting:
            self._admit(stepping=True)
        return loss

    def end_epoch(self) -> None:
        """The end of an epoch: AllReduceSGD.synchronize_parameters (ranks with fewer steps
        wait for the others), surviving a death there too, and taking back in ranks that
        come back meanwhile."""
        while True:
            try:
                self.draining = True
                # the optimizer's state too: momentum of the steps a rank sat out would
                # otherwise part the replicas again (and a rank let in takes the root's)
                self.sgd.synchronize_parameters(self.model, self.optimizer)
                return
            except _Admit:
                self.draining = False
                self._admit(stepping=False)
            except Exception as err:
                dead = self._dead(err)
                if dead is None:
                    raise
                self.draining = False
                self._recover(dead, None, in_step=False)
            finally:
                self.draining = False

    @staticmethod
    def _dead(err: BaseException) -> int | None:
        from . import ipc

        if isinstance(err, ipc.PeerError) and isinstance(getattr(err, "node", None), int):
            return err.node
        return None

    # -- ranks that come back -------------------------------------------------------------

    def _admit(self, stepping: bool) -> None:
        """Node 0 said processes wait in the lobby: every rank, after the same round, takes
        them in (node 0's list, shared), then `_welcome` on the grown tree. When they do not
        all join (one died or froze after its knock was answered), the tree as it was goes
        on: nobody left it."""
        from .ipc.errors import IPCError
        from .ipc.rendezvous.lobby import Knock

        t0, comm = time.monotonic(), self.comm
        mine = [vars(k) for k in comm.knocks(fresh=True)] if comm.node_index == 0 else None
        got = share_bytes(comm, json.dumps(mine).encode() if mine is not None else None)
        knocks = [Knock(**k) for k in json.loads(got)]
        self.waiting = 0
        if not knocks:
            return  # who knocked has gone again
        log.warning("survivors: %d process(es) come back; taking them in", len(knocks))
        try:
            self.comm = comm.admit(knocks)
        except IPCError as err:
            log.warning("survivors: the process(es) coming back did not join (%s); going on "
                        "without them", err)  # fmt: skip
            return
        self._welcome(t0, stepping, old_world=comm.num_nodes)

    def _welcome(self, t0: float, stepping: bool, old_world: int | None) -> None:
        """On the grown tree, every rank: the old ones, and those that came back (the last
        ranks; `old_world` None). Those that came back get the root's parameters and
        optimizer state; each old rank still in its epoch pools what it had not handed
        out and shares it with them (dataset.sampling.elastic.admit): every example still
        once. One whose loader differs (index, seed, sampler) is turned away. Should one
        that came back die before the shares are dealt, the old ranks re-form without
        those that came back, as they were."""
        from .dataset.sampling import elastic
        from .ipc.errors import PeerError

        back = old_world is None  # this process is one that came back
        try:
            met = self._meet(stepping, old_world)
        except PeerError as err:
            if back:
                raise
            assert old_world is not None
            log.warning("survivors: a process coming back left while being taken in (%s); "
                        "going on without them", err)  # fmt: skip
            self.comm = self.comm.reform(set(range(old_world, self.comm.num_nodes)))
            self._form()
            return
        if met is None:
            return  # every one that came back was turned away
        old_world, states, sharers = met
        comm = self.comm
        old = [elastic.Position.parse(st) for st in states[:old_world]]
        stream = self.batcher.stream
        # Every rank's new position, computed alike everywhere: no collective is left
        # after the shares are dealt, so a death from here on is an ordinary one.
        positions = [elastic.admit(old, sharers, r, comm.num_nodes, self.batcher.batch_size,
                                   stream, stream.piece_weight)
                     for r in range(comm.num_nodes)]  # fmt: skip
        self.batcher.take_over(positions[comm.node_index])
        self._form([stream.state_of(pos) for pos in positions])
        took = time.monotonic() - t0
        self.comebacks.append({"world": [old_world, comm.num_nodes], "now": comm.node_index,
                               "sharers": sharers, "generation": comm.generation,
                               "seconds": took})  # fmt: skip
        log.warning("survivors: %d ranks go on, %d of them back (this one is %d) after %.2f s",
                    comm.num_nodes, comm.num_nodes - old_world, comm.node_index, took)  # fmt: skip

    def _meet(self, stepping: bool, old_world: int | None) -> tuple[int, list, list] | None:
        """`_welcome`'s collectives, before anything of an old rank changes but the
        optimizer state (reloaded from the root's, which it equals): (the old world size,
        every rank's state, the old ranks still in their epoch); None when those that came
        back were all turned away (the tree re-formed as it was)."""
        from .dataset.sampling import elastic

        comm = self.comm
        back = old_world is None
        # The old ranks know how many they were; those that came back learn it.
        agree = torch.tensor([comm.num_nodes if back else old_world], dtype=torch.int64)
        comm.all_reduce(agree, op="min")
        old_world = int(agree[0])
        root_state = self.model.state_dict() if comm.node_index == 0 else None
        state = broadcast_state_dict(comm, root_state)
        if back:
            self.model.load_state_dict(state)
        synchronize_optimizer(comm, self.optimizer)
        steps = torch.tensor([self.steps], dtype=torch.int64)
        comm.all_reduce(steps, op="max")
        self.steps = int(steps[0])
        mine = json.dumps(self.batcher.state_dict()).encode()
        states = [json.loads(b) for b in gather_bytes(comm, mine)]
        ident = [{k: st.get(k) for k in elastic.IDENTITY} for st in states]
        bad = {r for r in range(old_world, comm.num_nodes) if ident[r] != ident[0]}
        if comm.node_index in bad:
            differs = [f"{k}={ident[0][k]!r} there, {v!r} here"
                       for k, v in ident[comm.node_index].items() if v != ident[0][k]]  # fmt: skip
            raise ValueError(
                "survivors: this process came back to a job whose loader differs: "
                + ", ".join(differs)
            )
        if bad:
            log.warning("survivors: turned away ranks %s: their loader differs", sorted(bad))
            self.comm = comm = comm.reform(bad)
            states = [st for r, st in enumerate(states) if r not in bad]
            if comm.num_nodes == old_world:  # nobody came back after all: as we were
                self._form()
                return None
        flags = torch.zeros(comm.num_nodes, dtype=torch.int64)
        flags[comm.node_index] = int(stepping)
        comm.all_reduce(flags)
        return old_world, states, [r for r in range(old_world) if flags[r]]

    # -- a death -------------------------------------------------------------------------

    def _recover(self, dead: int, closure, in_step: bool, fallback: Any = None) -> Any:
        t0 = time.monotonic()
        old_world, me_before = self.comm.num_nodes, self.comm.node_index
        log.warning("survivors: node %d died; re-forming the tree without it", dead)
        self.comm = self.comm.reform({dead})
        comm, w = self.comm, self.comm.num_nodes
        # Who died is who is not here (a survivor may have blamed another node: the error
        # it saw first can name a peer that left the failed collective for the new tree).
        here = torch.zeros(old_world, dtype=torch.int64)
        here[me_before] = 1
        comm.all_reduce(here)
        missing = [r for r in range(old_world) if not here[r]]
        if len(missing) != 1:
            raise RuntimeError(f"survivors: after re-forming, old ranks {missing} are missing "
                               "(one death at a time is survived)")  # fmt: skip
        dead = missing[0]
        # 1. who completed what: the steps each completed, every rank's last known count,
        # and which survivors are still in their epoch (the others take no share)
        done = self.steps
        stepping = [0] * w
        stepping[comm.node_index] = int(in_step)
        agree = torch.tensor([done, -done, *self.known, *stepping], dtype=torch.int64)
        comm.all_reduce(agree, op="max")
        most, least = int(agree[0]), -int(agree[1])
        known = [int(v) for v in agree[2 : 2 + old_world]]
        stepping = [int(v) for v in agree[2 + old_world :]]
        ahead = done == most and most > least
        if most > least:  # some got the failed step's sum: the rest take their result
            winner = torch.tensor([comm.node_index if ahead else w], dtype=torch.int64)
            comm.all_reduce(winner, op="min")
            self._take_result(int(winner[0]))
            if not ahead:
                self.steps = most
        # 2. the dead rank's position, and a share of its rest for each survivor
        from .dataset.sampling import elastic

        stream = self.batcher.stream
        everyone = [elastic.Position.parse(s) for s in self.states]
        dead_now = elastic.advance(everyone[dead], known[dead], stream)
        mine = [elastic.Position.parse(json.loads(b)) for b in gather_bytes(
            comm, json.dumps(self.batcher.state_dict()).encode())]  # fmt: skip
        own = mine[comm.node_index]
        # the dead rank's rest goes to the survivors still in their epoch; where none is
        # (it was the last), to all, as the next loop over the batcher
        sharers = [r for r in range(w) if stepping[r]] or list(range(w))
        share = (sharers.index(comm.node_index), len(sharers)) if comm.node_index in sharers \
            else (0, 0)  # fmt: skip
        position = elastic.take_over(own, [dead_now], [*mine, dead_now], comm.node_index, w,
                                     self.batcher.batch_size, stream, stream.piece_weight,
                                     share)  # fmt: skip
        self.batcher.take_over(position)
        self.deaths.append({"dead": dead, "was": me_before, "now": comm.node_index,
                            "world": [old_world, w], "dead_position": dead_now.state(),
                            "took_result": most > least and not ahead})  # fmt: skip
        self._form()
        took = time.monotonic() - t0
        log.warning("survivors: %d ranks go on (this one is %d, was %d) after %.2f s", w,
                    comm.node_index, me_before, took)  # fmt: skip
        self.deaths[-1]["seconds"] = took
        if not in_step:
            return None
        if most > least and not ahead:
            return None  # this step's result came from a survivor that had it
        loss = closure()  # the same batch again: its gradients, summed on the new tree
        self.sgd.sum_and_normalize_gradients(self.model)
        self.steps += 1
        self.optimizer.step()
        return loss if loss is not None else fallback

    def _take_result(self, winner: int) -> None:
        """Every survivor gets `winner`'s parameters, buffers and optimizer state: the
        others send zeros into one sum."""
        comm = self.comm
        params = [*self.model.parameters(), *self.model.buffers()]
        opt = [t for st in self.optimizer.state.values() for _, t in sorted(st.items())
               if isinstance(t, torch.Tensor)]  # fmt: skip
        count = torch.tensor([len(opt)], dtype=torch.int64)
        comm.all_reduce(count, op="max")
        if int(count[0]) != len(opt):
            raise RuntimeError(
                "survivors: the optimizer states differ in shape between the survivors (one "
                "had not stepped yet): cannot take the step's result; restart from a checkpoint"
            )
        with torch.no_grad():
            if comm.node_index != winner:
                for t in params + opt:
                    t.zero_()
            comm.all_reduce(params + opt)
