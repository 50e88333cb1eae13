"""Matmuls with an ``InterleavedShard`` operand run on the local shards (2 gloo ranks, TP=2).

HF's MoE experts keep gate|up in one tensor laid out ``InterleavedShard`` by ``moe_plan``; their
``grouped_mm`` / ``batched_mm`` kernels multiply by it. DTensor's own rules do not know the layout
and gathered the weight on every call. Checked here: the forward issues no collective, the output
is laid out as the rule says, a backward from a gradient laid out like the output issues none
either, and output and gradients equal the single-device ones (within 1e-5:
the same fp32 products, summed in another order where a contraction is split). A weight whose local
rows would break ``_grouped_mm``'s 16-byte stride rule falls back to DTensor's rule (it gathers the
weight: a Replicate output).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, distribute_tensor

import vescale
from vescale.debug import CollectiveCounter
from vescale.placement import InterleavedShard
from vescale.testing import run_on_ranks

E, K, M = 4, 8, 10


def _case(op: str, n: int):
    mesh = vescale.init_mesh((2,), ("TP",))
    vescale.dispatch.install()
    torch.manual_seed(0)
    offs = torch.tensor([3, 5, 8, 10], dtype=torch.int32)
    if op == "grouped_mm":
        a, b, w = torch.randn(M, K), torch.randn(E, K, n), torch.randn(M, n)
        fn = lambda x, y, o: torch._grouped_mm(x, y, o)  # noqa: E731
    else:  # batched_mm: one bmm per expert's tokens
        a, b, w = torch.randn(E, M, K), torch.randn(E, K, n), torch.randn(E, M, n)
        fn = lambda x, y, o: torch.bmm(x, y)  # noqa: E731
    a.requires_grad_(True)
    b.requires_grad_(True)
    ref = fn(a, b, offs)
    ref.backward(w)
    da = distribute_tensor(a.detach(), mesh, [Replicate()]).requires_grad_(True)
    db = distribute_tensor(b.detach(), mesh, [InterleavedShard(2, 2)]).requires_grad_(True)
    dw = distribute_tensor(w, mesh, [InterleavedShard(w.ndim - 1, 2)])  # the gradient arrives laid out like the output
    doffs = distribute_tensor(offs, mesh, [Replicate()])
    with CollectiveCounter() as forward:
        out = fn(da, db, doffs)
    with CollectiveCounter() as backward:
        out.backward(dw)
    close = lambda x, y: torch.allclose(x, y, atol=1e-5)  # noqa: E731
    return {
        "placements": out.placements,
        "forward": dict(forward.counts),
        "backward": dict(backward.counts),
        "values": close(out.full_tensor(), ref),
        "grads": close(da.grad.full_tensor(), a.grad) and close(db.grad.full_tensor(), b.grad),
        "grad_placements": (da.grad.placements, db.grad.placements),
    }


def _cases():
    return {(op, n): _case(op, n) for op, n in (("grouped_mm", 16), ("bmm", 16), ("grouped_mm", 12))}


@pytest.mark.multiproc
def test_interleaved_weights_multiply_locally_and_match_one_device():
    r = run_on_ranks(_cases, 2)[0]
    for op in ("grouped_mm", "bmm"):
        case = r[(op, 16)]
        out_dim = 1 if op == "grouped_mm" else 2
        assert case["placements"] == (InterleavedShard(out_dim, 2),), case
        assert case["forward"] == case["backward"] == {}, f"{op} communicated: {case}"
        assert case["values"] and case["grads"], case
        # The input's gradient is a Partial sum over the split columns; the weight's stays interleaved.
        assert case["grad_placements"] == ((Partial(),), (InterleavedShard(2, 2),)), case
    misaligned = r[("grouped_mm", 12)]  # 6 local floats a row: 24 bytes, not a multiple of 16
    assert misaligned["placements"] == (Replicate(),) and misaligned["forward"].get("all_gather", 0) >= 1, misaligned
    assert misaligned["values"] and misaligned["grads"], misaligned
