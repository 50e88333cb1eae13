"""In-process A/B of eager-dispatch extensions: the same model and plan with an extension on and off.

``bench_dispatch.py``'s runners (fake process group, rank 0, one intra-op thread, thread-CPU clock),
interleaved round by round in one process, so the arms see the same machine load. Arms:

* ``torch``, ``local``, ``megatron``: ``bench_dispatch``'s variants of those names (the baselines);
* ``eager``: vescale eager mode as installed;
* ``eager-off``: vescale eager mode with ``vescale.dispatch.fast.sized``'s handler taken out of DTensor's
  per-op table and the CPU SDPA handler deciding afresh on every call (what they cost before these
  extensions);
* ``eager-gradR`` (an experiment, not a plan vescale has): eager mode with a hook that all-reduces the
  routing weights' Partial gradient where it leaves each MoE router (``mlp.gate``), so the router's
  backward runs replicated instead of DTensor's reduce-scatter choice;
* ``static``: Static Eager mode as installed;
* ``static-before``: Static Eager mode with the zoo plan as it was for HF's models before
  2026-11-26: the logits gathered as they leave the LM head (``lm_head.<out>`` Replicate on TP, the
  loss then over the whole vocabulary; now ``Shard(-1)``, HF's loss view rewritten by
  ``vescale.static.local_sizes``), and under SP the embeddings reduce-scattered along the sequence
  with HF's model body kept eager (now all-reduced, split at the first layer, the body static);
* ``static-body-eager``: Static Eager mode with HF's model body kept eager and its embeddings
  reduce-scattered (the zoo plans under DP before HF's body ran static there: ``llama_plan`` /
  ``moe_plan`` stated ``plan.eager("model")``; the logits as now);
* ``static-hooks``: Static Eager mode running the batch-local MoE blocks' hooks
  (the runtime's ``_find_relabelled`` replaced to find none; ``vescale.static.relabel`` replaces them by precompiled relabels);
* ``eager-pertensor``, ``static-pertensor``: the optimiser step per tensor on local shards, without
  ``vescale.optim.flat``'s flat runs (``optim.flat_allowed`` answering no around the arm's steps).

Each arm's forward / backward / optimiser-step medians (the step includes ``zero_grad``) follow.

    .venv/bin/python benchmarks/bench_dispatch_ab.py [--config dp2tp4] [--model moe] [--rounds 15] [--arms torch,eager-off,eager]
    .venv/bin/python benchmarks/bench_dispatch_ab.py --model llama --config tp8 --arms static-pertensor,static
    .venv/bin/python benchmarks/bench_dispatch_ab.py --model moe --config tp8 --arms static-before,static
    .venv/bin/python benchmarks/bench_dispatch_ab.py --model moe --config dp2tp4 --arms torch,static-body-eager,static-hooks,static
"""

from __future__ import annotations

import statistics

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import bench_dispatch as B
from vescale import dispatch
from vescale.dispatch.fast import sized
from vescale.dispatch.coverage import attention
from vescale.optim import local_step as optim
from vescale.zoo import LlamaConfig
from vescale.model_state import state_of
from vescale.memo import Memo

_HANDLERS = DTensor._op_dispatcher._custom_op_handlers
_INSTALL = dispatch.install
_FLAT_ALLOWED = optim.flat_allowed
_PLAN = B._vescale_plan


def _plan_before(kind, model, mesh, sp, zero3, whole_logits: bool = True):
    """The bench's plan as it was for HF's models before 2026-11-26 (``static-before``), or with
    the logits as now (``static-body-eager``)."""
    plan = _PLAN(kind, model, mesh, sp, zero3)
    if isinstance(model.config, LlamaConfig):
        return plan  # the zoo LLaMA's plan did not change
    kept = []
    for st in plan.statements:
        if st.path == r"lm_head\.<out>" and st.placements == (Shard(-1),) and whole_logits:
            st = dataclasses.replace(st, placements=(Replicate(),))
        elif st.path == r"model\.embed_tokens\.<out>" and sp:
            st = dataclasses.replace(st, placements=(Shard(1),))
        elif st.path == r"model\.layers\.0\.<in>[hidden_states]":
            continue
        kept.append(st)
    plan.statements = kept
    if sp and not any(st.kind == "eager" for st in kept):
        plan.eager(r"model")
    return plan


def _variant(arm: str) -> str:
    if arm in ("torch", "local", "megatron"):
        return arm
    return "static" if arm.startswith("static") else "eager"


def _flat_steps(arm: str) -> None:
    """Flat optimiser runs on, or off for a ``-pertensor`` arm (read by the pre-step hook)."""
    optim.flat_allowed = (lambda group: False) if arm.endswith("-pertensor") else _FLAT_ALLOWED


def _sdpa_forgetting(op, args, kwargs):
    """The SDPA handler deciding afresh (an empty table of its own: the other arms keep theirs)."""
    kept = attention._SDPA_DECISIONS
    attention._SDPA_DECISIONS = Memo("SDPA decisions of one call", 1)
    try:
        return attention._cpu_sdpa_handler(op, args, kwargs)
    finally:
        attention._SDPA_DECISIONS = kept


_SIZED_OPS: list = []


def _installer(off: bool):
    """``dispatch.install`` as the runners call it each step, with the extensions on or off."""

    def install():
        _INSTALL()
        if not _SIZED_OPS:  # the ops dispatch.install gave the sized-op handler (learnt with the extensions on)
            _SIZED_OPS.extend(op for op, handler in _HANDLERS.items() if handler is sized.sized_op_handler)
        for op in _SIZED_OPS:
            if off:
                _HANDLERS.pop(op, None)
            else:
                _HANDLERS[op] = sized.sized_op_handler
        for op in attention.CPU_SDPA_OPS:
            _HANDLERS[op] = _sdpa_forgetting if off else attention._cpu_sdpa_handler

    return install


class _GradReplicate(torch.autograd.Function):
    """Identity forward; a Partial gradient is all-reduced to Replicate."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if any(p.is_partial() for p in grad.placements):
            grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
        return grad


def _replicate_routing_grads(model) -> None:
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(lambda mod, args, out: (out[0], _GradReplicate.apply(out[1]), out[2]))


def main() -> None:
    ap = B.one_process_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--arms", default="torch,eager-off,eager")
    args = ap.parse_args()
    arms = args.arms.split(",")
    mesh, shape, sp, zero3 = B.fake_mesh(args.config)
    runners = {}
    for arm in arms:
        dispatch.install = _installer(arm.endswith("-off"))
        dispatch.install()
        plans = {"static-before": _plan_before, "static-body-eager": lambda *a: _plan_before(*a, whole_logits=False)}
        B._vescale_plan = plans.get(arm, _PLAN)
        runners[arm] = B.Runner(_variant(arm), mesh, *shape, sp, zero3, args.model)
        B._vescale_plan = _PLAN
        if arm == "static-hooks":
            state_of(runners[arm].model).static._find_relabelled = lambda rec: frozenset()  # hooks always run
        if arm == "eager-gradR":
            _replicate_routing_grads(runners[arm].model)
    times = {arm: [] for arm in arms}
    phases = {arm: [] for arm in arms}
    for i in range(args.rounds + 3):  # 3 warm-up rounds
        for arm in arms:
            dispatch.install = _installer(arm.endswith("-off"))
            _flat_steps(arm)
            t = runners[arm].step()
            if i >= 3:
                times[arm].append(t)
                phases[arm].append(runners[arm].phases)
    dispatch.install = _INSTALL
    optim.flat_allowed = _FLAT_ALLOWED
    base = statistics.median(times[arms[0]])
    print(f"## {args.model} {args.config} (fake group, thread clock), {args.rounds} interleaved rounds")
    for arm in arms:
        q = statistics.quantiles(times[arm], n=4)
        med = statistics.median(times[arm])
        parts = " / ".join(f"{statistics.median(p[k] for p in phases[arm]) * 1e3:.2f}" for k in range(3))
        print(f"{arm:16s} {med * 1e3:7.1f} ms ({q[0] * 1e3:.1f}-{q[2] * 1e3:.1f})  x {arms[0]} {med / base:.3f}"
              f"   fwd / bwd / opt {parts}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
