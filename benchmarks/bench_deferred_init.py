"""Peak memory of building and parallelizing a model: on the meta device (deferred init) vs built
whole on every rank, per rank, on 4 gloo ranks (DP=2 x TP=2 + ZeRO-3, the zoo LLaMA plan).

    .venv/bin/python benchmarks/bench_deferred_init.py

Each rank resets its peak resident set (Linux ``/proc/self/clear_refs``), builds the model and
parallelizes it, and reports the growth of its peak RSS (``VmHWM``) over the RSS before building,
beside the bytes of its parameter shards (the lower bound) and of the whole model. Both modes run
in separate processes so one cannot reuse the other's freed pages.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

import vescale
from vescale.testing import run_on_ranks
from vescale.zoo import LlamaConfig, LlamaForCausalLM, llama_plan

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _measure(deferred: bool):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    vescale.manual_seed(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    if deferred:
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    else:
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    vescale.parallelize(model, llama_plan(mesh, model.config, zero3=True), mesh)
    peak = _status("VmHWM") - before
    shards = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    return peak, shards, whole


def main() -> None:
    mib = 2**20
    for deferred in (False, True):
        rows = run_on_ranks(_measure, 4, deferred, timeout=300)
        peak = max(r[0] for r in rows)
        shards = max(r[1] for r in rows)
        whole = rows[0][2]
        label = "meta + deferred init" if deferred else "built whole per rank"
        print(f"{label:22s}: peak RSS growth {peak / mib:7.1f} MiB/rank | own shards {shards / mib:6.1f} MiB | "
              f"whole model {whole / mib:6.1f} MiB | peak/shards {peak / shards:4.2f}")


if __name__ == "__main__":
    main()
