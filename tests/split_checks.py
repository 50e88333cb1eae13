"""Split checks for the zoo's LLaMA models under ``vescale.zoo.llama_plan``, shared by the parallel
equivalence tests (tests/zoo, tests/parallel, tests/static).

Equal losses, gradients and parameters cannot show that a plan split anything: a plan that
replicated every tensor, or data parallelism where every rank trained on the whole batch, computes
the single-device numbers too. ``check_llama_split`` therefore runs one probe step after training and
checks, on this rank, what the plan promises (docs/zoo.md, Megatron-LM's layout), stated here
independently of the plan's code:

* every parameter's local shard: column-parallel ``q/k/v/gate/up`` (k/v only where the TP size
  divides the key/value heads) and ``lm_head`` split on dim 0 by TP, row-parallel ``o/down`` on dim 1,
  the embedding by vocabulary (SP) or hidden (no SP); under ZeRO-3 every weight also split on dim 0
  by DP at rest;
* the first decoder layer's input: ``(batch / DP, seq / TP if SP else seq, hidden)``, so each DP rank
  sees its share of the global batch;
* the probe step's collectives by kind: under TP at least one reduction (all-reduce or
  reduce-scatter) per row-parallel block; under DP a gradient all-reduce (ZeRO-3: all-gathers and
  reduce-scatters).

The probe runs after the compared training (it draws dropout numbers and would move the RNG).
"""

from __future__ import annotations

import torch

from vescale.debug import CollectiveCounter
from vescale.testing import assert_local_shapes, input_shapes

_LAYER = r"model\.layers\.\d+"


def llama_divisors(config, tp: int = 1, dp: int = 1, sequence_parallel: bool = False, zero3: bool = False) -> dict:
    """{parameter pattern: per-dim divisors of the global shape} that llama_plan promises."""
    z = dp if zero3 else 1
    column, row = (tp * z, 1), (z, tp)
    qkv = "q|k|v" if config.num_key_value_heads % tp == 0 else "q"  # Megatron-LM: replicate k/v otherwise
    rules = {
        rf"{_LAYER}\.self_attn\.({qkv})_proj\.weight": column,
        rf"{_LAYER}\.mlp\.(gate|up)_proj\.weight": column,
        rf"{_LAYER}\.(self_attn\.o|mlp\.down)_proj\.weight": row,
        r"model\.embed_tokens\.weight": column if sequence_parallel and tp > 1 else row,
        r"lm_head\.weight": column,
    }
    if zero3:
        rules[r".*weight"] = (dp,)  # everything else: norms, replicated k/v
    return rules


def check_llama_split(model, batch, *, tp: int = 1, dp: int = 1, sequence_parallel: bool = False,
                      zero3: bool = False, label: str = "") -> dict:
    """One forward and backward of ``batch`` (input_ids, labels) on a parallelised zoo LLaMA; asserts
    the split described in this module's docstring on this rank and returns the probe's collective
    counts. Gradients are zeroed afterwards; parameters are not touched."""
    sp = sequence_parallel and tp > 1
    input_ids, labels = batch
    with input_shapes(model, "model.layers.0") as seen, CollectiveCounter() as counter:
        model(input_ids=input_ids, labels=labels).loss.backward()
    model.zero_grad(set_to_none=True)
    counts = dict(counter.counts)
    config = model.config
    assert_local_shapes(model, llama_divisors(config, tp, dp, sp, zero3), label)
    batch_size, seq = input_ids.shape
    want = (batch_size // dp, seq // tp if sp else seq, config.hidden_size)
    assert seen["model.layers.0"] == [want], (
        f"{label}: the first decoder layer saw inputs {seen['model.layers.0']}, expected [{want}] "
        f"(global batch {tuple(input_ids.shape)} split {dp}-way over DP{', sequence over TP' if sp else ''})"
    )
    reductions = counts.get("all_reduce", 0) + counts.get("reduce_scatter", 0)
    if tp > 1:
        blocks = 2 * config.num_hidden_layers  # attention and MLP end row-parallel in every layer
        assert reductions >= blocks, f"{label}: {counts} in a TP step: fewer reductions than {blocks} row-parallel blocks"
    if dp > 1 and zero3:
        assert counts.get("all_gather", 0) >= 1 and counts.get("reduce_scatter", 0) >= 1, f"{label}: ZeRO-3 step issued {counts}"
    elif dp > 1:
        assert counts.get("all_reduce", 0) >= 1, f"{label}: a DP step reduced no gradient: {counts}"
    return counts


def probe_batch(batch_size: int = 4, seq: int = 16, vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed global batch for the probe step (the same on every rank)."""
    from vescale.zoo import synthetic_batches

    return synthetic_batches(1, batch_size, seq, vocab, seed=99)[0]
