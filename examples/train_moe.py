"""Train a tiny HF Mixtral or Qwen3-MoE, unchanged, with tensor-parallel or expert-parallel experts.

    torchrun --standalone --nproc-per-node 4 examples/train_moe.py --mesh DP=2,TP=2 --zero3
    torchrun --standalone --nproc-per-node 2 examples/train_moe.py --mesh EP=2 --kernel eager
    python examples/train_moe.py                       # single device, the reference losses

Prints one loss per step on rank 0; the losses are the single-device ones up to float32 rounding.
"""

from __future__ import annotations

import argparse
import os

import torch

import vescale
from vescale.zoo import moe_plan, synthetic_batches, tiny_hf_mixtral, tiny_hf_qwen3_moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mixtral", "qwen3_moe"], default="mixtral")
    ap.add_argument("--kernel", choices=["grouped_mm", "batched_mm", "eager"], default=None,
                    help="HF experts kernel (default: the model's own, grouped_mm)")
    ap.add_argument("--mesh", default="", help="mesh dims, e.g. DP=2,TP=2 or EP=2 (empty: single device)")
    ap.add_argument("--zero3", action="store_true", help="ZeRO-3 on the DP dim")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()

    overrides = {}
    if args.kernel:
        overrides["experts_implementation"] = args.kernel
    build = tiny_hf_mixtral if args.model == "mixtral" else tiny_hf_qwen3_moe
    torch.manual_seed(0)
    model = build(**overrides)
    rank = 0
    if args.mesh:
        dims = [d.split("=") for d in args.mesh.split(",")]
        mesh = vescale.init_mesh(tuple(int(n) for _, n in dims), tuple(name for name, _ in dims))
        vescale.parallelize(model, moe_plan(mesh, model.config, zero3=args.zero3), mesh)
        rank = int(os.environ.get("RANK", "0"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, (ids, labels) in enumerate(synthetic_batches(args.steps, 4, 8, model.config.vocab_size, seed=1)):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        if rank == 0:
            print(f"step {step} loss {value.item():.6f}")


if __name__ == "__main__":
    main()
