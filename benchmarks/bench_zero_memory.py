"""Per-rank training state at rest (params + grads + AdamW state) under DP with and without ZeRO-3.

    .venv/bin/python benchmarks/bench_zero_memory.py

Runs the zoo's LLaMA (a bigger config than the tests') on 1, 2 and 4 gloo ranks for one step and
prints bytes per rank, and the ratio to plain data parallelism measured in the same run.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import vescale
from vescale.debug import bytes_at_rest
from vescale.testing import run_on_ranks
from vescale.zoo import LlamaConfig, LlamaForCausalLM, llama_plan, synthetic_batches

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)


def _state_bytes(zero3: bool) -> int:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((dist.get_world_size(),), ("DP",))
    torch.manual_seed(0)
    model = vescale.parallelize(LlamaForCausalLM(LlamaConfig(**CONFIG)), llama_plan(mesh, zero3=zero3), mesh)
    opt = torch.optim.AdamW(model.parameters())
    input_ids, labels = synthetic_batches(1, 4, 32, CONFIG["vocab_size"], seed=0)[0]
    model(input_ids=input_ids, labels=labels).loss.backward()
    opt.step()
    return bytes_at_rest(model, opt)["total"]


def _both():
    return _state_bytes(zero3=False), _state_bytes(zero3=True)


def main():
    print(f"{'DP':>3} {'plain DP (MiB/rank)':>20} {'ZeRO-3 (MiB/rank)':>18} {'ratio':>7} {'1/DP':>6}")
    for world in (1, 2, 4):
        plain, zero = run_on_ranks(_both, world)[0]
        print(f"{world:>3} {plain / 2**20:>20.2f} {zero / 2**20:>18.2f} {zero / plain:>7.3f} {1 / world:>6.3f}")


if __name__ == "__main__":
    main()
