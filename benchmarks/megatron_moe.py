"""Hand-written Megatron-style TP + SP of HF's Mixtral on plain tensors, with real collectives.

The issue's "local" for ``bench_dispatch.py --model moe`` (variant ``megatron``): the per-rank work a
hand-written implementation does on a ``(1, TP)`` mesh, no DTensor anywhere, every collective a
``torch.distributed`` call on the TP group (the fake group copies the data a real one would move).
``local`` stays the plain-tensor stand-ins (a ``cat`` / ``narrow`` where this code communicates).

* Attention: this rank's heads (q/k/v rows, o columns). Experts: every expert's intermediate dim
  cut to this rank's share (the gate and up halves of ``gate_up_proj`` each, ``down_proj``'s
  columns), so the block's output is a partial sum over TP; the router stays whole.
* Sequence parallel: the vocabulary-parallel embedding's partial rows are reduce-scattered along the
  sequence at the first layer (HF's model reads the sequence length for its rotary table from the
  embeddings, so they stay whole until then); an all-gather before attention and before the MoE
  block, a reduce-scatter after them (backward: the reverse), an all-gather after the final norm.
* Gradients that are partial over TP are all-reduced once at the end of backward, as one flat
  buffer: the norms' (each rank saw its part of the sequence) and the routers' (the routing
  weights' gradient comes from this rank's share of the experts' output).
* Loss: Megatron's vocabulary-parallel cross-entropy (``megatron_local``), the logits never gathered.

``tests/zoo/test_megatron_local.py`` checks it against the single-device model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_local import GatherSequence, ScatterSequence, VocabParallelEmbedding, _loss_share
from vescale.zoo.llama import CausalLMOutput

__all__ = ["MegatronMixtral"]


class MegatronMixtral:
    """This rank's part of ``model`` (a single-device HF ``MixtralForCausalLM``, cut in place) on a
    ``(DP=1, TP)`` mesh. Called like the model (``.loss``); ``parameters()`` for the optimiser."""

    def __init__(self, model, mesh):
        if mesh["DP"].size() > 1:
            raise ValueError("MegatronMixtral: written for tensor parallelism only (a DP dim of size 1); "
                             f"the mesh has DP={mesh['DP'].size()}")
        self.model, config = model, model.config
        self.tp_group = mesh["TP"].get_group()
        self.dp_group = mesh["DP"].get_group()
        tp, rank = mesh["TP"].size(), mesh["TP"].get_local_rank()
        for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            if getattr(config, what) % tp:
                raise ValueError(f"MegatronMixtral: {what} ({getattr(config, what)}) must be a multiple of the TP size ({tp})")
        self.vocab_start = rank * config.vocab_size // tp
        _cut_for_tensor_parallel(model, tp, rank, self.vocab_start)
        self._sequence_parallel()
        # Gradients every rank holds a partial sum of (see the module doc).
        self.partial = [m.weight for layer in model.model.layers
                        for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.gate)]
        self.partial.append(model.model.norm.weight)

    def _sequence_parallel(self) -> None:
        tp, layers = self.tp_group, self.model.model.layers
        layers[0].register_forward_pre_hook(lambda mod, args: (ScatterSequence.apply(args[0], tp), *args[1:]))
        for layer in layers:
            for block in (layer.self_attn, layer.mlp):
                block.register_forward_pre_hook(_gathering(tp), with_kwargs=True)
                block.register_forward_hook(lambda mod, args, out: (ScatterSequence.apply(out[0], tp), *out[1:])
                                            if isinstance(out, tuple) else ScatterSequence.apply(out, tp))
        self.model.model.norm.register_forward_hook(lambda mod, args, out: GatherSequence.apply(out, tp))

    def _at_backward_start(self, grad) -> None:
        """The loss's gradient hook: the partial gradients are reduced once backward is done."""
        torch.autograd.Variable._execution_engine.queue_callback(self._reduce_partial_grads)

    def _reduce_partial_grads(self) -> None:
        grads = [p.grad for p in self.partial]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.tp_group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def parameters(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def __call__(self, input_ids, labels=None):
        if input_ids.shape[1] % self.tp_group.size():
            raise ValueError(f"MegatronMixtral: sequence parallelism splits the sequence over TP ({self.tp_group.size()}), "
                             f"but input_ids has {input_ids.shape[1]} positions; pad it to a multiple")
        hidden = self.model.model(input_ids=input_ids).last_hidden_state  # (batch, seq, hidden), gathered
        logits = self.model.lm_head(hidden)  # (batch, seq, vocab / TP)
        loss = None
        if labels is not None:
            loss = _loss_share(logits, labels, self.vocab_start, self.tp_group, self.dp_group)
            loss.register_hook(self._at_backward_start)
        return CausalLMOutput(loss=loss, logits=logits)


def _gathering(tp):
    """Forward pre-hook: the block's hidden states (positional or keyword) gathered along the sequence."""

    def hook(mod, args, kwargs):
        if args:
            return (GatherSequence.apply(args[0], tp), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": GatherSequence.apply(kwargs["hidden_states"], tp)}

    return hook


def _cut_for_tensor_parallel(model, tp: int, rank: int, vocab_start: int) -> None:
    """Keep this rank's heads, its share of every expert's intermediate dim and its vocabulary rows."""

    def keep(owner, name: str, piece: torch.Tensor) -> None:
        setattr(owner, name, nn.Parameter(piece.detach().clone()))

    for layer in model.model.layers:
        a, experts = layer.self_attn, layer.mlp.experts
        for linear in (a.q_proj, a.k_proj, a.v_proj):
            keep(linear, "weight", linear.weight.chunk(tp, 0)[rank])
        keep(a.o_proj, "weight", a.o_proj.weight.chunk(tp, 1)[rank])
        gate, up = experts.gate_up_proj.chunk(2, 1)  # (experts, 2 x intermediate, hidden): gate | up
        keep(experts, "gate_up_proj", torch.cat([gate.chunk(tp, 1)[rank], up.chunk(tp, 1)[rank]], 1))
        keep(experts, "down_proj", experts.down_proj.chunk(tp, 2)[rank])  # (experts, hidden, intermediate)
    keep(model.lm_head, "weight", model.lm_head.weight.chunk(tp, 0)[rank])
    rows = model.model.embed_tokens.weight.detach().chunk(tp, 0)[rank].clone()
    model.model.embed_tokens = VocabParallelEmbedding(rows, vocab_start)
