"""HuggingFace ``GPT2LMHeadModel``, unchanged, and its plan.

GPT-2 differs from LLaMA where a plan notices:

* its projections are ``Conv1D`` layers, whose weight is ``(in, out)`` — the transpose of
  ``nn.Linear``'s — so column-parallel is ``Shard(1)`` of the weight (and ``Shard(0)`` of the bias)
  and row-parallel is ``Shard(0)``;
* attention's q|k|v are one fused ``c_attn`` whose output the model ``split``\\ s into three. Its
  weight is ``InterleavedShard(1, 3)`` (its bias ``InterleavedShard(0, 3)``): each rank holds the
  same heads of q, k and v, the model's own ``split`` stays local (see ``vescale.dispatch``), and
  attention runs head-parallel;
* the token embedding ``wte`` is tied to ``lm_head``. The plan keeps the tied pair replicated on TP
  (one tensor, one placement; it stays tied): a vocabulary-parallel lookup without sequence
  parallelism hits DTensor's masked-partial gradient limit (see docs/architecture.md), and
  replicating costs no communication, only the head's matmul on every TP rank With ``zero3`` it
  is stored ``Shard(0)`` on DP like every other weight (often the largest tensor): gathered once per
  step for both of its modules, its two gradient contributions reduce-scattered once.

The builder uses GPT-2's default config (dropouts 0.1, tied embeddings, gelu_new, KV cache on, SDPA
attention) at tiny sizes. Training (dropout > 0) takes PyTorch's decomposed math attention, whose
dropout vescale's RNG draws; evaluation (dropout 0) takes the fused CPU flash kernel, which
``vescale.dispatch`` runs head-parallel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

if TYPE_CHECKING:
    from torch import nn

from ..placement import InterleavedShard
from ..plan import INIT, RUN, VescalePlan
from .plans import LocalInputs, _mesh_has, batch_keys, split_batch
from .hf import _transformers

__all__ = ["TINY_GPT2_SIZES", "tiny_hf_gpt2_config", "tiny_hf_gpt2", "gpt2_plan"]

# Heads, hidden, MLP (4 x hidden), vocabulary, batch and sequence all divide by 2 and 4.
TINY_GPT2_SIZES = dict(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=127, eos_token_id=127)

_BLOCK = r"transformer\.h\.\d+"


def tiny_hf_gpt2_config(**overrides: Any) -> Any:
    """``transformers.GPT2Config`` at the tiny sizes, otherwise GPT-2's defaults (SDPA attention)."""
    return _transformers().GPT2Config(**{**TINY_GPT2_SIZES, **overrides})


def tiny_hf_gpt2(**overrides: Any) -> nn.Module:
    """``transformers.GPT2LMHeadModel`` from ``tiny_hf_gpt2_config(**overrides)``, randomly initialised."""
    return _transformers().GPT2LMHeadModel(tiny_hf_gpt2_config(**overrides))


def gpt2_plan(
    mesh: DeviceMesh | None = None,
    config: Any = None,
    *,
    tp: str | None = "TP",
    dp: str | None = "DP",
    zero3: bool = False,
    local_inputs: LocalInputs = False,
) -> VescalePlan:
    """A plan for ``GPT2LMHeadModel``: head-parallel attention through the fused ``c_attn``
    (``InterleavedShard``), Megatron-style split MLP, replicated tied embeddings (TP); the batch
    split over DP; with ``zero3``, every weight (the block weights, ``wpe``, ``ln_f`` and the tied
    ``wte``/``lm_head``) stored ``Shard(0)`` on DP and gathered while its modules run (the biases
    stay replicated on DP). A name that is ``None`` or not in ``mesh`` turns that parallelism off.
    ``config`` (the model's GPT2Config) lets the plan check that TP divides the head count.
    ``local_inputs`` (as in ``llama_plan``): each DP rank passes only its share of the batch.
    """
    use_tp, use_dp = _mesh_has(mesh, tp), _mesh_has(mesh, dp)
    if zero3 and not use_dp:
        raise ValueError(f"gpt2_plan: zero3=True shards parameters over the DP dimension, but {dp!r} is not in the mesh")
    heads = getattr(config, "n_head", None)
    if use_tp and mesh is not None and heads is not None and heads % mesh[tp].size():
        raise ValueError(f"gpt2_plan: TP size {mesh[tp].size()} must divide the head count n_head={heads}")
    plan = VescalePlan()
    if use_tp:
        # Attention: q|k|v sections split by heads; the output projection row-parallel.
        plan.shard(rf"{_BLOCK}\.attn\.<in>[hidden_states]", Replicate(), mesh=tp)
        plan.shard(rf"{_BLOCK}\.attn\.c_attn\.weight", InterleavedShard(1, 3), mesh=tp)
        plan.shard(rf"{_BLOCK}\.attn\.c_attn\.bias", InterleavedShard(0, 3), mesh=tp)
        plan.shard(rf"{_BLOCK}\.attn\.c_proj\.weight", Shard(0), mesh=tp)
        plan.shard(rf"{_BLOCK}\.attn\.c_proj\.<out>", Replicate(), mesh=tp)
        # MLP: c_fc column-parallel, c_proj row-parallel.
        plan.shard(rf"{_BLOCK}\.mlp\.<in>", Replicate(), mesh=tp)
        plan.shard(rf"{_BLOCK}\.mlp\.c_fc\.weight", Shard(1), mesh=tp)
        plan.shard(rf"{_BLOCK}\.mlp\.c_fc\.bias", Shard(0), mesh=tp)
        plan.shard(rf"{_BLOCK}\.mlp\.c_proj\.weight", Shard(0), mesh=tp)
        plan.shard(rf"{_BLOCK}\.mlp\.c_proj\.<out>", Replicate(), mesh=tp)
        # Static Eager: attention splits q|k|v with the global ``split_size`` and Conv1D views its
        # output with its global width (``nf``); static steps pass the local sizes
        # (vescale.static.local_sizes), so the blocks run on local tensors.
    if use_dp:
        # Static Eager: GPT2Model expands its plain position ids to the batch size it reads from the
        # input, which DP splits; static steps give that call the global size back
        # (vescale.static.local_sizes.GlobalSizes), so its body runs static too.
        keys, local = batch_keys(local_inputs, [r"<in>[(input_ids|labels)]"], "gpt2_plan")  # keys are regexes too
        split_batch(plan, keys, dp, local)
        if zero3:
            # Every weight, the tied wte/lm_head included (one statement names both: a shared
            # tensor gets the same statements under every name; it is gathered once per step and
            # its two gradient contributions reduce-scattered once). Not the biases (c_attn's is
            # interleaved on its only dim, which cannot be sharded on DP too).
            weights = rf"({_BLOCK}\..*|transformer\.(wte|wpe|ln_f)|lm_head)\.weight"
            plan.shard(weights, Shard(0), mesh=dp, phase=INIT)
            plan.shard(weights, Replicate(), mesh=dp, phase=RUN)
    return plan
