"""What a new sequence length costs: a step at a length no arm has run, over a repeat at that length.

``bench_dispatch.py``'s runners (fake process group, rank 0, one intra-op thread, thread-CPU clock) in
one process, arms interleaved length by length; every length is new to every arm (the arms share
PyTorch's shape-keyed sharding cache, so each arm gets lengths of its own). Per length and arm:
the new step's time over the faster of two repeats. Run it with another tree on ``PYTHONPATH`` to
compare branches (the runners come from this directory's ``bench_dispatch.py``).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_new_length.py [--config dp2tp4] [--model moe] [--lengths 9] [--arms torch,eager]
"""

from __future__ import annotations

import statistics

import torch.distributed as dist

import bench_dispatch as B


def main() -> None:
    ap = B.one_process_parser(__doc__)
    ap.add_argument("--lengths", type=int, default=9)
    ap.add_argument("--arms", default="torch,eager")
    args = ap.parse_args()
    arms = args.arms.split(",")
    mesh, shape, sp, zero3 = B.fake_mesh(args.config)
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
