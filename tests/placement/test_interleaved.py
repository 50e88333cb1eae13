"""InterleavedShard on real gloo ranks: layout, redistribution, the split/cat rules, matmuls, the
RNG (bit-identical init), ZeRO-3 gathers, training against one device, and DCP checkpoints."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import vescale
from vescale import INIT, RUN, InterleavedShard, VescalePlan
from vescale.placement import is_interleaved
from vescale.testing import run_on_ranks

pytestmark = pytest.mark.multiproc


def _ops():
    mesh = vescale.init_mesh((2,), ("TP",))
    vescale.dispatch.install()
    torch._C._set_dtensor_allow_implicit_replication(True)  # plain expert ids / inputs meet DTensors (as in parallelize)
    r = dist.get_rank()
    out = {}
    # Layout: rows q0 q1 | k0 k1 | v0 v1 (2 per section); rank r holds row r of every section.
    w = torch.arange(6.0).repeat_interleave(2).view(6, 2)
    d = distribute_tensor(w, mesh, [InterleavedShard(0, 3)])
    out["layout"] = torch.equal(d.to_local(), w[[r, 2 + r, 4 + r]])
    out["to_replicate"] = torch.equal(d.full_tensor(), w)
    back = DTensor.from_local(w, mesh, [Replicate()]).redistribute(mesh, [InterleavedShard(0, 3)])
    out["from_replicate"] = torch.equal(back.to_local(), d.to_local())
    # A linear with an IS(0,3) weight: the output is interleaved on its last dim, and splitting it
    # into q, k, v (split or chunk) stays local: Shard(-1), one section slice per rank.
    torch.manual_seed(0)
    W, b, x = torch.randn(12, 8), torch.randn(12), torch.randn(2, 5, 8)
    Wd = distribute_tensor(W, mesh, [InterleavedShard(0, 3)]).requires_grad_()
    bd = distribute_tensor(b, mesh, [InterleavedShard(0, 3)]).requires_grad_()
    y = nn.functional.linear(DTensor.from_local(x, mesh, [Replicate()]), Wd, bd)
    out["linear"] = (is_interleaved(y.placements[0]), y.placements[0].dim, tuple(y.to_local().shape))
    q, k, v = y.split(4, dim=-1)
    qc, _, _ = y.chunk(3, dim=2)
    out["split"] = (q.placements, tuple(q.to_local().shape), qc.placements)
    # Values of each section: as single device (matmul on fewer columns: rounding only, 1e-6).
    ref = nn.functional.linear(x, W, b)
    out["sections"] = max((t.full_tensor() - s).abs().max().item() for t, s in zip((q, k, v), ref.split(4, -1)))
    # Backward through split (a cat of Shard sections -> IS gradient) matches single device and
    # needs no collective until the scalar loss.
    loss = (q * k.sigmoid() + v).pow(2).sum()
    with CommDebugMode() as comm:
        loss.backward()
    out["backward_collectives"] = comm.get_total_counts()
    Wr, br = W.clone().requires_grad_(), b.clone().requires_grad_()
    qr, kr, vr = nn.functional.linear(x, Wr, br).split(4, -1)
    (qr * kr.sigmoid() + vr).pow(2).sum().backward()
    out["grads"] = (Wd.grad.placements, (Wd.grad.full_tensor() - Wr.grad).abs().max().item(),
                    (bd.grad.full_tensor() - br.grad).abs().max().item())
    c = torch.cat([q, k, v], dim=-1)
    out["cat"] = (repr(c.placements[0]), torch.equal(c.to_local(), y.to_local()))
    # Splits that are not the sections still gather first (PyTorch's rule), with correct values.
    halves = y.split(6, dim=-1)
    out["other_split"] = (halves[0].placements, torch.equal(halves[0].full_tensor(), y.full_tensor()[..., :6]))
    # MoE gate|up experts (E, 2I, H) as HF's kernels use them: an expert's slice (select), the
    # batched_mm path (index by expert ids, bmm) and the gate/up chunk stay local and exact.
    E, I, H = 3, 4, 6
    Wm, xm, ids = torch.randn(E, 2 * I, H), torch.randn(5, H), torch.tensor([0, 2, 1, 2, 0])
    Wmd = distribute_tensor(Wm, mesh, [InterleavedShard(1, 2)])
    with CommDebugMode() as comm:
        gate, up = nn.functional.linear(xm, Wmd[1]).chunk(2, dim=-1)
        bgate, bup = torch.bmm(Wmd[ids], xm.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    ref_gate, ref_up = nn.functional.linear(xm, Wm[1]).chunk(2, dim=-1)
    ref_bgate, ref_bup = torch.bmm(Wm[ids], xm.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    out["moe"] = (
        comm.get_total_counts(),
        [t.placements for t in (gate, up, bgate, bup)],
        all(torch.equal(t.full_tensor(), r) for t, r in zip((gate, up, bgate, bup), (ref_gate, ref_up, ref_bgate, ref_bup))),
    )
    return out


def test_layout_redistribute_and_ops():
    for out in run_on_ranks(_ops, 2):
        assert out["layout"] and out["to_replicate"] and out["from_replicate"]
        assert out["linear"] == (True, 2, (2, 5, 6))
        assert out["split"] == ((Shard(2),), (2, 5, 2), (Shard(2),))
        assert out["sections"] <= 1e-6
        placements, gw, gb = out["grads"]
        assert is_interleaved(placements[0]) and gw <= 1e-5 and gb <= 1e-5
        assert out["backward_collectives"] == 0
        assert out["cat"] == ("InterleavedShard(dim=2, interleave=3)", True)
        assert out["other_split"] == ((Replicate(),), True)
        assert out["moe"] == (0, [(Shard(1),)] * 4, True)


def _rng():
    mesh = vescale.init_mesh((2,), ("TP",))
    vescale.manual_seed(7)
    d = distribute_tensor(torch.zeros(12, 5), mesh, [InterleavedShard(0, 3)])
    nn.init.normal_(d)
    nn.init.kaiming_uniform_(e := distribute_tensor(torch.zeros(6, 4), mesh, [InterleavedShard(1, 2)]))
    vescale.manual_seed(7)
    with vescale.random.consistent():
        ref = nn.init.normal_(torch.zeros(12, 5))
        ref2 = nn.init.kaiming_uniform_(torch.zeros(6, 4))
    return torch.equal(d.full_tensor(), ref), torch.equal(e.full_tensor(), ref2), tuple(d.to_local().shape)


def test_random_init_is_single_device_exact():
    for same, same2, shape in run_on_ranks(_rng, 2):
        assert same and same2 and shape == (6, 5)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 12)
        self.out = nn.Linear(4, 8)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        q, k, v = self.drop(self.qkv(x)).chunk(3, dim=-1)
        return self.out(q * k.sigmoid() + v).pow(2).mean()


def _plan(zero3: bool) -> VescalePlan:
    plan = VescalePlan()
    plan.shard(r"qkv\.(weight|bias)", InterleavedShard(0, 3), mesh="TP")
    plan.shard(r"out\.weight", Shard(1), mesh="TP")
    if zero3:  # ZeRO-3 on the other dim of the interleaved weight
        plan.shard(r".*weight", Shard(1), mesh="DP", phase=INIT)
        plan.shard(r".*weight", Replicate(), mesh="DP", phase=RUN)
        plan.shard("<in>", Shard(0), mesh="DP")
    return plan


def _train(path, zero3):
    world = dist.get_world_size()
    mesh = vescale.init_mesh((2, 2), ("DP", "TP")) if world == 4 else vescale.init_mesh((2,), ("TP",))
    vescale.manual_seed(0)
    ref, model = Net(), Net()
    model.load_state_dict(ref.state_dict())
    vescale.parallelize(model, _plan(zero3), mesh)
    local = tuple(model.qkv.weight.to_local().shape)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    x = torch.randn(4, 8)
    for step in range(5):
        for m, opt in zip((ref, model), opts):
            vescale.manual_seed(100 + step)  # the same dropout mask on one device and on the mesh
            with vescale.random.consistent():
                loss = m(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
    diff = max((a.full_tensor() - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    # DCP: save the interleaved model, load into an unplanned (replicated) one and into a fresh
    # interleaved one.
    dcp.save(model.state_dict(), checkpoint_id=path)
    plain = vescale.parallelize(Net(), VescalePlan(), mesh)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=path)
    plain.load_state_dict(sd)
    to_plain = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(plain.parameters(), model.parameters()))
    fresh = vescale.parallelize(Net(), _plan(zero3), mesh)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=path)
    fresh.load_state_dict(sd)
    to_fresh = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(fresh.parameters(), model.parameters()))
    return local, diff, to_plain, to_fresh, model.qkv.weight.placements


@pytest.mark.parametrize("world,zero3", [(2, False), (4, True)])
def test_training_zero3_and_checkpoint(world, zero3):
    path = tempfile.mkdtemp()
    for local, diff, to_plain, to_fresh, placements in run_on_ranks(_train, world, path, zero3):
        assert local == ((6, 4) if zero3 else (6, 8))  # split by TP (and by DP on dim 1 at rest)
        assert is_interleaved(placements[-1])
        # fp32, 5 AdamW steps; TP changes only summation order within matmuls.
        assert diff <= 1e-5
        assert to_plain and to_fresh
