"""Mixture-of-experts models from HuggingFace (Mixtral, Qwen3-MoE), unchanged, and their plan.

    model = vescale.zoo.tiny_hf_mixtral()                  # or tiny_hf_qwen3_moe(); any experts kernel
    plan = vescale.zoo.moe_plan(mesh, model.config, zero3=True)
    vescale.parallelize(model, plan, mesh)

``moe_plan`` is ``llama_plan`` (attention TP, SP, DP, ZeRO-3) with the dense MLP statements replaced
by the experts' ones:

* **tensor-parallel experts** (``tp``, the paper's MoE plan): HF keeps every expert's gate and up
  projections in one tensor, ``gate_up_proj`` of shape (experts, 2 x intermediate, hidden), and its
  kernels ``chunk`` the projection's output into gate and up. ``InterleavedShard(1, 2)`` gives each
  rank its slice of both halves, so that ``chunk`` stays local; ``down_proj`` (experts, hidden,
  intermediate) is row-parallel (``Shard(2)``) and the block's output is reduced once, as in LLaMA.
  The router (``mlp.gate``) stays replicated: every rank routes every token the same way.
* **expert parallelism** (``ep``): each rank of the ``EP`` mesh dim holds experts/EP whole experts and
  the tokens are routed to them with all-to-all (``vescale.parallel.experts``); the EP dim also splits
  the batch, like DP, for everything outside the experts.
* **data parallelism** (``dp``, without ``ep``): the MoE blocks are batch-local
  (``plan.batch_local``, ``vescale.parallel.batch_local``): each DP rank's router and experts run on
  its own tokens, on the sub-mesh of the other dims (the routing's data-dependent ops would
  otherwise gather the tokens over DP and every rank would run the experts on all of them).
* **ZeRO-3** (``zero3``, on ``dp``): ``.*weight`` does not name HF's expert tensors
  (``gate_up_proj``, ``down_proj``), so the plan adds them: stored ``Shard(0)`` (by expert) on DP,
  gathered while their module runs.

Every experts kernel HF offers (``config._experts_implementation``: ``grouped_mm`` — the default —,
``batched_mm``, ``eager``) runs unchanged under these plans; ``vescale.dispatch`` supplies the
data-dependent ops (``nonzero``, ``where``, ``index_add_``) and fp32 ``_grouped_mm`` they use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

if TYPE_CHECKING:
    from torch import nn

from ..placement import InterleavedShard
from ..plan import INIT, RUN, PlanError, VescalePlan
from .hf import _transformers
from .plans import LocalInputs, _mesh_has, batch_keys, llama_plan, split_batch

__all__ = [
    "moe_plan", "TINY_MOE_SIZES", "tiny_hf_mixtral", "tiny_hf_mixtral_config", "tiny_hf_qwen3_moe",
    "tiny_hf_qwen3_moe_config",
]

_EXPERTS = r"model\.layers\.\d+\.mlp\.experts"

# Every sharded size (heads, kv heads, experts, intermediate, vocab, batch, sequence) divides by 2
# and 4; 4 experts with 2 per token, so small batches still leave some experts without tokens.
TINY_MOE_SIZES = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)


def tiny_hf_mixtral_config(**overrides: Any) -> Any:
    """``transformers.MixtralConfig`` at the tiny sizes, 4 experts, ``use_cache=False`` (training
    needs no KV cache); overrides use HF's names."""
    settings = {**TINY_MOE_SIZES, "num_local_experts": 4, "use_cache": False, **overrides}
    return _transformers().MixtralConfig(**settings)


def tiny_hf_mixtral(**overrides: Any) -> nn.Module:
    """``transformers.MixtralForCausalLM`` from ``tiny_hf_mixtral_config(**overrides)``: the model's
    default kernels unless overridden, e.g. ``experts_implementation="eager"``, ``attn_implementation="eager"``."""
    return _transformers().MixtralForCausalLM(tiny_hf_mixtral_config(**overrides))


def tiny_hf_qwen3_moe_config(**overrides: Any) -> Any:
    """``transformers.Qwen3MoeConfig`` at the tiny sizes (4 experts of intermediate 32, head_dim 8),
    ``use_cache=False``; overrides use HF's names."""
    settings = {
        **TINY_MOE_SIZES, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 8, "use_cache": False,
        **overrides,
    }
    return _transformers().Qwen3MoeConfig(**settings)


def tiny_hf_qwen3_moe(**overrides: Any) -> nn.Module:
    """``transformers.Qwen3MoeForCausalLM`` from ``tiny_hf_qwen3_moe_config(**overrides)``, default kernels otherwise."""
    return _transformers().Qwen3MoeForCausalLM(tiny_hf_qwen3_moe_config(**overrides))


def moe_plan(
    mesh: DeviceMesh | None = None,
    config: Any = None,
    *,
    tp: str | None = "TP",
    dp: str | None = "DP",
    ep: str | None = "EP",
    sequence_parallel: bool = False,
    zero3: bool = False,
    local_inputs: LocalInputs = False,
) -> VescalePlan:
    """A plan for HF MoE causal LMs (Mixtral, Qwen3-MoE): ``llama_plan`` for attention, embeddings,
    DP and ZeRO-3, plus tensor-parallel experts on ``tp`` and expert parallelism on ``ep``.

    A mesh dim name that is ``None`` (or absent from ``mesh``) turns that parallelism off. Experts are
    either tensor-parallel or expert-parallel, never both: with ``ep`` in the mesh the experts are
    whole on each EP rank and replicated on ``tp``.

    ``local_inputs`` (as in ``llama_plan``): each rank passes only its share of the batch, split over
    ``dp`` and ``ep`` (both split the batch): ``vescale.data.GlobalBatchSampler(..., dims=(dp, ep))``.
    """
    use_tp, use_dp, use_ep = _mesh_has(mesh, tp), _mesh_has(mesh, dp), _mesh_has(mesh, ep)
    plan = llama_plan(mesh, config, tp=tp, dp=dp, sequence_parallel=sequence_parallel, zero3=zero3, mlp=False,
                      local_inputs=local_inputs)
    if use_tp:
        between = Shard(1) if sequence_parallel else Replicate()
        plan.shard(r"model\.layers\.\d+\.mlp\.<in>", Replicate(), mesh=tp)
        plan.shard(r"model\.layers\.\d+\.mlp\.<out>", between, mesh=tp)
        if not use_ep:
            plan.shard(rf"{_EXPERTS}\.gate_up_proj", InterleavedShard(1, 2), mesh=tp)  # gate | up
            plan.shard(rf"{_EXPERTS}\.down_proj", Shard(2), mesh=tp)  # row-parallel
            # Static Eager runs the whole block on local tensors: the router's and the experts' input
            # gradients are both Partial over TP (vescale.dispatch.fast.partial keeps the router's Partial
            # through its softmax backward), so the block adds them as local tensors of one layout;
            # the gradients of the router's top-k and of the experts' token gather go into autograd's
            # own zeros (local: vescale.static.record._zeros_made_partial).
    if use_ep:
        keys, local = batch_keys(local_inputs, [r"<in>\[input_ids\]", r"<in>\[labels\]"], "moe_plan")
        split_batch(plan, keys, ep, local)  # EP ranks split the batch ...
        plan.experts(_EXPERTS, mesh=ep)  # ... and own experts/EP experts each
    if use_dp and not use_ep and (mesh is None or mesh[dp].size() > 1):
        if getattr(config, "output_router_logits", False):
            # HF collects the router logits of every layer for its load-balancing loss outside the
            # blocks, where they would be this DP rank's tokens taken for the whole batch.
            raise PlanError(
                f"moe_plan: config.output_router_logits=True (the load-balancing auxiliary loss) is not supported "
                f"with batch-local MoE blocks under {dp!r}; set output_router_logits=False, or split the experts "
                f"with an EP mesh dim instead"
            )
        # The router and the experts are per-token: each DP rank runs the MoE block on its own
        # tokens (on the other dims' sub-mesh). Without this, DTensor's rules for the routing's
        # data-dependent ops would replicate the tokens over DP: every rank would run the experts
        # on every rank's tokens.
        plan.batch_local(r"model\.layers\.\d+\.mlp", mesh=dp)
    if zero3 and use_dp:
        # `.*weight` in llama_plan does not match HF's expert tensors.
        plan.shard(rf"{_EXPERTS}\.(gate_up_proj|down_proj)", Shard(0), mesh=dp, phase=INIT)
        plan.shard(rf"{_EXPERTS}\.(gate_up_proj|down_proj)", Replicate(), mesh=dp, phase=RUN)
    return plan
