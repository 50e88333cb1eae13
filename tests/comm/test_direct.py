"""vescale.comm.direct on gloo: all-gathers and two-member reduce-scatters go over all-to-all (on
two-member groups one that moves only the other member's part), and give exactly what gloo's own
collectives give.

Values are random floats spread over eight orders of magnitude, so a sum in another order would
show in the bits; comparisons are ``torch.equal``. The ops that reach the wire are recorded with a
dispatch mode, so a path that silently kept gloo's own collective fails too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import vescale
from vescale.comm import direct
from vescale.debug import CollectiveCounter
from vescale.testing import run_on_ranks

pytestmark = pytest.mark.multiproc


class _WireOps(TorchDispatchMode):
    """The c10d ops issued, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


def _spread(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-4, 5, shape, generator=g)
    return x.to(dtype)


def _compare(group, seed: int) -> list[str]:
    failures = []
    n, rank = group.size(), dist.get_rank(group)
    gather_ops = ["alltoall_base_"]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for rows in (1, 3, 64, 1001):
            x = _spread((n * rows, 5), dtype, seed * 7919 + rows + 1000 * dist.get_rank())
            want = torch.empty(n * n * rows, 5, dtype=dtype)
            dist.all_gather_single(want, x, group=group)
            got = torch.empty_like(want)
            with _WireOps() as wire:
                direct.all_gather(got, x, group)
            if not torch.equal(got, want) or wire.names != gather_ops:
                failures.append(f"all_gather {dtype} rows={rows}: equal {torch.equal(got, want)}, ops {wire.names}")
            want_rs = torch.empty(rows, 5, dtype=dtype)
            dist.reduce_scatter_single(want_rs, x, group=group)
            for async_op in (False, True):
                got_rs = torch.empty_like(want_rs)
                with _WireOps() as wire:
                    work = direct.reduce_scatter(got_rs, x, group, async_op=async_op)
                    direct.wait(work)
                wire_ops = ["alltoall_base_" if n == 2 else "_reduce_scatter_base_"]
                if not torch.equal(got_rs, want_rs) or wire.names != wire_ops:
                    failures.append(f"reduce_scatter {dtype} rows={rows} async={async_op} n={n}: "
                                    f"equal {torch.equal(got_rs, want_rs)}, ops {wire.names}")
    for d in (0, 1, 2):  # joined along a tensor dim; summed and split along one
        x = _spread((2, 3, 4), torch.float32, seed + rank)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        if not torch.equal(direct.all_gather_dim(x, d, group), torch.cat(parts, dim=d)):
            failures.append(f"all_gather_dim d={d} n={n}")
        y = _spread((2 * n, 2 * n, 3 * n), torch.float32, seed + 10 * rank)
        want_rs = torch.empty(y.chunk(n, d)[0].shape)  # gloo's own, on the chunks stacked (DTensor's call)
        dist.reduce_scatter_tensor(want_rs, torch.cat(y.chunk(n, d)), group=group)
        got_rs = direct.reduce_scatter_dim(y, d, group)
        if not (torch.equal(got_rs, want_rs) and got_rs.is_contiguous()):
            failures.append(f"reduce_scatter_dim d={d} n={n}")
    return failures


def _check_both_paths():
    """Each group on the path it takes, then with the pairs over the even all-to-all."""
    failures = _check_groups()
    direct.pairs_exchange = False
    try:
        return failures + [f"(even all-to-all) {f}" for f in _check_groups()]
    finally:
        direct.pairs_exchange = True


def _check_groups():
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    return _compare(mesh.get_group("TP"), 1) + _compare(mesh.get_group("DP"), 2) + _compare(dist.group.WORLD, 3)


def test_gloo_collectives_over_all_to_all_give_gloo_bits():
    for rank, failures in enumerate(run_on_ranks(_check_both_paths, 4)):
        assert not failures, f"rank {rank}: {failures}"


def _counted(pairs: bool):
    direct.pairs_exchange = pairs
    x = torch.ones(4, 4)
    out, part = torch.empty(8, 4), torch.empty(2, 4)
    with CollectiveCounter() as counter:
        direct.all_gather(out, x, dist.group.WORLD)
        direct.reduce_scatter(part, x, dist.group.WORLD)
        direct.all_gather_dim(x, 1, dist.group.WORLD)
        direct.reduce_scatter_dim(x, 1, dist.group.WORLD)
    return dict(counter.counts), dict(counter.nbytes), direct.meant()


@pytest.mark.parametrize("pairs", [True, False])
def test_counter_counts_what_the_exchange_stands_for(pairs):
    counts, nbytes, left = run_on_ranks(_counted, 2, pairs)[0]
    assert counts == {"all_gather": 2, "reduce_scatter": 2}
    # The gathered output, the scattered input (128 and 64 bytes), whichever way they travel.
    assert nbytes == {"all_gather": 2 * 128, "reduce_scatter": 2 * 64}, nbytes
    assert left is None  # nothing claims to stand for a collective once it is issued
