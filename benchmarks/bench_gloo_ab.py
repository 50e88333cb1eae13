"""A/B of one vescale switch on real gloo ranks: the same runner with the switch on and off, step by step.

``bench_dispatch.py``'s runner (default: Static Eager on the zoo LLaMA, DP=2 x TP=2 + SP + ZeRO-3,
4 gloo ranks), one model per rank, the switch flipped between steps in the order off, on, on, off,
... so both arms see the same ranks, caches and machine load (separate launches on this shared
2-core machine differ by 10-20% on the wall clock). Per arm: rank 0's wall time per step and every
rank's process CPU time per step (its own work, gloo's threads included), medians (p25-p75).

Switches:

* ``keep``: ``GatherScheduler.keep_for_backward`` (what forward used last stays gathered for backward);
* ``pairs``: ``vescale.comm.direct.pairs_exchange`` (a two-member gloo group's all-gathers and
  reduce-scatters move only the other member's part);
* ``steps``: the step check (``parallelize(check_steps=)``: one small all-reduce on its own gloo
  group at the end of every forward, ``vescale.parallel.faults``).

    .venv/bin/python benchmarks/bench_gloo_ab.py --switch pairs [--pairs 30] [--config dp2tp2] [--variant static]
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time

import torch.distributed as dist

import bench_dispatch as B
import vescale
from vescale.comm import direct
from vescale.testing import run_on_ranks
from vescale.model_state import state_of


def _keep(runner, on: bool) -> None:
    state_of(runner.model).gathers.keep_for_backward = on


def _pairs(runner, on: bool) -> None:
    direct.pairs_exchange = on


def _steps(runner, on: bool) -> None:
    state_of(runner.model).step_check.enabled = on


SWITCHES = {"keep": _keep, "pairs": _pairs, "steps": _steps}


def _on_rank(config: str, variant: str, switch: str, pairs: int) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    shape, names, sp, zero3 = B.CONFIGS[config]
    mesh = vescale.init_mesh(shape, names)
    vescale.manual_seed(0)
    runner = B.Runner(variant, mesh, *shape, sp, zero3, "llama", real_collectives=True)
    flip = SWITCHES[switch]
    for i in range(6):  # recording and warm-up, both arms
        flip(runner, i % 2 == 1)
        runner.step()
    times = {False: ([], []), True: ([], [])}  # arm -> (wall, process CPU) per step
    for i in range(2 * pairs):
        on = (i % 2 == 1) != (i // 2 % 2 == 1)  # off, on, on, off, ...: neither arm always goes first
        flip(runner, on)
        dist.barrier()  # every rank starts the step together (the wall clock waits for the slowest)
        wall, cpu = time.perf_counter(), time.process_time()
        runner.step()
        times[on][0].append(time.perf_counter() - wall)
        times[on][1].append(time.process_time() - cpu)
    return times


def _fmt(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{statistics.median(xs) * 1e3:6.1f} ({q[0] * 1e3:6.1f}-{q[2] * 1e3:6.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--switch", choices=tuple(SWITCHES), required=True)
    ap.add_argument("--pairs", type=int, default=30, help="steps per arm")
    ap.add_argument("--config", default="dp2tp2", choices=("dp2tp2", "tp2"))
    ap.add_argument("--variant", default="static", choices=("static", "eager"))
    args = ap.parse_args()
    world = math.prod(B.CONFIGS[args.config][0])
    ranks = run_on_ranks(_on_rank, world, args.config, args.variant, args.switch, args.pairs, timeout=1800)
    print(f"## {args.variant} {args.config} on {world} gloo ranks, {args.switch} off / on, {args.pairs} steps each, interleaved")
    medians = {}
    for on in (False, True):
        cpu = [x for r in ranks for x in r[on][1]]
        medians[on] = (statistics.median(ranks[0][on][0]), statistics.median(cpu))
        per_rank = " ".join(f"{statistics.median(r[on][1]) * 1e3:.1f}" for r in ranks)
        print(f"{args.switch}={'on ' if on else 'off'}  wall (rank 0) {_fmt(ranks[0][on][0])} ms   "
              f"CPU (all ranks) {_fmt(cpu)} ms   per-rank CPU medians {per_rank}")
    print(f"on / off: wall {medians[True][0] / medians[False][0]:.3f}, CPU {medians[True][1] / medians[False][1]:.3f}")


if __name__ == "__main__":
    main()
