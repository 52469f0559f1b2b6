"""Gradient buckets: AllReduceSGD's all-reduce overlapped with backward, as DDP does it.

A module's trainable parameters are split, in the order backward reaches them (the
reverse of `module.parameters()`), into buckets of about `bucket_bytes` (the first one
smaller, so communication starts early). Each bucket owns a flat buffer. A
post-accumulate hook on each parameter counts its gradient ready; a full bucket copies
its gradients in and starts its all-reduce, in bucket order, while backward goes on:
at once, or at the next hook where a user's hook on the same parameter has yet to run
(so a user's hook that changes `.grad` has run, as under DDP).
`finish_step` (AllReduceSGD's `sum_*_gradients`) starts what is left, waits, and points
each `.grad` at its slice of the bucket: one copy per step (in), like DDP's
`gradient_as_bucket_view`, with the division by the node count riding on that copy.

The contract that keeps every node in step: per step, every bucket is all-reduced
exactly once, in bucket order, the last one always by `finish_step`. The last bucket
carries more elements ("marks"): for each parameter the number of nodes that had a
`.grad` for it, then the number of nodes whose gradients changed after their bucket
had left ("late": a second backward before the step ended), then the number of nodes
whose trainable parameters changed since the buckets were built, then the number of
nodes asked to stop (distlearn.preemption: a SIGTERM rides here, for every node to
learn in the same step). If any node was late,
or every contributing node's trainable parameters changed, every node all-reduces its
gradients once more (after rebuilding the buckets and checking that all nodes' new
sets match), so the result is always the sum of what each node holds when it ends the
step; a parameter frozen after backward keeps its result from the first send. If only
some changed, every node raises ValueError at that step: the others' buckets would no
longer line up with theirs. A parameter that no contributing node had a `.grad` for
keeps `.grad = None`, as in one process (and under DDP): the optimizer skips it rather
than stepping on zeros.
Nodes that finished their epoch run the same sequence with `finished=True`
(`finish_step(contribute=False)`), until a step in which nobody contributes.

A communicator with `all_reduce_counted` (the flat backends: TorchDistributed) gets one
more slot at the end of every bucket for its contributor count, so a bucket travels in
its own memory as one collective, as DDP's do, and a step reads the counts back to the
host once, from the last bucket (on CUDA: one sync a step, where DDP has none but cannot
end uneven epochs); otherwise a bucket is an ordinary `all_reduce` (the `ipc` tree counts
the nodes in its own messages).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import preemption
from .comm import Communicator, Completed, check_same_layout, start_all_reduce
from .tensors import check_dense

__all__ = ["GradientBuckets", "compressed_scale", "wire_dtype"]

# Buckets up to this size that backward did not fill are copied in with one call.
_BULK_BYTES = 1 << 20


def _trainable_params(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters in the order of `module.parameters()`, a shared one as
    often as the module tree holds it. A walk of the tree itself: it runs every step
    (GradientBuckets.changed), and `module.parameters()`'s generators and
    de-duplication cost 4x more (17 against 4 us on the MNIST model)."""
    out, stack = [], [module]
    while stack:
        m = stack.pop()
        for p in m._parameters.values():
            if p is not None and p.requires_grad:
                out.append(p)
        if m._modules:
            stack += [c for c in reversed(m._modules.values()) if c is not None]
    return out


def wire_dtype(dtype: torch.dtype, compress: torch.dtype | None) -> torch.dtype:
    """What a gradient of `dtype` travels as: float32/64 as `compress` if given, the
    rest (float16 and bfloat16 already, complex) as they are."""
    if compress is not None and dtype in (torch.float32, torch.float64):
        return compress
    return dtype


def compressed_scale(dtype: torch.dtype, wire: torch.dtype, num_nodes: int) -> float:
    """What a gradient of `dtype` is multiplied by before it travels as `wire`.

    float16 overflows at 65504: like DDP's fp16 hook, a compressed gradient travels as
    its node's share of the mean (bfloat16 has float32's range and is sent as is).
    """
    return 1.0 / num_nodes if wire == torch.float16 and dtype != wire else 1.0


class _Bucket:
    """Parameters whose gradients travel together, and the flat buffers they travel in.

    After a step the parameters' `.grad` are views of the buffer that carried them, so
    nothing is copied back. A step fills a buffer that no `.grad` points into: the same
    one when `zero_grad()` set them to None, else a second one (made on first need), so
    the buffer in flight is never a `.grad` that a late backward could write into.
    Compressed buckets (another dtype than the parameters') are copied back instead.
    """

    __slots__ = (
        "alias", "cur", "datas", "extra", "factor", "filling", "flats", "handle", "index",
        "numel", "params", "pending", "ready", "share", "views",
    )  # fmt: skip

    def __init__(self, params: list[nn.Parameter], wire: torch.dtype, extra: int) -> None:
        self.params = params
        self.index: list[int] = []  # each parameter's place in GradientBuckets.params
        self.numel = sum(p.numel() for p in params)  # the gradients; then `extra` slots:
        self.extra = extra  # the last bucket's marks (see GradientBuckets), the count
        self.alias = wire == params[0].dtype
        self.flats: list[torch.Tensor] = []
        self.datas: list[torch.Tensor] = []  # each flat's gradients (without `extra`)
        self.views: list[list[torch.Tensor]] = []
        self._add_buffer(wire)
        self.cur = 0  # the buffer of this step (or of the last one, until `target`)
        # This step's gradients went in as each one's share of the mean over `share`
        # nodes (1: as they are), multiplied by `scale` = 1 / share; `factor` is that
        # number as a 0-dim float64 tensor on the host, which the copies in take:
        # a Python number costs each of them a conversion into a tensor of its own
        # (5.5 us of 15.4 for 256 KiB on this repo's 2-core machine, 0.6 of 3.4 for
        # 1 KiB). On the host, a CUDA kernel reads it as a scalar: no copy, no sync.
        self.share = 1
        self.factor = torch.tensor(1.0, dtype=torch.float64)
        self.handle: Any = None
        self.reset()

    def _add_buffer(self, wire: torch.dtype) -> None:
        flat = torch.zeros(self.numel + self.extra, dtype=wire, device=self.params[0].device)
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.flats.append(flat)
        self.datas.append(flat[: self.numel])
        self.views.append(views)

    @property
    def flat(self) -> torch.Tensor:
        return self.flats[self.cur]

    @property
    def data(self) -> torch.Tensor:
        return self.datas[self.cur]

    @property
    def scale(self) -> float:
        return 1.0 / self.share

    def target(self, share: int) -> list[torch.Tensor]:
        """The views to fill this step: a buffer no `.grad` points into. The first call
        of a step also sets over how many nodes the gradients go in as their share."""
        if not self.filling:
            if share != self.share:
                self.share = share
                self.factor = torch.tensor(self.scale, dtype=torch.float64)
            views = self.views[self.cur]
            if self.alias and any(p.grad is v for p, v in zip(self.params, views, strict=True)):
                if len(self.flats) == 1:
                    self._add_buffer(self.flats[0].dtype)
                self.cur = 1 - self.cur
            self.filling = True
        return self.views[self.cur]

    def still_to_apply(self, count: int | None) -> float:
        """What the result is still to be multiplied by: the sum, or the mean over
        `count` nodes. Exactly 1.0 when `count` is `share` (the usual step), where
        1 / (1 / n) / n is not for some n (49 among them), which would cost a pass over
        the gradients that changes nothing."""
        return self.share / (count or 1)

    def reset(self) -> None:
        self.ready = [False] * len(self.params)  # the hook saw its gradient this step
        self.pending = len(self.params)  # members not ready yet
        self.handle = None  # the all-reduce in flight, once started this step
        self.filling = False


def _layout(
    params: list[nn.Parameter], wire: Callable[[torch.dtype], torch.dtype], first: int, cap: int
) -> list[list[nn.Parameter]]:
    """Parameters (in backward order) grouped into buckets of one device, one dtype and
    one wire dtype (a bucket is either the parameters' own dtype, its buffer the `.grad`,
    or compressed, copied back).

    A bucket closes once it holds `cap` bytes (`first` for the first bucket of each
    device and dtype), so one large parameter makes a bucket of its own. Buckets are
    ordered by their first parameter, the order in which backward fills them.
    """
    Key = tuple[torch.device, torch.dtype, torch.dtype]
    open_: dict[Key, list[nn.Parameter]] = {}
    size: dict[Key, int] = {}
    closed: dict[Key, int] = {}
    buckets: list[tuple[int, list[nn.Parameter]]] = []
    for i, p in enumerate(params):
        key = (p.device, p.dtype, wire(p.dtype))
        if key not in open_:
            open_[key], size[key] = [], 0
            buckets.append((i, open_[key]))
        open_[key].append(p)
        size[key] += p.numel() * key[2].itemsize
        if size[key] >= (first if closed.get(key, 0) == 0 else cap):
            closed[key] = closed.get(key, 0) + 1
            del open_[key]
    return [members for _, members in sorted(buckets, key=lambda b: b[0])]


def _zero_at(buf: torch.Tensor, places: list[int]) -> None:
    """`buf[places] = 0`, queued on the device. Assigned, the places would be copied
    from pageable host memory, which on CUDA waits for all that was queued before (the
    backward pass); from pinned memory the copy is queued like a kernel, and torch's
    host allocator keeps the pinned block until it has run."""
    index = torch.tensor(places, dtype=torch.int64, pin_memory=buf.is_cuda)
    buf.index_fill_(0, index.to(buf.device, non_blocking=True), 0)


def _hook(p: nn.Parameter, reducer: weakref.ref) -> tuple:
    """Call `reducer()._ready(p)` each time backward has accumulated `p.grad`.

    A post-accumulate hook on the parameter itself. Not on its gradient accumulator
    (DDP's way): that node lives only while someone holds it, and a node held from one
    step to the next keeps the shape it was made for, so backward refuses a parameter
    whose `.data` was replaced by one of another shape ("invalid gradient ... expected
    shape compatible with"), which plain torch takes. A user's hook registered after
    ours runs after it: `_ready` leaves a bucket that such a parameter completes to the
    next hook (see `_last_hook`). The hook holds the reducer weakly, and the parameter
    not at all (it is given the parameter): the hook lives in the parameter.
    """

    def hook(q: torch.Tensor) -> None:
        me = reducer()
        if me is not None:
            me._ready(q)

    return weakref.ref(p), p.register_post_accumulate_grad_hook(hook)


def _remove_hooks(hooks: dict[int, tuple]) -> None:
    for _, handle in hooks.values():
        handle.remove()
    hooks.clear()


class GradientBuckets:
    """The buckets of one module's gradients for one AllReduceSGD (see the module doc)."""

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        bucket_bytes: int,
        first_bucket_bytes: int,
        wire_dtype: torch.dtype | None,
        rider: Any = None,
    ) -> None:
        self.module = module
        # More elements after the marks: `rider.size` of them, filled by `rider.fill(view)`
        # and read by `rider.read(values)` (distlearn.survivors: every rank's position).
        self.rider = rider
        self.comm = comm
        self.bucket_bytes = bucket_bytes
        self.first_bucket_bytes = first_bucket_bytes
        self.wire_dtype = wire_dtype
        # The communicator sums a buffer with a slot for the count (backends/_flat.py):
        # every bucket carries that slot and travels as it is, in one collective.
        self.counted = callable(getattr(comm, "all_reduce_counted", None))
        self.syncing = True  # False inside AllReduceSGD.no_sync(): hooks only accumulate
        self.expect_normalize = True  # the mean, not the sum (as the last step asked)
        self.buckets: list[_Bucket] = []
        self.params: list[nn.Parameter] = []  # backward order: the order of the marks
        self.late_nodes = 0  # of the last step: nodes that were late
        # this step: the parameters this node had no .grad for (places in `params`, noted
        # as their zeros are copied in); the last step: of those, the ones no node had
        self._missing: list[int] = []
        self.unused: list[int] = []
        self.launched = 0  # buckets[:launched] have started their all-reduce this step
        self.late = False
        self._slot: dict[int, tuple[_Bucket, int]] = {}
        self._signature: list[tuple] = []
        self._hooks: dict[int, tuple] = {}  # id(parameter) -> _hook's (ref, handle)
        # The hooks live in the parameters: they go when these buckets do (not at exit).
        weakref.finalize(self, _remove_hooks, self._hooks).atexit = False
        self._due = False  # a full bucket waits for the next hook (see _ready)
        self._hold = False  # a gradient did not fit its slot: the step's end sends
        # steps ended; buckets started by hooks (overlapped with backward); steps sent
        # twice (a node was late, or the trainable parameters changed)
        self.stats = {"steps": 0, "started_in_backward": 0, "resent": 0}
        self._build()

    # -- layout -----------------------------------------------------------------------

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        return wire_dtype(dtype, self.wire_dtype)

    def _trainable(self) -> list[tuple]:
        """(parameter, dtype, device, shape) of each trainable parameter (`_trainable_params`)."""
        return [(p, p.dtype, p.device, p.shape) for p in _trainable_params(self.module)]

    def changed(self) -> bool:
        """Whether the trainable parameters (which, and their dtype, device or shape)
        differ from those the buckets were built for (checked every step)."""
        params, built = _trainable_params(self.module), self._signature
        if len(params) != len(built):
            return True
        for p, (q, dtype, device, shape) in zip(params, built):  # noqa: B905 (same length)
            if q is not p or dtype != p.dtype or device != p.device or shape != p.shape:
                return True
        return False

    @property
    def _rider_size(self) -> int:
        return self.rider.size if self.rider is not None else 0

    def _build(self) -> None:
        self._signature = self._trainable()
        # backward order, each parameter once (a shared one where the tree first holds it);
        # one without elements has nothing to send, and keeps the .grad backward gave it
        unique = {id(e[0]): e[0] for e in self._signature}.values()
        params = [p for p in unique if p.numel() > 0][::-1]
        groups = _layout(params, self._wire, self.first_bucket_bytes, self.bucket_bytes)
        if not groups:
            raise ValueError(
                f"AllReduceSGD: {type(self.module).__name__} has no trainable parameters "
                "with elements"
            )
        last = len(groups) - 1
        self.params = params
        # a count a parameter, the late count, the changed count, the stop count, a rider's
        marks = len(params) + 3 + self._rider_size
        self.buckets = [
            _Bucket(members, self._wire(members[0].dtype), marks * (i == last) + self.counted)
            for i, members in enumerate(groups)
        ]
        # A contributing node's usual marks (every .grad, not late, unchanged), copied in at once;
        # on the bucket's device: a copy from host memory would sync with CUDA.
        flat = self.buckets[-1].flat
        self._marks = torch.ones(marks, dtype=flat.dtype, device=flat.device)
        self._marks[len(params) :] = 0
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        place = {id(p): j for j, p in enumerate(params)}
        for b in self.buckets:
            b.index = [place[id(p)] for p in b.params]
        self.launched = 0
        self.late = False
        if len(self.buckets) == 1:
            # One bucket leaves at the end anyway: hooks would only cost time.
            self.remove_hooks()
            return
        reducer = weakref.ref(self)
        for p in params:  # the trainable ones (torch refuses a hook on a frozen tensor)
            hooked = self._hooks.get(id(p))
            if hooked is None or hooked[0]() is not p:  # (an id can be a dead one's)
                self._hooks[id(p)] = _hook(p, reducer)

    def remove_hooks(self) -> None:
        _remove_hooks(self._hooks)

    # -- during backward --------------------------------------------------------------

    def _ready(self, p: torch.Tensor) -> None:
        """The hook: `p.grad` holds this backward's gradient (accumulated). It only
        counts: the bucket's gradients are copied in together as it leaves (_fill)."""
        if self._due:  # a bucket full since an earlier hook: all of its hooks have run
            self._due = False
            self._launch_ready()
        slot = self._slot.get(id(p))
        if slot is None:
            return  # not trainable when the buckets were built: finish_step rebuilds
        bucket, i = slot
        if bucket.handle is not None:
            # Its bucket already left: this node's sum is now out of date.
            self.late = True
            return
        if not self.syncing or p.grad is None or bucket.ready[i]:
            # no_sync(): the gradient accumulates in .grad, copied at the end; or a
            # second backward added to a .grad whose bucket has yet to be copied
            return
        bucket.ready[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            if self._last_hook(p):
                self._launch_ready()
            else:  # a user's hook on p, registered after ours, has yet to run
                self._due = True

    def _last_hook(self, p: torch.Tensor) -> bool:
        """Whether ours is the last post-accumulate hook on `p` (torch keeps them in an
        ordered dict on the tensor, by handle id; if that ever changes, False: the
        bucket then leaves at the next hook, a gradient's compute later)."""
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        return bool(hooks) and next(reversed(hooks)) == self._hooks[id(p)][1].id

    @torch.no_grad()  # (backward(create_graph=True) runs hooks with grad; `out=` refuses it)
    def _launch_ready(self) -> None:
        """Start every full bucket whose predecessors have started (not the last one)."""
        while (
            not self._hold
            and self.launched < len(self.buckets) - 1
            and self.buckets[self.launched].pending == 0
        ):
            bucket = self.buckets[self.launched]
            try:
                self._fill(bucket, self._target(bucket))
            except RuntimeError:
                # A gradient no longer fits its slot (its parameter changed shape):
                # the step's end sends the buckets and resends once they are rebuilt.
                self._hold = True
                return
            self._launch(bucket, contribute=True)
            self.stats["started_in_backward"] += 1

    def _launch(self, bucket: _Bucket, contribute: bool, wait: bool = False) -> None:
        if self.counted:
            # The bucket's own memory with the count in its last slot: one collective,
            # on the communicator's threads (or NCCL's stream), or done before it
            # returns where TorchDistributed reduces a small CPU buffer at the root.
            bucket.handle = self.comm.all_reduce_counted(
                bucket.flat, finished=not contribute, async_op=True
            )
        elif wait:
            # The last bucket, started when nothing is left to overlap with: the
            # synchronous call skips the hand-off to a communication thread.
            count = self.comm.all_reduce(bucket.flat, finished=not contribute)
            bucket.handle = Completed(count)
        else:
            bucket.handle = start_all_reduce(self.comm, bucket.flat, finished=not contribute)
        self.launched += 1

    # -- copies -----------------------------------------------------------------------

    def _target(self, bucket: _Bucket) -> list[torch.Tensor]:
        # Gradients go in as each node's share of the mean when the mean is what is
        # asked for (the division rides on the copy in, not on a pass of its own).
        nodes = self.comm.num_nodes
        scale = compressed_scale(bucket.params[0].dtype, bucket.flat.dtype, nodes)
        return bucket.target(nodes if self.expect_normalize or scale != 1.0 else 1)

    def _copy_in(self, bucket: _Bucket, i: int, views: list[torch.Tensor]) -> None:
        """One gradient into its bucket (under no_grad: `out=` refuses autograd)."""
        grad, view = bucket.params[i].grad, views[i]
        if grad is None:
            view.zero_()
            self._missing.append(bucket.index[i])
            return
        check_dense(grad, bucket.params[i])
        if bucket.share != 1:
            torch.mul(grad, bucket.factor, out=view)
        else:
            view.copy_(grad)

    def _fill(self, bucket: _Bucket, views: list[torch.Tensor]) -> None:
        """Copy the bucket's gradients in, all at once, right before it leaves.

        Not one at a time from the hooks: a torch call made from a hook, right after
        backward's own kernels, took 8-11 us on this repo's 2-core machine, against
        1-2 us in a loop of them; copied from the hooks, 300 tensors of 4 KiB or less
        cost AllReduceSGD twice what they cost it now (bench/RESULTS-step-time.md). The
        bucket leaves no later: either way its copies run on backward's thread before.
        """
        grads = [p.grad for p in bucket.params]
        if (
            bucket.alias
            and bucket.numel * bucket.flat.element_size() <= _BULK_BYTES
            and all(g is not None and g.layout == torch.strided for g in grads)
        ):
            # A small bucket in two calls, not two per parameter: here Python costs more
            # than a second pass over the bytes (the MNIST model: 35 us against 13 us).
            torch._foreach_copy_(views, grads)
            if bucket.share != 1:
                bucket.data.mul_(bucket.factor)
            return
        for i in range(len(bucket.params)):
            self._copy_in(bucket, i, views)

    def _land(self, count: int | None) -> None:
        """Results into `.grad`: the sum, or the mean over `count` nodes; None where no
        node had a gradient."""
        for bucket in self.buckets:
            factor = bucket.still_to_apply(count)
            views = bucket.views[bucket.cur]
            if bucket.alias:
                if factor != 1.0:  # e.g. fewer contributors than nodes
                    bucket.data.mul_(factor)
                for p, view in zip(bucket.params, views, strict=True):
                    if p.grad is not view:
                        p.grad = view
                continue
            for p, view in zip(bucket.params, views, strict=True):
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                # widen first: a product in bfloat16 would round again
                p.grad.copy_(view)
                if factor != 1.0:
                    p.grad.mul_(factor)
        for j in self.unused:  # parameters that no contributing node had a .grad for
            self.params[j].grad = None

    # -- the end of a step ------------------------------------------------------------

    def _all_buckets(self, contribute: bool, late: bool) -> tuple[int, int]:
        """Start the buckets not started yet (in order), wait for all. Returns the count
        and how many nodes' trainable parameters changed, and leaves the marks of the
        step in `self.late_nodes` (how many nodes said they were late) and `self.unused`."""
        last = self.buckets[-1]
        # Before the last bucket leaves, so that every node learns who changed.
        changed = self.changed()
        for bucket in self.buckets[self.launched :]:
            views = self._target(bucket)  # (a finished node's buffer is overwritten too)
            if contribute:
                try:
                    self._fill(bucket, views)
                except RuntimeError:
                    # A gradient no longer fits its slot (a parameter changed shape):
                    # the bucket goes anyway, every node sends every bucket, and the
                    # step is resent once the buckets are rebuilt.
                    if not changed:
                        raise
            if bucket is last:
                self._mark(last, late, contribute, changed)
            # The tree runs the last bucket here (no hand-off to its communication
            # thread); a counted bucket is started like the others.
            self._launch(bucket, contribute, wait=bucket is last and not self.counted)
        count = None
        if self.counted:
            # Every bucket of a step has the same count: the last one's is read with
            # its marks, so a step reads back to the host once (on CUDA one sync, not
            # one a bucket).
            for bucket in self.buckets:
                bucket.handle.complete()
        else:
            for bucket in self.buckets:
                count = bucket.handle.wait()
        # The marks (and a counted bucket's count): only the late and changed counts and
        # the count unless this node had no .grad for a parameter, which may then stay None.
        had = len(self.params)
        start = last.numel if self._missing else last.numel + had
        tail = last.flat[start:].real.tolist()  # (complex: counts live in the real part)
        self.unused = [j for j in self._missing if tail[j] == 0]
        at = had if self._missing else 0
        self.late_nodes = round(tail[at])
        if count is None:
            count = round(tail[-1]) if last.handle.count_in_slot else last.handle.wait()
        preemption.observe(tail[at + 2], count, self.comm.num_nodes)
        if self._rider_size:
            self.rider.read(tail[at + 3 : at + 3 + self._rider_size])
        return count, round(tail[at + 1])

    def _frozen_means(self, count: int | None) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The parameters of these buckets that stopped requiring grad after backward (before
        the sum), each with its result from this round: the rebuilt buckets leave them out,
        and their `.grad` (which the optimizer still steps on) must be the mean, as in one
        process and under DDP, not this node's own. One that no node had a `.grad` for
        keeps None."""
        out = []
        for j, p in enumerate(self.params):
            if p.requires_grad or (p.grad is None and j in self.unused):
                continue
            bucket, i = self._slot[id(p)]
            view = bucket.views[bucket.cur][i]
            # widen first, as _land does: a product in bfloat16 would round again
            out.append((p, view.to(p.dtype) * bucket.still_to_apply(count)))
        return out

    def _mark(self, last: _Bucket, late: bool, contribute: bool, changed: bool) -> None:
        """This node's marks into the last bucket, after its gradients: 1 for each
        parameter it has a .grad for, 1 if it was late, 1 if its trainable parameters
        changed, 1 if it was asked to stop (0s from a finished node: a communicator may
        leave its values out)."""
        had = len(self.params)
        marks = last.flat[last.numel : last.numel + had + 3 + self._rider_size]
        if not contribute:
            marks.zero_()
            return
        marks.copy_(self._marks)
        if self._missing:
            _zero_at(marks, self._missing)
        if late:  # (fill_: an assigned number would wait for the device, see _set_slot)
            marks[had].fill_(1)
        if changed:
            marks[had + 1].fill_(1)
        if preemption.local_flag():
            marks[had + 2].fill_(1)
        if self._rider_size:
            self.rider.fill(marks[had + 3 :])

    def _reset(self) -> None:
        self._due = self._hold = False
        for bucket in self.buckets:
            bucket.reset()
        self._missing = []
        self.launched = 0
        self.late = False

    def finish_step(self, normalize: bool, contribute: bool = True) -> int:
        """End this step's all-reduces (see the module docstring); returns the count of
        contributing nodes. With `contribute=False` (a finished node) the gradients are
        left alone and 0 means that every node has finished."""
        try:
            with torch.no_grad():  # (parameters require grad; `out=` refuses autograd)
                return self._finish_step(normalize, contribute)
        finally:
            self._reset()

    def _finish_step(self, normalize: bool, contribute: bool) -> int:
        count, changed = self._all_buckets(contribute, self.late)
        if count == 0 and not contribute:
            return 0
        if 0 < changed < count:
            raise ValueError(
                f"AllReduceSGD: the trainable parameters (which ones require grad, their "
                f"dtypes, devices or shapes) changed on {changed} of {count} nodes in this "
                f"step, {'this one among them' if self.changed() else 'not this one'}: "
                f"change them on every node before the same step"
            )
        frozen = []
        if self.late_nodes > 0 or changed:
            # Somebody's gradients moved after they were sent, or the buckets no
            # longer fit the parameters: everyone sends what it holds now.
            if changed and contribute:
                frozen = self._frozen_means(count if normalize else None)
            self._reset()
            if changed:
                self._build()
                # Every contributing node changed its set: all nodes' sets must now
                # match (one small all-reduce, on such steps only; a node that finished
                # its epoch before the change fails it), and not only in size: two
                # nodes that froze two layers of one shape would sum one's gradients
                # into the other's.
                check_same_layout(self.comm, list(self.module.parameters()), "AllReduceSGD")
            count, _ = self._all_buckets(contribute, late=False)
            self.stats["resent"] += 1
        if contribute:
            self._land(count if normalize else None)
            for p, mean in frozen:
                p.grad = mean
            self.stats["steps"] += 1
            self.expect_normalize = normalize
        return count
