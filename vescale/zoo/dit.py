"""diffusers ``DiTTransformer2DModel``, unchanged and with its default config and attention
processor (``AttnProcessor2_0``: ``F.scaled_dot_product_attention``), and a plan for it.

``dit_plan`` is Megatron-style tensor parallelism on the transformer blocks plus data parallelism
and an optional ZeRO-3:

* attention, head-parallel: ``to_q``/``to_k``/``to_v`` column-wise (``Shard(0)`` of weight and
  bias), so each rank's projection holds whole heads; the processor's
  ``view(batch, -1, heads, head_dim).transpose(1, 2)`` then gives heads-sharded q/k/v (DTensor's
  view rule splits the sharded feature dim into (heads, head_dim) with the shard on heads) and
  SDPA runs on local heads; ``to_out.0`` row-wise (``Shard(1)``), its Partial output all-reduced
  at the block's ``attn1.<out>``;
* FFN, split: ``ff.net.0.proj`` column-wise, ``ff.net.2`` row-wise, all-reduced at ``ff.<out>``;
* adaLN-Zero modulation (``norm1.linear``, 6 chunks of the hidden size), timestep/class embedders,
  patch embedding and the output head stay replicated: they are small and ``chunk``ed along the
  feature dim, which a plain ``Shard`` would mis-align;
* DP: the batch (``hidden_states``, ``timestep``, ``class_labels``) is split along dim 0 (with
  ``local_inputs=True`` each rank passes its own rows instead);
* ZeRO-3 (on DP): every parameter is stored ``Shard(0)`` on DP and gathered while its module runs.

What made attention head-parallel for real (in ``vescale.dispatch``, nothing in the model is
changed): the CPU SDPA kernel got a heads/batch rule (it had none, so the default processor failed
under TP); its outputs carry the kernel's real memory layout in their global strides (with the
meta kernel's "contiguous" strides, a replicated SDPA output made ``transpose(1, 2).contiguous()``
a no-op and the next ``reshape`` fail with ``view size is not compatible`` — reproduced with HF
LLaMA at TP=4; with this DiT's ``transpose(1, 2).reshape`` it did not reproduce); and the older
``AttnProcessor``'s ``head_to_batch_dim`` path keeps its scores on local heads because the search
slices the plain ``baddbmm`` operand instead of gathering q and k.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

if TYPE_CHECKING:
    from torch import nn

from ..plan import INIT, RUN, VescalePlan
from .plans import LocalInputs, _mesh_has, batch_keys, split_batch

__all__ = ["TINY_DIT_SIZES", "tiny_dit", "dit_plan"]

# Every dimension a plan splits (heads, FFN width, batch) divides by 2 and 4.
TINY_DIT_SIZES = dict(
    num_attention_heads=4,
    attention_head_dim=8,
    in_channels=4,
    num_layers=2,
    sample_size=8,
    patch_size=2,
    num_embeds_ada_norm=10,
)

_BLOCK = r"transformer_blocks\.\d+"


def _diffusers():
    try:
        import diffusers
    except ImportError as e:
        raise ImportError(
            "vescale.zoo's DiT needs the `diffusers` package; install it with `pip install -e '.[hf]'` "
            "(or `pip install diffusers`)"
        ) from e
    return diffusers


def tiny_dit(**overrides: Any) -> nn.Module:
    """``diffusers.DiTTransformer2DModel`` at the tiny sizes, every other setting its default
    (dropout, norm, activation, attention processor); keyword arguments override config fields."""
    return _diffusers().DiTTransformer2DModel(**{**TINY_DIT_SIZES, **overrides})


def dit_plan(
    mesh: DeviceMesh | None = None,
    config: Any = None,
    *,
    tp: str | None = "TP",
    dp: str | None = "DP",
    zero3: bool = False,
    local_inputs: LocalInputs = False,
) -> VescalePlan:
    """A plan for ``DiTTransformer2DModel`` (see the module doc). ``tp`` / ``dp`` name the mesh
    dimensions; a name that is ``None`` or absent from ``mesh`` turns that parallelism off.
    ``config`` (the model's) is checked: the TP size must divide the number of heads.
    ``local_inputs=True``: each DP rank passes only its share of the batch (its rows of
    ``hidden_states``, ``timestep`` and ``class_labels``; a list of argument names says which)."""
    use_tp, use_dp = _mesh_has(mesh, tp), _mesh_has(mesh, dp)
    if zero3 and not use_dp:
        raise ValueError(f"dit_plan: zero3=True shards parameters over the DP dimension, but {dp!r} is not in the mesh")
    plan = VescalePlan()
    if use_tp:
        heads = getattr(config, "num_attention_heads", None)
        if heads is not None and mesh is not None and heads % mesh[tp].size():
            raise ValueError(
                f"dit_plan: {heads} attention heads do not split over {tp}={mesh[tp].size()}; "
                "use a TP size that divides the number of heads"
            )
        for block, col, row in ((r"attn1", r"to_(q|k|v)", r"to_out\.0"), (r"ff", r"net\.0\.proj", r"net\.2")):
            plan.shard(rf"{_BLOCK}\.{block}\.<in>[hidden_states]", Replicate(), mesh=tp)
            plan.shard(rf"{_BLOCK}\.{block}\.{col}\.(weight|bias)", Shard(0), mesh=tp)
            plan.shard(rf"{_BLOCK}\.{block}\.{row}\.weight", Shard(1), mesh=tp)
            plan.shard(rf"{_BLOCK}\.{block}\.<out>", Replicate(), mesh=tp)
        # Static Eager: diffusers' attention processors view q, k and v with the global head count
        # (``attn.heads``), which the local, head-split projections do not have: attention's own
        # ops stay on DTensors; its projections and the feed-forward run static.
        plan.eager(rf"{_BLOCK}\.attn1")
    if use_dp:
        keys, local = batch_keys(local_inputs, [rf"<in>[{n}]" for n in ("hidden_states", "timestep", "class_labels")], "dit_plan")
        split_batch(plan, keys, dp, local)
        if zero3:
            plan.shard(r".*\.(weight|bias)", Shard(0), mesh=dp, phase=INIT)
            plan.shard(r".*\.(weight|bias)", Replicate(), mesh=dp, phase=RUN)
    return plan
