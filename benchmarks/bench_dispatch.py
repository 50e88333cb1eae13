"""CPU overhead of eager DTensor dispatch and of Static Eager mode on the zoo LLaMA.

One process plays rank 0 of a mesh over PyTorch's ``fake`` process group (collectives return at
once), so what is timed is the CPU work one rank does per step: the DTensor machinery against the
same model's own arithmetic. Variants, interleaved round by round in one run:

* ``local``: the per-rank work on plain tensors, hand-written Megatron style: the same model with
  this rank's share of every projection, of the vocabulary and of the batch; on the fake group with
  plain-tensor stand-ins for the sequence-parallel collectives (see ``_megatron_rank``), on gloo
  ranks (LLaMA only) with real ones and hand-written ZeRO-3 (``benchmarks/megatron_local.py``);
* ``megatron``: ``megatron_local.MegatronLlama`` on the fake group too: the same
  hand-written Megatron + ZeRO-3 code with explicit collectives (``torch.distributed`` calls on the
  mesh's groups; the fake group copies the data an all-gather or reduce-scatter would move) where
  ``local`` does a ``cat`` / ``narrow``; on gloo ranks it is ``local`` itself, so left out there;
  with ``--model moe``, ``megatron_moe.MegatronMixtral`` (TP + SP, no DP: the tp8 config only);
* ``torch``: PyTorch's own stack used the TorchTitan way (``_torchtitan``): parallelize_module,
  loss_parallel, fully_shard for ZeRO-3, stock AdamW on its DTensor parameters, with
  ``vescale.dispatch`` uninstalled for its steps (LLaMA); HF's MoE experts kernels need vescale's
  rules for their data-dependent ops and fp32 ``_grouped_mm``, so ``--model moe``'s ``torch`` runs
  with ``vescale.dispatch`` installed (its search, caches and local optimiser step serve it too);
* ``torch-vd`` (LLaMA): the same stack with ``vescale.dispatch`` installed, as ``torch`` ran in
  every figure until 2026-11-26 13:30 UTC (``docs/performance.md``): vescale's cheap search,
  shape-free cache and local optimiser step make PyTorch's own stack faster;
* ``torch-dispatch``: vescale eager with PyTorch's own sharding search, miss path and optimiser on
  DTensors (vescale.dispatch uninstalled): where the project stood before;
* ``eager``: vescale eager mode with vescale.dispatch (cheap misses, shape-free cache, local
  optimiser steps);
* ``static``: ``parallelize(..., mode="static")``.

Printed: steady step time (median and the 25-75% spread over rounds) and its ratio to ``local``
and to ``torch``, and its forward / backward / optimiser-step parts; the first step of a fresh model with cold sharding caches; a step with a new
sequence length against the faster of two repeats of it, the median over ``--lengths`` lengths (static mode derives the new length's record from a
recorded one, ``vescale/static/resize.py``; ``reuse_records = False`` on its runtime records again). ``--gloo``
runs the same on real gloo ranks (one process each; ``local`` is ``megatron_local.MegatronLlama``
there, ``megatron_moe.MegatronMixtral`` for ``--model moe`` on the TP-only tp2; 4 ranks oversubscribe 2 cores, so read ratios, not
absolutes). ``--cold-first N`` measures instead each variant's first step on the ``--gloo``
configs in N fresh launches of its own: in one interleaved process the variants after the first
find PyTorch's process-wide state warmed (FakeTensor's dispatch cache, op tables, gloo's
connections). Run:

    .venv/bin/python benchmarks/bench_dispatch.py [--rounds 7] [--configs tp8,dp2tp4] [--gloo tp2,dp2tp2] [--model llama|moe]
        [--clock wall|cpu|thread] [--gloo-clock wall|cpu] [--lengths 3] [--dropout 0.1] [--cold-first 3]

``--model moe``: HF's unchanged ``MixtralForCausalLM`` with many small experts (16 experts of
intermediate 64, 2 per token) under ``vescale.zoo.moe_plan`` (tensor-parallel experts, SP, ZeRO-3),
where per-op overhead dominates; ``torch`` is ``benchmarks/torchtitan_plans.py``'s TorchTitan-style
MoE parallelisation, ``local`` the per-rank Mixtral with every head, expert and vocabulary dim cut
to this rank's share.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import loss_parallel

import vescale
from vescale import dispatch
from vescale.testing import forget_dtensor_caches
from vescale.zoo import LlamaConfig, LlamaForCausalLM, llama_plan, synthetic_batches

CONFIGS = {  # name: (mesh shape, mesh names, sequence parallel, zero3)
    "tp8": ((1, 8), ("DP", "TP"), True, False),
    "dp2tp4": ((2, 4), ("DP", "TP"), True, True),
    "dp2tp2": ((2, 2), ("DP", "TP"), True, True),
    "tp2": ((1, 2), ("DP", "TP"), True, False),
}
# The model: hidden 256, 4 layers, 8 heads, vocab 512, batch 8, sequence 64.
MODEL = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
BATCH, SEQ = 8, 64
# What times a step on the fake group: wall time, or (``--clock cpu`` / ``thread``) this process's /
# this thread's CPU time, which other processes on a shared machine disturb far less (the fake
# group never waits, so on an idle machine they agree). Gloo ranks use wall time, or with
# ``--gloo-clock cpu`` their process CPU time.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time}
CLOCK = [time.perf_counter]
# Many small experts: a step is hundreds of small ops, so per-op overhead dominates.
MOE_SIZES = dict(vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8, head_dim=16, num_local_experts=16, num_experts_per_tok=2,
                 max_position_embeddings=512)


def _megatron_rank(dp: int, tp: int, sp: bool) -> LlamaForCausalLM:
    """The per-rank model of hand-written Megatron-style TP (+SP): the zoo model with every
    projection resized to this rank's shard, and the collectives replaced by plain-tensor stand-ins
    of the same shapes (a cat for all-gather, a narrow for reduce-scatter): the fake group would not
    communicate anyway, so this is the rank's own arithmetic plus the data movement of its buffers."""
    model = LlamaForCausalLM(MODEL)
    H, I, V = MODEL.hidden_size, MODEL.intermediate_size, MODEL.vocab_size
    nn = torch.nn
    model.model.embed_tokens = nn.Embedding(V // tp, H)
    model.lm_head = nn.Linear(H, V // tp, bias=False)
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.q_proj, a.k_proj, a.v_proj = (nn.Linear(H, H // tp, bias=False) for _ in range(3))
        a.o_proj = nn.Linear(H // tp, H, bias=False)
        m.gate_proj, m.up_proj = (nn.Linear(H, I // tp, bias=False) for _ in range(2))
        m.down_proj = nn.Linear(I // tp, H, bias=False)
    if sp and tp > 1:
        _sp_stand_ins(model, tp)
    return model


def _megatron_moe_rank(dp: int, tp: int, sp: bool):
    """The per-rank HF Mixtral of hand-written TP (+SP): heads, every expert's intermediate dim and
    the vocabulary cut to this rank's share (the router is whole), SP collectives as stand-ins."""
    from vescale.zoo import tiny_hf_mixtral

    m = MOE_SIZES
    model = tiny_hf_mixtral(**{**m, "num_attention_heads": m["num_attention_heads"] // tp,
                               "num_key_value_heads": m["num_key_value_heads"] // tp,
                               "intermediate_size": m["intermediate_size"] // tp, "vocab_size": m["vocab_size"] // tp})
    if sp and tp > 1:
        # HF's model derives rotary positions from the embeddings' length: cut the sequence at
        # the first layer instead of after the embedding.
        _sp_stand_ins(model, tp, cut=model.model.layers[0])
    return model


def _sp_stand_ins(model, tp: int, cut=None) -> None:
    """Plain-tensor stand-ins of SP's collectives: a cat (all-gather) before attention and MLP, a
    narrow (reduce-scatter) after them, after the embedding (or before ``cut``), and a cat after
    the final norm."""
    for layer in model.model.layers:
        for block in (layer.self_attn, layer.mlp):
            block.register_forward_pre_hook(
                lambda mod, args, kw: ((torch.cat([args[0] if args else kw.pop("hidden_states")] * tp, 1),) + tuple(args[1:]), kw),
                with_kwargs=True)
            block.register_forward_hook(
                lambda mod, args, out: (out[0].narrow(1, 0, out[0].shape[1] // tp),) + tuple(out[1:]) if isinstance(out, tuple)
                else out.narrow(1, 0, out.shape[1] // tp))
    if cut is None:
        model.model.embed_tokens.register_forward_hook(lambda mod, args, out: out.narrow(1, 0, out.shape[1] // tp))
    else:
        cut.register_forward_pre_hook(lambda mod, args: (args[0].narrow(1, 0, args[0].shape[1] // tp),) + tuple(args[1:]))
    model.model.norm.register_forward_hook(lambda mod, args, out: torch.cat([out] * tp, 1))


def _torchtitan(model: LlamaForCausalLM, mesh, sp: bool, zero3: bool) -> None:
    """PyTorch's own stack, used the way TorchTitan parallelises LLaMA: ``parallelize_module`` with
    Colwise/Rowwise/SequenceParallel/PrepareModuleInput (attention and MLP bodies then run on local
    tensors), ``loss_parallel`` around the step, and ``fully_shard`` per layer for ZeRO-3."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    tp = mesh["TP"]
    between = Shard(1) if sp else Replicate()
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "model.norm": SequenceParallel() if sp else None,
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    } if sp else {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.model.layers:
        plan = {
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": between},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=between),
            "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        if sp:
            plan.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()})
        parallelize_module(layer, tp, plan)
    if zero3:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["DP"]).set_force_sum_reduction_for_comms(True)
        fully_shard(model, mesh=mesh["DP"]).set_force_sum_reduction_for_comms(True)


TORCH_STACKS = ("torch", "torch-vd")  # PyTorch's own stack, without and with vescale.dispatch


class Runner:
    """One variant: a model, its optimiser and a step function."""

    def __init__(self, variant: str, mesh, dp: int, tp: int, sp: bool, zero3: bool, kind: str = "llama",
                 real_collectives: bool = False):
        torch.manual_seed(0)
        self.variant, self.batch, self.kind = variant, BATCH, kind
        vocab = MODEL.vocab_size if kind == "llama" else MOE_SIZES["vocab_size"]
        self.vocab = vocab
        if variant in TORCH_STACKS:
            self.model = _build(kind)
            if kind == "llama":
                _torchtitan(self.model, mesh, sp, zero3)
            else:
                from torchtitan_plans import torchtitan_moe

                torchtitan_moe(self.model, mesh, zero3=zero3)  # TP experts + SP (+ FSDP)
            self.batch = BATCH // dp  # each DP rank loads its own part of the batch
        elif variant == "megatron" or (variant == "local" and real_collectives):  # explicit TP / SP / ZeRO-3 collectives
            if not sp:
                raise ValueError("bench_dispatch: the hand-written variants are written for sequence parallelism; use an SP config")
            if kind == "llama":
                from megatron_local import MegatronLlama

                self.model = MegatronLlama(LlamaForCausalLM(MODEL), mesh, zero3=zero3)
            else:
                from megatron_moe import MegatronMixtral

                self.model = MegatronMixtral(_build(kind), mesh)  # TP only (DP=1)
            self.batch = BATCH // dp  # ids over the whole vocabulary: the embedding masks the others
        elif variant == "local":
            self.model = _megatron_rank(dp, tp, sp) if kind == "llama" else _megatron_moe_rank(dp, tp, sp)
            self.batch = BATCH // dp
            self.vocab = vocab // tp  # ids of this rank's vocabulary shard (no masking)
        else:
            if variant == "torch-dispatch":
                dispatch.uninstall(keep_learned=True, keep_coverage=True)
            self.model = _build(kind)
            mode = "static" if variant == "static" else "eager"
            vescale.parallelize(self.model, _vescale_plan(kind, self.model, mesh, sp, zero3), mesh, mode=mode)
            if variant == "torch-dispatch":
                dispatch.uninstall(keep_learned=True, keep_coverage=True)  # parallelize installs them; this variant runs without
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, seq: int = SEQ) -> float:
        if self.variant == "torch-dispatch" or (self.variant == "torch" and self.kind == "llama"):
            dispatch.uninstall(keep_learned=True, keep_coverage=True)  # the other arms' shape-free cache waits for them
        else:
            dispatch.install()
        (x, y), = synthetic_batches(1, self.batch, seq, self.vocab, seed=seq)
        t0 = CLOCK[0]()
        # TorchTitan's LLaMA keeps the logits vocabulary-sharded (loss_parallel); its MoE here replicates them.
        if self.variant in TORCH_STACKS and self.kind == "llama":
            context = loss_parallel()
        elif self.variant in TORCH_STACKS:  # HF's experts kernels mix plain index tensors with DTensors
            context = implicit_replication()
        else:
            context = contextlib.nullcontext()
        with context:
            loss = self.model(input_ids=x, labels=y).loss
            t1 = CLOCK[0]()
            loss.backward()
        t2 = CLOCK[0]()
        self.opt.step()
        self.opt.zero_grad()
        t3 = CLOCK[0]()
        self.phases = (t1 - t0, t2 - t1, t3 - t2)  # forward, backward, optimiser step
        return t3 - t0


def one_process_parser(doc: str, default_model: str = "moe") -> argparse.ArgumentParser:
    """The arguments the one-process A/B scripts share (``bench_dispatch_ab.py``, ``bench_new_length.py``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--config", default="dp2tp4", choices=tuple(CONFIGS))
    ap.add_argument("--model", default=default_model, choices=("llama", "moe"))
    return ap


def fake_mesh(config: str):
    """This process as rank 0 of ``config``'s mesh over the fake group, one intra-op thread, steps
    timed on the thread clock. Returns ``(mesh, shape, sp, zero3)``."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    CLOCK[0] = time.thread_time
    shape, names, sp, zero3 = CONFIGS[config]
    dist.init_process_group("fake", rank=0, world_size=math.prod(shape))
    mesh = vescale.init_mesh(shape, names)
    vescale.manual_seed(0)
    return mesh, shape, sp, zero3


def _set_dropout(p: float) -> None:
    global MODEL
    MODEL = dataclasses.replace(MODEL, attention_dropout=p, hidden_dropout=p)


def _build(kind: str):
    if kind == "llama":
        return LlamaForCausalLM(MODEL)
    from vescale.zoo import tiny_hf_mixtral

    return tiny_hf_mixtral(**MOE_SIZES)


def _vescale_plan(kind: str, model, mesh, sp: bool, zero3: bool):
    if kind == "llama":
        return llama_plan(mesh, MODEL, sequence_parallel=sp, zero3=zero3)
    from vescale.zoo import moe_plan

    return moe_plan(mesh, model.config, sequence_parallel=sp, zero3=zero3)


def _stats(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return statistics.median(xs), q[0], q[2]


def _fresh_caches() -> None:
    forget_dtensor_caches()
    cache = dispatch.shape_free_cache()
    if cache is not None:
        cache.clear()


def _op_cases(mesh):
    """(name, local fn, DTensor fn factory over a size) for per-op overhead on a DP x TP mesh."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def dt(*shape, placements):
        return DTensor.from_local(torch.randn(*shape), mesh, placements, run_check=False)

    def cases(n):  # n: a size that changes to force PyTorch's sharding-cache misses
        x = dt(4, n, 64, placements=[Shard(0), Replicate()])
        w = dt(64, 32, placements=[Replicate(), Shard(1)])
        h = dt(4, n, 32, placements=[Shard(0), Shard(2)])
        q = dt(4, 4, n, 16, placements=[Shard(0), Shard(1)])
        return {
            "mm (linear)": lambda: x @ w,
            "add": lambda: h + h,
            "view": lambda: h.view(8, n, 8, 8),  # global sizes (local shape x mesh)
            "transpose": lambda: q.transpose(2, 3),
            "bmm (attention)": lambda: q @ q.transpose(2, 3),
        }

    return cases


def per_op(mesh, repeat: int = 200) -> None:
    """Per-op time: plain local tensors of the local shape, DTensor hit, DTensor miss (new size)."""
    cases = _op_cases(mesh)
    print(f"{'op':16s} {'local us':>9s} {'hit us':>8s} {'miss us, PyTorch':>17s} {'miss us, vescale':>17s}")
    for name in cases(64):
        timings = {}
        for installed in (False, True):
            _fresh_caches()
            dispatch.install() if installed else dispatch.uninstall(keep_coverage=True)
            misses = []
            for n in range(8, 8 + 8 * 6, 8):  # a new sequence length per call: all misses
                fn = cases(n)[name]
                t0 = time.perf_counter()
                fn()
                misses.append(time.perf_counter() - t0)
            timings[installed] = statistics.median(misses[1:])
        fn = cases(64)[name]
        fn()
        hit = min(_timeit(fn, repeat) for _ in range(3))
        out = fn()
        local_fn = _local_twin(name, out)
        local = min(_timeit(local_fn, repeat) for _ in range(3))
        print(f"{name:16s} {local*1e6:9.1f} {hit*1e6:8.1f} {timings[False]*1e6:17.1f} {timings[True]*1e6:17.1f}")
    dispatch.install()


def _timeit(fn, repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def _local_twin(name: str, out):
    """The same op on plain tensors with this rank's local shapes."""
    shape = out._local_tensor.shape
    if name == "mm (linear)":
        a, b = torch.randn(*shape[:-1], 64), torch.randn(64, shape[-1])
        return lambda: a @ b
    if name == "add":
        a = torch.randn(shape)
        return lambda: a + a
    if name == "view":
        a = torch.randn(shape[0], shape[1], shape[2] * shape[3])
        return lambda: a.view(shape)
    if name == "transpose":
        a = torch.randn(shape[0], shape[1], shape[3], shape[2])
        return lambda: a.transpose(2, 3)
    a = torch.randn(shape[0], shape[1], shape[2], 16)
    return lambda: a @ a.transpose(2, 3)


def _measure(mesh, shape, sp, zero3, rounds, variants, kind, real_collectives: bool = False, lengths: int = 3) -> dict:
    """First step, steady steps (interleaved rounds) and new-length ratios of every variant."""
    dp, tp = shape
    first, runners = {}, {}
    for v in variants:  # first step: fresh model, cold sharding caches
        _fresh_caches()
        runners[v] = Runner(v, mesh, dp, tp, sp, zero3, kind, real_collectives)
        first[v] = runners[v].step()
    for v in variants:  # warm up (static: until recorded)
        for _ in range(3):
            runners[v].step()
    steady = {v: [] for v in variants}
    phases = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            steady[v].append(runners[v].step())
            phases[v].append(runners[v].phases)
    fresh_len = {v: [] for v in variants}
    for i in range(lengths):  # a new sequence length each time, then the same length again
        for k, v in enumerate(variants):
            # Lengths no variant has run: the variants share PyTorch's shape-keyed sharding cache,
            # so a length another variant ran first would not be new to this one.
            seq = SEQ + 8 * (1 + k + len(variants) * i)
            new = runners[v].step(seq)
            again = min(runners[v].step(seq) for _ in range(2))
            fresh_len[v].append(new / again)
    eager_modules = None
    if "static" in runners:
        eager_modules = sorted(vescale.static.eager_modules(runners["static"].model))
    return {"first": first, "steady": steady, "phases": phases, "fresh_len": fresh_len, "eager_modules": eager_modules}


def _report(title: str, r: dict, base_name: str) -> None:
    print(title)
    base = _stats(r["steady"][base_name])[0] if base_name in r["steady"] else None
    torch_med = _stats(r["steady"]["torch"])[0] if "torch" in r["steady"] and base_name != "torch" else None
    torch_col = f" {'x torch':>8s}" if base_name != "torch" else ""  # the base column is torch already
    print(f"{'variant':16s} {'steady ms (p25-p75)':>24s} {'x ' + base_name:>9s}{torch_col} {'first step s':>13s} {'new length x':>13s}")
    for v, times in r["steady"].items():
        med, lo, hi = _stats(times)
        ratio = f"{med / base:9.2f}" if base else "        -"
        vs_torch = "" if not torch_col else (f" {med / torch_med:8.2f}" if torch_med else "        -")
        print(f"{v:16s} {med*1e3:9.1f} ({lo*1e3:6.1f}-{hi*1e3:6.1f}) {ratio}{vs_torch} {r['first'][v]:13.2f} "
              f"{statistics.median(r['fresh_len'][v]):13.2f}")
    print("forward / backward / optimiser step, ms (medians): " + "; ".join(
        f"{v} " + " / ".join(f"{statistics.median(p[i] for p in ps) * 1e3:.1f}" for i in range(3))
        for v, ps in r["phases"].items()))
    if "megatron" in r["steady"] and base_name != "megatron":
        floor = _stats(r["steady"]["megatron"])[0]
        print("x megatron (hand-written, explicit collectives): " + ", ".join(
            f"{v} {_stats(times)[0] / floor:.2f}" for v, times in r["steady"].items()))
    if r["eager_modules"] is not None:
        print(f"static: modules kept eager: {r['eager_modules']}")


def bench(config: str, rounds: int, variants: list[str], kind: str, lengths: int = 3) -> None:
    shape, names, sp, zero3 = CONFIGS[config]
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=math.prod(shape))
    mesh = vescale.init_mesh(shape, names)
    vescale.manual_seed(0)
    if kind != "llama" and shape[0] > 1:  # megatron_moe writes out tensor parallelism only
        variants = [v for v in variants if v != "megatron"]
    r = _measure(mesh, shape, sp, zero3, rounds, variants, kind, lengths=lengths)
    _report(f"\n## {kind} {config}: mesh {dict(zip(names, shape))}, SP={sp}, ZeRO-3={zero3}; rank 0 of "
            f"{math.prod(shape)} (fake group)", r, "local")


def _on_gloo_rank(config: str, rounds: int, variants: list[str], kind: str, dropout: float, clock: str, lengths: int = 3):
    # Wall time counts the waits for the other ranks (and for the cores they share); the process's
    # CPU time (``--gloo-clock cpu``) is this rank's own work, gloo's threads included, which
    # other sessions on a shared machine disturb far less.
    CLOCK[0] = CLOCKS[clock]
    _set_dropout(dropout)  # a fresh process: the parent's setting does not carry over
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    shape, names, sp, zero3 = CONFIGS[config]
    mesh = vescale.init_mesh(shape, names)
    vescale.manual_seed(0)
    r = _measure(mesh, shape, sp, zero3, rounds, variants, kind, real_collectives=True, lengths=lengths)
    return r if dist.get_rank() == 0 else None


def _first_on_gloo_rank(config: str, variant: str, kind: str, dropout: float, clock: str):
    CLOCK[0] = CLOCKS[clock]
    _set_dropout(dropout)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    shape, names, sp, zero3 = CONFIGS[config]
    mesh = vescale.init_mesh(shape, names)
    vescale.manual_seed(0)
    first = Runner(variant, mesh, shape[0], shape[1], sp, zero3, kind, real_collectives=True).step()
    return first if dist.get_rank() == 0 else None


def bench_cold_first(config: str, launches: int, variants: list[str], kind: str, clock: str = "wall") -> None:
    """The first step of each variant in a launch of its own (``launches`` per variant, in turn): in
    the interleaved run, the variants after the first find PyTorch's process-wide state warmed
    (FakeTensor's dispatch cache, lazily built op tables, gloo's connections), which a user's fresh
    process does not."""
    from vescale.testing import run_on_ranks

    shape, names, sp, zero3 = CONFIGS[config]
    variants = [v for v in variants if v not in ("megatron", "local")]
    firsts = {v: [] for v in variants}
    for _ in range(launches):
        for v in variants:
            firsts[v].append(run_on_ranks(_first_on_gloo_rank, math.prod(shape), config, v, kind,
                                          MODEL.attention_dropout, clock, timeout=900)[0])
    print(f"\n## {kind} {config} on {math.prod(shape)} gloo ranks: first step, each variant in fresh processes "
          f"({launches} launches each, rank 0's {clock} clock, seconds)")
    base = statistics.median(firsts["torch"]) if "torch" in firsts else None
    for v, xs in firsts.items():
        med = statistics.median(xs)
        ratio = f"  x torch {med / base:.2f}" if base else ""
        print(f"{v:16s} median {med:.2f} (runs {' '.join(f'{x:.2f}' for x in xs)}){ratio}")


def bench_gloo(config: str, rounds: int, variants: list[str], kind: str, clock: str = "wall", lengths: int = 3) -> None:
    from vescale.testing import run_on_ranks

    shape, names, sp, zero3 = CONFIGS[config]
    variants = [v for v in variants if v != "megatron"]  # `local` is the hand-written code on gloo ranks
    if kind != "llama" and shape[0] > 1:  # megatron_moe writes out tensor parallelism only
        variants = [v for v in variants if v != "local"]
    r = run_on_ranks(_on_gloo_rank, math.prod(shape), config, rounds, variants, kind, MODEL.attention_dropout, clock,
                     lengths, timeout=1800)[0]
    _report(f"\n## {kind} {config} on {math.prod(shape)} gloo ranks (processes): mesh {dict(zip(names, shape))}, "
            f"SP={sp}, ZeRO-3={zero3}; rank 0's times ({clock} clock)", r, "local" if "local" in variants else "torch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--configs", default="tp8,dp2tp4")
    ap.add_argument("--variants", default="local,torch,torch-dispatch,eager,static")
    ap.add_argument("--gloo", default="", help="configs to run on real gloo ranks too, e.g. tp2,dp2tp2")
    ap.add_argument("--model", choices=("llama", "moe"), default="llama", help="the zoo LLaMA or HF Mixtral (many small experts)")
    ap.add_argument("--ops", action="store_true", help="per-op overhead on a DP=2 x TP=2 mesh first")
    ap.add_argument("--dropout", type=float, default=0.0,
                    help="attention and hidden-state dropout of the zoo LLaMA (its random ops go through "
                         "vescale.random in eager and static mode; 0: none, as in the issue's model)")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="fake-group step times: wall clock, or this process's (cpu) / thread's (thread) CPU "
                         "time, steadier on a shared machine")
    ap.add_argument("--cold-first", type=int, default=0, metavar="N",
                    help="for the --gloo configs, instead: each variant's first step in N fresh launches of its own")
    ap.add_argument("--lengths", type=int, default=3,
                    help="new sequence lengths per variant (each: a step at a length no variant ran, over the "
                         "faster of two repeats; the table shows the median)")
    ap.add_argument("--gloo-clock", choices=("wall", "cpu"), default="wall",
                    help="gloo-rank step times: wall clock (waits for the other ranks included), or the "
                         "rank's process CPU time (its own work, gloo's threads included)")
    args = ap.parse_args()
    CLOCK[0] = CLOCKS[args.clock]
    _set_dropout(args.dropout)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; 1 intra-op thread; {args.rounds} interleaved rounds; {args.clock} clock; "
          f"dropout {args.dropout}")
    if args.ops:
        dist.init_process_group("fake", rank=0, world_size=4)
        print("\n## per-op time on a DP=2 x TP=2 mesh (fake group), microseconds")
        per_op(vescale.init_mesh((2, 2), ("DP", "TP")))
        dist.destroy_process_group()
    for config in filter(None, args.configs.split(",")):
        bench(config, args.rounds, args.variants.split(","), args.model, args.lengths)
    if dist.is_initialized():
        dist.destroy_process_group()
    for config in filter(None, args.gloo.split(",")):
        if args.cold_first:
            bench_cold_first(config, args.cold_first, args.variants.split(","), args.model, args.gloo_clock)
        else:
            bench_gloo(config, args.rounds, args.variants.split(","), args.model, args.gloo_clock, args.lengths)


if __name__ == "__main__":
    main()
