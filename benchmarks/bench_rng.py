"""Throughput of vescale.random's counter kernel on a rank's local shard, against native torch.rand / torch.randn.

    python benchmarks/bench_rng.py [--parts 1 2 3] [--threads 1 2] [--repeat 7] [--rounds 15 --calls 20]

Part 1 fills a local block of float32 values of a global tensor sharded 8 ways, as one rank does:
Shard(0) (the block is one contiguous run of the global tensor) and Shard(1) (one run per row), with
the compiled kernel and with the pure-PyTorch fallback, next to torch.rand / torch.randn filling a tensor
of the same local size on the same CPU. Part 2 keeps the local size fixed and grows the global tensor
x1, x8, x64: the cost must follow the local size, not the global one.

Times are the best of --repeat runs (wall clock); on a shared machine the best run is the one least
disturbed by other processes. The device profile is an H100 SXM (T = 270,336 threads for large tensors).
Native torch.rand / randn on CPU run on one thread whatever torch.set_num_threads says (one mt19937
stream); the compiled kernel uses torch.get_num_threads() threads, set per row of the table.

Part 3 (per-op overhead) times whole random ops on DTensors, as a model calls them (F.dropout,
torch.rand_like, Tensor.uniform_, aten.native_dropout), against the same native op on the rank's local
shard, on a (1, 8) mesh over the fake process group, one thread, in CPU time of the thread (time.thread_time:
a busy shared machine inflates wall-clock times, not this). The variants are interleaved: each round
times --calls calls of every variant in turn; the table gives the median over --rounds rounds of the
per-call time, with the interquartile range, and the ratio of the medians. "kernel only" is
kernel.generate of the same block (the drawing itself, no DTensor or op machinery).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vescale.random import _native, kernel

PROFILE = kernel.H100_SXM
WORLD = 8


def best_seconds(fn, repeat: int) -> float:
    fn()  # warm-up: first-use costs (building the kernel, page faults of the output) are not measured
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def shard_indices(global_shape, dim: int, rank: int):
    """dim_indices of rank `rank`'s block when dim `dim` is split evenly over WORLD ranks."""
    index = [torch.arange(size) for size in global_shape]
    chunk = global_shape[dim] // WORLD
    index[dim] = torch.arange(rank * chunk, (rank + 1) * chunk)
    return index


def vescale_fill(out, kind, global_shape, index, backend):
    params = dict(low=0.0, high=1.0) if kind == "uniform" else dict(mean=0.0, std=1.0)
    return lambda: kernel.generate(out, kind, seed=1234, offset=0, global_shape=global_shape, dim_indices=index,
                                   profile=PROFILE, backend=backend, **params)


def part1(local_sizes, thread_counts, repeat):
    print("Part 1: ns per element of a rank's float32 block (global tensor = 8 blocks), ratio to native")
    header = f"{'local elements':>14}  {'what':<44}{'threads':>7}  {'ns/elem':>8}  {'x native':>8}"
    print(header)
    print("-" * len(header))
    for numel in local_sizes:
        cols = 1024
        rows = numel // cols
        x = torch.empty(numel)
        for kind, native_name, native in (("uniform", "torch.rand", x.uniform_), ("normal", "torch.randn", x.normal_)):
            base = best_seconds(native, repeat) / numel * 1e9
            print(f"{numel:>14,}  {native_name + ' (native, CPU)':<44}{1:>7}  {base:>8.2f}  {1.0:>8.2f}")
            cases = [(f"vescale {kind} C, Shard(0) block", 0, "native"), (f"vescale {kind} C, Shard(1) block", 1, "native")]
            if numel <= 2**20:
                cases.append((f"vescale {kind} pure-PyTorch path, Shard(0)", 0, "torch"))
            for label, dim, backend in cases:
                global_shape = (rows * WORLD, cols) if dim == 0 else (rows, cols * WORLD)
                index = shard_indices(global_shape, dim, rank=3)
                out = torch.empty(rows, cols)
                for threads in thread_counts if backend == "native" else thread_counts[:1]:
                    torch.set_num_threads(threads)
                    t = best_seconds(vescale_fill(out, kind, global_shape, index, backend), repeat) / numel * 1e9
                    print(f"{'':>14}  {label:<44}{threads:>7}  {t:>8.2f}  {t / base:>8.2f}")
        print()


def part2(local_numel, thread_counts, repeat):
    threads = min(thread_counts)  # one thread: the least disturbed by other work on a shared machine
    torch.set_num_threads(threads)
    print(f"Part 2: a fixed local block of {local_numel:,} float32 elements in ever larger global tensors "
          f"(compiled kernel, {threads} thread(s); x1 is the whole tensor)")
    header = f"{'global elements':>16}  {'x':>3}  {'layout':<16}{'uniform ms':>11}{'vs x1':>7}{'normal ms':>11}{'vs x1':>7}"
    print(header)
    print("-" * len(header))
    cols = 1024
    rows = local_numel // cols
    out = torch.empty(rows, cols)
    baseline = {}
    for factor in (1, 8, 64):
        for layout, global_shape, index in (
            ("Shard(0) rows", (rows * factor, cols), [torch.arange(rows) + rows * (factor // 2), torch.arange(cols)]),
            ("Shard(1) cols", (rows, cols * factor), [torch.arange(rows), torch.arange(cols) + cols * (factor // 2)]),
        ):
            times = [best_seconds(vescale_fill(out, kind, global_shape, index, "native"), repeat) * 1e3
                     for kind in ("uniform", "normal")]
            base = baseline.setdefault(layout, times)
            print(f"{rows * cols * factor:>16,}  {factor:>3}  {layout:<16}{times[0]:>11.2f}{times[0] / base[0]:>7.2f}"
                  f"{times[1]:>11.2f}{times[1] / base[1]:>7.2f}")
    print()


def _overhead_cases():
    """(label, DTensor op, native op on the local shard, kernel-only draw of the same block)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import vescale
    from vescale.random import dtensor as random_dtensor

    mesh = vescale.init_mesh((1, WORLD), ("DP", "TP"))
    vescale.manual_seed(0)
    cases = []
    for label, local_shape, placements, op in (
        ("F.dropout hidden (8,64,256) Shard(1)", (8, 8, 256), [Replicate(), Shard(1)], "dropout"),
        ("F.dropout attn probs (8,8,64,64) Shard(1)", (8, 1, 64, 64), [Replicate(), Shard(1)], "dropout"),
        ("aten.native_dropout (8,64,256) Shard(1)", (8, 8, 256), [Replicate(), Shard(1)], "native_dropout"),
        ("rand_like (8,64,256) Shard(1)", (8, 8, 256), [Replicate(), Shard(1)], "rand_like"),
        ("uniform_ weight (512,256) Shard(0)", (64, 256), [Replicate(), Shard(0)], "uniform_"),
        ("randn_like (8,64,256) Replicate", (8, 64, 256), [Replicate(), Replicate()], "randn_like"),
    ):
        local = torch.randn(local_shape)
        dist_tensor = DTensor.from_local(local, mesh, placements, run_check=False)
        call = {
            "dropout": lambda t: F.dropout(t, 0.1, True),
            "native_dropout": lambda t: torch.ops.aten.native_dropout(t, 0.1, True),
            "rand_like": torch.rand_like,
            "randn_like": torch.randn_like,
            "uniform_": lambda t: t.uniform_(-0.1, 0.1),
        }[op]
        block = random_dtensor._plan_of(dist_tensor._spec).block
        kind, params = {
            "rand_like": ("uniform", dict(low=0.0, high=1.0)),
            "uniform_": ("uniform", dict(low=-0.1, high=0.1)),
            "randn_like": ("normal", dict(mean=0.0, std=1.0)),
        }.get(op, ("bernoulli", dict(p=0.9)))
        out = torch.empty(local_shape)

        def kernel_only(out=out, block=block, kind=kind, params=params):
            kernel.generate(out, kind, seed=0, offset=0, global_shape=block.global_shape, dim_indices=block,
                            profile=PROFILE, **params)

        cases.append((label, (lambda t=dist_tensor, c=call: c(t)), (lambda t=local, c=call: c(t)), kernel_only))
    return cases


def part3(rounds: int, calls: int):
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend

    from vescale import dispatch

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=WORLD)
    dispatch.install()
    cases = _overhead_cases()
    print(f"Part 3: per-op overhead of random ops on DTensors ((1, {WORLD}) mesh, fake process group, 1 thread); "
          f"median CPU us per call over {rounds} rounds of {calls} calls [interquartile range]")
    header = f"{'op':<44}{'native local':>20}{'DTensor':>20}{'x native':>9}{'kernel only':>20}"
    print(header)
    print("-" * len(header))
    for label, dtensor_op, native_op, kernel_op in cases:
        variants = (native_op, dtensor_op, kernel_op)
        for fn in variants:  # warm-up: plans, caches, first-use builds
            for _ in range(5):
                fn()
        samples = [[] for _ in variants]
        for _ in range(rounds):
            for fn, times in zip(variants, samples):
                start = time.thread_time()
                for _ in range(calls):
                    fn()
                times.append((time.thread_time() - start) / calls * 1e6)
        cells = []
        for times in samples:
            q1, _, q3 = statistics.quantiles(times, n=4)
            cells.append((statistics.median(times), f"{statistics.median(times):.0f} [{q1:.0f}-{q3:.0f}]"))
        ratio = cells[1][0] / cells[0][0]
        print(f"{label:<44}{cells[0][1]:>20}{cells[1][1]:>20}{ratio:>9.2f}{cells[2][1]:>20}")
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**16, 2**20, 2**22], help="local elements")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts for the C kernel")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=15, help="part 3: interleaved rounds")
    parser.add_argument("--calls", type=int, default=20, help="part 3: calls per variant per round")
    args = parser.parse_args()
    if _native.load() is None:
        raise SystemExit("the compiled kernel could not be built; nothing to compare")
    print(f"torch {torch.__version__}, profile {PROFILE}, {torch.get_num_threads()} threads available\n")
    if 1 in args.parts:
        part1(args.sizes, args.threads, args.repeat)
    if 2 in args.parts:
        part2(2**20, args.threads, 2 * args.repeat)
    if 3 in args.parts:
        part3(args.rounds, args.calls)


if __name__ == "__main__":
    main()
