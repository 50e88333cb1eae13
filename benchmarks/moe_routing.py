"""Does an MoE trained on many ranks pick the experts one device picks, step for step?

    .venv/bin/python benchmarks/moe_routing.py --steps 1000 --modes eager static [--mesh dp2tp2] [--json out.json]

HF Mixtral at ``vescale.zoo``'s tiny sizes with attention dropout 0.1 (default kernels), AdamW lr
1e-3, ``synthetic_batches(steps, 8, 32, 128, seed=3)`` (issue 33's run). The reference trains on one
device under ``vescale.random.consistent()``; each mode trains on 4 gloo ranks with
``moe_plan(mesh, config, sequence_parallel=True, zero3=True)`` on DP=2 x TP=2 (``--mesh dp2``: DP=2
with ZeRO-3 on 2 ranks, no TP). Every run records, per step, the loss and every router's choice of
experts for every token (its top-k indices, in global token order) and its logits. Printed per mode:

* the largest per-step |loss difference| from one device, and the first step above 1e-6;
* the steps where some token's expert choice differs from one device's (how many, the first), and
  the largest |router logit difference| before that first step (how close the logits stay while
  the parameters are still the same);
* static against eager: whether every loss and every choice is equal (Static Eager computes eager
  mode's bits, ``tests/static/test_static_equal.py``).

Progress every 100 steps. A 1,000-step run of the three takes ~15-60 min of CPU on a busy 2-core
machine; run it with ``nice``.
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
from vescale.testing import run_on_ranks

BATCH, SEQ, VOCAB, SEED, LR = 8, 32, 128, 3, 1e-3
MESHES = {"dp2tp2": (4, (2, 2), ("DP", "TP")), "dp2": (2, (2,), ("DP",))}
TARGET = 1e-6


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t._local_tensor if isinstance(t, DTensor) else t).detach().clone()


def train(steps: int, mode: str | None, mesh_name: str) -> dict:
    """Losses, router choices and logits of ``steps`` AdamW steps: on one device (``mode`` None) or
    on this rank of the mesh (choices and logits: this rank's tokens)."""
    from vescale.zoo import moe_plan, synthetic_batches, tiny_hf_mixtral

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = tiny_hf_mixtral(attention_dropout=0.1)
    coord = {}
    if mode is not None:
        _, shape, names = MESHES[mesh_name]
        mesh = vescale.init_mesh(shape, names)
        coord = dict(zip(names, mesh.get_coordinate()))
        vescale.parallelize(model, moe_plan(mesh, model.config, sequence_parallel="TP" in names, zero3=True), mesh, mode=mode)
    vescale.manual_seed(SEED)
    routers = [layer.mlp.gate for layer in model.model.layers]
    step_out: list = []
    for layer, gate in enumerate(routers):
        gate.register_forward_hook(lambda m, a, out, layer=layer: step_out.append((layer, _local(out[0]), _local(out[2]))))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, choices, logits = [], [], []
    t0 = time.perf_counter()
    rng = vescale.random.consistent() if mode is None else _nothing()
    with rng:
        for step, (input_ids, labels) in enumerate(synthetic_batches(steps, BATCH, SEQ, VOCAB, seed=SEED)):
            step_out.clear()
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item())
            by_layer = sorted(step_out, key=lambda x: x[0])
            logits.append(torch.stack([lg for _, lg, _ in by_layer]))
            choices.append(torch.stack([ix for _, _, ix in by_layer]).to(torch.int8))
            if (step + 1) % 100 == 0 and (mode is None or dist.get_rank() == 0):
                where = "one device" if mode is None else f"{mode} on {dist.get_world_size()} ranks"
                print(f"  {where}: step {step + 1}/{steps}, loss {losses[-1]:.6f}, {time.perf_counter() - t0:.0f} s", flush=True)
    return {"losses": losses, "choices": torch.stack(choices), "logits": torch.stack(logits), "coord": coord}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _rank(steps: int, mode: str, mesh_name: str) -> dict | None:
    torch.set_num_threads(1)
    out = train(steps, mode, mesh_name)
    # The router of each DP rank sees that rank's tokens (batch-local MoE blocks), whole over TP.
    return out if out["coord"].get("TP", 0) == 0 else None


def distributed(steps: int, mode: str, mesh_name: str) -> dict:
    ranks, _, _ = MESHES[mesh_name]
    results = [r for r in run_on_ranks(_rank, ranks, steps, mode, mesh_name, timeout=48 * 3600) if r is not None]
    results.sort(key=lambda r: r["coord"].get("DP", 0))
    # dim 2 is the tokens (steps, layers, tokens, ...): DP rank d holds the d-th share of the batch
    return {"losses": results[0]["losses"], "choices": torch.cat([r["choices"] for r in results], 2),
            "logits": torch.cat([r["logits"] for r in results], 2)}


def compare(ref: dict, run: dict) -> dict:
    diffs = [abs(a - b) for a, b in zip(ref["losses"], run["losses"])]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    above = next((i for i, d in enumerate(diffs) if not d <= TARGET), None)
    # A token's choice differs if its set of experts differs (top-k order aside).
    a, b = ref["choices"].sort(-1).values, run["choices"].sort(-1).values
    differ = (a != b).any(-1)  # (steps, layers, tokens)
    steps_differ = differ.flatten(1).any(1)
    first = int(steps_differ.nonzero()[0]) if steps_differ.any() else None
    until = first if first is not None else len(diffs)
    logit_diff = (ref["logits"][:until] - run["logits"][:until]).abs().amax().item() if until else 0.0
    return {"max_loss_diff": diffs[worst], "max_loss_step": worst, "first_loss_above_target": above,
            "steps_with_other_experts": int(steps_differ.sum()), "first_other_experts": first,
            "tokens_with_other_experts": int(differ.sum()), "max_logit_diff_before": logit_diff,
            "logits_equal_at_step0": bool(torch.equal(ref["logits"][0], run["logits"][0]))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--modes", nargs="+", choices=["eager", "static"], default=["eager", "static"])
    parser.add_argument("--mesh", choices=list(MESHES), default="dp2tp2")
    parser.add_argument("--json", help="also write the summaries and the losses to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    print(f"one device: {args.steps} steps ...", flush=True)
    ref = train(args.steps, None, args.mesh)
    runs, summary = {}, {}
    for mode in args.modes:
        print(f"{mode} on {args.mesh}: {args.steps} steps ...", flush=True)
        runs[mode] = distributed(args.steps, mode, args.mesh)
        s = summary[mode] = compare(ref, runs[mode])
        print(f"{mode} vs one device: max |loss diff| {s['max_loss_diff']:.3g} (step {s['max_loss_step']}), first above "
              f"{TARGET:g}: {s['first_loss_above_target']}; steps with another expert choice: {s['steps_with_other_experts']} "
              f"(first {s['first_other_experts']}, {s['tokens_with_other_experts']} token choices in all); router logits "
              f"equal at step 0: {s['logits_equal_at_step0']}, largest |logit diff| before the first other choice: "
              f"{s['max_logit_diff_before']:.3g}", flush=True)
    if "eager" in runs and "static" in runs:
        e, s = runs["eager"], runs["static"]
        same = e["losses"] == s["losses"] and torch.equal(e["choices"], s["choices"]) and torch.equal(e["logits"], s["logits"])
        summary["static_equals_eager"] = same
        print(f"static vs eager: every loss, expert choice and router logit equal: {same}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "mesh": args.mesh, "summary": summary, "reference": ref["losses"],
                       **{mode: r["losses"] for mode, r in runs.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
