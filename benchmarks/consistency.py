"""How far a distributed run's losses drift from one device's over many steps, dropout on.

    .venv/bin/python benchmarks/consistency.py MODEL MODE STEPS [--json out.json]

MODEL is a zoo model (``llama``: the zoo's LLaMA, ``moe``: HF Mixtral, ``dit``: diffusers DiT,
``gpt2``: HF GPT-2), MODE ``eager`` or ``static``. Both runs build the model from one seed, train it
with AdamW on the same global batches, and draw their dropout masks from vescale's generator, seeded
once (the single-device run under ``vescale.random.consistent()``, as ``examples/train_llama.py``
does), so after step k both generators must still sit at the same offset. The distributed run is
4 gloo ranks, DP=2 x TP=2 with the zoo plan's SP and ZeRO-3 where it has them (``llama``, ``moe``:
both; ``gpt2``, ``dit``: ZeRO-3, no SP). Prints the largest per-step |loss difference|, the step it
is at, and the first step where it exceeds 1e-6 (the target; the paper reports 2e-5 to 6e-5).

Dropout: ``llama`` attention and residual 0.1; ``moe`` attention 0.1 (Mixtral has no other; its
router jitter must stay 0 under batch-local MoE blocks); ``gpt2`` its defaults (embedding, attention,
residual 0.1); ``dit`` 0.1 (diffusers' ``dropout``: attention output and feed-forward).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import vescale
import vescale.random
from vescale.testing import global_value, run_on_ranks

TARGET = 1e-6
BATCH, SEQ, LR, SEED = 8, 16, 1e-3, 0
MESH = ((2, 2), ("DP", "TP"))


def build(model: str):
    """The model (seeded) and a function making its plan for a mesh."""
    from vescale import zoo

    torch.manual_seed(SEED)
    if model == "llama":
        m = zoo.tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)
        return m, lambda mesh: zoo.llama_plan(mesh, m.config, sequence_parallel=True, zero3=True)
    if model == "moe":
        m = zoo.tiny_hf_mixtral(attention_dropout=0.1)
        return m, lambda mesh: zoo.moe_plan(mesh, m.config, sequence_parallel=True, zero3=True)
    if model == "gpt2":
        m = zoo.tiny_hf_gpt2()
        return m, lambda mesh: zoo.gpt2_plan(mesh, m.config, zero3=True)
    if model == "dit":
        m = zoo.tiny_dit(dropout=0.1)
        return m, lambda mesh: zoo.dit_plan(mesh, m.config, zero3=True)
    raise SystemExit(f"unknown model {model!r}; use llama, moe, dit or gpt2")


def batches(model: str, steps: int):
    """The global batches as (args, kwargs) of the model call, the same in every process."""
    g = torch.Generator().manual_seed(SEED + 1)
    if model == "dit":
        for _ in range(steps):
            x, t = torch.randn(BATCH, 4, 8, 8, generator=g), torch.randint(0, 1000, (BATCH,), generator=g)
            c, target = torch.randint(0, 10, (BATCH,), generator=g), torch.randn(BATCH, 4, 8, 8, generator=g)
            yield dict(hidden_states=x, timestep=t, class_labels=c), target
    else:
        from vescale.zoo import synthetic_batches

        for input_ids, labels in synthetic_batches(steps, BATCH, SEQ, 128, seed=SEED + 1):
            yield dict(input_ids=input_ids, labels=labels), None


def loss_of(model, inputs: dict, target):
    if target is None:
        return model(**inputs).loss
    return ((model(**inputs).sample - target) ** 2).mean()


def train(model_name: str, steps: int, mode: str | None, progress: bool) -> list[float]:
    """The losses of ``steps`` AdamW steps: on one device (``mode`` None) or on this rank of the mesh."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    distributed = mode is not None
    mesh = vescale.init_mesh(*MESH) if distributed else None
    vescale.manual_seed(SEED)
    model, plan = build(model_name)
    if distributed:
        vescale.parallelize(model, plan(mesh), mesh, mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, t0 = [], time.perf_counter()
    with vescale.random.consistent():
        for step, (inputs, target) in enumerate(batches(model_name, steps)):
            loss = loss_of(model, inputs, target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(global_value(loss).item())
            if progress and (step + 1) % 100 == 0:
                where = f"{mode} on {dist.get_world_size()} ranks" if distributed else "one device"
                print(f"  {model_name} {where}: step {step + 1}/{steps}, loss {losses[-1]:.6f}, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
    return losses


def _rank(model_name: str, steps: int, mode: str) -> list[float] | None:
    torch.set_num_threads(1)
    losses = train(model_name, steps, mode, progress=dist.get_rank() == 0)
    return losses if dist.get_rank() == 0 else None


def compare(reference: list[float], candidate: list[float]) -> dict:
    diffs = [abs(a - b) for a, b in zip(reference, candidate)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    first = next((i for i, d in enumerate(diffs) if not d <= TARGET), None)
    return {"max_diff": diffs[worst], "max_step": worst, "first_above_target": first,
            "diff_at": {str(s): diffs[s] for s in (0, 9, 99, 499, len(diffs) - 1) if s < len(diffs)}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=["llama", "moe", "dit", "gpt2"])
    parser.add_argument("mode", choices=["eager", "static"])
    parser.add_argument("steps", type=int)
    parser.add_argument("--json", help="also write the losses and the summary to this file")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    print(f"{args.model} {args.mode}: {args.steps} steps on one device ...", flush=True)
    torch.set_num_threads(1)
    reference = train(args.model, args.steps, None, progress=True)
    print(f"{args.model} {args.mode}: {args.steps} steps on DP=2 x TP=2 (4 gloo ranks) ...", flush=True)
    candidate = run_on_ranks(_rank, 4, args.model, args.steps, args.mode, timeout=48 * 3600)[0]
    summary = compare(reference, candidate)
    first = summary["first_above_target"]
    print(f"{args.model} {args.mode} {args.steps} steps: max |loss diff| {summary['max_diff']:.3g} at step "
          f"{summary['max_step']}; first step above {TARGET:g}: {'none' if first is None else first} "
          f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "mode": args.mode, "steps": args.steps, **summary,
                       "reference": reference, "candidate": candidate}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
