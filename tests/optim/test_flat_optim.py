"""vescale.optim.flat: elementwise optimiser steps over flat buffers give the per-tensor bits.

Each case steps DTensor parameters (odd local sizes, several placements), plain parameters and a
float64 parameter (a layout of its own) in two param groups through vescale's hooks, and a twin of
plain tensors holding the same local shards through PyTorch's own per-tensor loop (what the local
step ran before flat buffers). Parameters, per-element state and per-parameter ``step`` must be
``torch.equal`` after every step, with some gradients left None on some steps (those parameters
must not move, and their ``step`` falls behind their neighbours'), across ``load_state_dict`` of
edited state (the buffers must take the loaded values) and a replaced local storage.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.optim.flat import FlatLayout
from vescale.optim.local_step import step_state

OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.1}),  # no state at all
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}),
    (torch.optim.NAdam, {"lr": 0.01}),
    (torch.optim.RAdam, {"lr": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.9, "centered": True}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.Adadelta, {}),
    (torch.optim.Adamax, {"lr": 0.01}),
    (torch.optim.ASGD, {"lr": 0.01}),
]
# (step, parameter index) pairs whose gradient is None
NO_GRAD = {(0, 3), (1, 2), (2, 2), (3, 0), (4, 5)}  # (0, 3): state made one step late


def _dt(mesh, shape, placements, seed):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    local = full
    for size, p in zip(mesh.shape, placements):
        if isinstance(p, Shard):
            local = local.narrow(p.dim, 0, local.shape[p.dim] // size)
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _params(mesh):
    """Mixed parameters: DTensors of odd local sizes, plain tensors, one float64 DTensor."""
    return [
        torch.nn.Parameter(_dt(mesh, (10, 7), (Shard(0), Shard(1)), 1)),
        torch.nn.Parameter(_dt(mesh, (9,), (Replicate(), Replicate()), 2)),
        torch.nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(3))),
        torch.nn.Parameter(_dt(mesh, (6, 13), (Replicate(), Shard(0)), 4)),
        torch.nn.Parameter(_dt(mesh, (4, 4), (Shard(1), Replicate()), 5).to(torch.float64)),
        torch.nn.Parameter(_dt(mesh, (33,), (Shard(0), Replicate()), 6)),
        torch.nn.Parameter(torch.randn(7, generator=torch.Generator().manual_seed(7))),
    ]


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _groups(params, kw):
    wider = dict(kw, lr=kw.get("lr", 1.0) / 2)
    return [{"params": params[:4], **kw}, {"params": params[4:], **wider}]


def _twins(params):
    return [torch.nn.Parameter(_local(p).detach().clone()) for p in params]


def _set_grads(params, twins, step):
    for i, (p, t) in enumerate(zip(params, twins)):
        if (step, i) in NO_GRAD:
            p.grad = t.grad = None
            continue
        g = torch.randn(_local(p).shape, generator=torch.Generator().manual_seed(100 * step + i), dtype=_local(p).dtype)
        t.grad = g.clone()
        p.grad = DTensor(g, p._spec, requires_grad=False) if isinstance(p, DTensor) else g


def _assert_same(opt, params, ref, twins, where):
    assert sorted(map(len, opt.state.values())) == sorted(map(len, ref.state.values())), f"{where}: state entries"
    for i, (p, t) in enumerate(zip(params, twins)):
        assert isinstance(p, torch.Tensor) and torch.equal(_local(p), t), f"{where}: parameter {i}"
        mine, theirs = opt.state.get(p, {}), ref.state.get(t, {})
        assert mine.keys() == theirs.keys(), f"{where}: parameter {i}'s state keys"
        for key, value in theirs.items():
            got = mine[key]
            if isinstance(value, torch.Tensor) and value.ndim > 0 and isinstance(p, DTensor):
                assert isinstance(got, DTensor) and got.placements == p.placements, f"{where}: {key} of {i}"
            if isinstance(value, torch.Tensor):
                assert torch.equal(_local(got), value), f"{where}: {key} of parameter {i}"
            else:
                assert got == value, f"{where}: {key} of parameter {i}"


def _train(mesh, cls, kw, steps=5, edit=None):
    params = _params(mesh)
    twins = _twins(params)
    opt, ref = cls(_groups(params, kw)), cls(_groups(twins, kw))
    for step in range(steps):
        _set_grads(params, twins, step)
        opt.step()
        ref.step()
        _assert_same(opt, params, ref, twins, f"step {step}")
        if edit is not None:
            edit(step, opt, ref, params, twins)
    return opt, params


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", ""))
def test_flat_steps_equal_the_per_tensor_steps(mesh, cls, kw, foreach):
    _train(mesh, cls, dict(kw, foreach=foreach))


def _layouts(opt):
    return [layout for kept in step_state(opt).flat_layouts.values() for layout in kept[2]]


def test_shards_and_state_live_in_the_flat_buffers(mesh):
    """Each layout's parameters' local shards are slots of its parameter buffer, their
    per-element state slots of one buffer per key; the float64 parameter (alone in its dtype)
    has no layout."""
    opt, params = _train(mesh, torch.optim.AdamW, {"lr": 0.01, "amsgrad": True})
    layouts = _layouts(opt)
    assert sorted(len(layout.params) for layout in layouts) == [2, 4]  # group 1: two float32 ones
    for layout in layouts:
        assert set(layout.state) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        for i, p in enumerate(layout.params):
            offset = layout.bounds[i] * 4
            assert _local(p).data_ptr() == layout.param_buf.data_ptr() + offset
            for key, buf in layout.state.items():
                assert _local(opt.state[p][key]).data_ptr() == buf.data_ptr() + offset, key
    assert not any(params[4] is p for layout in layouts for p in layout.params)
    steps = [opt.state[p]["step"].item() for p in params]
    assert steps == [4.0, 5.0, 3.0, 4.0, 5.0, 4.0, 5.0], steps  # each parameter's own count (NO_GRAD)


def _load_edited(step, opt, ref, params, twins):
    """After step 1: load into both optimisers a state dict whose state was changed (new tensors)."""
    if step != 1:
        return
    for o in (opt, ref):
        sd = copy.deepcopy(o.state_dict())
        for s in sd["state"].values():
            for key, v in s.items():
                if isinstance(v, torch.Tensor) and v.ndim > 0:
                    s[key] = v * 2
                elif key == "step":
                    s[key] = v + 3
        o.load_state_dict(sd)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS[1:5], ids=lambda v: getattr(v, "__name__", ""))
def test_loaded_state_is_taken_into_the_buffers(mesh, cls, kw):
    _train(mesh, cls, kw, edit=_load_edited)


def _state_replaced(step, opt, ref, params, twins):
    """After step 1: state entries replaced by new tensors in place of the old (a relayout, as
    vescale.checkpoint's after loading), the param groups untouched."""
    if step != 1:
        return
    for o, ps in ((opt, params), (ref, twins)):
        for p in ps:
            for key, v in list(o.state[p].items()):
                if isinstance(v, torch.Tensor):
                    o.state[p][key] = v * 2 if v.ndim > 0 else v + 3


@pytest.mark.parametrize("cls,kw", OPTIMIZERS[1:5], ids=lambda v: getattr(v, "__name__", ""))
def test_replaced_state_entries_are_taken_into_the_buffers(mesh, cls, kw):
    _train(mesh, cls, kw, edit=_state_replaced)


def _state_written_in_place(step, opt, ref, params, twins):
    """After step 2: every state entry written in place (DCP loads into the existing tensors)."""
    if step != 2:
        return
    for o, ps in ((opt, params), (ref, twins)):
        for p in ps:
            for v in o.state[p].values():
                if isinstance(v, torch.Tensor):
                    _local(v).mul_(3)
        o.state[ps[6]]["step"].add_(1)  # now unlike its neighbour's: it must leave their run


def test_state_written_in_place_is_seen(mesh):
    _train(mesh, torch.optim.Adam, {"lr": 0.01}, edit=_state_written_in_place)


def _new_storage(step, opt, ref, params, twins):
    """After step 1: a parameter's local tensor moved to new storage (``model.to()``, ZeRO-3)."""
    if step == 1:
        with torch.no_grad():
            _local(params[0]).set_(_local(params[0]).clone())
            params[2].data = params[2].data.clone()


def test_a_replaced_local_storage_is_stepped(mesh):
    _train(mesh, torch.optim.AdamW, {"lr": 0.01}, edit=_new_storage)


@pytest.mark.parametrize("kw", [{"fused": True}])
def test_fused_steps_stay_per_tensor(mesh, kw):
    """Fused kernels round differently by position in a tensor: flat runs would change bits."""
    params = _params(mesh)
    twins = _twins(params)
    opt, ref = torch.optim.Adam(params, lr=0.01, **kw), torch.optim.Adam(twins, lr=0.01, **kw)
    for step in range(3):
        _set_grads(params, twins, step)
        opt.step()
        ref.step()
        _assert_same(opt, params, ref, twins, f"step {step}")
    assert not _layouts(opt)


def test_a_parameter_added_later_gets_a_layout(mesh):
    params = _params(mesh)
    twins = _twins(params)
    opt, ref = torch.optim.Adam(params[:3], lr=0.01), torch.optim.Adam(twins[:3], lr=0.01)
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": params[3:], "lr": 0.02})
            ref.add_param_group({"params": twins[3:], "lr": 0.02})
        _set_grads(params, twins, step)
        opt.step()
        ref.step()
        _assert_same(opt, params, ref, twins, f"step {step}")


def test_layout_refuses_a_changed_shard_shape(mesh):
    """A local shard of another shape (a parameter resharded in place) makes begin() refuse, so
    the caller builds a new layout instead of copying into the old slots."""
    params = _params(mesh)[:2]
    layout = FlatLayout(params)
    opt = torch.optim.SGD(params, lr=0.1)
    with torch.no_grad():
        _local(params[1]).set_(torch.zeros(3))
    assert layout.begin(opt) is None


def test_state_dict_of_flat_state_saves_and_deep_copies(mesh, tmp_path):
    """Per-parameter entries are views of flat buffers: torch.save and deepcopy must still work
    and give each parameter's own values."""
    opt, params = _train(mesh, torch.optim.AdamW, {"lr": 0.01}, steps=2)
    sd = opt.state_dict()
    torch.save(sd, tmp_path / "opt.pt")
    # the parameters moved into the buffer, and DTensors made from them (DCP detaches them)
    weights = [p.detach() for p in params]
    torch.save(weights, tmp_path / "weights.pt")
    for got in (copy.deepcopy(weights), torch.load(tmp_path / "weights.pt", weights_only=False)):
        assert all(torch.equal(_local(a), _local(b)) for a, b in zip(got, weights))
    for got in (copy.deepcopy(sd), torch.load(tmp_path / "opt.pt", weights_only=False)):
        for i, s in sd["state"].items():
            for key, value in s.items():
                assert torch.equal(_local(got["state"][i][key]), _local(value)), (i, key)

