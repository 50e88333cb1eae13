"""Gradient and ZeRO-3 communication: per-tensor vs bucketed vs bucketed + N-D fused.

    .venv/bin/python benchmarks/bench_comm.py            # all three parts
    .venv/bin/python benchmarks/bench_comm.py --part 1   # or 2, 3, 4

Part 1 (4 gloo ranks, DP=2 x TP=2 with sequence parallelism): a model with many small parameters
(``--depth`` blocks of a norm vector and two small linears). Every weight's gradient is Partial on
DP, the norms' also on TP. Per mode: collectives per training step (forward + backward, counted by
``vescale.debug.CollectiveCounter``), the gradient-reduction collectives alone, the median step
time and its ratio to per-tensor, and the ring (alpha-beta) cost model's prediction of the gradient
reduction time, with alpha (per collective) and beta (per byte) measured on the same ranks in the
same run.

Part 2 (fake process group, rank 0 of a simulated DP=8 x TP=8 mesh): the same model. Collectives do
not communicate, so the time is vescale's CPU cost of issuing them; the cost model's bandwidth term
(in units of 2SB, S = bytes of all gradients) shows what fusion saves on a real 8x8 mesh.

Part 3 (4 gloo ranks): the zoo LLaMA (4 layers), DP=2 x TP=2 + SP + ZeRO-3: vescale per-tensor vs
vescale bucketed (eager and Static Eager) vs a TorchTitan-style stack on plain PyTorch (``parallelize_module`` TP + SP,
``fully_shard`` per block + root on DP): collectives and bytes per step, median step time.

Part 4 (2 and 4 gloo ranks): one collective at a time, ``vescale.comm.direct`` (all-gathers and
two-member reduce-scatters over gloo's all-to-all) against gloo's own ``all_gather_single`` /
``reduce_scatter_single``, interleaved: wall and process-CPU microseconds per call, medians.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import vescale
from vescale import VescalePlan
from vescale.debug import CollectiveCounter
from vescale.testing import run_on_ranks
from vescale.model_state import state_of

MODES = {
    "per-tensor": dict(bucket_mb=None),
    "bucketed": dict(bucket_mb=25.0, fuse_dims=False),
    "bucketed+fused": dict(bucket_mb=25.0, fuse_dims=True),
}


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(width))
        self.mlp = nn.Sequential(nn.Linear(width, width, bias=False), nn.ReLU(), nn.Linear(width, width, bias=False))

    def forward(self, x):
        return x + self.mlp(x * self.norm)


class ManySmall(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def _plan() -> VescalePlan:
    """DP on tokens; SP on TP outside the MLPs (norm gradients Partial on TP too); Megatron MLPs."""
    plan = VescalePlan()
    plan.shard("<in>", Shard(0), mesh="DP")
    plan.shard("<in>", Shard(0), mesh="TP")
    plan.shard(r"layers\.\d+\.mlp\.<in>", Replicate(), mesh="TP")
    plan.shard(r"layers\.\d+\.mlp\.0\.weight", Shard(0), mesh="TP")
    plan.shard(r"layers\.\d+\.mlp\.2\.weight", Shard(1), mesh="TP")
    plan.shard(r"layers\.\d+\.mlp\.<out>", Shard(0), mesh="TP")
    return plan


def _ring_cost(records, mesh_shape, fused: bool, per_tensor: bool):
    """(collectives, bandwidth term in bytes) of the gradient reduction under the ring model:
    all-reduce of S bytes over P ranks moves 2S(P-1)/P; over several dims one at a time, the sum."""
    n, moved, buckets = 0, 0.0, set()
    for dims, nbytes in records:
        sizes = [mesh_shape[d] for d in dims]
        if fused:
            p = 1
            for s in sizes:
                p *= s
            moved += 2 * nbytes * (p - 1) / p
        else:
            moved += sum(2 * nbytes * (s - 1) / s for s in sizes)
        if per_tensor:
            n += len(dims)
        else:
            buckets.add(dims)
    if not per_tensor:
        n = sum(1 if fused else len(d) for d in buckets)
    return n, moved


def _grad_records(model) -> list[tuple[tuple[int, ...], int]]:
    """(Partial mesh dims, local bytes) of every gradient the reducer files, from one backward."""
    reducer, records = state_of(model).reducer, []
    original = reducer._file

    def recording(entry):
        records.append((entry.plan.dims, entry.local.numel() * entry.local.element_size()))
        return original(entry)

    reducer._file = recording  # this benchmark's own instance only
    return records


def _alpha_beta(group=None, repeat: int = 20) -> tuple[float, float]:
    """Seconds per all-reduce call (alpha) and per ring-moved byte (beta), on this group."""

    def timed(numel):
        t = torch.ones(numel)
        dist.all_reduce(t, group=group)
        start = time.perf_counter()
        for _ in range(repeat):
            dist.all_reduce(t, group=group)
        return (time.perf_counter() - start) / repeat

    p = dist.get_world_size(group)
    small, big = timed(1), timed(1 << 20)
    alpha = small
    beta = max(big - small, 0.0) / (2 * 4 * (1 << 20) * (p - 1) / p)
    return alpha, beta


def _one_step(model, x) -> tuple[float, int]:
    start = time.perf_counter()
    with CollectiveCounter() as c:
        model(x).backward()
    elapsed = time.perf_counter() - start
    for p in model.parameters():
        p.grad = None
    return elapsed, c.total


def _mode_steps(name, shape, width, depth, tokens, steps, fake: bool):
    """One mode on fresh processes: modes must not share one, because the flattened sub-meshes that
    bucketed+fused registers on the mesh are also used by DTensor's own redistribution, which
    would make the per-tensor baseline partly fused."""
    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh(shape, ("DP", "TP"))
    x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = vescale.parallelize(ManySmall(width, depth), _plan(), mesh, **MODES[name])
    reducer = state_of(model).reducer
    records = _grad_records(model) if reducer is not None else None
    _one_step(model, x)  # warm-up: sharding propagation caches
    if reducer is not None:
        records = list(records)  # one backward's gradients
        reducer.stats.clear()
    times, counts = zip(*(_one_step(model, x) for _ in range(steps)))
    return dict(times=list(times), collectives=counts[-1], records=records,
                grad_coll=sum(reducer.stats.values()) / steps if reducer else None,
                alpha_beta=None if fake or name != "per-tensor" else _alpha_beta())


def _fake_child(name, shape, width, depth, tokens, steps, conn):
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend

    dist.init_process_group("fake", rank=0, world_size=shape[0] * shape[1])
    conn.send(_mode_steps(name, shape, width, depth, tokens, steps, True))
    dist.destroy_process_group()


def _fake_mode(*args):
    """``_mode_steps`` as rank 0 of a fake process group, in a forked process of its own."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_fake_child, args=(*args, child))
    proc.start()
    out = parent.recv()
    proc.join()
    return out


def _part12(shape, width, depth, tokens, steps, fake: bool, rounds: int = 2):
    out: dict[str, dict] = {}
    for _ in range(rounds):  # the modes take turns, so that load changes touch each alike
        for name in MODES:
            args = (name, shape, width, depth, tokens, steps)
            r = _fake_mode(*args) if fake else run_on_ranks(_mode_steps, 4, *args, False)[0]
            if name in out:
                out[name]["times"] += r["times"]
            else:
                out[name] = r
    for r in out.values():
        r["time"] = statistics.median(r["times"])
    return out, out["per-tensor"]["alpha_beta"]


def _report_parts12(out, alpha_beta, shape, title):
    records = out["bucketed+fused"]["records"]  # one backward's gradients (same for every mode)
    base = out["per-tensor"]
    n_grads = len(records)
    total = sum(b for _, b in records)
    print(f"\n{title}: {n_grads} gradients reduced per step, {total / 1024:.1f} KiB")
    head = f"{'mode':>15} {'coll/step':>10} {'grad coll':>10} {'step ms':>9} {'x per-tensor':>13} {'ring model: coll':>17} {'bytes (2SB)':>12}"
    if alpha_beta:
        head += f" {'pred. ms':>9} {'pred. x':>8} {'pred. step x':>13}"
    print(head)
    preds = {}
    for name in MODES:
        r = out[name]
        n, moved = _ring_cost(records, shape, fused=name == "bucketed+fused", per_tensor=name == "per-tensor")
        # Per-tensor: the step's collectives less the others (the same in every mode, measured in
        # the fused run as its total less its reducer's own count).
        fused = out["bucketed+fused"]
        grad_coll = r["grad_coll"] if r["grad_coll"] is not None else r["collectives"] - (fused["collectives"] - fused["grad_coll"])
        line = (f"{name:>15} {r['collectives']:>10} {grad_coll:>10.0f} {r['time'] * 1e3:>9.1f} "
                f"{r['time'] / base['time']:>13.3f} {n:>17} {moved / (2 * total):>12.3f}")
        if alpha_beta:
            alpha, beta = alpha_beta
            preds[name] = n * alpha + moved * beta
            # The rest of the step (compute, SP collectives) taken from the per-tensor run.
            rest = base["time"] - preds["per-tensor"]
            line += (f" {preds[name] * 1e3:>9.2f} {preds[name] / preds['per-tensor']:>8.3f}"
                     f" {(rest + preds[name]) / base['time']:>13.3f}")
        print(line)
    if alpha_beta:
        print(f"  (alpha = {alpha_beta[0] * 1e6:.0f} us per all-reduce, beta = {alpha_beta[1] * 1e9:.2f} ns per byte, "
              "measured on these ranks; pred. ms/x: gradient reduction alone; pred. step x: the per-tensor step with its "
              "predicted reduction time replaced by this mode's)")


# ---------------------------------------------------------------------------------------------
# Part 3: zoo LLaMA, vescale vs a TorchTitan-style TP + FSDP2 stack
# ---------------------------------------------------------------------------------------------

LLAMA = dict(num_hidden_layers=4)


def _titan_style(model, mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    tp, dp = mesh["TP"], mesh["DP"]
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        parallelize_module(layer, tp, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    model.set_force_sum_reduction_for_comms(True)  # gloo has no AVG
    return model


STACKS = ("titan", "vescale per-tensor", "vescale bucketed", "vescale static")


def _llama_steps(kind: str, steps: int):
    """One stack on fresh ranks (stacks do not share a process: vescale's thread-local DTensor
    settings would change how the plain-PyTorch stack runs)."""
    from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

    warnings.filterwarnings("ignore")  # FSDP2's and c10d's deprecation notes, once per rank

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    torch.manual_seed(0)
    model = tiny_llama(**LLAMA)
    batches = synthetic_batches(steps + 2, 4, 16, 128, seed=1)
    if kind == "titan":
        _titan_style(model, mesh)
        dp_rank, dp = mesh["DP"].get_local_rank(), mesh["DP"].size()
        # FSDP2 takes this rank's share of the batch; sum-reduced gradients: scale the loss by 1/DP.
        batches = [(x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]) for x, y in batches]
        scale = 1.0 / dp
    else:
        plan = llama_plan(mesh, model.config, sequence_parallel=True, zero3=True)
        options = {"vescale per-tensor": dict(bucket_mb=None), "vescale static": dict(mode="static")}.get(kind, {})
        vescale.parallelize(model, plan, mesh, **options)  # static: bucketed, Static Eager
        scale = 1.0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, counts, losses = [], [], []
    for x, y in batches:
        start = time.perf_counter()
        with CollectiveCounter() as c:
            loss = model(input_ids=x, labels=y).loss * scale
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        counts.append((dict(c.counts), dict(c.nbytes)))
        losses.append((loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()) / scale)
    return dict(times=times[2:], counts=counts[-1][0], nbytes=counts[-1][1], loss=losses[0])  # after 2 warm-up steps


def part3(steps: int, rounds: int = 2):
    print("\nPart 3: zoo LLaMA (4 layers), DP=2 x TP=2 + SP + ZeRO-3 (FSDP2), 4 gloo ranks, AdamW steps")
    print(f"{'stack':>22} {'coll/step':>10} {'(all-gather, reduce-scatter, all-reduce)':>42} {'KiB/step (ag, rs, ar)':>24} "
          f"{'step ms':>9} {'x titan':>8}")
    rows: dict[str, dict] = {}
    for _ in range(rounds):  # the stacks take turns, so that load changes touch each alike
        for kind in STACKS:
            r = run_on_ranks(_llama_steps, 4, kind, steps)[0]
            rows.setdefault(kind, dict(r, times=[]))["times"] += r["times"]
    for r in rows.values():
        r["time"] = statistics.median(r["times"])
    for name, r in rows.items():
        c = r["counts"]
        kinds = (c.get("all_gather", 0), c.get("reduce_scatter", 0), c.get("all_reduce", 0))
        kib = tuple(round(r["nbytes"].get(k, 0) / 1024) for k in ("all_gather", "reduce_scatter", "all_reduce"))
        print(f"{name:>22} {sum(c.values()):>10} {str(kinds):>42} {str(kib):>24} {r['time'] * 1e3:>9.1f} "
              f"{r['time'] / rows['titan']['time']:>8.3f}")
    losses = ", ".join(f"{k} {r['loss']:.6f}" for k, r in rows.items())
    print("  (KiB/step: per collective its largest buffer, i.e. the gathered output of an all-gather and the "
          "input of a reduce-scatter, summed over the collectives one rank issues in a step)")
    print(f"  (median of {rounds} x {steps} steps per stack; first-step losses: {losses}; "
          "the TorchTitan-style loss is rank 0's half of the batch)")


def _gloo_calls(sizes: list[int], rounds: int, calls: int) -> list[tuple]:
    from vescale.comm import direct

    group, n = dist.group.WORLD, dist.get_world_size()
    rows = []
    for numel in sizes:
        x = torch.randn(n * numel)
        gathered, part = torch.empty(n * n * numel), torch.empty(numel)
        arms = {
            ("all_gather", "gloo"): lambda: dist.all_gather_single(gathered, x, group=group),
            ("all_gather", "vescale"): lambda: direct.all_gather(gathered, x, group),
            ("reduce_scatter", "gloo"): lambda: dist.reduce_scatter_single(part, x, group=group),
            ("reduce_scatter", "vescale"): lambda: direct.reduce_scatter(part, x, group),
        }
        times = {k: ([], []) for k in arms}
        for _ in range(rounds):
            for key, call in arms.items():
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    call()
                times[key][0].append((time.perf_counter() - t0) / calls)
                times[key][1].append((time.process_time() - c0) / calls)
        for (kind, arm), (wall, cpu) in times.items():
            rows.append((numel * 4, kind, arm, statistics.median(wall), statistics.median(cpu)))
    return rows


def part4(rounds: int = 7, calls: int = 20):
    print("\nPart 4: one collective on gloo ranks, vescale.comm.direct vs gloo's own (us per call: wall / process CPU)")
    print(f"{'ranks':>5} {'KiB in':>7} {'collective':>15} {'gloo':>14} {'vescale':>14} {'x gloo (wall)':>14}")
    for world in (2, 4):
        rows = run_on_ranks(_gloo_calls, world, [2048, 32768, 131072], rounds, calls)[0]
        got = {(b, k, a): (w, c) for b, k, a, w, c in rows}
        for b, k in dict.fromkeys((b, k) for b, k, _, _, _ in rows):
            g, v = got[b, k, "gloo"], got[b, k, "vescale"]
            print(f"{world:>5} {b // 1024:>7} {k:>15} {g[0]*1e6:>6.0f} / {g[1]*1e6:>5.0f} {v[0]*1e6:>6.0f} / {v[1]*1e6:>5.0f} "
                  f"{v[0] / g[0]:>14.2f}")
    print("  (reduce-scatters of 4 members stay gloo's own: see vescale/comm/direct.py)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", type=int, choices=(1, 2, 3, 4))
    ap.add_argument("--depth", type=int, default=64, help="blocks of the part 1 model")
    ap.add_argument("--fake-depth", type=int, default=32, help="blocks of the part 2 model")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (each run twice)")
    args = ap.parse_args()
    width, tokens = 64, 256
    if args.part in (None, 1):
        out, ab = _part12((2, 2), width, args.depth, tokens, args.steps, fake=False)
        _report_parts12(out, ab, (2, 2), f"Part 1: {args.depth} blocks (width {width}), 4 gloo ranks DP=2 x TP=2 + SP")
    if args.part in (None, 2):
        out, _ = _part12((8, 8), width, args.fake_depth, tokens, args.steps, fake=True)
        _report_parts12(out, None, (8, 8), f"Part 2: {args.fake_depth} blocks (width {width}), fake process group, DP=8 x TP=8 + SP")
    if args.part in (None, 3):
        part3(args.steps)
    if args.part in (None, 4):
        part4()


if __name__ == "__main__":
    main()
