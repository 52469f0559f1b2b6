"""ipc.collectives.hostops: the tree's copies and reductions give torch's results, dtype by dtype,
and never start torch's intra-op pool."""

from __future__ import annotations

import pytest
import torch
from ipc_harness import TRANSPORTS, run_tree

from distlearn.ipc.collectives import hostops

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
# More than one GRAIN, not a multiple of it: the piecewise path's last piece is short.
N = 2 * hostops.GRAIN + 123


def _pair(dtype: torch.dtype, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return (torch.rand(n, generator=g) > 0.5, torch.rand(n, generator=g) > 0.5)
    if dtype.is_floating_point or dtype.is_complex:
        a, b = (torch.randn(n, generator=g, dtype=torch.float64) for _ in range(2))
        if dtype.is_complex:
            return (torch.complex(a, b).to(dtype), torch.complex(b, a).to(dtype))
        a[::97] = float("nan")  # max/min propagate NaN, as torch's do
        return a.to(dtype), b.to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)  # int8 sums wrap around
    return tuple(torch.randint(lo, hi, (n,), generator=g).to(dtype) for _ in range(2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [N, 100], ids=["numpy-or-pieces", "below-grain"])
def test_reductions_match_torch(dtype, n):
    a, b = _pair(dtype, n)
    expected = {"add": a.clone().add_(b)}
    if not dtype.is_complex:
        expected["maximum"] = torch.maximum(a, b)
        expected["minimum"] = torch.minimum(a, b)
    for name, want in expected.items():
        acc = a.clone()
        getattr(hostops, name)(acc, b)
        assert acc.dtype == dtype
        assert torch.equal(acc, want) or (
            dtype.is_floating_point and torch.allclose(acc, want, equal_nan=True, rtol=0, atol=0)
        ), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_moves_the_bits_into_views(dtype):
    for rows in (N, 1000):  # numpy's copy, and torch's below GRAIN
        a, b = _pair(dtype, 3 * rows)
        dst = a.clone()
        # Into and out of strided views (a column of a matrix), as the tree's slices are not.
        hostops.copy(dst.view(rows, 3)[:, 1], b.view(rows, 3)[:, 2])
        want = a.clone()
        want.view(rows, 3)[:, 1] = b.view(rows, 3)[:, 2]
        assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8)), rows


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_reductions_leave_the_source_alone_and_accept_read_only_buffers():
    # The TCP engine reduces from received frames: read-only buffers.
    src = torch.frombuffer(
        torch.arange(10, dtype=torch.float32).numpy().tobytes(), dtype=torch.float32
    )
    acc = torch.ones(10)
    hostops.add(acc, src)
    assert torch.equal(acc, torch.arange(10, dtype=torch.float32) + 1)
    assert torch.equal(src, torch.arange(10, dtype=torch.float32))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float32], ids=str)
def test_lazy_conjugates_and_negations_are_resolved_as_torch_does(dtype):
    a, b = _pair(dtype)
    a, b = a.nan_to_num(), b.nan_to_num()
    for src in ([b.conj()] if dtype.is_complex else []) + [torch._neg_view(b)]:
        dst = torch.empty_like(a)
        hostops.copy(dst, src)
        assert torch.equal(dst, src.resolve_conj().resolve_neg())
        acc = a.clone()
        hostops.add(acc, src)
        assert torch.equal(acc, a + src)


@pytest.mark.parametrize("shm", TRANSPORTS)
def test_large_all_reduces_leave_the_intra_op_pool_asleep(shm, tmp_path):
    """The nodes of a host reduce in parallel, one slice each; OpenMP workers spinning
    after an op inside one node take the cores the others need (a 38 MB all-reduce on
    2 cores took 60 ms instead of 7 with 2 torch threads a node). Through torch's
    copy_/add_ these all-reduces start 3 workers a node; through hostops, none."""
    n = 2
    results, _ = run_tree("pool_free", n, tmp_path, timeout=120, shm=shm)
    for r in results:
        assert r["counts"] == [n, n, n]
        assert r["x_ok"] and r["x"] == 2 * (1 + 2)  # summed twice in place
        assert r["h_ok"] and r["h"] == n
        before, after = r["threads"]
        assert after == before, f"{after - before} native threads started (OpenMP's pool)"
