"""vescale.dispatch: the same answers as PyTorch's DTensor dispatch, found more cheaply.

Every comparison runs the op twice, with vescale's extensions installed and uninstalled (PyTorch's
own search, miss path and optimiser on DTensors), after clearing DTensor's caches, and requires
identical output placements and bit-identical local values (the same local kernel runs on the same
local data; nothing may differ). Cost claims live in benchmarks/bench_dispatch.py; these tests show
the cheap paths are actually taken (the exhaustive expansion is not called, the shape-free cache
hits, the optimiser sees local tensors).
"""

from __future__ import annotations

import pytest
import torch
import torch.testing._internal.distributed.fake_pg  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._ops import utils as dtensor_op_utils

import vescale
from vescale import dispatch
from vescale.dispatch.fast.cache import _key
from vescale.testing import fake_world, forget_dtensor_caches


@pytest.fixture(scope="module")
def mesh():
    with fake_world(4):
        try:
            yield vescale.init_mesh((2, 2), ("DP", "TP"))
        finally:
            dispatch.install()


def _fresh(installed: bool) -> None:
    forget_dtensor_caches()
    dispatch.install() if installed else dispatch.uninstall(keep_coverage=True)
    if installed:
        dispatch.shape_free_cache().clear()


def _dt(mesh, shape, placements, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g)
    local = full
    for dim, p in zip(mesh.shape, placements):  # rank 0 holds the first block on every sharded dim
        if isinstance(p, Shard):
            local = local.narrow(p.dim, 0, local.shape[p.dim] // dim)
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


CASES = {
    # attention scores on DP x TP: (batch x heads) flattened is (Shard(0), _StridedShard(0)) on both sides
    "4-D matmul, heads sharded": (lambda a, b: a @ b, ((8, 4, 6, 5), (Shard(0), Shard(1))), ((8, 4, 5, 6), (Shard(0), Shard(1)))),
    "row-parallel linear": (lambda a, b: a @ b, ((8, 6, 16), (Shard(0), Shard(2))), ((16, 12), (Replicate(), Shard(0)))),
    "column-parallel linear": (lambda a, b: a @ b, ((8, 6, 16), (Shard(0), Replicate())), ((16, 12), (Replicate(), Shard(1)))),
    "residual add": (lambda a, b: a + b, ((8, 6, 16), (Shard(0), Shard(1))), ((8, 6, 16), (Shard(0), Shard(1)))),
    "broadcast mul": (lambda a, b: a * b, ((8, 6, 16), (Shard(0), Shard(1))), ((16,), (Replicate(), Replicate()))),
    # in place: the result keeps self's placements (an optimiser's param.add_(grad))
    "in-place add, same layout": (lambda a, b: a.add_(b), ((8, 6), (Shard(0), Shard(1))), ((8, 6), (Shard(0), Shard(1)))),
    "in-place add of a Partial": (lambda a, b: a.add_(b), ((8, 6), (Replicate(), Replicate())), ((8, 6), (Replicate(), Partial()))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_search_gives_pytorchs_answer_without_the_exhaustive_expansion(mesh, case, monkeypatch):
    fn, (sa, pa), (sb, pb) = CASES[case]
    results = {}
    for installed in (False, True):
        _fresh(installed)
        calls = []
        real = dtensor_op_utils.expand_to_full_mesh_op_strategy
        monkeypatch.setattr(dtensor_op_utils, "expand_to_full_mesh_op_strategy", lambda *a, **k: calls.append(1) or real(*a, **k))
        out = fn(_dt(mesh, sa, pa, 1), _dt(mesh, sb, pb, 2))
        monkeypatch.undo()
        results[installed] = (out.placements, out._local_tensor.clone(), out.shape, len(calls))
    (p0, v0, s0, _), (p1, v1, s1, expansions) = results[False], results[True]
    assert p1 == p0 and s1 == s0, f"{case}: placements {p1} vs PyTorch's {p0}"
    assert torch.equal(v1, v0), f"{case}: local values differ from PyTorch's"
    if "Partial" not in case:  # an in-place op that must move its other operand takes the full expansion
        assert expansions == 0, f"{case}: the exhaustive N-D expansion still ran {expansions} time(s)"


def _attention_like(mesh, seq: int):
    """q/k projections, a head-split view, scores and softmax, on a DP x TP mesh."""
    x = _dt(mesh, (4, seq, 16), (Shard(0), Replicate()), seq)
    w = _dt(mesh, (16, 16), (Replicate(), Shard(1)), 7)
    q = (x @ w).view(4, seq, 4, 4).transpose(1, 2)  # heads from the TP-sharded columns
    return torch.softmax(q @ q.transpose(-1, -2), dim=-1)


def test_a_new_sequence_length_is_a_cache_hit_with_pytorchs_answer(mesh):
    _fresh(True)
    cache = dispatch.shape_free_cache()
    _attention_like(mesh, 8)
    hits = cache.hits
    ours = _attention_like(mesh, 12)  # new sizes everywhere: PyTorch's own caches all miss
    assert cache.hits - hits >= 5, f"only {cache.hits - hits} shape-free hits for a new sequence length"
    _fresh(False)
    theirs = _attention_like(mesh, 12)
    assert ours.placements == theirs.placements and ours.shape == theirs.shape
    assert torch.equal(ours._local_tensor, theirs._local_tensor)


def test_uninstall_keep_learned_sets_the_shape_free_cache_aside_for_the_next_install(mesh):
    """A benchmark switching between PyTorch's dispatch and vescale's step by step: with
    ``keep_learned`` the next install serves a new length from what was learned before the switch
    (a hit, PyTorch's answer); a plain uninstall drops it (a miss after reinstalling), and
    ``forget_dtensor_caches`` empties a cache set aside too."""
    _fresh(True)
    _attention_like(mesh, 8)
    learned = dispatch.shape_free_cache()
    dispatch.uninstall(keep_learned=True)
    assert dispatch.shape_free_cache() is None  # PyTorch's own miss path while uninstalled
    _attention_like(mesh, 10)
    dispatch.install()
    assert dispatch.shape_free_cache() is learned
    hits = learned.hits
    ours = _attention_like(mesh, 12)
    assert learned.hits - hits >= 5, f"only {learned.hits - hits} hits after reinstalling"

    dispatch.uninstall()
    dispatch.install()
    fresh = dispatch.shape_free_cache()
    assert fresh is not learned and not fresh.entries
    dispatch.uninstall(keep_learned=True)
    forget_dtensor_caches()
    dispatch.install()
    assert dispatch.shape_free_cache() is fresh and not fresh.entries
    _fresh(False)
    theirs = _attention_like(mesh, 12)
    assert ours.placements == theirs.placements and torch.equal(ours._local_tensor, theirs._local_tensor)


def test_the_cache_key_keeps_what_changes_the_decision(mesh):
    from torch.distributed.tensor._op_schema import OpSchema

    a16, a1 = _dt(mesh, (8, 16), (Shard(0), Replicate())), _dt(mesh, (8, 1), (Shard(0), Replicate()))
    a24 = _dt(mesh, (8, 24), (Shard(0), Replicate()))
    s = lambda *ts: OpSchema(torch.ops.aten.add.Tensor, tuple(t._spec for t in ts), {})
    assert _key(s(a16, a16)) == _key(s(a24, a24)), "sizes >= 2 must not split the key"
    assert _key(s(a16, a1)) != _key(s(a16, a16)), "a size-1 (broadcast) dim must split the key"
    b = _dt(mesh, (8, 16), (Shard(0), Shard(1)))
    assert _key(s(a16, a16)) != _key(s(b, b)), "placements must split the key"


def _step_params(mesh, opt_cls, installed: bool, **kw):
    _fresh(installed)
    torch.manual_seed(0)
    params = [
        torch.nn.Parameter(_dt(mesh, (8, 6), (Shard(0), Shard(1)), 3)),
        torch.nn.Parameter(_dt(mesh, (6,), (Replicate(), Replicate()), 4)),
    ]
    opt = opt_cls(params, lr=0.1, **kw)
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = _dt(mesh, p.shape, p.placements, 10 * step + i)
        opt.step()
    return params, opt


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.AdamW, {}), (torch.optim.SGD, {"momentum": 0.9})])
def test_optimizer_steps_on_local_shards_equal_dtensor_steps(mesh, opt_cls, kw):
    ref, ref_opt = _step_params(mesh, opt_cls, False, **kw)
    got, opt = _step_params(mesh, opt_cls, True, **kw)
    for p, q in zip(got, ref):
        assert isinstance(p, DTensor) and torch.equal(p._local_tensor, q._local_tensor)
    for p, q in zip(got, ref):
        for name, value in ref_opt.state[q].items():
            mine = opt.state[p][name]
            if isinstance(value, DTensor):  # per-element state stays a DTensor laid out like its parameter
                assert isinstance(mine, DTensor) and mine.placements == p.placements
                assert torch.equal(mine._local_tensor, value._local_tensor)
    assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
    opt.state_dict()  # still keyed by the DTensor parameters


def test_optimizer_state_wrappers_are_reused_across_steps(mesh):
    """The step updates per-element state in place: the DTensor wrapping it after a step is the
    one from the step before (no new wrapper per state entry and step), over the same storage;
    state loaded from a state_dict (new tensors) is taken into the flat buffers once (new
    wrappers, the loaded values), then reused."""
    params, opt = _step_params(mesh, torch.optim.AdamW, True)
    p = params[0]
    before = dict(opt.state[p])
    p.grad = _dt(mesh, p.shape, p.placements, 99)
    opt.step()
    for name in ("exp_avg", "exp_avg_sq"):
        assert opt.state[p][name] is before[name], name
    opt.load_state_dict(opt.state_dict())  # deep-copies the state: new tensors
    opt.step()  # takes the loaded values (tests/dispatch/test_flat_optim.py checks them)
    adopted = opt.state[p]["exp_avg"]
    assert isinstance(adopted, DTensor) and adopted.placements == p.placements
    opt.step()
    assert opt.state[p]["exp_avg"] is adopted


def test_optimizer_step_really_sees_local_tensors(mesh):
    _fresh(True)
    seen = []

    class Spy(torch.optim.SGD):
        pass

    p = torch.nn.Parameter(_dt(mesh, (8, 6), (Shard(0), Shard(1))))
    p.grad = _dt(mesh, (8, 6), (Shard(0), Shard(1)), 1)
    sgd = torch.optim.SGD([p], lr=0.1)
    sgd.register_step_pre_hook(lambda o, a, k: seen.append(isinstance(o.param_groups[0]["params"][0], DTensor)))
    sgd.step()
    spy = Spy([p], lr=0.1)  # a subclass may add non-elementwise logic: left on DTensors
    spy.register_step_pre_hook(lambda o, a, k: seen.append(isinstance(o.param_groups[0]["params"][0], DTensor)))
    spy.step()
    # Global hooks run before the optimiser's own, so per-instance hooks see what step() sees.
    assert seen == [False, True], seen
    assert isinstance(sgd.param_groups[0]["params"][0], DTensor)


def test_a_step_that_raises_leaves_the_optimizer_intact(mesh):
    _fresh(True)
    p = torch.nn.Parameter(_dt(mesh, (8, 6), (Shard(0), Shard(1))))
    p.grad = _dt(mesh, (8, 6), (Shard(0), Shard(1)), 1)
    opt = torch.optim.SGD([p], lr=0.1)
    opt.param_groups[0]["lr"] = "not a number"
    with pytest.raises(TypeError):
        opt.step()
    opt.param_groups[0]["lr"] = 0.1
    before = p._local_tensor.clone()
    opt.step()  # the next step puts the parameters back first
    assert opt.param_groups[0]["params"][0] is p
    assert not torch.equal(p._local_tensor, before)


def test_a_gradient_laid_out_unlike_its_parameter_keeps_the_step_on_dtensors(mesh):
    """PyTorch's own TP can leave a Partial gradient on a Replicate parameter: its local values are
    partial sums, so the step must go through DTensor (which reduces it), not run on them."""
    results = []
    for installed in (False, True):
        _fresh(installed)
        p = torch.nn.Parameter(_dt(mesh, (8, 6), (Replicate(), Replicate())))
        p.grad = DTensor.from_local(torch.ones(8, 6), mesh, [Replicate(), Partial()], run_check=False)
        torch.optim.SGD([p], lr=0.1).step()
        results.append(p._local_tensor.clone())
    assert torch.equal(results[0], results[1])


def test_a_replayed_decision_carries_the_ops_own_mesh(mesh):
    """DeviceMesh equality ignores the rank that built a mesh: a decision learned as rank 0 must not
    hand rank 1 a spec on rank 0's mesh (vescale.random would then draw rank 0's numbers)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _fresh(True)
    _attention_like(mesh, 8)  # learned on this mesh
    # The same mesh as rank 1 sees it, over the module's process group (not a new one: the other
    # tests of this module use the fixture's groups, in whatever order they run).
    other = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("DP", "TP"), _init_backend=False, _rank=1)
    assert other == mesh and other.get_coordinate() != mesh.get_coordinate()
    _clear_sharding_prop_cache()  # PyTorch's own caches forgotten; vescale's shape-free one kept
    hits = dispatch.shape_free_cache().hits
    out = _attention_like(other, 12)
    assert dispatch.shape_free_cache().hits > hits
    assert out._spec.mesh is other and out.device_mesh.get_coordinate() == other.get_coordinate()
