"""Preemption: a stop signal that every rank learns in the same step, for 4 bytes.

A scheduler stops a job with a signal: SIGTERM (torchrun's agent, Slurm at a
preemption, a time limit or `scancel`, Kubernetes), or one the user asked for
(`sbatch --signal=USR1@120`). It reaches the ranks at different moments, and a rank
that stopped on its own would leave the others waiting in their next collective. So the
signal only raises this process's flag (:func:`install`; a handler does nothing else),
and the flag travels with the step's gradient all-reduce: AllReduceSGD carries, beside
its per-parameter marks, the number of nodes whose flag is up, and AllReduceEA carries
it in each average. Every node reads the same sum from the same collective, so every
node sees :func:`agreed` turn true after the same step, saves (``Checkpoint.step``) and
exits 0. On the tree, gloo, NCCL and XLA alike it costs one element in a collective that
runs anyway.

The protocol for a collective that carries the flag (a *rider*): put
:func:`local_flag` (0 or 1) in an element that is summed, and after the collective pass
the summed element to :func:`observe`. A node that contributes nothing (``finished``)
carries nothing: its flag rides its next contributing step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "agreed",
    "exchanges",
    "full",
    "install",
    "local_flag",
    "observe",
    "request",
    "requested",
    "reset",
    "uninstall",
]

log = logging.getLogger(__name__)


class _State:
    def __init__(self) -> None:
        self.requested: str | None = None  # why this process was asked to stop
        self.at = 0.0  # when (time.monotonic())
        self.agreed = False  # every node knows that some node was asked
        self.pending: Any = None  # summed flags on a device, not read yet (see observe)
        self.full = True  # every node contributed to the last round
        self.pending_full: Any = None  # (count on a device, nodes), not read yet
        self.exchanges = 0  # collectives that carried the flag so far
        self.previous: dict[int, object] = {}  # signal -> the handler ours replaced


_state = _State()


def _handler(signum: int, frame: object) -> None:
    if _state.requested is not None:
        # a second one: the user insists (a second Ctrl-C); the signal's own action now
        previous = _state.previous.get(signum, signal.SIG_DFL)
        signal.signal(signum, previous if callable(previous) else signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _state.requested = signal.Signals(signum).name
    _state.at = time.monotonic()


def install(signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1)) -> list[int]:
    """Make `signals` raise the stop flag instead of ending the process; returns those
    installed. Only the main thread can install handlers: elsewhere nothing is installed
    and a warning says so (the process then stops at the signal as before)."""
    if threading.current_thread() is not threading.main_thread():
        log.warning("preemption: handlers are installed from the main thread only; %s will "
                    "end this process without a save", ", ".join(_names(signals)))  # fmt: skip
        return []
    done = []
    for sig in signals:
        current = signal.getsignal(sig)
        if current is not _handler:
            _state.previous[int(sig)] = current
            signal.signal(sig, _handler)
        done.append(int(sig))
    return done


def uninstall() -> None:
    """Give the signals back the handlers ours replaced."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, previous in _state.previous.items():
        if signal.getsignal(sig) is _handler:
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
    _state.previous.clear()


def request(reason: str = "request()") -> None:
    """Raise the flag from code (a health check, a test), as a signal would."""
    if _state.requested is None:
        _state.requested, _state.at = reason, time.monotonic()


def requested() -> str | None:
    """Why this process was asked to stop (the signal's name), or None."""
    return _state.requested


def local_flag() -> int:
    """What a rider puts in its summed element: 1 when this process was asked to stop."""
    return 0 if _state.requested is None else 1


def observe(stop: Any, count: Any = None, nodes: int | None = None, rider: bool = True) -> None:
    """A rider's summed stop flag after its collective, and how many of `nodes` nodes
    contributed to it (`count`). Numbers, or tensors (1-element views, copied on their
    device and read only when :func:`agreed` or :func:`full` is asked, so a rider adds
    no read back to the host, which on CUDA is a sync). Every node sees the same sums
    from the same collectives, so every node agrees after the same one.
    `rider=False`: a collective run only to carry the flag (not counted as a round)."""
    _state.exchanges += rider
    _state.pending_full = None
    _state.full = True
    if count is not None and nodes is not None:
        if isinstance(count, torch.Tensor):
            _state.pending_full = (_copy(count), nodes)
        else:
            _state.full = round(float(count)) >= nodes
    if isinstance(stop, torch.Tensor):
        value = _copy(stop)
        pending = _state.pending
        if pending is not None and pending.device != value.device:
            _resolve()
            pending = None
        _state.pending = value if pending is None else pending + value
        return
    _agree(float(stop))


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1)[:1].real.to(torch.float64, copy=True)


def _agree(count: float) -> None:
    if round(count) > 0 and not _state.agreed:
        _state.agreed = True
        here = f" ({_state.requested} here)" if _state.requested else ""
        log.warning("preemption: %d node(s) were asked to stop%s; stopping after this step",
                    round(count), here)  # fmt: skip


def _resolve() -> None:
    pending, _state.pending = _state.pending, None
    if pending is not None:
        _agree(float(pending.item()))
    if _state.pending_full is not None:
        (count, nodes), _state.pending_full = _state.pending_full, None
        _state.full = round(float(count.item())) >= nodes


def full() -> bool:
    """Whether every node contributed to the last collective that carried the flag: the
    nodes are in step (none is draining the end of an uneven epoch), so a collective
    that all of them start now, such as a save, meets every node."""
    _resolve()
    return _state.full


def agreed() -> bool:
    """Whether every node knows a stop was asked for (true on all after the same step)."""
    _resolve()
    return _state.agreed


def exchanges() -> int:
    """How many collectives carried the flag so far: the rounds of gradient all-reduces
    (the same number on every node, contributing or draining). Checkpoint.step counts its
    saves in these, and runs a collective of its own only where none carries the flag."""
    return _state.exchanges


def reset() -> None:
    """Forget any request and agreement (a job that goes on after a save, tests)."""
    _state.requested, _state.agreed, _state.at, _state.pending = None, False, 0.0, None
    _state.full, _state.pending_full = True, None


def _names(signals: Iterable[int]) -> list[str]:
    return [signal.Signals(s).name for s in signals]
