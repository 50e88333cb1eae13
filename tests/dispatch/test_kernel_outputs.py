"""PyTorch's miss path without its FakeTensor run: ``vescale.dispatch.metas.kernel_outputs``.

On a first miss DTensor learns an op's output metadata (global shape, stride, dtype) by running the
op under ``FakeTensorMode``; for ops where FakeTensor would only call the op's Meta kernel, vescale
calls that kernel on meta tensors instead (a rank's first step: ~90 such misses). The claim is
equality with PyTorch's answer, so every answer given in the first training steps of the zoo's
model kinds (dense LLaMA with dropout, HF Mixtral's routing, HF GPT-2's Conv1D, diffusers' DiT) is
compared with PyTorch's own FakeTensor propagation of the same schema, and the ops FakeTensor
treats specially (views, decompositions, constructors, device moves) are left to it.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import vescale
from vescale._torch import DTensorSpec, OpSchema, TensorMeta, fake_mode_runs_meta_kernel
from vescale.dispatch.fast import cache
from vescale.dispatch.metas import kernel_outputs
from vescale.testing import fake_world, forget_dtensor_caches
from vescale.zoo import (
    dit_plan, gpt2_plan, llama_plan, moe_plan, synthetic_batches, tiny_dit, tiny_hf_gpt2, tiny_hf_mixtral, tiny_llama,
)

aten = torch.ops.aten


def _as_tuple(meta) -> tuple:
    if meta is None:
        return None
    if isinstance(meta, TensorMeta):
        return (tuple(meta.shape), tuple(meta.stride), meta.dtype)
    return tuple(_as_tuple(m) for m in meta)


def _pytorchs(op_schema):
    prop = DTensor._op_dispatcher.sharding_propagator
    return type(prop)._propagate_tensor_meta_non_cached(prop, op_schema)


def _step(name: str) -> None:
    torch.manual_seed(0)
    if name == "dit":
        mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
        model = tiny_dit(dropout=0.1)
        vescale.parallelize(model, dit_plan(mesh, model.config, zero3=True), mesh)
        x, t, c = torch.randn(4, 4, 8, 8), torch.randint(0, 1000, (4,)), torch.randint(0, 10, (4,))
        model(x, timestep=t, class_labels=c).sample.mean().backward()
        return
    build, plan = {
        "llama": (lambda: tiny_llama(attention_dropout=0.1, hidden_dropout=0.1),
                  lambda mesh, c: llama_plan(mesh, c, sequence_parallel=True, zero3=True)),
        "mixtral": (tiny_hf_mixtral, lambda mesh, c: moe_plan(mesh, c, sequence_parallel=True, zero3=True)),
        "gpt2": (tiny_hf_gpt2, lambda mesh, c: gpt2_plan(mesh, c, zero3=True)),
    }[name]
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    model = build()
    vescale.parallelize(model, plan(mesh, model.config), mesh)
    vescale.manual_seed(0)
    for input_ids, labels in synthetic_batches(1, 4, 16, 128, seed=1):
        model(input_ids=input_ids, labels=labels).loss.backward()


@pytest.mark.parametrize("name", ["llama", "mixtral", "gpt2", "dit"])
def test_first_step_metadata_from_meta_kernels_equals_fake_tensor_propagation(name, monkeypatch):
    answered, differ = [], []

    def checked(op_schema):
        ours = kernel_outputs(op_schema)
        if ours is not None:
            answered.append(str(op_schema.op))
            theirs = _pytorchs(op_schema)
            if _as_tuple(ours) != _as_tuple(theirs):
                differ.append(f"{op_schema}: meta kernel {_as_tuple(ours)}, FakeTensor {_as_tuple(theirs)}")
        return ours

    monkeypatch.setattr(cache, "kernel_outputs", checked)
    with fake_world(4):
        forget_dtensor_caches()  # every op of the step is a first miss
        try:
            _step(name)
        finally:
            forget_dtensor_caches()
    assert not differ, "\n".join(differ)
    # not vacuous: the step's first misses were answered here (elementwise ops, reductions, softmax)
    assert len(answered) >= 10 and {"aten.add.Tensor", "aten.mul.Tensor"} & set(answered), answered


def _spec(mesh, shape, dtype=torch.float32) -> DTensorSpec:
    stride = torch.empty(shape).stride()
    return DTensorSpec(mesh, (Shard(0), Replicate()), tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))


def test_ops_fake_tensor_treats_specially_are_left_to_it():
    for op in (aten.view.default, aten._to_copy.default, aten.new_empty.default, aten.nonzero.default,
               aten.index.Tensor, aten._log_softmax.default, aten.native_dropout.default, aten.ones_like.default):
        assert not fake_mode_runs_meta_kernel(op), op
    for op in (aten.mm.default, aten.add.Tensor, aten.mul.Tensor, aten._softmax.default, aten.sum.dim_IntList):
        assert fake_mode_runs_meta_kernel(op), op


def test_a_device_argument_or_an_active_dispatch_mode_leaves_the_answer_to_pytorch():
    with fake_world(4):
        mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
        a, b = _spec(mesh, (8, 6)), _spec(mesh, (6, 4))
        assert _as_tuple(kernel_outputs(OpSchema(aten.mm.default, (a, b), {}))) == ((8, 4), (4, 1), torch.float32)
        assert _as_tuple(kernel_outputs(OpSchema(aten.mm.default, (a, b), {}))) == _as_tuple(_pytorchs(OpSchema(aten.mm.default, (a, b), {})))
        # a meta call with a device would allocate there (FakeTensor's own rule handles devices)
        assert kernel_outputs(OpSchema(aten.add.Tensor, (a, torch.device("cpu")), {})) is None

        class Watching(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with Watching():  # a tracing or counting mode must not see these calls
            assert kernel_outputs(OpSchema(aten.mm.default, (a, b), {})) is None


def test_the_metadata_step_holds_coverage_below_and_the_fast_path_above():
    """``uninstall(keep_coverage=True)`` leaves datadep's fp32 ``_grouped_mm`` metadata over PyTorch's
    FakeTensor step (what comparisons with PyTorch run); ``install()`` puts the fast path on top."""
    from vescale import dispatch
    from vescale.dispatch.fast.cache import _FastOutputMetadata
    from vescale.dispatch.coverage.datadep import _GroupedMMMetadata

    prop = DTensor._op_dispatcher.sharding_propagator
    dispatch.install()
    try:
        step = prop._propagate_tensor_meta_non_cached
        assert type(step) is _FastOutputMetadata and type(step.fallback) is _GroupedMMMetadata
        dispatch.uninstall(keep_coverage=True)
        assert type(prop._propagate_tensor_meta_non_cached) is _GroupedMMMetadata
        dispatch.uninstall()
        assert "_propagate_tensor_meta_non_cached" not in vars(prop)  # PyTorch's own method again
    finally:
        dispatch.install()
