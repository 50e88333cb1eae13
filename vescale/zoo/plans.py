"""Ready plans for LLaMA-style models (the zoo's own and HuggingFace's LlamaForCausalLM).

Both models use the same module names, so one plan serves both. The plan is Megatron-style:

* tensor parallel (TP): q/k/v and gate/up projections column-wise (``Shard(0)`` of the weight),
  o/down projections row-wise (``Shard(1)``), vocabulary-parallel embedding and LM head (the
  logits stay vocabulary-sharded and the loss is computed on the shards);
* sequence parallel (SP, on TP): between blocks the residual stream is split along the sequence
  (``Shard(1)``), gathered before attention/MLP and reduce-scattered after them, so norms and
  residual adds run on 1/TP of the tokens (HF's model body, which reads the sequence length from
  the embeddings, gets them whole: the first layer takes its shard);
* data parallel (DP): the batch (``input_ids``, ``labels``) is split along dim 0: the global batch
  every rank passes (``plan.shard``), or with ``local_inputs`` the share each rank loads itself
  (``plan.annotate``; ``vescale.data`` gives each DP rank its rows);
* ZeRO-3 (on DP): every parameter is stored as ``Shard(0)`` on DP (INIT) and gathered to Replicate
  only while its module runs (RUN). Lowering stores a weight TP also shards on dim 0 inside its TP
  shard (``InterleavedShard(0, TP)`` on DP, FSDP2's layout), so gathers run over DP alone.
"""

from __future__ import annotations

import re
from typing import Any, Sequence, Union

from torch.distributed.device_mesh import DeviceMesh

from ..plan import INIT, RUN, VescalePlan
from torch.distributed.tensor import Replicate, Shard

__all__ = ["llama_plan"]

_LAYER = r"model\.layers\.\d+"


def _is_zoo_config(config) -> bool:
    from .llama import LlamaConfig

    return isinstance(config, LlamaConfig)


def _mesh_has(mesh: DeviceMesh | None, name: str | None) -> bool:
    return name is not None and (mesh is None or name in (mesh.mesh_dim_names or ()))


LocalInputs = Union[bool, Sequence[str]]


def batch_keys(local_inputs: LocalInputs, default: list[str], who: str) -> tuple[list[str], bool]:
    """The root-input paths a zoo plan splits by batch, and whether each rank passes its own share:
    ``local_inputs`` False (the global batch) or True give the plan's ``default`` paths; a list of
    argument names (``["input_ids", "labels", "attention_mask"]``) gives those, as shares."""
    if isinstance(local_inputs, bool):
        return default, local_inputs
    names = [local_inputs] if isinstance(local_inputs, str) else list(local_inputs or ())
    if not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            f"{who}: local_inputs must be True / False or a list of the root's argument names (e.g. "
            f"['input_ids', 'labels', 'attention_mask']), got {local_inputs!r}"
        )
    return [rf"<in>[{re.escape(n)}]" for n in names], True


def split_batch(plan: VescalePlan, keys: list[str], mesh_dim: str, local: bool) -> None:
    """The batch inputs ``keys`` split along dim 0 over ``mesh_dim``: the global batch, which the
    plan slices (``plan.shard``), or with ``local`` this rank's share of it (``plan.annotate``:
    each rank passes only its rows, e.g. from ``vescale.data.GlobalBatchSampler``)."""
    for key in keys:
        (plan.annotate if local else plan.shard)(key, Shard(0), mesh=mesh_dim)


def llama_plan(
    mesh: DeviceMesh | None = None,
    config: Any = None,
    *,
    tp: str | None = "TP",
    dp: str | None = "DP",
    sequence_parallel: bool = True,
    zero3: bool = False,
    mlp: bool = True,
    local_inputs: LocalInputs = False,
) -> VescalePlan:
    """A plan for LLaMA-style causal LMs.

    ``tp`` / ``dp`` name the mesh dimensions used for tensor and data parallelism; a name that is
    ``None`` (or absent from ``mesh`` when a mesh is given) turns that parallelism off.
    ``sequence_parallel`` and ``zero3`` need ``tp`` and ``dp`` respectively. ``config`` (the
    model's config, ours or HF's) lets the plan replicate the key/value projections when the TP
    size does not divide the number of key/value heads, as Megatron-LM does. ``mlp=False`` leaves
    the MLP blocks out of tensor parallelism (``vescale.zoo.moe_plan`` plans MoE blocks instead).

    ``local_inputs=True``: each DP rank passes only its share of the batch (``input_ids`` and
    ``labels``, its rows of the global batch, e.g. from ``vescale.data.GlobalBatchSampler``) instead
    of the whole global batch; a list of argument names (``["input_ids", "labels",
    "attention_mask"]``) says which inputs are shares (each must be passed at the first call).
    Results are those of the global batch, bit for bit.
    """
    use_tp, use_dp = _mesh_has(mesh, tp), _mesh_has(mesh, dp)
    if sequence_parallel and not use_tp:
        sequence_parallel = False  # SP lives on the TP dimension; without TP there is nothing to split
    if zero3 and not use_dp:
        raise ValueError(f"llama_plan: zero3=True shards parameters over the DP dimension, but {dp!r} is not in the mesh")
    plan = VescalePlan()
    # Static Eager and HF's LlamaModel: its own ops read the sequence length for the position ids
    # and the causal mask from the embeddings, which SP would split. So for HF's model the sequence
    # is kept whole there: the embeddings leave the vocabulary-parallel lookup all-reduced and the
    # first layer takes its sequence shard (a local slice), and the body runs static (its layers
    # meet a static caller: no DTensor wrapping around each layer). (Under DP it reads the batch
    # size there too, the DP share in static steps, and expands the plain position ids to it:
    # vescale.static.local_sizes gives that call the recorded global size.) The zoo's LlamaModel
    # reads the length from input_ids (whole along the sequence) and broadcasts over the batch; its
    # embeddings are reduce-scattered. Without a config, HF's model is assumed.
    hf = not _is_zoo_config(config)
    if use_tp:
        kv_heads = getattr(config, "num_key_value_heads", None)
        split_kv = kv_heads is None or mesh is None or kv_heads % mesh[tp].size() == 0
        _tensor_parallel(plan, tp, sequence_parallel, split_kv, mlp, whole_embeddings=hf)
    keys, local = batch_keys(local_inputs, [r"<in>\[input_ids\]", r"<in>\[labels\]"], "llama_plan")
    if use_dp:
        split_batch(plan, keys, dp, local)
        if zero3:
            plan.shard(r".*weight", Shard(0), mesh=dp, phase=INIT)
            plan.shard(r".*weight", Replicate(), mesh=dp, phase=RUN)
    return plan


def _tensor_parallel(plan: VescalePlan, tp: str, sequence_parallel: bool, split_kv: bool, mlp: bool = True,
                     whole_embeddings: bool = False) -> None:
    # Between blocks: sequence-sharded with SP, replicated without.
    between = Shard(1) if sequence_parallel else Replicate()
    # Vocabulary-parallel embedding with SP: its Partial output is reduce-scattered along the
    # sequence, or with ``whole_embeddings`` all-reduced and split along the sequence where the first
    # layer takes it (a local slice; backward: an all-gather), so that the model body sees the whole
    # sequence. (Its gradient arrives whole there, not Partial.) Without SP, split the hidden dim
    # instead: a local lookup, where a vocabulary-parallel one would all-reduce its output (it works
    # too: vescale.comm.moves.grad_placements hands its Partial gradient back as it arrives).
    plan.shard(r"model\.embed_tokens\.weight", Shard(0) if sequence_parallel else Shard(1), mesh=tp)
    if whole_embeddings and sequence_parallel:
        plan.shard(r"model\.embed_tokens\.<out>", Replicate(), mesh=tp)
        plan.shard(r"model\.layers\.0\.<in>[hidden_states]", between, mesh=tp)
    else:
        plan.shard(r"model\.embed_tokens\.<out>", between, mesh=tp)
    blocks = [("self_attn", r"(q|k|v)_proj" if split_kv else "q_proj", "o_proj")]
    if mlp:
        blocks.append(("mlp", r"(gate|up)_proj", "down_proj"))
    for block, col, row in blocks:
        plan.shard(rf"{_LAYER}\.{block}\.<in>[hidden_states]" if block == "self_attn" else rf"{_LAYER}\.{block}\.<in>",
                   Replicate(), mesh=tp)
        plan.shard(rf"{_LAYER}\.{block}\.{col}\.weight", Shard(0), mesh=tp)
        plan.shard(rf"{_LAYER}\.{block}\.{row}\.weight", Shard(1), mesh=tp)
        plan.shard(rf"{_LAYER}\.{block}\.<out>", between, mesh=tp)
    plan.shard(r"lm_head\.<in>", Replicate(), mesh=tp)
    plan.shard(r"lm_head\.weight", Shard(0), mesh=tp)  # vocabulary-parallel matmul
    # The logits are gathered where the LM head returns them: the loss runs on whole rows, as on one
    # device, and backward hands the LM head its classes of the gradient at this move, in eager and
    # Static Eager mode alike (so the two compute the same bits; left split, eager DTensor would
    # gather them inside log_softmax and hand the LM head a replicated gradient, a whole-vocabulary
    # weight-gradient matmul on every rank: vescale.static.local_loss).
    plan.shard(r"lm_head\.<out>", Replicate(), mesh=tp)
