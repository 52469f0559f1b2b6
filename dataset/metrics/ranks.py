"""Across ranks: which rank's loader holds the job back, and why.

Each rank sends its totals since the last exchange (:data:`FIELDS`) as its row of a
``[world, len(FIELDS)]`` float64 tensor, zeros elsewhere; one ``all_reduce`` (sum) gives
every rank every row. The tensor can ride in a collective the job already makes (add it
to the list of tensors given to ``all_reduce``: no extra round trip), or go in a call of
its own (``batcher.metrics(comm=comm)``), once per window: it is a few hundred bytes.

In a synchronous job every rank waits for the slowest at each collective: a rank whose
loader is slow shows a long stall in ``next()``, while the others show the same time as
their consumer's (waiting in the collective). So the straggler is the rank whose stall
share is the largest, when it is at least STALL_BOUND of its time and twice the median
of the others'; its largest stage is why.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from .loader import STALL_BOUND, LoaderMetrics, bound_by

__all__ = ["FIELDS", "describe_ranks", "exchange_tensor", "read_exchange"]

FIELDS = ("seconds", "steps", "items", "stall_s", "sampling_s", "source_s", "decode_s",
          "handoff_s", "device_s")  # fmt: skip


def exchange_tensor(metrics: LoaderMetrics, rank: int, world: int) -> torch.Tensor:
    """This rank's row (its totals since the last exchange) of a zero ``[world, F]`` tensor."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, world={world})")
    now = metrics.totals()
    last = metrics.exchanged or [0.0] * len(now)
    metrics.exchanged = now
    out = torch.zeros(world, len(FIELDS), dtype=torch.float64)
    out[rank] = torch.tensor([a - b for a, b in zip(now, last, strict=True)], dtype=torch.float64)
    return out


def read_exchange(summed: torch.Tensor) -> dict[str, Any]:
    """Every rank's numbers from the all-reduced tensor, and the straggler (None when the
    ranks' stalls are even) with its verdict and why."""
    rows = summed.tolist()
    ranks = []
    for r, row in enumerate(rows):
        d = dict(zip(FIELDS, row, strict=True))
        d["rank"] = r
        d["stall_fraction"] = d["stall_s"] / d["seconds"] if d["seconds"] > 0 else 0.0
        d["stage"] = bound_by(d)[0] if d["stall_fraction"] >= STALL_BOUND else "consumer"
        ranks.append(d)
    out: dict[str, Any] = {"ranks": ranks, "straggler": None, "verdict": "even", "why": ""}
    if not ranks:
        return out
    worst = max(ranks, key=lambda d: d["stall_fraction"])
    others = [d["stall_fraction"] for d in ranks if d is not worst] or [0.0]
    median = statistics.median(others)
    share = worst["stall_fraction"]
    if len(ranks) > 1 and share >= STALL_BOUND and share >= 2 * median:  # (one: no straggler)
        name, top = bound_by(worst)
        out.update(
            straggler=worst["rank"],
            verdict=name,
            why=(
                f"rank {worst['rank']} waited on its loader {100 * share:.0f}% of the time "
                f"(the median of the others {100 * median:.0f}%), "
                f"{100 * worst[top] / max(worst['stall_s'], 1e-12):.0f}% of it on "
                f"{top[:-2].replace('_', ' ')}"
            ),
        )
    elif share >= STALL_BOUND:
        out.update(verdict="loader", why=f"every rank waits on its loader ({100 * share:.0f}%)")
    else:
        out["why"] = "no rank waited on its loader more than a tenth of its time"
    return out


def describe_ranks(result: dict[str, Any]) -> str:
    """The exchange's result in a line: the straggler and why, or the ranks' verdict."""
    if result["straggler"] is not None:
        r, v, why = result["straggler"], result["verdict"], result["why"]
        return f"straggler rank {r}, bound by {v} ({why})"
    ranks = result["ranks"]
    stages = sorted({d["stage"] for d in ranks})
    most = max((d["stall_fraction"] for d in ranks), default=0.0)
    where = "every rank" if len(ranks) > 1 else "rank 0"
    return (
        f"bound by {' / '.join(stages)} on {where} (the loop waited on the loader at most "
        f"{100 * most:.0f}% of the time), no straggler"
    )
