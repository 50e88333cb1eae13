"""``vescale.dispatch.fast.unwrap``: the shorter ``unwrap_to_op_info`` builds PyTorch's own ``OpInfo``
(every field) for calls of DTensors, size lists and scalars, takes that short path for them, and
hands every other call (plain tensors, tensor lists, tensor keywords, ops that need pytree) to
PyTorch's function; and in training steps of HF's LLaMA and Mixtral under their plans (two lengths,
a (1, 4) mesh) every call the C++ dispatcher makes gets PyTorch's ``OpInfo`` (~320 and ~370 calls,
all but 18 and 30 on the short path)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vescale.dispatch import install, uninstall
from vescale.dispatch.fast.unwrap import unwrap_to_op_info

aten = torch.ops.aten


def _dt(mesh, shape, placements):
    return DTensor.from_local(torch.randn(*shape), mesh, placements, run_check=False)


def _calls(mesh):
    a = _dt(mesh, (4, 6), (Shard(0), Replicate()))
    b = _dt(mesh, (4, 6), (Shard(0), Replicate()))
    p = _dt(mesh, (4, 6), (Replicate(), Partial()))
    short = [  # (op, args, kwargs) the short path builds
        (aten.add.Tensor, (a, b), {}),
        (aten.add.Tensor, (a, p), {"alpha": 2}),
        (aten.mul.Scalar, (a, 3.0), {}),
        (aten.view.default, (a, [8, 6]), {}),
        (aten.sum.dim_IntList, (a, [1], True), {}),
        (aten.transpose.int, (a, 0, 1), {}),
        (aten._to_copy.default, (a,), {"dtype": torch.float64}),
    ]
    general = [  # ... and those it leaves to PyTorch's function
        (aten.mul.Tensor, (a, torch.tensor(2.0)), {}),  # a plain (scalar) tensor
        (aten.cat.default, ([a, b], 0), {}),  # a tensor list (pytree)
        (aten.index.Tensor, (a, [torch.tensor([1])]), {}),  # one element: replicated
        (aten.add.Tensor, (torch.tensor(1.0), a), {}),  # the mesh comes from a later argument
        (aten.where.self, (torch.tensor(True), a, b), {}),
    ]
    return short, general


def _assert_same(ours, theirs):
    assert ours.compute_mesh is theirs.compute_mesh
    assert ours.schema == theirs.schema
    assert ours.schema.args_schema == theirs.schema.args_schema
    assert ours.schema.kwargs_schema == theirs.schema.kwargs_schema
    assert ours.schema.schema_info is theirs.schema.schema_info
    assert ours.flat_args_schema == theirs.flat_args_schema
    assert len(ours.local_args) == len(theirs.local_args)
    for x, y in zip(ours.local_args, theirs.local_args):
        assert x is y or (not isinstance(x, torch.Tensor) and x == y)
    assert ours.local_kwargs == theirs.local_kwargs
    assert ours.args_tree_spec == theirs.args_tree_spec
    assert ours.output_sharding is theirs.output_sharding is None


@pytest.fixture
def general_calls(monkeypatch):
    """Counts the calls that reach PyTorch's general function."""
    dispatcher = DTensor._op_dispatcher
    real = dispatcher._unwrap_to_op_info_impl
    seen = []

    def counted(op, args, kwargs, create_schema):
        seen.append(op)
        return real(op, args, kwargs, create_schema)

    monkeypatch.setattr(dispatcher, "_unwrap_to_op_info_impl", counted)
    return seen, real


def test_short_path_builds_pytorchs_op_info(mesh, general_calls):
    seen, pytorchs = general_calls
    short, _ = _calls(mesh)
    for op, args, kwargs in short:
        ours = unwrap_to_op_info(op, args, kwargs)
        assert not seen, f"{op} left the short path"
        _assert_same(ours, pytorchs(op, args, kwargs, True))


def test_other_calls_go_to_pytorchs_function(mesh, general_calls):
    seen, pytorchs = general_calls
    _, general = _calls(mesh)
    for op, args, kwargs in general:
        seen.clear()
        ours = unwrap_to_op_info(op, args, kwargs)
        assert seen == [op]
        _assert_same(ours, pytorchs(op, args, kwargs, True))


def test_install_puts_it_on_the_dispatcher_and_uninstall_takes_it_off(mesh):
    dispatcher = DTensor._op_dispatcher
    try:
        uninstall()
        assert "unwrap_to_op_info" not in vars(dispatcher)
        a = _dt(mesh, (4, 6), (Shard(0), Replicate()))
        expected = (a + a).to_local()
        install()
        assert dispatcher.unwrap_to_op_info is unwrap_to_op_info
        assert torch.equal((a + a).to_local(), expected)
    finally:
        install()


def test_a_plain_tensor_argument_keeps_pytorchs_error(mesh):
    a = _dt(mesh, (4, 6), (Shard(0), Replicate()))
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        unwrap_to_op_info(aten.add.Tensor, (a, torch.ones(4, 6)), {})


def _every_call_checked(model, plan_fn, mesh, seq_lengths) -> dict:
    """Training steps of ``model`` in which every call of vescale's unwrap (what DTensor's C++
    dispatcher calls on a miss of its cache) is compared with PyTorch's function."""
    import vescale
    from vescale.zoo import synthetic_batches

    dispatcher = DTensor._op_dispatcher
    real_impl = dispatcher._unwrap_to_op_info_impl
    calls = {"all": 0, "general": 0, "inside": False}

    def checked(op, args, kwargs):
        calls["all"] += 1
        calls["inside"] = True
        try:
            ours = unwrap_to_op_info(op, args, kwargs)
        finally:
            calls["inside"] = False
        _assert_same(ours, real_impl(op, args, kwargs, True))
        return ours

    def counted_impl(op, args, kwargs, create_schema):
        calls["general"] += calls["inside"]  # a call that left the short path
        return real_impl(op, args, kwargs, create_schema)

    vescale.parallelize(model, plan_fn(mesh, model.config), mesh)
    dispatcher.unwrap_to_op_info = checked
    dispatcher._unwrap_to_op_info_impl = counted_impl
    try:
        for seq in seq_lengths:
            (x, y), = synthetic_batches(1, 4, seq, model.config.vocab_size, seed=seq)
            model(input_ids=x, labels=y).loss.backward()
    finally:
        del dispatcher._unwrap_to_op_info_impl
        dispatcher.unwrap_to_op_info = unwrap_to_op_info
    return calls


def test_every_call_of_training_steps_gets_pytorchs_op_info(unit_mesh):
    """The HF LLaMA and Mixtral under their plans on a (1, 4) mesh, at two lengths: every miss of
    PyTorch's cache gets the OpInfo PyTorch's function builds, and most take the short path."""
    import vescale
    from vescale.zoo import llama_plan, moe_plan, tiny_hf_mixtral, tiny_llama

    vescale.manual_seed(0)
    for model, plan_fn in ((tiny_llama(), llama_plan), (tiny_hf_mixtral(), moe_plan)):
        calls = _every_call_checked(model, plan_fn, unit_mesh, (16, 24))
        assert calls["all"] > 50 and calls["general"] < calls["all"] / 4, (type(model).__name__, calls)
