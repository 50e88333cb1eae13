"""Mixed precision (bf16 compute, fp32 masters and reduction) under DP=2 x TP=2 + SP + ZeRO-3 on 4 gloo ranks.

    .venv/bin/python benchmarks/bench_mixed_precision.py [--steps 100]

1. Consistency: the zoo's tiny LLaMA trained ``--steps`` AdamW steps with
   ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``, parallel against the single-device run
   with the same policy (``vescale.apply_mixed_precision``); prints the largest per-step loss
   difference, and for scale the same figure for the fp32 parallel run against fp32 on one device,
   and for the bf16 single-device run against fp32 on one device.
2. Memory per rank, bf16 policy against fp32 measured in the same run: state at rest (params,
   grads, AdamW state: the fp32 masters keep it equal), and in the step: the ZeRO-3 gathered
   parameters held at most (``GatherScheduler.held_bytes`` at every module start), the activations
   autograd saves for backward (unique storages, at the end of forward), and the bytes the ZeRO-3
   all-gathers move per step.
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch.distributed.tensor import DTensor

import vescale
from vescale.debug import CollectiveCounter, bytes_at_rest
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama
from vescale.model_state import state_of

POLICY = vescale.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BATCH, SEQ, VOCAB = 4, 16, 128


def _losses(model, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for input_ids, labels in synthetic_batches(steps, BATCH, SEQ, VOCAB, seed=1):
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return losses


def _single(policy, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = tiny_llama()
    if policy is not None:
        vescale.apply_mixed_precision(model, policy)
    return _losses(model, steps)


def _saved_bytes(model, input_ids, labels) -> tuple[int, object]:
    """Bytes of the unique storages autograd saves for backward in one forward; and the loss."""
    storages: dict[int, int] = {}

    def pack(t):
        local = t._local_tensor if isinstance(t, DTensor) else t
        s = local.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=input_ids, labels=labels).loss
    return sum(storages.values()), loss


def _parallel(policy, steps: int) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    torch.manual_seed(0)
    model = tiny_llama()
    model = vescale.parallelize(model, llama_plan(mesh, model.config, zero3=True), mesh, mixed_precision=policy)
    losses = _losses(model, steps)
    # Memory: one more step, measured.
    sched, peak = state_of(model).gathers, [0]
    hooks = [m.register_forward_pre_hook(lambda *_: peak.__setitem__(0, max(peak[0], sched.held_bytes())))
             for m in model.modules()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids, labels = synthetic_batches(1, BATCH, SEQ, VOCAB, seed=2)[0]
    with CollectiveCounter() as counter:
        saved, loss = _saved_bytes(model, input_ids, labels)
        loss.backward()
    opt.step()
    for h in hooks:
        h.remove()
    rest = bytes_at_rest(model, opt)
    return {"losses": losses, "rest": rest["total"], "gathered_peak": peak[0], "saved": saved,
            "gather_bytes": counter.nbytes["all_gather"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    steps = parser.parse_args().steps
    ref_bf16, ref_fp32 = _single(POLICY, steps), _single(None, steps)
    bf16 = run_on_ranks(_parallel, 4, POLICY, steps, timeout=1800)[0]
    fp32 = run_on_ranks(_parallel, 4, None, steps, timeout=1800)[0]

    def worst(a, b):
        return max(abs(x - y) for x, y in zip(a, b))

    print(f"tiny LLaMA, {steps} AdamW steps, DP=2 x TP=2 + SP + ZeRO-3 (4 gloo ranks), batch {BATCH}x{SEQ}")
    print(f"{'comparison':<52} {'max |loss diff| per step':>24}")
    print(f"{'bf16 policy: parallel vs single-device policy':<52} {worst(bf16['losses'], ref_bf16):>24.3e}")
    print(f"{'fp32: parallel vs single device':<52} {worst(fp32['losses'], ref_fp32):>24.3e}")
    print(f"{'(scale) bf16 policy vs fp32, both on one device':<52} {worst(ref_bf16, ref_fp32):>24.3e}")
    print(f"final loss: bf16 parallel {bf16['losses'][-1]:.4f}, bf16 one device {ref_bf16[-1]:.4f}, fp32 {ref_fp32[-1]:.4f}")
    print()
    print(f"{'per rank (KiB)':<44} {'fp32':>10} {'bf16 policy':>12} {'ratio':>7}")
    for key, label in [("rest", "state at rest (params + grads + AdamW)"),
                       ("gathered_peak", "in step: ZeRO-3 gathered params, peak"),
                       ("saved", "in step: activations saved for backward"),
                       ("gather_bytes", "in step: bytes all-gathered (ZeRO-3 + SP)")]:
        a, b = fp32[key], bf16[key]
        print(f"{label:<44} {a / 1024:>10.1f} {b / 1024:>12.1f} {b / a:>7.3f}")


if __name__ == "__main__":
    main()
