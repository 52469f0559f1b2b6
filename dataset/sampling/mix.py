"""A mix of sources: which source each example of the job's global order comes from.

Contract. A mix draws from S sources (each an index with its own sampler) by weights.
The job's examples form one *global order* k = 0, 1, 2, ... whatever the world size:
global batch s of a job of W ranks of batch size B is examples ``[s G, (s + 1) G)``,
``G = W B``, cut into W slices of B; rank r takes slice ``(r + s) mod W`` (turned by
one each step, so that over W steps every rank has had every slice). Which source
example k comes from is a pure function of k (:class:`Allocator`), so:

- **exact at every prefix**: after any k examples, source i has given ``c_i(k)``, with
  ``|c_i(k) - T_i(k)| < 1``, where ``T_i(k)`` is the sum of its weight over those k
  examples (``w_i k`` for constant weights): within one example, at every k, not in
  expectation;
- **the same at any world size**: the composition of every global batch depends on G
  and the weights only, never on how many ranks share it;
- **each source walks its own sampler's epochs**, in order, over its whole index: the
  t-th example a source gives is item ``t mod N`` of its epoch ``t div N`` (N: the
  epoch's length), each example once per epoch, however the weights change. A part-file
  source, whose epochs have no length known ahead, is read by partition instead: each
  rank walks its own parts' records, epoch after epoch, each once per epoch, and the
  allocation says how many of them each batch holds; its epochs end passes nowhere;
- **the position is a few integers** (:class:`MixPosition`): the global examples k
  handed out, each source's count, epoch and place in it, and its target scaled to
  integers. Every rank of a job holds the same one after the same step, so a job
  resumes at any world size and batch size (part-file sources add each rank's position
  in its parts, pooled and split as for one part-file dataset).

The allocation is earliest-deadline-first over unit jobs: source i's j-th example may
go to slot n (1-based) once ``T_i(n) > j`` (else it would run ahead of its share by a
whole example) and must go by the first slot where ``T_i(n) >= j + 1`` (else it would
fall behind by one). Over any run of slots ``(a, b]`` the examples whose window lies in
it number at most ``sum_i (T_i(b) - T_i(a)) = b - a``, so a schedule meeting every
window exists (Hall's condition), and EDF finds one whenever one exists (unit jobs,
integer release times; a deadline further ahead than the schedule is looked at counts
as last, and is looked for again long before it comes). Weights are rounded to
multiples of ``2**-24`` summing exactly to 1, so the targets are integers scaled by
``2**24`` and nothing is a float.

Weights may change with the *step* (a global batch: G examples of the global order):
a list of ``(step, weights)`` or a function of the step, which the allocator calls for
steps ahead of the current one to know the deadlines (it must be a pure function).
A source's count never goes back, so no change loses or repeats its examples.

Passes (what one ``for`` loop over the batcher is) end by the ``exhausted`` policy,
with the global batch in which it is met (so every rank has as many batches, and a
pass is whole global batches): ``"stop"`` when a source finishes an epoch,
``("repeat", n)`` when a source finishes its n-th epoch of the pass, ``"cycle"`` when
every source (of a nonzero weight at that step) has finished at least one. A source
that runs out before the pass ends begins its next epoch at once (so the last global
batch of a "stop" pass may hold the first examples of the next epoch of the source
that ended it). Sources are never rewound: the next pass goes on from where each
stood, so over a run every source walks whole epochs, one after the other, each example
exactly once in each.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["SCALE", "Allocator", "MixPosition", "Policy", "Schedule", "scale_weights"]

SCALE = 1 << 24  # weights are integers summing to SCALE
# How many runs of weights (steps of a function schedule) ahead a deadline is looked
# for; one further counts as not due, and is looked for again halfway there.
HORIZON = 4096
NEVER = math.inf


def scale_weights(weights: Sequence[Any], where: str = "weights") -> tuple[int, ...]:
    """`weights` (non-negative numbers, any sum > 0) as integers summing to SCALE, rounded
    by largest remainder (each within one unit of its exact share)."""
    ws = list(weights)
    for i, w in enumerate(ws):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w < 0:
            raise ValueError(f"{where}[{i}] must be a finite number >= 0, got {w!r}")
    total = math.fsum(float(w) for w in ws)
    if total <= 0:
        raise ValueError(f"{where} must have a positive sum, got {ws}")
    exact = [float(w) * SCALE / total for w in ws]
    out = [math.floor(x) for x in exact]
    short = SCALE - sum(out)
    for i in sorted(range(len(ws)), key=lambda i: (out[i] - exact[i], i))[:short]:
        out[i] += 1
    return tuple(out)


class Schedule:
    """The weights of each step: a constant, a list of ``(step, weights)`` (from that step
    on; the first must be step 0) or a function ``step -> weights``. Weights are a
    sequence in source order or a mapping by source name."""

    def __init__(self, spec: Any, names: Sequence[str]):
        self.names = list(names)
        self._fn: Callable[[int], Any] | None = None
        self._steps: list[int] = []
        self._table: list[tuple[int, ...]] = []
        self._memo: dict[int, tuple[int, ...]] = {}
        if callable(spec):
            self._fn = spec
            self.weights(0)  # checked where it is given
            return
        if (
            isinstance(spec, list | tuple)
            and spec
            and all(isinstance(x, tuple | list) and len(x) == 2 and _is_step(x[0]) for x in spec)
        ):
            pairs = sorted(spec, key=lambda x: x[0])
            if pairs[0][0] != 0:
                raise ValueError(f"schedule starts at step {pairs[0][0]}: give the weights "
                                 "of step 0 first")  # fmt: skip
            for (step, w), (nxt, _) in zip(pairs, [*pairs[1:], (None, None)], strict=True):
                if nxt == step:
                    raise ValueError(f"schedule names step {step} twice")
                self._steps.append(int(step))
                self._table.append(self._scaled(w, f"schedule step {step}"))
            return
        self._steps, self._table = [0], [self._scaled(spec, "weights")]

    def _scaled(self, w: Any, where: str) -> tuple[int, ...]:
        if isinstance(w, Mapping):
            unknown = sorted(set(w) - set(self.names))
            if unknown:
                raise ValueError(f"{where} names {unknown}, not sources of the mix "
                                 f"({self.names})")  # fmt: skip
            w = [w.get(n, 0) for n in self.names]
        if not isinstance(w, Sequence) or isinstance(w, str) or len(w) != len(self.names):
            raise ValueError(f"{where}: want {len(self.names)} weights (one per source "
                             f"{self.names}) or a dict by name, got {w!r}")  # fmt: skip
        return scale_weights(w, where)

    def weights(self, step: int) -> tuple[int, ...]:
        """The scaled weights of `step`."""
        if self._fn is None:
            at = _bisect(self._steps, step)
            return self._table[at]
        got = self._memo.get(step)
        if got is None:
            got = self._scaled(self._fn(step), f"schedule({step})")
            if len(self._memo) > 4 * HORIZON:
                self._memo.clear()
            self._memo[step] = got
        return got

    def next_change(self, step: int) -> int | None:
        """The first step after `step` whose weights may differ (None: never)."""
        if self._fn is not None:
            return step + 1
        at = _bisect(self._steps, step)
        return self._steps[at + 1] if at + 1 < len(self._steps) else None


def _bisect(steps: list[int], step: int) -> int:
    lo, hi = 0, len(steps)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if steps[mid] <= step:
            lo = mid
        else:
            hi = mid
    return lo


def _is_step(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0


class Allocator:
    """Which source each example of the global order comes from (module docstring).

    `n` examples allocated so far, `counts[i]` of them from source i, `targets[i]` its
    share of those n scaled by SCALE; `step_size` is G, the examples of a step."""

    def __init__(self, schedule: Schedule, step_size: int, n: int, counts: Sequence[int],
                 targets: Sequence[int]):  # fmt: skip
        if step_size < 1:
            raise ValueError(f"a step holds at least one example, got {step_size}")
        self.schedule, self.step_size = schedule, step_size
        self.n, self.counts, self.targets = n, list(counts), list(targets)
        self._seg: tuple[int, tuple[int, ...], int | None] | None = None
        self.recheck: list[int | None] = [None] * len(self.counts)  # see _deadline
        self.deadlines = [self._deadline(i) for i in range(len(self.counts))]

    def _segment(self, step: int) -> tuple[tuple[int, ...], int | None]:
        """The weights of `step` and the first example after their run (None: never)."""
        if self._seg is None or self._seg[0] != step:
            change = self.schedule.next_change(step)
            self._seg = (step, self.schedule.weights(step),
                         None if change is None else change * self.step_size)  # fmt: skip
        return self._seg[1], self._seg[2]

    def _deadline(self, i: int) -> float:
        """The slot by which source i's next example must be placed (NEVER: not due).

        Looked for over HORIZON runs of weights ahead; past them it counts as NEVER, and
        is looked for again halfway there, so a due date is known well before it comes."""
        need = (self.counts[i] + 1) * SCALE
        k, u, G = self.n, self.targets[i], self.step_size
        self.recheck[i] = None
        for _ in range(HORIZON):
            step = k // G
            if self._seg is not None and self._seg[0] == step:  # the current step's
                w, end = self._seg[1], self._seg[2]
            else:
                change = self.schedule.next_change(step)
                w, end = self.schedule.weights(step), None if change is None else change * G
            a = w[i]
            if a > 0:
                t = max(1, -(-(need - u) // a))  # slots from k on until the target reaches need
                if end is None or k + t <= end:
                    return k + t
            if end is None:
                return NEVER
            u += a * (end - k)
            k = end
        self.recheck[i] = (self.n + k) // 2
        return NEVER

    def take(self, m: int, stop: Callable[[int], bool] | None = None) -> list[int]:
        """The sources of the next `m` examples (fewer when ``stop(source)``, called after
        each example is counted, says the run ends there)."""
        out: list[int] = []
        counts, targets, deadlines = self.counts, self.targets, self.deadlines
        sources, G = range(len(counts)), self.step_size
        while len(out) < m:
            step = self.n // G
            w, _ = self._segment(step)
            for i in sources:
                at = self.recheck[i]
                if at is not None and self.n >= at:
                    deadlines[i] = self._deadline(i)
            for _ in range(min(m - len(out), (step + 1) * G - self.n)):  # a step at a time
                best, when = -1, NEVER
                for i in sources:
                    targets[i] += w[i]
                    if targets[i] > counts[i] * SCALE and (best < 0 or deadlines[i] < when):
                        best, when = i, deadlines[i]
                self.n += 1
                counts[best] += 1
                deadlines[best] = self._deadline(best)
                out.append(best)
                if stop is not None and stop(best):
                    return out
        return out


@dataclass(frozen=True)
class Policy:
    """When a pass ends: "stop" (a source finished an epoch), ("repeat", n) (a source
    finished n epochs in the pass), "cycle" (every source finished one); checked after
    each global batch."""

    kind: str
    times: int = 1

    @classmethod
    def parse(cls, spec: Any) -> Policy:
        if spec == "stop":
            return cls("repeat", 1)
        if spec == "cycle":
            return cls("cycle", 1)
        if (isinstance(spec, tuple | list) and len(spec) == 2 and spec[0] == "repeat"
                and _is_step(spec[1]) and spec[1] >= 1):  # fmt: skip
            return cls("repeat", int(spec[1]))
        raise ValueError(f"exhausted={spec!r}: want 'stop', 'cycle' or ('repeat', n) with "
                         "n >= 1")  # fmt: skip

    def ended(self, done: Sequence[int], weights: Sequence[int]) -> bool:
        """Whether a pass in which source i finished ``done[i]`` epochs is over, at a step
        of `weights` ("cycle" waits for the sources drawn from only)."""
        if self.kind == "cycle":
            return all(d >= 1 or w == 0 for d, w in zip(done, weights, strict=True))
        return any(d >= self.times for d in done)

    def __str__(self) -> str:
        if self.kind == "cycle":
            return "cycle"
        return "stop" if self.times == 1 else f"('repeat', {self.times})"


@dataclass
class MixPosition:
    """Where a mix stands; the same on every rank of a job after the same step.

    ``pass_``: the pass being read; ``examples``: global examples handed out (where the
    next global batch starts); per source: ``counts`` (examples given), ``targets``
    (its share of ``examples``, times SCALE), ``epochs`` and ``offsets`` (its epoch and
    the items of it given), ``done`` (epochs it finished in this pass)."""

    pass_: int
    examples: int
    counts: list[int]
    targets: list[int]
    epochs: list[int]
    offsets: list[int]
    done: list[int] = field(default_factory=list)
    # part-file sources (read by partition): this rank's position in each, by source
    parts: dict = field(default_factory=dict, compare=False)

    @classmethod
    def fresh(cls, sources: int) -> MixPosition:
        zero = [0] * sources
        return cls(0, 0, list(zero), list(zero), list(zero), list(zero), list(zero))

    def next_pass(self, pass_: int | None = None) -> MixPosition:
        p = self.pass_ + 1 if pass_ is None else pass_
        return replace(self, pass_=p, done=[0] * len(self.counts), parts=dict(self.parts))

    def state(self) -> dict:
        return {
            "pass": self.pass_,
            "examples": self.examples,
            "counts": list(self.counts),
            "targets": list(self.targets),
            "epochs": list(self.epochs),
            "offsets": list(self.offsets),
            "done": list(self.done),
        }

    @classmethod
    def parse(cls, raw: Any, sources: int, where: str) -> MixPosition:
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}['mix'] must be a dict, got {raw!r}")
        for key in ("pass", "examples"):
            if not _is_step(raw.get(key)):
                raise ValueError(f"{where}['mix'][{key!r}] must be an int >= 0, "
                                 f"got {raw.get(key)!r}")  # fmt: skip
        lists = {}
        for key in ("counts", "targets", "epochs", "offsets", "done"):
            v = raw.get(key)
            if not isinstance(v, list | tuple) or len(v) != sources or not all(map(_is_step, v)):
                raise ValueError(f"{where}['mix'][{key!r}] must be {sources} ints >= 0 (one "
                                 f"per source), got {v!r}")  # fmt: skip
            lists[key] = [int(x) for x in v]
        pos = cls(int(raw["pass"]), int(raw["examples"]), **lists)
        if sum(pos.counts) != pos.examples or sum(pos.targets) != pos.examples * SCALE:
            raise ValueError(f"{where}['mix'] is inconsistent: its counts sum to "
                             f"{sum(pos.counts)} and its targets to {sum(pos.targets)}, for "
                             f"{pos.examples} examples")  # fmt: skip
        if any(abs(c * SCALE - t) >= SCALE for c, t in zip(pos.counts, pos.targets, strict=True)):
            raise ValueError(f"{where}['mix']: a source's count is a whole example off its "
                             "target; this is not a state this mix wrote")  # fmt: skip
        return pos
