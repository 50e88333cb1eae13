"""Run fuzz cases on gloo ranks and on one device, and judge each (the differential fuzzer's engine).

Every case of a batch runs in one set of ``world`` forked gloo ranks (``vescale.testing.run_on_ranks``:
process start-up and gloo set-up are paid once), one after the other; after each, one of the ranks
trains it on one device too (the reference: plain tensors, under ``vescale.random.consistent()``, so
dropout draws the same numbers), and the parent judges it:

* ``ok``: losses of every micro-step within ``LOSS_TOL``, gradients of the first and last step and
  parameters after the last optimiser step within ``TOL`` of one device, every planned parameter
  split at rest (its local shard smaller than the tensor) and every expected activation split (the
  local size along the expected dim smaller than the global one, in every forward: eager and static
  steps);
* ``named``: a vescale error (a ``PlanError``, ``DataContractError``, ``MissingShardingRule``, ...:
  an exception class defined in vescale) raised on every rank before any number differed;
* ``FAIL``: anything else — a number off, a split not in effect, a raw error (an ``AssertionError`` or
  ``RuntimeError`` out of torch.distributed.tensor), ranks that disagree or a hang.

A case that raises on some ranks only, or differently on different ranks, ends its set of ranks
(collectives may be out of step); the rest of the batch runs on a fresh set. A case that runs longer
than ``CASE_TIMEOUT_S`` (a collective some rank never joins), or that spends more than
``CASE_CPU_S`` of CPU time on one rank (a search that does not end), is a hang: every rank exits,
leaving its stack for the report.

Command line (from the repository root)::

    .venv/bin/python tests/fuzz/fuzz_run.py --seed 1234 --world 4      # one example, with its details
    .venv/bin/python tests/fuzz/fuzz_run.py --examples 200 --start 1000 --world 4
    .venv/bin/python tests/fuzz/fuzz_run.py --case gpt2_conv1d_bias_zero3   # a regression case
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import re
import resource
import sys
import tempfile
import threading
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_cases import Case, Spec, batches, build_model, build_plan, draw_case, placement  # noqa: E402

import vescale  # noqa: E402
import vescale.random  # noqa: E402
from vescale.testing import global_value, run_on_ranks  # noqa: E402

LOSS_TOL = 1e-6  # losses: O(1) values in fp32 (ulp 1.2e-7 to 4.8e-7); only the order of sums differs
TOL = 1e-5  # gradients and parameters after the steps
CASE_TIMEOUT_S = 600.0  # wall clock: generous, a loaded machine slows every rank
CASE_CPU_S = 60.0  # CPU time of one rank: a cold 4-rank case takes ~3-5 s


@dataclasses.dataclass
class Verdict:
    kind: str  # "ok", "named", "FAIL"
    detail: str = ""
    trace: str = ""  # the first failing rank's traceback, if any

    def __str__(self) -> str:
        return self.kind + (f": {self.detail}" if self.detail else "")


# ------------------------------------------------------------------------------ training, both sides


def _optimizer(model: nn.Module, case: Case):
    if case.optim == "adamw":
        # A gradient that is 0 up to rounding (a key bias: softmax ignores a per-row constant) moves its
        # weight by up to lr * noise / eps per step on either side; eps 1e-4 keeps that below 1e-7.
        return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _watch(model: nn.Module, case: Case, seen: list) -> None:
    """Record, at every forward, the local size of each expected activation along its dim."""
    modules = dict(model.named_modules())
    for i, (path, key, dim, _) in enumerate(case.expect):
        def record(mod, args, kwargs, out=None, i=i, key=key, dim=dim):
            t = out if key == "out" else (args[key] if isinstance(key, int) and key < len(args) else kwargs.get(key))
            if isinstance(t, tuple):
                t = t[0]
            if isinstance(t, torch.Tensor):
                # No op on the tensor (``to_local()`` is one): Static Eager's recording would take it
                # for one of the module's own ops, and the static steps, which do not run it, for a change.
                local = t._local_tensor if isinstance(t, DTensor) else t
                seen.append((i, local.shape[dim], type(t).__name__))
        if path not in modules:
            continue  # the generator's expectation names a module the model lacks: judged as not seen
        if key == "out":
            modules[path].register_forward_hook(lambda m, a, k, o, r=record: r(m, a, k, o), with_kwargs=True)
        else:
            modules[path].register_forward_pre_hook(record, with_kwargs=True)


def train(model: nn.Module, case: Case, distributed: bool, progress: dict) -> dict:
    """Train ``case.steps`` optimiser steps of ``case.accum`` micro-batches; the global values of the
    losses, the first and last step's gradients and the final parameters (``progress`` holds what
    exists so far, for the judge of a step that fails)."""
    opt = _optimizer(model, case)
    data = batches(case)
    progress.update(losses=[], grads=[])
    for step in range(case.steps):
        for micro in range(case.accum):
            progress["stage"] = f"step {step} micro-batch {micro}"
            x, labels = data[step * case.accum + micro]
            last = micro == case.accum - 1
            sync = vescale.no_grad_sync(model) if distributed and not last else _nothing()
            with sync, vescale.random.consistent():
                loss = model(x, labels)
                progress["losses"].append(global_value(loss).item())
                loss.backward()
        if step in (0, case.steps - 1):
            progress["grads"].append({n: global_value(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        progress["stage"] = f"step {step} optimizer"
        opt.step()
        opt.zero_grad()
    progress["params"] = {n: global_value(p) for n, p in model.named_parameters()}
    progress["stage"] = "done"
    return progress


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def reference(case: Case) -> dict:
    """The single-device run of ``case``, on one rank; its optimizer steps are not counted by
    vescale's step check (they are this rank's own, not the parallel run's)."""
    from vescale.parallel.faults import PROGRESS

    taken = PROGRESS.optimizer_steps
    try:
        return _reference(case)
    finally:
        PROGRESS.optimizer_steps = taken


def _reference(case: Case) -> dict:
    """The single-device run (``error`` set if the model itself fails: a generator bug). It may run
    in a rank's process: the generators are seeded as ``vescale.manual_seed`` does, without its
    check across ranks (a collective)."""
    profile = vescale.random.device_profile()
    vescale.random.set_state(torch.tensor([case.seed, 0, profile.sm_count, profile.max_threads_per_sm], dtype=torch.int64))
    torch.manual_seed(case.seed)
    vescale.random.install()
    model = build_model(case.model, case.seed)
    out = {"seen": []}
    _watch(model, case, out["seen"])
    try:
        train(model, case, False, out)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _error_info(e: BaseException, stage: str) -> dict:
    kind = type(e)
    named = kind.__module__.split(".")[0] == "vescale"
    return {"type": kind.__name__, "named": named, "stage": stage, "message": str(e).split("\n")[0][:500],
            "traceback": traceback.format_exc()[-6000:]}


def run_distributed(case: Case) -> dict:
    """This rank's run of ``case``: the global results (the same on every rank) and its local facts."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out: dict = {"stage": "init"}
    try:
        names, sizes = zip(*case.mesh)
        mesh = vescale.init_mesh(sizes, names, device_type="cpu")
        vescale.manual_seed(case.seed)
        model = build_model(case.model, case.seed)
        out["stage"] = "parallelize"
        vescale.parallelize(model, build_plan(case), mesh, mode=case.mode, bucket_mb=case.bucket_mb)
        out["seen"] = []
        _watch(model, case, out["seen"])
        train(model, case, True, out)
        out["local_numel"] = {n: p.to_local().numel() for n, p in model.named_parameters(remove_duplicate=False)}
    except Exception as e:  # judged by the parent
        out["error"] = _error_info(e, out.get("stage", "?"))
    return out


# --------------------------------------------------------------------------------------------- judge


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> float | None:
    """The largest difference if above ``tol`` (or shapes differ: inf), else None."""
    if a.shape != b.shape:
        return float("inf")
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    return diff if not diff <= tol else None  # NaN counts as a difference


def _numbers(case: Case, ref: dict, got: dict) -> str | None:
    """The first number that differs from one device, or None."""
    for i, (a, b) in enumerate(zip(got.get("losses", []), ref["losses"])):
        if not abs(a - b) <= LOSS_TOL:
            return f"loss of micro-step {i}: {a!r} vs one device {b!r} (|diff| {abs(a - b):.3g} > {LOSS_TOL})"
    for which, (gg, rg) in zip(("first", "last"), zip(got.get("grads", []), ref["grads"])):
        for name, g in rg.items():
            if name not in gg:
                return f"{which} step: no gradient for {name} (one device has one)"
            if (d := _close(gg[name], g, TOL)) is not None:
                return f"{which} step's gradient of {name} differs by {d:.3g}"
    for name, p in (got.get("params") or {}).items():
        if (d := _close(p, ref["params"][name], TOL)) is not None:
            return f"parameter {name} after {case.steps} steps differs by {d:.3g}"
    return None


def _split_failures(case: Case, ref: dict, ranks: list[dict]) -> str | None:
    """A planned split that did not happen: a parameter whole at rest, an activation whole."""
    sizes = dict(case.mesh)
    params = dict(build_model(case.model, case.seed).named_parameters(remove_duplicate=False))
    for kind, path, place, mesh, phase in case.plan:
        if kind not in ("shard", "experts") or "<" in path or sizes.get(mesh, 1) < 2 or phase == "RUN":
            continue
        p = placement(place or "S(0)")
        if not hasattr(p, "dim"):
            continue
        k = p._split_factor_int() if hasattr(p, "_split_factor_int") else 1
        import re

        for name, t in params.items():
            hit = re.fullmatch(rf"(?:{path})\.[^.]+", name) if kind == "experts" else re.fullmatch(path, name)
            if hit and t.shape[p.dim] // k >= 2:
                local = max(r["local_numel"][name] for r in ranks)
                if local >= t.numel():
                    return f"{name} is planned {place} on {mesh} but each rank holds all {t.numel()} elements"
    for i, (path, key, dim, mesh) in enumerate(case.expect):
        glob = [size for j, size, _ in ref["seen"] if j == i]
        if not glob or glob[0] < 2 or sizes.get(mesh, 1) < 2:
            continue
        for r, facts in enumerate(ranks):
            local = [(size, kind) for j, size, kind in facts.get("seen", []) if j == i]
            if len(local) < len(glob):
                return f"{path or '<root>'} input {key} was seen in {len(local)} of {len(glob)} forwards on rank {r}"
            whole = [n for n, (size, kind) in enumerate(local) if size >= glob[0]]
            if whole:
                what = "output" if key == "out" else f"input {key}"
                return (f"{path or '<root>'} {what} is not split along dim {dim} over {mesh} in forward {whole[0]} "
                        f"on rank {r}: local size {local[whole[0]][0]} of {glob[0]} ({local[whole[0]][1]})")
    return None


def judge(case: Case, ref: dict, ranks: list[dict]) -> Verdict:
    if "error" in ref:
        return Verdict("FAIL", f"the single-device run fails (generator bug): {ref['error']}")
    got = ranks[0]
    errors = [r.get("error") for r in ranks]
    if (bad := _numbers(case, ref, got)) is not None:
        return Verdict("FAIL", "silent mismatch: " + bad + (f" (before: {errors[0]['type']})" if errors[0] else ""))
    if any(errors):
        first = next(e for e in errors if e)
        text = f"{first['type']} at {first['stage']}: {first['message']}"
        if not all(errors) or len({(e["type"], e["stage"]) for e in errors}) > 1:
            where = ", ".join(f"rank {r}: {e['type']} at {e['stage']}" if e else f"rank {r}: no error" for r, e in enumerate(errors))
            return Verdict("FAIL", f"ranks disagree ({where}); {text}", first["traceback"])
        if not first["named"]:
            return Verdict("FAIL", f"raw error {text}", first["traceback"])
        if case.must_run:
            return Verdict("FAIL", f"must run, but {text}", first["traceback"])
        if case.mode == "static" and first["stage"] not in ("init", "parallelize", "step 0 micro-batch 0"):
            # Static steps run what the eager recording step ran; refusing it later is a defect.
            return Verdict("FAIL", f"a static step refuses what the recording step ran: {text}", first["traceback"])
        return Verdict("named", text)
    if (bad := _split_failures(case, ref, ranks)) is not None:
        return Verdict("FAIL", "split not in effect: " + bad)
    return Verdict("ok")


# -------------------------------------------------------------------------------------- the ranks


class _Watchdog(threading.Thread):
    """Ends this rank if the running case takes longer than ``CASE_TIMEOUT_S`` or this rank spends
    more than ``CASE_CPU_S`` of CPU time on it, writing every thread's stack to ``path`` first."""

    def __init__(self, path: str):
        super().__init__(daemon=True)
        self.path, self.done = path, threading.Event()
        self.wall, self.cpu = time.monotonic(), time.process_time()
        self.start()

    def run(self):
        while not self.done.wait(1.0):
            wall, cpu = time.monotonic() - self.wall, time.process_time() - self.cpu
            if wall > CASE_TIMEOUT_S or cpu > CASE_CPU_S:
                with open(self.path, "w") as f:
                    f.write(f"after {wall:.0f} s, {cpu:.0f} CPU s\n")
                    faulthandler.dump_traceback(f)
                os._exit(3)

    def stop(self):
        self.done.set()


def _save(obj, folder: str, name: str) -> None:
    """Written whole, then renamed: the parent never reads half a file."""
    torch.save(obj, os.path.join(folder, name + ".tmp"))
    os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))


def _rank_loop(cases: list[Case], folder: str) -> None:
    """Run every case on this rank; rank 0 saves each case's results for the parent."""
    warnings.filterwarnings("ignore")  # DTensor's and HF's user warnings, once per case and rank
    rank = dist.get_rank()
    torch.set_num_threads(1)
    for index, case in enumerate(cases):
        # A hang (a collective some rank never joins) ends every rank of the set after the timeout.
        watchdog = _Watchdog(os.path.join(folder, f"{index}.hang{rank}"))
        out = run_distributed(case)
        if "error" in out:  # saved before the all-gather, which a rank stuck in a collective never joins
            torch.save(out["error"], os.path.join(folder, f"{index}.err{rank}"))
        facts = {k: out.get(k) for k in ("error", "seen", "local_numel")}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, facts)
        watchdog.stop()
        if rank == index % dist.get_world_size():  # the single-device run, one rank a case
            _save(reference(case), folder, f"{index}.ref")
        if rank == 0:
            _save({**out, "ranks": everyone}, folder, f"{index}.pt")
        errors = [(f["error"] or {}).get("message") for f in everyone]
        if any(errors) and len(set(errors)) > 1:
            return  # the ranks are out of step: the parent continues on a fresh set


def _load(folder: str, name: str):
    path = os.path.join(folder, name)
    return torch.load(path, weights_only=False) if os.path.exists(path) else None


def run_cases(cases: list[Case], world: int, report=print) -> list[tuple[Case, Verdict]]:
    """Run ``cases`` (all on ``world`` ranks) and return each with its verdict, reporting a line each."""
    results, todo = [], list(cases)
    while todo:
        with tempfile.TemporaryDirectory(prefix="vescale-fuzz-") as folder:
            crash = None
            try:
                run_on_ranks(_rank_loop, world, todo, folder, timeout=CASE_TIMEOUT_S * len(todo) + 60)
            except (RuntimeError, TimeoutError) as e:
                crash = str(e)
            done = 0
            while (got := _load(folder, f"{done}.pt")) is not None:
                ranks = [{**facts, **(got if r == 0 else {})} for r, facts in enumerate(got["ranks"])]
                ref = _load(folder, f"{done}.ref") or reference(todo[done])
                results.append((todo[done], judge(todo[done], ref, ranks)))
                report(_line(*results[-1]))
                done += 1
            if done < len(todo) and crash is not None:  # the case that hung or killed its ranks
                files = sorted(f for f in os.listdir(folder) if f.startswith(f"{done}."))
                what = "hang" if any(".hang" in f for f in files) else "crash"
                errs = [_load(folder, f) for f in files if ".err" in f]
                hangs = [f"rank {f[f.index('hang') + 4:]} stopped " + open(os.path.join(folder, f)).readline().strip()
                         for f in files if ".hang" in f]
                detail = "; ".join([f"{e['type']} at {e['stage']}: {e['message']}" for e in errs] + hangs) or crash[-500:]
                stacks = "".join(f"--- {f} ---\n" + open(os.path.join(folder, f)).read() for f in files if ".hang" in f)
                results.append((todo[done], Verdict("FAIL", f"{what}: {detail}", stacks)))
                report(_line(*results[-1]))
                done += 1
            todo = todo[done:]
    return results


def _line(case: Case, verdict: Verdict) -> str:
    mesh = "x".join(f"{n}{s}" for n, s in case.mesh)
    what = f"seed {case.seed} [{mesh} {case.mode} {'+'.join(case.model.blocks)} b{case.batch} s{case.seq}]"
    line = f"{what}: {verdict}"
    if verdict.kind == "FAIL":
        line += f"\n    reproduce: {reproduce_command(case)}"
    return line


def reproduce_command(case: Case) -> str:
    return f".venv/bin/python tests/fuzz/fuzz_run.py --seed {case.seed} --world {case.world}"


# ------------------------------------------------------------------------------------------ shrinking


def signature(verdict: Verdict) -> str:
    """What a smaller case must keep failing with: the kind of failure and the error's type."""
    head = verdict.detail.split(":")[0]
    return re.sub(r" at (step|parallelize|init).*", "", head)


def _without_block(case: Case, drop: int) -> Case | None:
    n = len(case.model.blocks)
    if n < 2:
        return None
    new = {i: i - (i > drop) for i in range(n) if i != drop}

    def remap(path: str) -> str | None:
        def group(m):
            ids = [str(new[int(i)]) for i in m.group(1).split("|") if int(i) in new]
            return rf"blocks\.({'|'.join(ids)})" if ids else "\0"
        path = re.sub(r"blocks\\\.\(([\d|]+)\)", group, path)
        path = re.sub(r"blocks\\\.(\d+)(?=\\\.)", lambda m: rf"blocks\.{new[int(m.group(1))]}" if int(m.group(1)) in new else "\0", path)
        return None if "\0" in path else path

    plan = tuple((k, remap(p), *rest) for k, p, *rest in case.plan if remap(p) is not None)
    expect = []
    for path, *rest in case.expect:
        m = re.match(r"blocks\.(\d+)(.*)", path)
        if m and int(m.group(1)) == drop:
            continue
        expect.append((f"blocks.{new[int(m.group(1))]}{m.group(2)}" if m else path, *rest))
    blocks = tuple(b for i, b in enumerate(case.model.blocks) if i != drop)
    return dataclasses.replace(case, model=dataclasses.replace(case.model, blocks=blocks), plan=plan, expect=tuple(expect))


def simpler(case: Case) -> list[Case]:
    """Cases one step simpler than ``case`` (same number of ranks)."""
    out = [c for i in range(len(case.model.blocks)) if (c := _without_block(case, i))]
    out += [dataclasses.replace(case, plan=case.plan[:i] + case.plan[i + 1:]) for i in range(len(case.plan))]
    out += [dataclasses.replace(case, mesh=tuple(d for d in case.mesh if d[0] != name),
                                plan=tuple(s for s in case.plan if s[3] != name),
                                expect=tuple(e for e in case.expect if e[3] != name))
            for name, size in case.mesh if size == 1 and len(case.mesh) > 1]
    spec_defaults = dict(dropout=0.0, bias=False, positions=False, tied=False, gated=False, fused="none",
                         attn="sdpa", norm="layer", proj="linear", experts="grouped_mm", dim=8, heads=2)
    for field, value in spec_defaults.items():
        if getattr(case.model, field) != value:
            out.append(dataclasses.replace(case, model=dataclasses.replace(case.model, **{field: value})))
    case_defaults = dict(mode="eager", bucket_mb=25, accum=1, steps=1 if case.steps <= 2 else 2, optim="sgd")
    for field, value in case_defaults.items():
        if getattr(case, field) != value:
            out.append(dataclasses.replace(case, **{field: value}))
    for field in ("batch", "seq"):
        for smaller in sorted({1, 2, getattr(case, field) // 2}):
            if smaller < getattr(case, field):
                out.append(dataclasses.replace(case, **{field: smaller}))
    return out


def shrink(case: Case, verdict: Verdict, report=print) -> tuple[Case, Verdict]:
    """The smallest case found (greedily) that still fails with ``verdict``'s signature."""
    want = signature(verdict)
    while True:
        candidates = simpler(case)
        report(f"shrinking: {len(candidates)} candidates for {want!r}")
        for smaller, got in run_cases(candidates, case.world, report=lambda s: None):
            if got.kind == "FAIL" and signature(got) == want:
                case, verdict = smaller, got
                report(f"  smaller: {case}")
                break
        else:
            return case, verdict


# ---------------------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, help="run the example of this seed, and print it in full")
    parser.add_argument("--case", help="run the regression case of this name (tests/fuzz/fuzz_regressions.py), "
                                       "'all', or those of one world size ('world2')")
    parser.add_argument("--literal", help="run this Case(...) as printed by a failure, or a list of them (or a file)")
    parser.add_argument("--examples", type=int, default=0, help="run this many examples from --start")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--world", type=int, default=4, choices=[2, 4, 8], help="ranks (the mesh's size)")
    parser.add_argument("--batch", type=int, default=20, help="examples per set of ranks")
    parser.add_argument("--case-timeout", type=float, help="seconds before a case counts as hung (default 300)")
    parser.add_argument("--trace", action="store_true", help="print the traceback of each failure")
    parser.add_argument("--shrink", action="store_true", help="look for the smallest case that fails the same way")
    args = parser.parse_args(argv)
    if args.case:
        from fuzz_regressions import REGRESSIONS

        names = [n for n, r in REGRESSIONS.items() if args.case in ("all", n) or args.case == f"world{r.case.world}"]
        if not names:
            raise SystemExit(f"no regression case {args.case!r}; there are: all, world2/4/8, {', '.join(REGRESSIONS)}")
        for world in sorted({REGRESSIONS[n].case.world for n in names}):
            group = [n for n in names if REGRESSIONS[n].case.world == world]
            for name, (_case, verdict) in zip(group, run_cases([REGRESSIONS[n].case for n in group], world, report=lambda s: None)):
                print(f"{name} ({REGRESSIONS[name].defect or 'must pass'}): {verdict}", flush=True)
        return 0
    elif args.literal:
        text = open(args.literal).read() if os.path.exists(args.literal) else args.literal
        cases = eval(text, {"Case": Case, "Spec": Spec})
        cases = cases if isinstance(cases, list) else [cases]
        args.world = cases[0].world
    elif args.seed is not None:
        cases = [draw_case(args.seed, args.world)]
    else:
        cases = [draw_case(s, args.world) for s in range(args.start, args.start + args.examples)]
    if args.case_timeout:
        globals()["CASE_TIMEOUT_S"] = args.case_timeout
    if len(cases) == 1:
        print(cases[0])
    t0, fails = time.perf_counter(), []
    for lo in range(0, len(cases), args.batch):
        for case, verdict in run_cases(cases[lo:lo + args.batch], args.world, report=lambda s: print(s, flush=True)):
            if verdict.kind == "FAIL":
                fails.append(case)
                if (args.trace or len(cases) == 1) and verdict.trace:
                    print(verdict.trace)
                if args.shrink:
                    small, why = shrink(case, verdict)
                    print(f"smallest: {why}\n{small}", flush=True)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu.ru_utime + cpu.ru_stime + time.process_time()
    counts = f"{len(cases)} example(s), {len(fails)} failure(s) in {time.perf_counter() - t0:.0f} s ({cpu:.0f} CPU s)"
    print(counts + ("; failing seeds: " + " ".join(str(c.seed) for c in fails) if fails else ""))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
