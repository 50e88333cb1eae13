"""Hand-written Megatron-style TP + SP + ZeRO-3 of the zoo LLaMA on plain tensors, with real collectives.

The floor for ``bench_dispatch.py``'s runs on gloo ranks (variant ``local``): the per-rank work a
hand-written implementation does, with no DTensor anywhere. Every collective is a
``torch.distributed`` call on the process groups of the bench's ``(DP, TP)`` DeviceMesh.

* Tensor parallel (TP group): q/k/v and gate/up projections keep this rank's rows (column-parallel),
  o/down projections its columns (row-parallel); the embedding and the LM head keep this rank's
  slice of the vocabulary.
* Sequence parallel (TP group): between blocks each rank holds 1/TP of the sequence. An all-gather
  along the sequence runs before attention and before the MLP (backward: reduce-scatter), a
  reduce-scatter after them and after the vocabulary-parallel embedding (backward: all-gather), and
  an all-gather before the LM head. The norms see only this rank's tokens, so their weight gradients
  are all-reduced over TP (Megatron's "sequence-parallel grads" all-reduce).
* Loss: Megatron's vocabulary-parallel cross-entropy (the logits are never gathered: all-reduces
  over TP of the row max, of the target's logit and of the sum of exponentials), like TorchTitan's
  ``loss_parallel`` and vescale's ``llama_plan``.
* ZeRO-3 (DP group), FSDP2's schedule with FSDP1's / DeepSpeed's flat buffers: each decoder layer is
  one unit, the embedding + final norm + LM head (the root) another. A unit's parameters are views
  of one flat buffer of which this rank stores 1/DP (the optimiser's parameter). A layer's buffer is
  all-gathered before its forward, freed after it (FSDP2's default ``reshard_after_forward``),
  gathered again when its output's gradient arrives, and freed once its gradients are
  reduce-scattered; the root is gathered once per step and kept until its own reduce-scatter
  (FSDP2 does not reshard the root after forward). One all-gather and one reduce-scatter per unit
  and pass, as FSDP2; no prefetching or overlap (gloo on CPU runs each collective on the calling
  thread anyway).
* Gradients are summed over DP (no averaging), as the bench's ``torch`` variant forces with
  ``set_force_sum_reduction_for_comms(True)``; each rank's loss is its tokens' summed loss over the
  whole batch's token count (one all-reduce of the count over DP), as vescale's DP mean does, so the
  summed gradients are the single-device model's and the DP ranks' losses add up to its loss.
  AdamW then steps on the flat shards.

``tests/zoo/test_megatron_local.py`` checks it against the single-device model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vescale.zoo import LlamaForCausalLM
from vescale.zoo.llama import CausalLMOutput

__all__ = ["MegatronLlama"]

IGNORE_INDEX = -100


# ---- sequence-parallel collectives: dim 1 of (batch, seq, hidden), on the TP group ----------------

def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    n, (b, s) = group.size(), x.shape[:2]
    pieces = x.new_empty((n * b, *x.shape[1:]))  # the collective stacks the ranks' pieces along dim 0
    dist.all_gather_single(pieces, x.contiguous(), group=group)
    return pieces.view(n, b, *x.shape[1:]).movedim(0, 1).reshape(b, n * s, *x.shape[2:])


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    n = group.size()
    b, s = x.shape[:2]
    # Rank i's chunk of the sequence, for all of the batch, at rows [i * b, (i + 1) * b).
    chunks = x.reshape(b, n, s // n, *x.shape[2:]).movedim(1, 0).reshape(n * b, s // n, *x.shape[2:])
    out = x.new_empty((b, s // n, *x.shape[2:]))
    dist.reduce_scatter_single(out, chunks, group=group)
    return out


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence; backward: reduce-scatter of the gradient (each rank's block
    computed a partial gradient of the whole sequence from its own heads / columns)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class ScatterSequence(torch.autograd.Function):
    """Sum of the TP ranks' partial outputs, this rank's part of the sequence; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


# ---- vocabulary parallelism ------------------------------------------------------------------------

class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; ids it does not hold give zeros (the partial sums the
    reduce-scatter after it adds up over TP)."""

    def __init__(self, weight: torch.Tensor, vocab_start: int):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start = vocab_start

    def forward(self, input_ids):
        ids = input_ids - self.vocab_start
        elsewhere = (ids < 0) | (ids >= self.weight.shape[0])
        rows = F.embedding(ids.masked_fill(elsewhere, 0), self.weight)
        return rows.masked_fill(elsewhere.unsqueeze(-1), 0.0)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over logits whose vocabulary is split over TP (Megatron's): the row
    max, the target's logit (from the rank holding it) and the sum of exponentials are all-reduced;
    backward is local (softmax minus the one-hot of the target, on this rank's columns)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start: int, group):
        logits = logits.float()
        row_max = logits.max(-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        ids = targets - vocab_start
        elsewhere = (ids < 0) | (ids >= logits.shape[-1])  # also every ignored (negative) target
        ids = ids.masked_fill(elsewhere, 0)
        target_logit = shifted.gather(-1, ids.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
        dist.all_reduce(target_logit, group=group)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), ids, elsewhere)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, ids, elsewhere = ctx.saved_tensors
        here = (~elsewhere).to(softmax.dtype).unsqueeze(-1)
        grad_logits = softmax.scatter_add_(-1, ids.unsqueeze(-1), -here)  # softmax is used once: in place
        return grad_logits.mul_(grad.unsqueeze(-1)), None, None, None


def _loss_share(logits, labels, vocab_start: int, tp_group, dp_group) -> torch.Tensor:
    """This rank's summed token losses over the whole batch's token count: summed over the DP
    ranks, the single-device mean loss (labels shifted as ``vescale.zoo``'s causal LM shifts them)."""
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    token_loss = VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets, vocab_start, tp_group)
    counted = targets != IGNORE_INDEX
    count = counted.sum()
    if dp_group.size() > 1:
        dist.all_reduce(count, group=dp_group)
    return (token_loss * counted).sum() / count


# ---- ZeRO-3 units ----------------------------------------------------------------------------------

class FlatParams:
    """One ZeRO-3 unit: its modules' parameters become views of one flat buffer (``full``) whose
    gradients accumulate into a second one (``grad``); ``shard`` (the optimiser's parameter) holds
    this rank's 1/DP of it when ``sharded``, else it is ``full`` itself.

    ``tp_summed`` (a count of the leading parameters) are the norms SP runs on this rank's tokens
    only: their gradients are partial over TP and all-reduced there before the DP reduction."""

    def __init__(self, owners: list[tuple[nn.Module, str]], tp_summed: int, tp_group, dp_group, sharded: bool):
        self.tp_group, self.dp_group, self.sharded = tp_group, dp_group, sharded
        old = [getattr(module, name) for module, name in owners]
        numel = sum(p.numel() for p in old)
        dp = dp_group.size()
        self.full = torch.zeros(-(-numel // dp) * dp)  # padded to a multiple of DP
        self.grad = torch.zeros_like(self.full)
        self.params, offset = [], 0
        for (module, name), p in zip(owners, old):
            span = slice(offset, offset + p.numel())
            self.full[span].copy_(p.detach().reshape(-1))
            param = nn.Parameter(self.full[span].view_as(p))
            param.grad = self.grad[span].view_as(p)  # accumulates in place into the flat buffer
            param.register_post_accumulate_grad_hook(self._grad_accumulated)
            setattr(module, name, param)
            self.params.append(param)
            offset += p.numel()
        self.tp_summed_numel = sum(p.numel() for p in old[:tp_summed]) if tp_group.size() > 1 else 0
        self.ready = 0
        if sharded:
            self.shard = nn.Parameter(self.full.chunk(dp)[dp_group.rank()].clone())
            self.free()
        else:
            self.shard = nn.Parameter(self.full)  # same storage: the optimiser updates the views

    def gather(self) -> None:
        if self.sharded:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
            # Through .data: autograd's saved views of `full` must not see a version bump.
            dist.all_gather_single(self.full.data, self.shard.detach(), group=self.dp_group)

    def free(self) -> None:
        if self.sharded:
            self.full.untyped_storage().resize_(0)

    def reshard_after_forward(self, output: torch.Tensor) -> torch.Tensor:
        """Free the gathered buffer; ``output`` (the layer's) gathers it again in backward."""
        self.free()
        return _RegatherForBackward.apply(output, self)

    def _grad_accumulated(self, _param) -> None:
        self.ready += 1
        if self.ready < len(self.params):
            return
        self.ready = 0  # every parameter's gradient is in `grad`: reduce it
        if self.tp_summed_numel:
            dist.all_reduce(self.grad[: self.tp_summed_numel], group=self.tp_group)
        if self.sharded:
            self.shard.grad = self.grad.new_empty(self.shard.shape)
            dist.reduce_scatter_single(self.shard.grad, self.grad, group=self.dp_group)
            self.free()
        else:
            if self.dp_group.size() > 1:  # plain data parallel
                dist.all_reduce(self.grad, group=self.dp_group)
            self.shard.grad = self.grad


class _RegatherForBackward(torch.autograd.Function):
    """Identity on a layer's output whose backward gathers the layer's unit again before the
    layer's own backward needs its weights."""

    @staticmethod
    def forward(ctx, x, unit):
        ctx.unit = unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.unit.gather()
        return grad, None


# ---- the per-rank model ----------------------------------------------------------------------------

class MegatronLlama:
    """This rank's part of ``model`` (a single-device ``vescale.zoo.LlamaForCausalLM``, cut in place)
    on a ``(DP, TP)`` mesh. Called like the model; ``.loss`` is this rank's share (see
    ``_loss_share``); ``parameters()`` are the flat shards to give the optimiser."""

    def __init__(self, model: LlamaForCausalLM, mesh, zero3: bool = True):
        self.model, config = model, model.config
        self.tp_group, self.dp_group = mesh["TP"].get_group(), mesh["DP"].get_group()
        tp, tp_rank = mesh["TP"].size(), mesh["TP"].get_local_rank()
        for what, n in (("num_key_value_heads", config.num_key_value_heads), ("intermediate_size", config.intermediate_size),
                        ("vocab_size", config.vocab_size)):
            if n % tp:
                raise ValueError(f"MegatronLlama: {what} ({n}) must be a multiple of the TP size ({tp}); change one of them")
        self.vocab_start = tp_rank * config.vocab_size // tp
        _cut_for_tensor_parallel(model, tp, tp_rank, self.vocab_start)
        self._sequence_parallel()
        sharded = zero3 and self.dp_group.size() > 1
        self.layers = []
        for layer in model.model.layers:
            unit = self._unit(layer, ["input_layernorm", "post_attention_layernorm"],
                              ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"], sharded)
            if sharded:
                layer.register_forward_pre_hook(lambda mod, args, unit=unit: unit.gather())
                layer.register_forward_hook(lambda mod, args, out, unit=unit: unit.reshard_after_forward(out))
            self.layers.append(unit)
        self.root = self._unit(model, ["model.norm"], ["model.embed_tokens", "lm_head"], sharded)

    def _unit(self, owner: nn.Module, norms: list[str], others: list[str], sharded: bool) -> FlatParams:
        owners = [(owner.get_submodule(path), "weight") for path in norms + others]
        return FlatParams(owners, len(norms), self.tp_group, self.dp_group, sharded)

    def _sequence_parallel(self) -> None:
        tp = self.tp_group
        self.model.model.embed_tokens.register_forward_hook(lambda mod, args, out: ScatterSequence.apply(out, tp))
        for layer in self.model.model.layers:
            layer.self_attn.register_forward_pre_hook(
                lambda mod, args, kw: (args, {**kw, "hidden_states": GatherSequence.apply(kw["hidden_states"], tp)}),
                with_kwargs=True)
            layer.self_attn.register_forward_hook(lambda mod, args, out: (ScatterSequence.apply(out[0], tp), *out[1:]))
            layer.mlp.register_forward_pre_hook(lambda mod, args: (GatherSequence.apply(args[0], tp),))
            layer.mlp.register_forward_hook(lambda mod, args, out: ScatterSequence.apply(out, tp))

    def parameters(self) -> list[nn.Parameter]:
        return [unit.shard for unit in self.layers + [self.root]]

    def __call__(self, input_ids, labels=None) -> CausalLMOutput:
        if input_ids.shape[1] % self.tp_group.size():
            raise ValueError(f"MegatronLlama: sequence parallelism splits the sequence over TP ({self.tp_group.size()}), "
                             f"but input_ids has {input_ids.shape[1]} positions; pad it to a multiple")
        for unit in self.layers + [self.root]:
            unit.grad.zero_()  # the last step's gradients were handed to the optimiser
        self.root.gather()
        hidden = self.model.model(input_ids=input_ids)  # (batch, seq / TP, hidden)
        logits = self.model.lm_head(GatherSequence.apply(hidden, self.tp_group))  # (batch, seq, vocab / TP)
        loss = None if labels is None else _loss_share(logits, labels, self.vocab_start, self.tp_group, self.dp_group)
        return CausalLMOutput(loss=loss, logits=logits)


def _cut_for_tensor_parallel(model: LlamaForCausalLM, tp: int, tp_rank: int, vocab_start: int) -> None:
    """Keep this rank's rows of the column-parallel weights (whole heads: the head count is a
    multiple of TP), its columns of the row-parallel ones, its vocabulary rows of the embedding and
    the head; the norms stay whole."""

    def keep(linear: nn.Linear, dim: int) -> None:
        linear.weight = nn.Parameter(linear.weight.detach().chunk(tp, dim)[tp_rank].clone())

    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for linear in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            keep(linear, 0)
        for linear in (a.o_proj, m.down_proj):
            keep(linear, 1)
    keep(model.lm_head, 0)
    rows = model.model.embed_tokens.weight.detach().chunk(tp, 0)[tp_rank].clone()
    model.model.embed_tokens = VocabParallelEmbedding(rows, vocab_start)
