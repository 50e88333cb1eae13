"""vescale.dispatch.coverage.attention: SDPA on DTensors, and the error for an op without a rule.

Runs as rank 0 of a fake 4-rank process group on a DP x TP = 2 x 2 mesh. A heads- or batch-sharded
SDPA needs no communication, so rank 0's local output and gradients must equal the matching block
of the single-device result. Tolerance: bit-identical is not guaranteed (the CPU flash kernel
blocks its loops by the local sizes, which changes fp32 summation order), so 1e-6 on values of
order 1 — a wrong head pairing or a missing mask changes them by ~1e-1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.testing._internal.distributed.fake_pg  # noqa: F401
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import vescale
from vescale import dispatch
from vescale.dispatch.coverage.attention import FusedDropoutError
from vescale.dispatch.coverage.errors import MissingShardingRule
from vescale.testing import fake_world, forget_dtensor_caches

TOL = 1e-6
aten = torch.ops.aten


@pytest.fixture(scope="module")
def mesh():
    with fake_world(4):
        try:
            forget_dtensor_caches()
            dispatch.install()
            torch._C._set_dtensor_allow_implicit_replication(True)
            yield vescale.init_mesh((2, 2), ("DP", "TP"))
        finally:
            torch._C._set_dtensor_allow_implicit_replication(False)
            forget_dtensor_caches()


def _block(t: torch.Tensor, placements) -> torch.Tensor:
    """Rank 0's block (first chunk on every sharded dim) of a global tensor."""
    for p, n in zip(placements, (2, 2)):
        if isinstance(p, Shard):
            t = t.narrow(p.dim, 0, t.shape[p.dim] // n)
    return t


def _qkv(kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 4, 8, 16, generator=g)
    k, v = (torch.randn(4, kv_heads, 8, 16, generator=g) for _ in range(2))
    return q, k, v


LAYOUTS = {
    "heads on TP": (Replicate(), Shard(1)),
    "batch on DP, heads on TP": (Shard(0), Shard(1)),
    "batch on DP x TP": (Shard(0), Shard(0)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["MHA", "GQA"])
@pytest.mark.parametrize("mask", [None, "causal", "bool(B,1,L,S)", "plain float(L,S)"])
def test_cpu_flash_sdpa_runs_sharded_forward_and_backward(mesh, layout, kv_heads, mask):
    placements = LAYOUTS[layout]
    q, k, v = _qkv(kv_heads)
    attn_mask = None
    if mask == "bool(B,1,L,S)":
        attn_mask = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(3)) > 0.3
        attn_mask[..., 0] = True  # no fully-masked row
    elif mask == "plain float(L,S)":  # a mask made inside forward stays a plain tensor (the global one)
        attn_mask = torch.randn(8, 8, generator=torch.Generator().manual_seed(4))
    kw = dict(is_causal=mask == "causal", enable_gqa=kv_heads != 4, attn_mask=attn_mask)
    grad = torch.randn(4, 4, 8, 16, generator=torch.Generator().manual_seed(9))

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, **kw)
    out.backward(grad)

    dts = [distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k, v)]
    seen = []
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):  # which kernel ran: the CPU flash one, not a decomposition
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    if mask == "bool(B,1,L,S)":
        kw["attn_mask"] = distribute_tensor(attn_mask, mesh, (Replicate(), Replicate()))
    with Ops():
        got = F.scaled_dot_product_attention(*dts, **kw)
        got.backward(distribute_tensor(grad, mesh, placements))
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in seen
    assert aten._scaled_dot_product_flash_attention_for_cpu_backward.default in seen
    assert got.placements == placements, f"output went to {got.placements}: the rule redistributed"
    local = got.to_local()
    assert local.shape == _block(out, placements).shape
    assert (local - _block(out, placements)).abs().max() <= TOL
    for name, d, r in zip("qkv", dts, ref):
        assert d.grad.placements == placements, f"grad {name} placements {d.grad.placements}"
        assert (d.grad.to_local() - _block(r.grad, placements)).abs().max() <= TOL, f"grad {name}"


def test_uneven_heads_split_is_replicated_instead_of_mispairing_gqa(mesh):
    """6 query heads, 3 k/v heads: TP=2 splits q evenly but not k/v, so the rule replicates heads
    (the fake process group's gather leaves other ranks' heads empty: compare rank 0's own heads)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 6, 8, 16, generator=g), torch.randn(2, 3, 8, 16, generator=g), torch.randn(2, 3, 8, 16, generator=g)
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    dq = distribute_tensor(q, mesh, (Replicate(), Shard(1)))
    dk, dv = (distribute_tensor(t, mesh, (Replicate(), Replicate())) for t in (k, v))
    got = F.scaled_dot_product_attention(dq, dk, dv, enable_gqa=True)
    assert got.placements == (Replicate(), Replicate())
    assert (got.to_local()[:, :3] - out[:, :3]).abs().max() <= TOL


def test_fused_cuda_kernels_refuse_in_kernel_dropout(mesh):
    """The strategy runs before any kernel, so the refusal is checked on CPU DTensors too."""
    q = distribute_tensor(torch.randn(4, 4, 8, 16), mesh, (Replicate(), Shard(1)))
    with pytest.raises(FusedDropoutError, match=r"dropout_p=0.1.*SDPBackend.MATH"):
        aten._scaled_dot_product_flash_attention.default(q, q, q, 0.1)
    with pytest.raises(FusedDropoutError, match="efficient"):
        aten._scaled_dot_product_efficient_attention.default(q, q, q, None, True, 0.1)


def test_an_op_without_a_rule_names_op_module_placements_and_the_fix(mesh):
    class Inner(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten._cdist_forward.default(x, x, 2.0, None)  # has no DTensor rule

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.ModuleDict({"dist": Inner()})

        def forward(self, x):
            return self.block["dist"](x)

    x = distribute_tensor(torch.randn(4, 6, 3), mesh, (Shard(0), Shard(1)))
    with pytest.raises(MissingShardingRule) as info:
        Outer()(x)
    msg = str(info.value)
    assert "aten._cdist_forward.default" in msg
    assert "module 'block.dist'" in msg
    assert "(4, 6, 3) [Shard(dim=0), Shard(dim=1)] on mesh ('DP', 'TP')" in msg
    assert r'plan.shard(r"block\.dist\.<in>", Replicate(), mesh="DP"); plan.shard(r"block\.dist\.<in>", Replicate(), mesh="TP")' in msg
    assert isinstance(info.value, NotImplementedError)  # DTensor's decomposition fallback still applies

    with pytest.raises(MissingShardingRule, match="outside any module.*every argument is already Replicate"):
        r = distribute_tensor(torch.randn(4, 6, 3), mesh, (Replicate(), Replicate()))
        torch.ops.aten._cdist_forward.default(r, r, 2.0, None)


def test_a_plain_operand_is_sliced_to_a_heads_split_one_not_gathered(mesh):
    """diffusers' ``head_to_batch_dim`` attention: q/k flattened to (batch x heads) are
    ``(Shard(0), _StridedShard(0))``; ``baddbmm(empty, q, k^T, beta=0)`` meets a plain tensor.
    PyTorch gathers q and k and runs it replicated; vescale's search slices the plain operand (no
    communication) and keeps the scores on local heads. Values: rank 0's block of the full result."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 16, 32, generator=g)
    dx = distribute_tensor(x, mesh, (Shard(0), Shard(2)))

    def to_batch(t):  # head_to_batch_dim: (B, L, H*D) -> (B*H, L, D)
        return t.reshape(4, 16, 4, 8).permute(0, 2, 1, 3).reshape(16, 16, 8)

    bias = torch.randn(16, 16, 16, generator=g)
    q = to_batch(dx)
    scores = torch.baddbmm(bias, q, q.transpose(-1, -2), beta=0.5, alpha=0.3)
    assert scores.placements == q.placements and not any(p.is_replicate() for p in scores.placements)
    ref = torch.baddbmm(bias, to_batch(x), to_batch(x).transpose(-1, -2), beta=0.5, alpha=0.3)
    # rank 0 (DP 0, TP 0) holds batch 0-1 and heads 0-1 of each: flat rows 0, 1, 4, 5
    assert scores.to_local().shape == (4, 16, 16)
    assert (scores.to_local() - ref[[0, 1, 4, 5]]).abs().max() <= TOL


def test_a_missing_rule_on_a_sharded_parameter_names_the_parameter(mesh):
    class WithWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6, 3), mesh, (Replicate(), Shard(0))))

        def forward(self):
            return torch.ops.aten._cdist_forward.default(self.w, self.w, 2.0, None)

    class Root(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = WithWeight()

        def forward(self):
            return self.proj()

    with pytest.raises(MissingShardingRule) as info:
        Root()()
    msg = str(info.value)
    assert "module 'proj'" in msg
    assert r'plan.shard(r"proj\.w", Replicate(), mesh="TP")' in msg, msg


@pytest.mark.parametrize("bias_shape", [(4, 4, 8, 8), (4, 1, 8, 8)], ids=["full bias", "broadcast bias"])
def test_cudnn_rules_with_an_attention_bias(mesh, bias_shape):
    """Strategy level only (the kernel needs CUDA): PyTorch 2.13's cuDNN forward rule fails on any
    ``attn_bias`` (``input_specs(3) != strategies(4)``) and its backward rule splits a broadcast
    bias on its size-1 dim, which leaves only all-Replicate. The bias must follow a heads split of
    q where it is full size and be read whole where it broadcasts."""
    from torch.distributed.tensor._op_schema import OpSchema

    prop = DTensor._op_dispatcher.sharding_propagator
    tp = (Replicate(), Shard(1))
    q = distribute_tensor(torch.randn(4, 4, 8, 16), mesh, tp)._spec
    bias = distribute_tensor(torch.randn(bias_shape), mesh, (Replicate(), Replicate()))._spec
    follows = tp if bias_shape[1] == 4 else (Replicate(), Replicate())

    fwd = prop.propagate_op_sharding_non_cached(
        OpSchema(aten._scaled_dot_product_cudnn_attention.default, (q, q, q, bias, True, 0.0, False, False), {})
    )
    assert fwd.output_spec[0].placements == tp, "attention must stay on local heads"
    moved = fwd.redistribute_schema.args_schema if fwd.redistribute_schema is not None else (q, q, q, bias)
    assert [a.placements for a in moved[:4]] == [tp, tp, tp, follows]

    lse = distribute_tensor(torch.randn(4, 4, 8), mesh, tp)._spec
    seed = distribute_tensor(torch.zeros((), dtype=torch.int64), mesh, (Replicate(), Replicate()))._spec
    schema = prop._wrap_with_op_strategy(OpSchema(
        aten._scaled_dot_product_cudnn_attention_backward.default,
        (q, q, q, q, q, lse, seed, seed, bias, None, None, 8, 8, 0.0, False), {},
    ))
    strategy = prop.op_strategy_funcs[aten._scaled_dot_product_cudnn_attention_backward.default](schema)
    heads = [s for s in strategy.strategies if s.output_specs[0].placements == tp]
    assert heads, "the backward must have a heads-split rule"
    assert heads[0].input_specs[8].placements == follows


def test_sdpa_dropout_mask_is_the_single_device_mask(mesh):
    """dropout_p > 0 on CPU takes PyTorch's math path, whose mask vescale's RNG draws by global
    index. With v = identity the output *is* the dropped-out attention matrix, so its zeros are the
    mask: rank 0's block must have exactly the single-device zeros (torch.equal), and the values
    agree to rounding."""
    from vescale.random import consistent

    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(4, 4, 8, 8, generator=g), torch.randn(4, 4, 8, 8, generator=g)
    v = torch.eye(8).expand(4, 4, 8, 8).contiguous()
    vescale.manual_seed(11)
    with consistent():
        ref = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    placements = (Shard(0), Shard(1))
    vescale.manual_seed(11)
    got = F.scaled_dot_product_attention(*(distribute_tensor(t, mesh, placements) for t in (q, k, v)), dropout_p=0.3)
    assert got.placements == placements
    block = _block(ref, placements)
    assert (block == 0).any() and not (block == 0).all(), "the check needs some dropped and some kept entries"
    assert torch.equal(got.to_local() == 0, block == 0), "dropout mask differs from the single-device mask"
    assert (got.to_local() - block).abs().max() <= TOL


def test_a_view_pytorch_refuses_to_unflatten_gathers_first(mesh):
    """Autograd's view in the backward of GQA's repeat_kv reshape splits a heads-sharded dim into
    (kv_heads, n_rep); PyTorch's strict view rule refuses when the first part does not divide by
    the mesh. vescale decides it as reshape (gather, then a local view). The fake process group's
    gather leaves other ranks' part empty, so rank 0's own head is compared."""
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(8))
    dx = distribute_tensor(x, mesh, (Replicate(), Shard(1)))
    dispatch.uninstall(keep_coverage=True)
    forget_dtensor_caches()
    try:
        with pytest.raises(RuntimeError, match="Cannot unflatten unevenly sharded"):
            dx.view(4, 3, 2, 16)
    finally:
        dispatch.install()
        forget_dtensor_caches()
    out = dx.view(4, 3, 2, 16)
    assert out.shape == (4, 3, 2, 16) and out.placements == (Replicate(), Replicate())
    assert torch.equal(out.to_local().reshape(4, 6, 16)[:, :3], x[:, :3])  # rank 0's heads 0-2
