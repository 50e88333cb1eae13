"""Launch a short vescale training run under torchrun many times and count the runs that fail.

    python scripts/exit_loop.py --runs 50                          # zoo LLaMA, TP=2, 2 ranks
    python scripts/exit_loop.py --runs 50 --model mixtral          # HF Mixtral (grouped_mm experts), TP=2
    python scripts/exit_loop.py --runs 50 --model mistral --sp     # HF Mistral, TP=2 + SP
    python scripts/exit_loop.py --runs 20 --nproc 4 --unwaited 10  # and 10 all-gathers left unwaited at exit

Every run trains a few steps, prints its loss and returns; a run whose torchrun exits non-zero (an
abort at interpreter exit: "terminate called without an active exception", SIGABRT) is a failure.
``--unwaited N`` issues N all-gathers at the end that nobody waits for, which makes the exit race
of gloo's worker threads (see ``vescale.mesh.GroupTeardown``) likely: without vescale's exit
handling, 3 to 9 of 20-30 such launches aborted on 4 ranks. ``--plain`` is the control: PyTorch
alone (``init_process_group``, no vescale, no model), the same unwaited all-gathers;
``--no-teardown`` the other control: vescale's run without its exit handling.
Exit status 0 only when every run succeeded. ``tests/parallel/test_exit.py`` runs it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def _worker(args) -> None:
    import logging

    import torch
    import torch.distributed as dist

    import vescale
    from vescale.zoo import llama_plan, moe_plan, synthetic_batches, tiny_hf_mixtral, tiny_llama

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if args.plain:  # the control: PyTorch alone, the same collectives left at exit
        dist.init_process_group("gloo")
        _unwaited(args.unwaited)
        return
    mesh = vescale.init_mesh((int(os.environ["WORLD_SIZE"]),), ("TP",), timeout=120)
    if args.no_teardown:  # the control: vescale without its exit handling
        import atexit

        from vescale.mesh import TEARDOWN

        atexit.unregister(TEARDOWN.at_exit)
    torch.manual_seed(0)
    if args.model == "llama":
        model = tiny_llama()
        plan = llama_plan(mesh, model.config, sequence_parallel=args.sp)
    elif args.model == "mixtral":
        model = tiny_hf_mixtral()
        plan = moe_plan(mesh, model.config, sequence_parallel=args.sp)
    else:
        import transformers

        from vescale.zoo.hf import TINY_LLAMA_SIZES

        model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY_LLAMA_SIZES, use_cache=False))
        plan = llama_plan(mesh, model.config, sequence_parallel=args.sp)
    vescale.manual_seed(0)
    vescale.parallelize(model, plan, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for ids, labels in synthetic_batches(args.steps, 4, 16, model.config.vocab_size, seed=1):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    _unwaited(args.unwaited)
    print(f"rank {dist.get_rank()}: loss {loss.item():.4f}", flush=True)


def _unwaited(n: int) -> None:
    """``n`` all-gathers nobody waits for: the worst case at exit."""
    import torch
    import torch.distributed as dist

    for _ in range(n):
        out = [torch.empty(1) for _ in range(dist.get_world_size())]
        dist.group.WORLD.allgather([out], [torch.tensor([float(dist.get_rank())])])


def run_loop(runs: int, nproc: int = 2, extra: tuple = (), timeout: float = 600.0, verbose: bool = True) -> list[str]:
    """``runs`` torchrun launches of this file's worker; the failures (one line each: the run, its
    exit status and what it printed about an abort)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", HERE,
        "--worker", *extra,  # (no --nproc: torchrun's parser would take it for --nproc-per-node)
    ]
    failures = []
    for i in range(runs):
        start = time.time()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
            status, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            status, output = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
        aborts = output.count("terminate called")
        if status != 0 or aborts:
            lines = [line for line in output.splitlines() if "terminate called" in line or "exitcode" in line or "Error" in line]
            failures.append(f"run {i}: exit status {status}, {aborts} abort(s): " + " | ".join(lines[:4]))
        if verbose:
            verdict = "ok" if status == 0 and not aborts else "FAILED: " + failures[-1].split(": ", 1)[1]
            print(f"run {i + 1}/{runs}: {verdict} ({time.time() - start:.0f} s)", flush=True)
    return failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", choices=("llama", "mixtral", "mistral"), default="llama")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--unwaited", type=int, default=0, help="all-gathers left unwaited at exit")
    ap.add_argument("--plain", action="store_true", help="init_process_group first (the control)")
    ap.add_argument("--no-teardown", action="store_true", help="without vescale's exit handling (the control)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    extra = [f"--model={args.model}", f"--steps={args.steps}", f"--unwaited={args.unwaited}"]
    extra += ["--sp"] if args.sp else []
    extra += ["--plain"] if args.plain else []
    extra += ["--no-teardown"] if args.no_teardown else []
    failures = run_loop(args.runs, args.nproc, tuple(extra))
    print(f"{len(failures)} of {args.runs} runs failed")
    for line in failures:
        print("  " + line)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
