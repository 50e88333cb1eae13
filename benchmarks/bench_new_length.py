"""What a new sequence length costs: a step at a length no arm has run, over a repeat at that length.

``bench_dispatch.py``'s runners (fake process group, rank 0, one intra-op thread, thread-CPU clock) in
one process, arms interleaved length by length; every length is new to every arm (the arms share
PyTorch's shape-keyed sharding cache, so each arm gets lengths of its own). Per length and arm:
the new step's time over the faster of two repeats. Run it with another tree on ``PYTHONPATH`` to
compare branches (the runners come from this directory's ``bench_dispatch.py``).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_new_length.py [--config dp2tp4] [--model moe] [--lengths 9] [--arms torch,eager]

``--hit-path``: instead, what one decision of vescale's shape-free cache costs on the ops of a new
length (eager arm): the sharding schemas of one new step are captured, and the cache's decision for
each (all hits) is timed in a loop, views and other ops apart (us per op, median of 30 passes).
Warm CPU caches make these lower than inside a step; compare trees with it, not with step times.
"""

from __future__ import annotations

import statistics
import time

import torch.distributed as dist

import bench_dispatch as B
from vescale.dispatch.fast import cache as C


def hit_path(runner) -> None:
    """Time the shape-free cache's decision on every op of a new step (see module doc)."""
    cache = C.shape_free_cache()
    seen = []
    decide = cache._decide
    cache._decide = lambda schema: seen.append(schema) or decide(schema)
    try:
        runner.step(B.SEQ + 8)
    finally:
        del cache._decide
    hits = [s for s in seen if type(cache.entries.get(C._key(s))) is tuple]
    print(f"{len(seen)} decisions in a new step, {len(hits)} of them hits")
    for name, group in (("views", [s for s in hits if s.op in C._VIEW_RULES]),
                        ("other ops", [s for s in hits if s.op not in C._VIEW_RULES])):
        passes = []
        for _ in range(30):
            t0 = time.perf_counter_ns()
            for s in group:
                cache._decide(s)
            passes.append((time.perf_counter_ns() - t0) / 1e3 / max(len(group), 1))
        print(f"{name:10s} {len(group):4d} ops  {statistics.median(passes):6.1f} us per decision")


def main() -> None:
    ap = B.one_process_parser(__doc__)
    ap.add_argument("--lengths", type=int, default=9)
    ap.add_argument("--arms", default="torch,eager")
    ap.add_argument("--hit-path", action="store_true", help="time the shape-free cache's decisions instead")
    args = ap.parse_args()
    arms = args.arms.split(",")
    mesh, shape, sp, zero3 = B.fake_mesh(args.config)
    if args.hit_path:
        runner = B.Runner("eager", mesh, *shape, sp, zero3, args.model)
        for _ in range(3):
            runner.step()
        hit_path(runner)
        dist.destroy_process_group()
        return
    runners = {arm: B.Runner(arm, mesh, *shape, sp, zero3, args.model) for arm in arms}
    for _ in range(3):  # warm-up
        for arm in arms:
            runners[arm].step()
    ratios = {arm: [] for arm in arms}
    again = {arm: [] for arm in arms}
    for i in range(args.lengths):
        for k, arm in enumerate(arms):
            seq = B.SEQ + 8 * (1 + k + len(arms) * i)
            new = runners[arm].step(seq)
            repeat = min(runners[arm].step(seq) for _ in range(2))
            ratios[arm].append(new / repeat)
            again[arm].append(repeat)
    print(f"## {args.model} {args.config} (fake group, thread clock), {args.lengths} new lengths per arm")
    for arm in arms:
        q = statistics.quantiles(ratios[arm], n=4)
        print(f"{arm:10s} new length x {statistics.median(ratios[arm]):.2f} ({q[0]:.2f}-{q[2]:.2f})"
              f"  repeat {statistics.median(again[arm]) * 1e3:.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
