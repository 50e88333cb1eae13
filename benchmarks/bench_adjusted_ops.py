"""Cost of a slice / split of a sharded DTensor, with and without ``cache._plain_if_unchanged``.

PyTorch marks every call of an op that has an argument adjuster (``split``'s sizes and, since issue
27, ``slice``'s bounds: ``vescale.dispatch.fast.interleaved``) as "rewritten" once any input is sharded,
even where the adjuster changed nothing, which sends the op down DTensor's Python slow path on
every call. vescale's shape-free cache now decides such a call plain (DTensor's C++ path).

One process, rank 0 of a fake 2-rank group (what is timed is one rank's CPU work), dispatch
installed; a (2, 8, 16, 64) tensor sharded along dim 1 (heads), cut along its last dim (rotary's
halves) by ``x[..., :32]`` / ``x[..., 32:]`` and by ``split(32, -1)``. Arms, interleaved round by
round, DTensor's and vescale's caches cleared at each switch and warmed again:

* ``plain``: vescale as shipped;
* ``marked``: the same with ``_plain_if_unchanged`` off (the decision PyTorch's propagator returns).

Printed: per arm and op, the median microseconds per call and the 25-75% spread over rounds, and
``marked / plain``. Run: ``.venv/bin/python benchmarks/bench_adjusted_ops.py [--rounds 15]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed.tensor import Shard, distribute_tensor

import vescale
from vescale import dispatch
from vescale.dispatch.fast import cache
from vescale.testing import fake_world, forget_dtensor_caches

OPS = {"slice": lambda x: (x[..., :32], x[..., 32:]), "split": lambda x: x.split(32, -1)}


def _per_call(fn, x, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / (2 * calls) * 1e6  # two cuts per call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    real = cache._plain_if_unchanged
    with fake_world(2):
        dispatch.install()
        mesh = vescale.init_mesh((2,), ("TP",), device_type="cpu")
        x = distribute_tensor(torch.randn(2, 8, 16, 64), mesh, [Shard(1)])
        times = {(arm, op): [] for arm in ("plain", "marked") for op in OPS}
        for _ in range(args.rounds):
            for arm in ("plain", "marked"):
                cache._plain_if_unchanged = real if arm == "plain" else (lambda schema, result: result)
                forget_dtensor_caches()
                for op, fn in OPS.items():
                    _per_call(fn, x, 20)  # warm: decisions made and cached
                    times[(arm, op)].append(_per_call(fn, x, args.calls))
        cache._plain_if_unchanged = real
    for op in OPS:
        medians = {}
        for arm in ("plain", "marked"):
            t = times[(arm, op)]
            q = statistics.quantiles(t, n=4)
            medians[arm] = statistics.median(t)
            print(f"{op:6s} {arm:7s} median {medians[arm]:7.1f} us/call  (25-75%: {q[0]:.1f}-{q[2]:.1f})")
        print(f"{op:6s} marked / plain = {medians['marked'] / medians['plain']:.2f}")


if __name__ == "__main__":
    main()
