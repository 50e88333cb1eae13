"""Per-rank cost against world size: one rank of a fake 8- to 1,024-rank world, the same work per rank.

One process plays one rank of a world over PyTorch's ``fake`` process group (collectives return at
once, moving nothing), so what is timed is the CPU work that rank does: vescale's and PyTorch's
planning, dispatch and bookkeeping. The model, the tensor-parallel degrees and the batch each rank
loads are the same at every world size (``--inputs local``, the default: each rank passes its own
rows), only the first (data-parallel) mesh dim grows; so anything that grows with the world is a
loop over ranks somewhere, or data that grows with a group. Each (config, world) runs in a fresh
subprocess (every cache starts cold, as on a real cluster).

Configs (``--configs``):

* ``llama-2d``: the zoo LLaMA at hidden 1,024 (2 layers, 8 heads, vocab 1,024, every ZeRO-sharded dim
  divisible by DP x TP up to 1,024 ranks), mesh (DP, TP=4), TP + SP + ZeRO-3 on DP (``llama_plan``);
  world 8 = 2 x 4, 1,024 = 256 x 4;
* ``llama-3d``: HSDP with the issue's zoo LLaMA (4 layers, hidden 128, 8 heads, vocab 512), mesh
  (DPR, DPS=2, TP=2): ZeRO-3 on DPS, the batch split over DPR and DPS, gradients reduce-scattered
  over DPS and all-reduced over DPR; world 8 = 2 x 2 x 2;
* ``moe-2d``: HF's Mixtral (2 layers, hidden 128, 16 experts of intermediate 64, 2 per token),
  ``moe_plan`` with tensor-parallel experts, SP and batch-local MoE blocks on (DP, TP=4);
* ``moe-3d``: the same model on (DP, EP=2, TP=2): expert parallelism (all-to-all routing), attention
  TP + SP (in static mode the experts modules stay eager: ``plan.eager``, see ``_model_and_plan``);
* ``llama-2d-small`` (not in the default set): the issue's model on (DP, TP=4) with ZeRO-3 over all
  of DP. Past DP x TP = 128 its weights' ZeRO shards are uneven and keep the (Shard, Shard) layout,
  whose gathers move the whole weight over DP x TP: the per-rank work is not the same.

Each in ``--modes`` eager and static (Static Eager). Printed per run: DeviceMesh creation
(PyTorch's), ``parallelize``, the first training step (forward, backward, AdamW step), the steady
step (median of ``--steps`` steps), peak memory (RSS high-water mark over ``parallelize`` and the
steps, less the RSS before ``parallelize``: tensors and Python objects alike; the child runs with
glibc's malloc returning freed blocks above 64 KiB at once, so the mark follows live memory), process groups
(``new_group`` calls made by mesh creation and by ``parallelize``, and how many of them this rank is
a member of). Times are this process's CPU time (``--clock cpu``, the default: other processes on a
shared machine disturb it far less than wall time; the fake group never waits, so on an idle
machine the two agree) or wall time (``--clock wall``). Ratios are against the smallest world of
the same config, measured in the same run. Run:

    .venv/bin/python benchmarks/bench_scale.py [--worlds 8,64,512,1024] [--configs llama-2d,llama-3d,moe-2d,moe-3d]
        [--modes eager,static] [--inputs local|global] [--steps 5] [--repeat 1] [--clock cpu|wall] [--timeout 1200]
        [--profile DIR]

``--repeat N`` runs every world N times, the worlds interleaved in alternating order, and prints
medians (steady step: median and range over the runs).

``--profile DIR`` writes a cProfile of ``parallelize`` + the first step per run (``DIR/<run>.prof``; the
``parallelize`` and first-step times printed then include the profiler's) and one of an extra steady
step (``DIR/<run>-steady.prof``; the steady times printed are of the unprofiled steps), and prints
the Python function calls counted in each (``calls first``: ``parallelize`` + first step, in
thousands; ``calls steady``: one steady step) with their ratios to the smallest world. Unlike
times, call counts do not depend on the machine's load: a count that does not grow with the world
says the rank's Python work does not.
Targets (issue 28, world 1,024 against world 8): first step <= 1.5x, steady step <= 1.2x,
``parallelize`` <= 1.5x, peak memory <= 1.1x.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time

# Model sizes. LLAMA_WIDE: every dim ZeRO-3 shards divides by DP x TP up to 1,024 ranks (TP=4,
# DP=256), so every world stores nested, even ZeRO shards and gathers 1/TP of each weight over DP:
# the same per-rank work. LLAMA_SMALL is the model: past DP x TP = 128 its ZeRO shards are
# uneven (a 128-row weight over 1,024 ranks), so weights keep the (Shard, Shard) layout whose
# gathers move the whole weight over DP x TP: per-rank bytes grow with DP (see docs/scale.md).
LLAMA_WIDE = dict(vocab_size=1024, hidden_size=1024, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
LLAMA_SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
# HF Mixtral with many small experts (bench_dispatch's): per-op overhead dominates a step.
MOE = dict(vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=8, head_dim=16, num_local_experts=16, num_experts_per_tok=2, max_position_embeddings=512)


@dataclasses.dataclass(frozen=True)
class Config:
    model: str  # "llama" | "moe"
    sizes: dict
    names: tuple[str, ...]  # mesh dim names; the first one grows with the world
    inner: tuple[int, ...]  # sizes of the other mesh dims (fixed)
    zero3: str | None  # the mesh dim ZeRO-3 shards over (None: no ZeRO-3)
    ep: str | None = None

    def mesh_shape(self, world: int) -> tuple[int, ...]:
        return (world // math.prod(self.inner),) + self.inner

    def batch_dims(self) -> list[str]:
        return [n for n in self.names if n in ("DP", "DPR", "DPS", "EP")]


CONFIGS = {
    # (DP, TP=4): TP + SP, ZeRO-3 over all of DP
    "llama-2d": Config("llama", LLAMA_WIDE, ("DP", "TP"), (4,), "DP"),
    # HSDP (DPR, DPS=2, TP=2): ZeRO-3 over DPS, gradients all-reduced over DPR too
    "llama-3d": Config("llama", LLAMA_SMALL, ("DPR", "DPS", "TP"), (2, 2), "DPS"),
    # (DP, TP=4): tensor-parallel experts, SP, batch-local MoE blocks; gradients all-reduced over DP
    "moe-2d": Config("moe", MOE, ("DP", "TP"), (4,), None),
    # (DP, EP=2, TP=2): expert parallelism (all-to-all routing), attention TP + SP
    "moe-3d": Config("moe", MOE, ("DP", "EP", "TP"), (2, 2), None, ep="EP"),
    # the model on (DP, TP=4) with ZeRO-3 over DP: uneven shards past 128 ranks (not the same work)
    "llama-2d-small": Config("llama", LLAMA_SMALL, ("DP", "TP"), (4,), "DP"),
}
DEFAULT_CONFIGS = "llama-2d,llama-3d,moe-2d,moe-3d"
LOCAL_BATCH, SEQ = 2, 64  # sequences each rank loads (its batch share), tokens each
TARGETS = {"parallelize": 1.5, "first": 1.5, "steady": 1.2, "peak_mb": 1.1}


# ---- one run (a child process) --------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _model_and_plan(cfg: Config, mesh, local_inputs: bool, static: bool):
    """The model, its zoo plan and its vocabulary size. The batch is split over every DP-like dim
    (and EP): with ``local_inputs`` each rank passes its own rows (``plan.annotate``), else the
    global batch (``plan.shard``, sliced by each rank)."""
    from torch.distributed.tensor import Shard

    from vescale.zoo import LlamaConfig, LlamaForCausalLM, llama_plan, moe_plan, tiny_hf_mixtral

    dp = cfg.zero3 or cfg.names[0]
    kwargs = dict(dp=dp, sequence_parallel=True, zero3=cfg.zero3 is not None)
    if cfg.model == "llama":
        config = LlamaConfig(**cfg.sizes)
        model, plan = LlamaForCausalLM(config), llama_plan(mesh, config, **kwargs)
    else:
        model = tiny_hf_mixtral(**cfg.sizes)
        plan = moe_plan(mesh, model.config, ep=cfg.ep, **kwargs)
        if cfg.ep and static:
            # Static Eager does not run expert-parallel experts modules yet (a view of a size EP
            # changes, refused in the first static step): the documented fix keeps them on DTensors.
            plan.eager(r"model\.layers\.\d+\.mlp\.experts")
    for name in cfg.batch_dims():
        for key in (r"<in>\[input_ids\]", r"<in>\[labels\]"):
            if local_inputs:
                plan.annotate(key, Shard(0), mesh=name)  # this rank's rows (ahead of the plan's own split)
            elif name not in (dp, cfg.ep):
                plan.shard(key, Shard(0), mesh=name)
    return model, plan, cfg.sizes["vocab_size"]


def child(run: dict) -> dict:
    import cProfile
    import pstats

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    clock = time.process_time if run["clock"] == "cpu" else time.perf_counter
    import vescale
    from vescale.testing import fake_world

    cfg = CONFIGS[run["config"]]
    shape = cfg.mesh_shape(run["world"])
    c10d = dist.distributed_c10d
    out: dict = {"mesh_shape": shape}
    with fake_world(run["world"], rank=run["rank"]):
        groups0, member0 = c10d._world.group_count, len(c10d._world.pg_map)
        t0 = clock()
        mesh = vescale.init_mesh(shape, cfg.names, "cpu")
        out["mesh_s"] = clock() - t0
        groups1 = c10d._world.group_count
        vescale.manual_seed(0)
        model, plan, vocab = _model_and_plan(cfg, mesh, run["inputs"] == "local", run["mode"] == "static")
        rows = LOCAL_BATCH
        if run["inputs"] == "global":
            rows *= math.prod(mesh[n].size() for n in cfg.batch_dims())
        ids = torch.randint(0, vocab, (rows, SEQ), generator=torch.Generator().manual_seed(1))
        profile = cProfile.Profile() if run.get("profile") else None
        rss0 = _rss_mb()
        if profile:
            profile.enable()
        t0 = clock()
        model = vescale.parallelize(model, plan, mesh, mode=run["mode"])
        out["parallelize_s"] = clock() - t0
        groups2, member2 = c10d._world.group_count, len(c10d._world.pg_map)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        t0 = clock()
        step()
        out["first_s"] = clock() - t0
        if profile:
            profile.disable()
            profile.dump_stats(run["profile"])
            out["calls_first"] = pstats.Stats(profile).total_calls
        steps = []
        for _ in range(run["steps"]):
            t0 = clock()
            step()
            steps.append(clock() - t0)
        if profile:  # one more steady step, profiled: the timed ones ran without the profiler
            steady_profile = cProfile.Profile()
            steady_profile.runcall(step)
            steady_profile.dump_stats(run["profile"].replace(".prof", "-steady.prof"))
            out["calls_steady"] = pstats.Stats(steady_profile).total_calls
        out["steady_s"] = statistics.median(steps)
        out["steady_spread"] = (min(steps), max(steps))
        out["peak_mb"] = _peak_rss_mb() - rss0
        out["groups_mesh"] = groups1 - groups0
        out["groups_parallelize"] = groups2 - groups1
        out["member_of"] = member2 - member0
        out["groups_steps"] = c10d._world.group_count - groups2
    return out


# ---- the parent: one subprocess per run, the table --------------------------------------------------


def _run_child(run: dict, timeout: float, tree: str | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(run)]
    # glibc returns freed blocks above 64 KiB to the system at once and keeps one arena, so the RSS
    # high-water mark follows what is alive rather than what the allocator kept cached.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "1"}
    if tree is not None:  # vescale imported from another source tree (a before/after comparison)
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree), env.get("PYTHONPATH", "")])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = [l for l in done.stderr.splitlines() if l.strip() and "Warning" not in l][-3:]
    return {"error": " | ".join(tail)[-400:]}


def _spread(values) -> str:
    """Median, and the range over repeats when there are several."""
    med = statistics.median(values)
    return f"{med:.1f}" if len(values) == 1 else f"{med:.1f} ({min(values):.1f}-{max(values):.1f})"


def _fmt_ratio(x, base, key):
    if base in (None, 0) or x is None:
        return "-"
    r = x / base
    mark = "" if key not in TARGETS or r <= TARGETS[key] else " !"
    return f"{r:.2f}{mark}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="8,64,512,1024")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--inputs", choices=("local", "global"), default="local",
                    help="each rank passes its own rows (default) or the global batch")
    ap.add_argument("--modes", default="eager,static")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1, help="runs per (config, mode, world), worlds interleaved; medians")
    ap.add_argument("--rank", type=int, default=None, help="the rank played (default: the middle one)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    ap.add_argument("--profile", default=None, help="folder for cProfile dumps of parallelize + first step")
    ap.add_argument("--trees", default=None,
                    help="comma-separated source trees to import vescale from (default: this one), interleaved run by run")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        result = child(json.loads(args.child))
        print("RESULT " + json.dumps(result), flush=True)
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    print(f"bench_scale: one rank of a fake world, the same work per rank; clock: {args.clock} time; "
          f"peak = RSS high-water mark over parallelize + steps, less RSS before parallelize", flush=True)
    trees = args.trees.split(",") if args.trees else [None]
    header = ("tree", "config", "mode", "world", "mesh", "mesh s", "parallelize s", "first s", "steady ms", "peak MB",
              "groups (mesh+par)", "member of", "x par", "x first", "x steady", "x peak")
    if args.profile:
        header += ("calls first (K)", "calls steady", "x calls first", "x calls steady")
    print(" | ".join(header), flush=True)
    for config in args.configs.split(","):
        for mode in args.modes.split(","):
            runs: dict[tuple, list] = {(t, w): [] for t in trees for w in worlds}
            for r in range(args.repeat):
                # Worlds (and trees) interleaved, in alternating order, so that a machine's drifting
                # load touches every one alike.
                for world in (worlds if r % 2 == 0 else worlds[::-1]):
                    for t, tree in enumerate(trees if r % 2 == 0 else trees[::-1]):
                        rank = args.rank if args.rank is not None else world // 2 + 1
                        run = {"config": config, "mode": mode, "world": world, "rank": rank, "steps": args.steps,
                               "clock": args.clock, "inputs": args.inputs}
                        if args.profile:
                            run["profile"] = os.path.join(args.profile, f"{config}-{mode}-{world}-{r}-{t}.prof")
                        runs[(tree, world)].append(_run_child(run, args.timeout, tree))
            for tree in trees:
                _print_rows(tree or ".", config, mode, worlds, {w: runs[(tree, w)] for w in worlds})
    print("(x: ratio to the smallest world of the same config, mode and tree, this run; ! above the issue's target)")


def _print_rows(tree: str, config: str, mode: str, worlds: list, runs: dict) -> None:
    base = None
    for world in worlds:
        ok = [x for x in runs[world] if "error" not in x]
        if not ok:
            print(f"{tree} | {config} | {mode} | {world} | - | error: {runs[world][0]['error']}", flush=True)
            continue
        r = {k: statistics.median(x[k] for x in ok) if isinstance(ok[0][k], (int, float)) else ok[0][k]
             for k in ok[0]}
        base = base or r
        row = (
            tree, config, mode, str(world), "x".join(map(str, r["mesh_shape"])), f"{r['mesh_s']:.2f}",
            f"{r['parallelize_s']:.2f}", f"{r['first_s']:.2f}", _spread([x["steady_s"] * 1e3 for x in ok]),
            f"{r['peak_mb']:.0f}", f"{r['groups_mesh']}+{r['groups_parallelize']}", str(r["member_of"]),
            _fmt_ratio(r["parallelize_s"], base["parallelize_s"], "parallelize"),
            _fmt_ratio(r["first_s"], base["first_s"], "first"),
            _fmt_ratio(r["steady_s"], base["steady_s"], "steady"),
            _fmt_ratio(r["peak_mb"], base["peak_mb"], "peak_mb"),
        )
        if "calls_first" in r:
            row += (f"{r['calls_first'] / 1e3:.0f}", f"{r['calls_steady']:.0f}",
                    _fmt_ratio(r["calls_first"], base.get("calls_first"), "calls"),
                    _fmt_ratio(r["calls_steady"], base.get("calls_steady"), "calls"))
        print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
