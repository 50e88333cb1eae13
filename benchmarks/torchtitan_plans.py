"""TorchTitan-style parallelisation of the zoo's models, for the plan-size comparison in docs/zoo.md.

The same parallelism as ``vescale.zoo.llama_plan`` / ``moe_plan`` (TP + SP on "TP", FSDP / ZeRO-3 on
"DP"), written the way TorchTitan writes it: ``parallelize_module`` with PyTorch's parallel styles
per module, a hand-written ``ParallelStyle`` for HF's experts (TorchTitan writes its own for its
grouped experts too), then ``fully_shard`` per block and on the root. ``vescale_llama`` / ``vescale_moe`` are
the zoo plans for that configuration written out as a user would write them (the test checks they
equal the zoo's). Run as a script, it prints the plan sizes: non-blank, non-comment code lines of
each function, counted the same way; ``tests/zoo/test_torchtitan_plans.py`` runs the TorchTitan-style
functions on 4 gloo ranks.

Both apply to HF models built by ``vescale.zoo`` (``tiny_hf_llama``, ``tiny_hf_mixtral``) and take a
``(DP, TP)`` mesh. The MoE one needs DTensor rules for the data-dependent ops and fp32
``_grouped_mm`` of HF's experts kernels, which ``vescale.dispatch.install()`` provides.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

if TYPE_CHECKING:
    from vescale import VescalePlan


def torchtitan_llama(model: nn.Module, mesh) -> nn.Module:
    tp, dp = mesh["TP"], mesh["DP"]
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


class ExpertsTensorParallel(ParallelStyle):
    """HF experts: gate|up column-parallel section by section, down row-parallel, output summed."""

    def _partition(self, name, module, mesh):
        if name:  # distribute_module visits every submodule; the expert tensors live on the root
            return
        gate_up = distribute_tensor(module.gate_up_proj, mesh, [_StridedShard(1, split_factor=2)])
        module.register_parameter("gate_up_proj", nn.Parameter(gate_up))
        module.register_parameter("down_proj", nn.Parameter(distribute_tensor(module.down_proj, mesh, [Shard(2)])))

    def _inputs(self, mod, inputs, mesh):
        from torch.distributed.tensor import DTensor

        return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)

    def _outputs(self, mod, output, mesh):
        return output.redistribute(mesh, [Replicate()]).to_local()

    def _apply(self, module, mesh):
        return distribute_module(module, mesh, self._partition, self._inputs, self._outputs)


def torchtitan_moe(model: nn.Module, mesh, zero3: bool = True) -> nn.Module:
    tp, dp = mesh["TP"], mesh["DP"]
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
            "mlp.experts": ExpertsTensorParallel(),
        })
        parallelize_module(layer, tp, {
            "mlp": PrepareModuleOutput(
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=False
            ),
        })
    if zero3:  # FSDP on DP (off: TP only, e.g. for benchmarks on a DP=1 mesh)
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def vescale_llama() -> "VescalePlan":
    """``llama_plan(mesh, zero3=True)`` on a (DP, TP) mesh, written out as a user would: one statement per rule."""
    from vescale import INIT, RUN, VescalePlan

    plan, layer = VescalePlan(), r"model\.layers\.\d+"
    # Column-parallel projections, vocabulary-parallel embedding and head; row-parallel projections.
    plan.shard(rf"(model\.embed_tokens|lm_head|{layer}\.(self_attn\.[qkv]|mlp\.(gate|up))_proj)\.weight", Shard(0), mesh="TP")
    plan.shard(rf"{layer}\.(self_attn\.o|mlp\.down)_proj\.weight", Shard(1), mesh="TP")
    # Sequence parallel: gather the sequence into attention, the MLP and the head, scatter it after.
    plan.shard(rf"({layer}\.(self_attn|mlp)|lm_head)\.<in>", Replicate(), mesh="TP")
    plan.shard(rf"{layer}\.(self_attn|mlp)\.<out>", Shard(1), mesh="TP")
    # HF's model body reads the sequence length from the embeddings: whole there, split from the first layer.
    plan.shard(r"model\.embed_tokens\.<out>", Replicate(), mesh="TP")
    plan.shard(r"model\.layers\.0\.<in>[hidden_states]", Shard(1), mesh="TP")
    plan.shard(r"lm_head\.<out>", Replicate(), mesh="TP")  # the logits gathered at the head, as the zoo plans do
    plan.shard(r"<in>\[(input_ids|labels)\]", Shard(0), mesh="DP")  # data parallel: split the batch
    plan.shard(r".*weight", Shard(0), mesh="DP", phase=INIT)  # ZeRO-3: stored sharded, gathered to run
    plan.shard(r".*weight", Replicate(), mesh="DP", phase=RUN)
    return plan


def vescale_moe() -> "VescalePlan":
    """``moe_plan(mesh, sequence_parallel=True, zero3=True)`` on a (DP, TP) mesh, written out: one statement per rule."""
    from vescale import INIT, RUN, InterleavedShard, VescalePlan

    plan, layer = VescalePlan(), r"model\.layers\.\d+"
    plan.shard(rf"(model\.embed_tokens|lm_head|{layer}\.self_attn\.[qkv]_proj)\.weight", Shard(0), mesh="TP")
    plan.shard(rf"{layer}\.self_attn\.o_proj\.weight", Shard(1), mesh="TP")
    # Every expert tensor-parallel: gate|up column-parallel section by section, down row-parallel.
    plan.shard(rf"{layer}\.mlp\.experts\.gate_up_proj", InterleavedShard(1, 2), mesh="TP")
    plan.shard(rf"{layer}\.mlp\.experts\.down_proj", Shard(2), mesh="TP")
    plan.shard(rf"({layer}\.(self_attn|mlp)|lm_head)\.<in>", Replicate(), mesh="TP")
    plan.shard(rf"{layer}\.(self_attn|mlp)\.<out>", Shard(1), mesh="TP")
    # HF's model body reads the sequence length from the embeddings: whole there, split from the first layer.
    plan.shard(r"model\.embed_tokens\.<out>", Replicate(), mesh="TP")
    plan.shard(r"model\.layers\.0\.<in>[hidden_states]", Shard(1), mesh="TP")
    plan.shard(r"lm_head\.<out>", Replicate(), mesh="TP")  # the logits gathered at the head, as the zoo plans do
    plan.shard(r"<in>\[(input_ids|labels)\]", Shard(0), mesh="DP")
    plan.shard(r".*(weight|gate_up_proj|down_proj)", Shard(0), mesh="DP", phase=INIT)
    plan.shard(r".*(weight|gate_up_proj|down_proj)", Replicate(), mesh="DP", phase=RUN)
    return plan


def code_lines(obj) -> int:
    """Non-blank, non-comment source lines (a docstring counts as code: it is the same in both)."""
    lines = inspect.getsource(obj).splitlines()
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def plan_sizes() -> list[tuple[str, int, int, int]]:
    """(model, vescale plan lines, TorchTitan-style lines, vescale zoo library lines), counted alike."""
    from vescale.zoo import moe as zoo_moe, plans as zoo_plans

    zoo_llama = code_lines(zoo_plans.llama_plan) + code_lines(zoo_plans._tensor_parallel)
    return [
        ("LLaMA (TP+SP, DP, ZeRO-3)", code_lines(vescale_llama), code_lines(torchtitan_llama), zoo_llama),
        ("Mixtral (TP experts+SP, DP, ZeRO-3)", code_lines(vescale_moe),
         code_lines(torchtitan_moe) + code_lines(ExpertsTensorParallel), zoo_llama + code_lines(zoo_moe.moe_plan)),
    ]


if __name__ == "__main__":
    print("| model | vescale plan | TorchTitan-style | zoo functions (all options) |")
    print("|---|---|---|---|")
    for row in plan_sizes():
        print("| " + " | ".join(str(x) for x in row) + " |")
