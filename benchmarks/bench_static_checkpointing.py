"""Static Eager mode with activation checkpointing: step time against eager mode and PyTorch's stack,
each checkpointing every decoder layer, and the activation memory checkpointing saves.

One process as rank 0 of a fake process group (``bench_dispatch.fake_mesh``: CPU overhead, one
intra-op thread, thread clock), the zoo LLaMA of ``bench_dispatch.py`` (4 layers). Arms, interleaved
round by round:

* ``torch+ckpt``: PyTorch's stack the TorchTitan way (``bench_dispatch._torchtitan``), each layer's
  body under ``torch.utils.checkpoint(use_reentrant=False)``;
* ``eager+ckpt`` / ``static+ckpt``: vescale, the same checkpointing with
  ``context_fn=vescale.random.checkpoint_context``;
* ``static``: Static Eager without checkpointing (what checkpointing costs, and the memory it saves).

Prints the median step (p25-p75) per arm and the ratios against ``eager+ckpt`` and ``torch+ckpt``,
and the bytes of activations autograd keeps for backward after one forward (rank 0's local tensors,
counted by a saved-tensor hook outside the checkpointed regions, storages counted once).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_static_checkpointing.py --config dp2tp4 --rounds 9
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parent))

import bench_dispatch as bd  # noqa: E402
import vescale  # noqa: E402

sys.path[:0] = [str(Path(__file__).parent.parent / "tests"), str(Path(__file__).parent.parent / "tests" / "static")]
from test_static_checkpointing import checkpoint_layers  # noqa: E402

ARMS = {"torch+ckpt": ("torch", True), "eager+ckpt": ("eager", True), "static+ckpt": ("static", True), "static": ("static", False)}


def _runner(arm: str, mesh, shape, sp: bool, zero3: bool) -> bd.Runner:
    variant, ckpt = ARMS[arm]
    runner = bd.Runner(variant, mesh, shape[0], shape[1], sp, zero3)
    if ckpt:
        context = torch.utils.checkpoint.noop_context_fn if variant == "torch" else vescale.random.checkpoint_context
        checkpoint_layers(runner.model, context)
    return runner


def saved_bytes(runner: bd.Runner) -> int:
    """Bytes of the local tensors autograd keeps for backward after one forward of ``runner``."""
    storages: dict[int, int] = {}

    def pack(t):
        local = t._local_tensor if isinstance(t, DTensor) else t
        try:
            storage = local.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()  # 0: a freed ZeRO-3 gathered copy
        except RuntimeError:  # a tensor without a plain storage (an in-flight collective's output)
            key, nbytes = id(local), local.numel() * local.element_size()
        storages[key] = max(storages.get(key, 0), nbytes)
        return t

    (x, y), = bd.synthetic_batches(1, runner.batch, bd.SEQ, runner.vocab, seed=0)
    context = torch.distributed.tensor.parallel.loss_parallel() if runner.variant == "torch" else contextlib.nullcontext()
    with context:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = runner.model(input_ids=x, labels=y).loss
        loss.backward()
    runner.opt.zero_grad()
    return sum(storages.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="dp2tp4", choices=tuple(bd.CONFIGS))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--arms", default=",".join(ARMS))
    args = ap.parse_args()
    mesh, shape, sp, zero3 = bd.fake_mesh(args.config)
    arms = args.arms.split(",")
    runners = {arm: _runner(arm, mesh, shape, sp, zero3) for arm in arms}
    for runner in runners.values():  # record, settle (static: two steps record at most, then quiet)
        for _ in range(4):
            runner.step()
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(args.rounds):
        for arm, runner in runners.items():
            times[arm].append(runner.step() * 1e3)
    print(f"## {args.config}, zoo LLaMA {bd.MODEL.num_hidden_layers} layers, fake group, thread clock, {args.rounds} rounds")
    med = {arm: statistics.median(ts) for arm, ts in times.items()}
    for arm, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        ratios = "  ".join(f"x {base} {med[arm] / med[base]:.2f}" for base in ("eager+ckpt", "torch+ckpt") if base in med and base != arm)
        print(f"{arm:12s} {med[arm]:8.1f} ms ({q[0]:.1f}-{q[2]:.1f})  {ratios}")
        if ARMS[arm][0] == "static":
            rt = vescale.static.static_runtime(runners[arm].model)
            print(f"{'':12s} steps: {rt.recorded_steps} recorded, {rt.static_steps} static, {rt.recomputations} regions recomputed")
    print("## activations kept for backward after one forward (rank 0, local bytes)")
    for arm, runner in runners.items():
        print(f"{arm:12s} {saved_bytes(runner) / 2**20:8.2f} MiB")


if __name__ == "__main__":
    main()
