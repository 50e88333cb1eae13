"""vescale.dispatch.coverage.datadep: data-dependent ops on DTensors give the single-device result.

Every case runs the same op on a plain tensor (the single-device reference) and on DTensors with
various placements of that tensor, on real gloo ranks, and compares the DTensor's global value with
``torch.equal`` (the same local kernels see the same values: integer outputs and sums of one or two
float addends are exact; ``_grouped_mm`` sums in a different order under a row-parallel split, so it
gets 1e-5, relative and absolute, for values of magnitude ~100). Placements of the outputs are checked too: value-sized outputs are Replicate, and an
accumulation keeps its target's placements (the old bug relabelled them and returned zeros).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import vescale
from vescale.testing import run_on_ranks

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2, 3, (6, 4), generator=g).float()  # zeros, repeats and negatives
    return x


def _dt(t, mesh, placements):
    if any(isinstance(p, Partial) for p in placements):
        # a Partial(sum) whose pieces add up to t exactly: every rank holds t / n (n a power of two)
        return DTensor.from_local(t / mesh.size(), mesh, placements, run_check=False)
    return distribute_tensor(t.clone(), mesh, placements)  # a Replicate DTensor may share t's storage


def _glob(v):
    if isinstance(v, DTensor):
        return ("dt", tuple(v.placements), v.full_tensor())
    if isinstance(v, (tuple, list)):
        return tuple(_glob(i) for i in v)
    return ("plain", None, v)


VALUE_SIZED = {
    "nonzero": lambda t: torch.nonzero(t),
    "argwhere": lambda t: torch.argwhere(t),
    "where(cond)": lambda t: torch.where(t > 0),
    "mask index": lambda t: t[t > 0],
    "mask index (rows)": lambda t: t[t[:, 0] > 0],
    "bincount": lambda t: torch.bincount((t.flatten() + 2).long()),
    "bincount(weights, minlength)": lambda t: torch.bincount((t[:, 0] + 2).long(), weights=t[:, 1], minlength=7),
    "unique": lambda t: torch.unique(t),
    "unique(inverse, counts)": lambda t: torch.unique(t, return_inverse=True, return_counts=True),
    "unique(dim=0)": lambda t: torch.unique(t, dim=0),
    "unique_consecutive": lambda t: torch.unique_consecutive(t, return_counts=True),
}
PLACEMENTS_1D = {"R": (R,), "S(0)": (S0,), "S(1)": (S1,)}


def _value_sized_cases():
    mesh = vescale.init_mesh((2,), ("TP",))
    vescale.dispatch.install()
    x = _data()
    out = {}
    for pname, pl in PLACEMENTS_1D.items():
        for name, fn in VALUE_SIZED.items():
            out[(name, pname)] = _glob(fn(distribute_tensor(x, mesh, pl)))
    return out


def _accumulate_cases():
    """index_add_/scatter_add_ into targets of every placement, sources plain or DTensor."""
    mesh = vescale.init_mesh((2,), ("TP",))
    vescale.dispatch.install()
    torch._C._set_dtensor_allow_implicit_replication(True)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(-4, 5, (6, 4), generator=g).float()
    src = torch.randint(-4, 5, (5, 4), generator=g).float()
    index = torch.tensor([5, 0, 5, 2, 3])
    sidx = torch.randint(0, 6, (3, 4), generator=g)
    ssrc = torch.randint(-4, 5, (3, 4), generator=g).float()
    out = {}
    for pname, pl in {**PLACEMENTS_1D, "P": (Partial(),)}.items():
        for sname, s in {"plain src": lambda: src, "R src": lambda: distribute_tensor(src, mesh, [R]),
                         "S(0) src": lambda: distribute_tensor(src, mesh, [S0])}.items():
            target = _dt(base, mesh, pl)
            res = target.index_add_(0, index, s(), alpha=2)
            out[("index_add_", pname, sname)] = (res is target, _glob(res))
            out[("index_add(dim=1)", pname, sname)] = _glob(
                _dt(base, mesh, pl).index_add(1, torch.tensor([3, 3, 1, 0]), _dt(base, mesh, pl))
            )
        target = _dt(base, mesh, pl)
        out[("scatter_add_", pname)] = _glob(target.scatter_add_(0, sidx, ssrc))
        out[("scatter_add(dim=1)", pname)] = _glob(
            torch.scatter_add(_dt(base, mesh, pl), 1, (sidx[:, :3].repeat(2, 1) % 4), _dt(ssrc[:, :3].repeat(2, 1), mesh, [R]))
        )
    # plain target, DTensor source: the plain tensor is the global tensor and stays plain
    for sname, spl in {"R": (R,), "S(0)": (S0,)}.items():
        out[("plain.index_add_", sname)] = _glob(base.clone().index_add_(0, index, distribute_tensor(src, mesh, spl)))
        out[("plain.scatter_add_", sname)] = _glob(base.clone().scatter_add_(0, sidx, distribute_tensor(ssrc, mesh, spl)))
    try:
        _dt(base, mesh, (S0,)).index_add_(0, torch.tensor([6]), src[:1])
        out["out of range"] = None
    except IndexError as e:
        out["out of range"] = str(e)
    return out


def _reference_accumulate():
    g = torch.Generator().manual_seed(1)
    base = torch.randint(-4, 5, (6, 4), generator=g).float()
    src = torch.randint(-4, 5, (5, 4), generator=g).float()
    index = torch.tensor([5, 0, 5, 2, 3])
    sidx = torch.randint(0, 6, (3, 4), generator=g)
    ssrc = torch.randint(-4, 5, (3, 4), generator=g).float()
    return {
        "index_add_": base.clone().index_add_(0, index, src, alpha=2),
        "index_add(dim=1)": base.index_add(1, torch.tensor([3, 3, 1, 0]), base),
        "scatter_add_": base.clone().scatter_add_(0, sidx, ssrc),
        "scatter_add(dim=1)": torch.scatter_add(base, 1, (sidx[:, :3].repeat(2, 1) % 4), ssrc[:, :3].repeat(2, 1)),
        "plain.index_add_": base.clone().index_add_(0, index, src),
        "plain.scatter_add_": base.clone().scatter_add_(0, sidx, ssrc),
    }


def _autograd_cases():
    """Gradients through mask indexing, index_add_ (HF's eager experts kernel) and fp32 _grouped_mm."""
    mesh = vescale.init_mesh((2,), ("TP",))
    vescale.dispatch.install()
    torch._C._set_dtensor_allow_implicit_replication(True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, generator=g)
    w = torch.randn(6, 4, generator=g)
    out = {}
    for pname, pl in PLACEMENTS_1D.items():
        d = distribute_tensor(x, mesh, pl).requires_grad_()
        y = d[x > 0]
        (y * w[x > 0]).sum().backward()
        out[("mask index grad", pname)] = (_glob(y.detach()), _glob(d.grad))
        src = distribute_tensor(x[:4], mesh, pl).requires_grad_()
        target = distribute_tensor(torch.zeros(6, 4), mesh, pl)
        res = target.index_add_(0, torch.tensor([1, 4, 1, 5]), src)
        (res * distribute_tensor(w, mesh, pl)).sum().backward()
        out[("index_add_ grad", pname)] = (_glob(res.detach()), _glob(src.grad))
    # fp32 _grouped_mm, 2d x 3d (HF's grouped_mm experts kernel): column- and row-parallel weights
    a, b = torch.randn(10, 8, generator=g), torch.randn(3, 8, 16, generator=g)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)
    for name, (pa, pb) in {"R x R": (R, R), "R x S(2)": (R, Shard(2)), "S(1) x S(1)": (S1, S1)}.items():
        da = distribute_tensor(a, mesh, [pa]).requires_grad_()
        db = distribute_tensor(b, mesh, [pb]).requires_grad_()
        o = torch._grouped_mm(da, db, offs=offs)
        placements = tuple(o.placements)
        o.full_tensor().pow(2).sum().backward()
        out[("grouped_mm", name)] = (placements, o.full_tensor().detach(), da.grad.full_tensor(), db.grad.full_tensor())
    return out


def _reference_autograd():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, generator=g)
    w = torch.randn(6, 4, generator=g)
    d = x.clone().requires_grad_()
    y = d[x > 0]
    (y * w[x > 0]).sum().backward()
    src = x[:4].clone().requires_grad_()
    res = torch.zeros(6, 4).index_add_(0, torch.tensor([1, 4, 1, 5]), src)
    (res * w).sum().backward()
    a, b = torch.randn(10, 8, generator=g), torch.randn(3, 8, 16, generator=g)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)
    a.requires_grad_(), b.requires_grad_()
    o = torch._grouped_mm(a, b, offs=offs)
    o.pow(2).sum().backward()
    return {"mask": (y.detach(), d.grad), "index_add": (res.detach(), src.grad), "grouped_mm": (o.detach(), a.grad, b.grad)}


def _two_d_mesh_cases():
    """(DP, TP) mesh: a target sharded on both dims, and Shard(0) twice (offsets compose)."""
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    vescale.dispatch.install()
    torch._C._set_dtensor_allow_implicit_replication(True)
    g = torch.Generator().manual_seed(3)
    base = torch.randint(-4, 5, (8, 4), generator=g).float()
    src = torch.randint(-4, 5, (6, 4), generator=g).float()
    index = torch.tensor([7, 0, 3, 3, 4, 6])
    out = {}
    for name, pl in {"S(0),S(1)": (S0, S1), "S(0),S(0)": (S0, S0), "P,S(0)": (Partial(), S0)}.items():
        t = distribute_tensor(base.clone(), mesh, pl) if "P" not in name else DTensor.from_local(
            distribute_tensor(base / 2, mesh, (R, S0))._local_tensor, mesh, pl, run_check=False)
        out[name] = _glob(t.index_add_(0, index, distribute_tensor(src, mesh, (S0, R))))
        out[("nonzero", name)] = _glob(torch.nonzero(distribute_tensor(base, mesh, (S0, S1))))
    return out, base.clone().index_add_(0, index, src), torch.nonzero(base)


@functools.cache
def _run(name: str, world: int = 2):
    return run_on_ranks(globals()[name], world)[0]


def _same(got, want):
    kind, _, value = got
    assert torch.equal(value, want), (value, want)


@pytest.mark.parametrize("pname", list(PLACEMENTS_1D))
@pytest.mark.parametrize("name", list(VALUE_SIZED))
def test_value_sized_ops_match_single_device_and_are_replicated(name, pname):
    got = _run("_value_sized_cases")[(name, pname)]
    want = VALUE_SIZED[name](_data())
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for g_, w_ in zip(got, want):
            assert g_[1] == (R,)
            _same(g_, w_)
    else:
        # a row mask on a column-sharded tensor keeps the columns sharded (DTensor's own
        # integer-index rule after the mask became indices); everything else is Replicate
        expected = (S1,) if (name, pname) == ("mask index (rows)", "S(1)") else (R,)
        assert got[1] == expected
        _same(got, want)


@pytest.mark.parametrize("pname", ["R", "S(0)", "S(1)", "P"])
def test_index_add_and_scatter_add_keep_placements_and_match(pname):
    got, ref = _run("_accumulate_cases"), _reference_accumulate()
    placements = {"R": (R,), "S(0)": (S0,), "S(1)": (S1,), "P": (Partial(),)}[pname]
    for sname in ("plain src", "R src", "S(0) src"):
        same_object, res = got[("index_add_", pname, sname)]
        assert same_object, "index_add_ must return its target"
        assert res[1] == placements, f"index_add_ changed the target's placements to {res[1]}"
        _same(res, ref["index_add_"])
        out_of_place = got[("index_add(dim=1)", pname, sname)]
        assert out_of_place[1] == placements
        _same(out_of_place, ref["index_add(dim=1)"])
    for op in ("scatter_add_", "scatter_add(dim=1)"):
        assert got[(op, pname)][1] == placements
        _same(got[(op, pname)], ref[op])


def test_plain_target_with_dtensor_source_stays_plain():
    got, ref = _run("_accumulate_cases"), _reference_accumulate()
    for sname in ("R", "S(0)"):
        for op in ("plain.index_add_", "plain.scatter_add_"):
            kind, _, value = got[(op, sname)]
            assert kind == "plain"
            assert torch.equal(value, ref[op])


def test_out_of_range_index_is_an_error_not_a_silent_drop():
    msg = _run("_accumulate_cases")["out of range"]
    assert msg is not None and "index 6 is out of bounds for dimension of size 6" in msg


def test_gradients_through_masks_index_add_and_fp32_grouped_mm():
    got, ref = _run("_autograd_cases"), _reference_autograd()
    for pname in PLACEMENTS_1D:
        y, grad = got[("mask index grad", pname)]
        _same(y, ref["mask"][0])
        _same(grad, ref["mask"][1])
        res, grad = got[("index_add_ grad", pname)]
        assert res[1] == PLACEMENTS_1D[pname]
        _same(res, ref["index_add"][0])
        _same(grad, ref["index_add"][1])
    expected_out = {"R x R": (R,), "R x S(2)": (S1,), "S(1) x S(1)": (Partial(),)}
    for name, placements in expected_out.items():
        got_placements, o, ga, gb = got[("grouped_mm", name)]
        # the sharded strategies are really taken (no gather to Replicate first)
        assert got_placements == placements, (name, got_placements)
        for value, want in zip((o, ga, gb), ref["grouped_mm"]):
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-5)  # fp32 sums in another order (values ~100)


def test_two_d_mesh_offsets_compose():
    got, want, nz = _run("_two_d_mesh_cases", 4)
    placements = {"S(0),S(1)": (S0, S1), "S(0),S(0)": (S0, S0), "P,S(0)": (Partial(), S0)}
    for name, pl in placements.items():
        assert got[name][1] == pl
        _same(got[name], want)
        assert got[("nonzero", name)][1] == (R, R)
        _same(got[("nonzero", name)], nz)
