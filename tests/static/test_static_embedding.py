"""Vocabulary-parallel lookups run static, masked on local tensors, bit for bit as eager mode.

``embedding(weight, ids)`` with the table's rows sharded (``Shard(0)``) is not local under DTensor's
rule (it masks the ids into a ``_MaskPartial`` layout), so Static Eager mode used to keep such a
module on DTensors. Now the recording keeps a ``MaskedLookup`` for it and static steps run the
masked lookup on the local rows (``vescale/static/local_ops.py``). These tests check, on gloo ranks:

* a model that is only a lookup (so nothing else moves a bit) computes *exactly* what eager mode
  computes, and under TP alone what the single device computes: losses, the table's gradient
  every step, and the table after AdamW steps, compared with ``torch.equal``; on TP=2 with the
  output reduce-scattered along the sequence (SP), all-reduced, or handed to the caller unreduced
  (whose plan all-reduces it), an uneven vocabulary (15 rows on 2 ranks), a padding row in the second shard, and DP=2 x TP=2 with the ids split on DP and the
  table ZeRO-3-sharded on DP (there the gradient sums two batch halves: within 1e-6 of one device);
* that it ran static: the lookup is recorded with this rank's rows, no ``aten.embedding`` reaches
  DTensor in a static step, and a static step issues no collective eager mode does not;
* the zoo LLaMA and HF's unchanged ``LlamaForCausalLM`` (also with tied embeddings), TP=2 + SP and
  DP=2 x TP=2 + SP + ZeRO-3: ``embed_tokens`` runs static (under TP nothing stays eager, so one
  step records; under DP the root does); every step hands layer 0 exactly (``torch.equal``) this rank's piece of the
  single-device lookup in the current table; losses within 1e-6 of eager mode's, parameters after
  4 AdamW steps within 2e-5. (Not bit for bit there: the rest of the model's gradients already differ by
  ulps between eager mode and a recording step, which mirrors static mode's boundaries.)
* what must not run masked does not: a lookup that bypasses ``F.embedding`` / ``torch.embedding``
  fails the first static step with the module named, and a static module that would receive an
  eager module's unreduced (still unmasked) lookup stays eager.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import vescale
from vescale import INIT, RUN, VescalePlan
from vescale.debug import CollectiveCounter
from vescale.plan.ir import PlanError
from vescale.testing import error_of, run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_hf_llama, tiny_llama
from vescale.model_state import state_of

HIDDEN, BATCH, SEQ, STEPS = 8, 4, 6, 4


class Lookup(nn.Module):
    def __init__(self, vocab: int, padding_idx=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, HIDDEN, padding_idx=padding_idx)

    def forward(self, ids):
        return self.embed(ids)


class _EmbeddingOps(TorchDispatchMode):
    """Counts ``aten.embedding`` calls that reach DTensor."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.embedding.default and any(issubclass(t, DTensor) for t in types):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _batches(vocab: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randn(BATCH, SEQ, HIDDEN, generator=g))
            for _ in range(STEPS)]


def _lookup_plan(out, dp: bool, zero3: bool) -> VescalePlan:
    plan = VescalePlan()
    plan.shard(r"embed\.weight", Shard(0), mesh="TP")
    if out is not None:  # None: the lookup leaves 'embed' unreduced, as a Partial the root's plan reduces
        plan.shard(r"embed\.<out>", out, mesh="TP")
    plan.shard(r"<out>", Replicate(), mesh="TP")  # the test's loss sees the whole output
    if dp:
        plan.shard(r"<in>\[ids\]", Shard(0), mesh="DP")
        plan.shard(r"<out>", Replicate(), mesh="DP")
    if zero3:
        plan.shard(r"embed\.weight", Shard(0), mesh="DP", phase=INIT)
        plan.shard(r"embed\.weight", Replicate(), mesh="DP", phase=RUN)
    return plan


def _value(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train_lookup(mode: str | None, vocab: int, padding_idx, out, mesh_shape: tuple, zero3: bool) -> dict:
    """Train the lookup for STEPS AdamW steps; ``mode`` None: on one device."""
    torch.manual_seed(0)
    model = Lookup(vocab, padding_idx)
    dp = len(mesh_shape) == 2
    if mode is not None:
        mesh = vescale.init_mesh(mesh_shape, ("DP", "TP") if dp else ("TP",))
        vescale.parallelize(model, _lookup_plan(out, dp, zero3), mesh, mode=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    run = {"losses": [], "grads": [], "embedding_ops": [], "collectives": []}
    for ids, target in _batches(vocab):
        counter, collectives = _EmbeddingOps(), CollectiveCounter()
        with collectives, counter:
            loss = (model(ids) * target).sum()
            loss.backward()
        run["embedding_ops"].append(counter.count)
        run["collectives"].append(dict(collectives.counts))
        run["losses"].append(_value(loss))
        run["grads"].append(_value(model.embed.weight.grad))
        opt.step()
        opt.zero_grad()
    run["table"] = _value(model.embed.weight)
    if mode == "static":
        rec = state_of(model).static.latest()
        run["unsafe"], run["lookups"] = dict(rec.unsafe), {k: dict(v) for k, v in rec.lookups.items()}
        run["static_steps"] = state_of(model).static.static_steps
        run["tp_rank"] = model.embed.weight.device_mesh.get_local_rank(len(mesh_shape) - 1)
    return run


def _lookup_runs(vocab, padding_idx, out, mesh_shape, zero3, modes=("eager", "static")):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return {mode: _train_lookup(mode, vocab, padding_idx, out, mesh_shape, zero3) for mode in modes}


LOOKUP_CASES = {  # name: (vocab, padding_idx, embed output, mesh shape, zero3, ranks)
    "TP=2+SP": (16, None, Shard(1), (2,), False, 2),
    "TP=2+SP, uneven vocab, padding row on rank 1": (15, 12, Shard(1), (2,), False, 2),
    "TP=2, output all-reduced": (16, None, Replicate(), (2,), False, 2),
    # Nothing moves at 'embed' (a "quiet" module but for its lookup: it must keep its hooks).
    "TP=2, output reduced by the caller": (16, None, None, (2,), False, 2),
    "DP=2xTP=2+SP+ZeRO-3": (16, None, Shard(1), (2, 2), True, 4),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(LOOKUP_CASES))
def test_a_vocabulary_parallel_lookup_runs_static_bit_for_bit(case):
    vocab, padding_idx, out, mesh_shape, zero3, ranks = LOOKUP_CASES[case]
    results = run_on_ranks(_lookup_runs, ranks, vocab, padding_idx, out, mesh_shape, zero3)
    single = _train_lookup(None, vocab, padding_idx, out, mesh_shape, zero3)
    for rank, runs in enumerate(results):
        eager, static = runs["eager"], runs["static"]
        assert static["unsafe"] == {} and static["static_steps"] == STEPS - 1, (case, static["unsafe"], static["static_steps"])
        lookup = static["lookups"]["embed"]["weight"]
        rows = -(-vocab // 2)  # torch.chunk's sizes: 8 and 8, or 8 and 7
        tp_rank = static["tp_rank"]
        assert (lookup.offset, lookup.rows, lookup.vocab) == (rows * tp_rank, min(rows, vocab - rows * tp_rank), vocab), lookup
        # Recording step on DTensors, then none: every static lookup ran on local tensors.
        assert static["embedding_ops"] == [1] + [0] * (STEPS - 1), static["embedding_ops"]
        assert eager["embedding_ops"] == [1] * STEPS
        # No more communication than eager mode, kind by kind (eager mode reduce-scatters the table's
        # gradient, computed whole on every rank; the kernel computes this rank's rows alone).
        for s, e in zip(static["collectives"], eager["collectives"]):
            assert all(n <= e.get(kind, 0) for kind, n in s.items()), (static["collectives"], eager["collectives"])
        # Under DP the table's gradient is a sum of the two batch halves' sums: bit for bit as
        # eager mode, within rounding of the single device's one sum.
        same_as_single = torch.equal if len(mesh_shape) == 1 else (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-6))
        for step in range(STEPS):
            for what in ("losses", "grads"):
                assert torch.equal(static[what][step], eager[what][step]), f"{case}, rank {rank}: step {step} {what} differ from eager"
                assert same_as_single(static[what][step], single[what][step]), f"{case}, rank {rank}: step {step} {what} differ from one device"
        assert torch.equal(static["table"], eager["table"]) and same_as_single(static["table"], single["table"]), case
    if padding_idx is not None:
        assert all(not g[padding_idx].any() for g in results[0]["static"]["grads"])  # the padding row learns nothing


# ---------------------------------------------------------------------------------------------
# LLaMA: embed_tokens runs static
# ---------------------------------------------------------------------------------------------


def _local(t):
    return (t._local_tensor if isinstance(t, DTensor) else t).detach().clone()


def _llama_runs(name: str, shape: tuple, overrides: dict) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    names = ("TP",) if len(shape) == 1 else ("DP", "TP")
    mesh = vescale.init_mesh(shape, names)
    coords = dict(zip(names, mesh.get_coordinate()))
    runs = {}
    for mode in ("eager", "static"):
        torch.manual_seed(0)
        model = tiny_llama(**overrides) if name == "ours" else tiny_hf_llama(**overrides)
        vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True, zero3=len(shape) == 2), mesh, mode=mode)
        layer0 = []  # this rank's embeddings as layer 0 gets them (reduce-scattered along the sequence)
        model.model.layers[0].register_forward_pre_hook(
            lambda m, args, kwargs: layer0.append(_local(args[0] if args else kwargs["hidden_states"])), with_kwargs=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = runs[mode] = {"losses": [], "lookups_exact": []}
        for input_ids, labels in synthetic_batches(4, 4, 16, 128, seed=1):
            # This rank's piece of the single-device lookup in the current table.
            want = torch.nn.functional.embedding(input_ids, _value(model.model.embed_tokens.weight))
            want = want.chunk(shape[0], 0)[coords["DP"]] if "DP" in coords else want
            want = want.chunk(shape[-1], 1)[coords["TP"]]
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            run["lookups_exact"].append(torch.equal(layer0[-1], want))
            run["losses"].append(_value(loss).item())
            opt.step()
            opt.zero_grad()
        run["params"] = {n: _value(p) for n, p in model.named_parameters()}
        run["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
        if mode == "static":
            rt = state_of(model).static
            run["unsafe"], run["steps"] = sorted(rt.latest().unsafe), (rt.recorded_steps, rt.static_steps)
            run["lookups"] = sorted(rt.latest().lookups)
    return runs


LLAMA_CASES = {
    "ours, TP=2+SP": ("ours", (2,), {}, 2),
    "hf, TP=2+SP": ("hf", (2,), {}, 2),
    "hf tied embeddings, TP=2+SP": ("hf", (2,), {"tie_word_embeddings": True}, 2),
    "ours, DP=2xTP=2+SP+ZeRO-3": ("ours", (2, 2), {}, 4),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_embeddings_run_static(case):
    name, shape, overrides, ranks = LLAMA_CASES[case]
    for rank, runs in enumerate(run_on_ranks(_llama_runs, ranks, name, shape, overrides)):
        eager, static = runs["eager"], runs["static"]
        assert static["tied"] == bool(overrides.get("tie_word_embeddings")), case
        assert static["lookups"] == ["model.embed_tokens"], static["lookups"]
        assert "model.embed_tokens" not in static["unsafe"], static["unsafe"]
        # Nothing stays eager (HF's LlamaModel own ops are plan.eager, not found unsafe; the loss
        # runs static under DP too, vescale/static/local_loss.py), so one recording step suffices.
        assert static["unsafe"] == [] and static["steps"] == (1, 3), (static["unsafe"], static["steps"])
        # Every step, static ones included, hands layer 0 exactly this rank's piece of the
        # single-device lookup in the table as it stands.
        assert all(static["lookups_exact"]) and all(eager["lookups_exact"]), (case, rank, static["lookups_exact"], eager["lookups_exact"])
        for a, b in zip(static["losses"], eager["losses"]):
            assert abs(a - b) <= 1e-6, (case, static["losses"], eager["losses"])
        # AdamW divides by sqrt(v): elements with a near-zero gradient turn those ulps into ~1e-6
        # parameter differences after a few steps (test_static_llama.py uses SGD for that reason).
        for n, p in eager["params"].items():
            diff = (static["params"][n] - p).abs().max().item()
            assert diff <= 2e-5, f"{case}: {n} differs from eager by {diff:.3g}"


# ---------------------------------------------------------------------------------------------
# What must not run masked
# ---------------------------------------------------------------------------------------------


class AtenLookup(nn.Module):
    """Reaches the op without F.embedding / torch.embedding (where the static kernel hooks in)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, HIDDEN))

    def forward(self, ids):
        return torch.ops.aten.embedding.default(self.weight, ids)


def _bypassing_lookup():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = AtenLookup(16)
    plan = VescalePlan()
    plan.shard(r"weight", Shard(0), mesh="TP")
    plan.shard(r"<out>", Shard(1), mesh="TP")
    vescale.parallelize(model, plan, mesh, mode="static")

    def steps():
        for ids, target in _batches(16):
            (model(ids) * target).sum().backward()

    return error_of(steps, kind=PlanError)


@pytest.mark.multiproc
def test_a_lookup_that_bypasses_the_kernel_fails_the_first_static_step():
    err = run_on_ranks(_bypassing_lookup, 2)[0]
    assert err is not None and "module ''" in err and "plan.eager('')" in err, err


class EagerChild(nn.Module):
    """Hands its child's lookup on unreduced (its plan reduces it as it leaves): no op of its own
    needs DTensor, so only the rule about masked Partials keeps it eager when the child is."""

    def __init__(self):
        super().__init__()
        self.inner = Lookup(16)

    def forward(self, ids):
        return self.inner(ids)


def _unmasked_input():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2,), ("TP",))
    result = {}
    for mode in ("eager", "static"):
        torch.manual_seed(0)
        model = EagerChild()
        plan = VescalePlan()
        plan.shard(r"inner\.embed\.weight", Shard(0), mesh="TP")
        plan.shard(r"<out>", Replicate(), mesh="TP")  # reduced only as it leaves the root
        plan.eager(r"inner\.embed")
        vescale.parallelize(model, plan, mesh, mode=mode)
        outs = []
        for ids, _ in _batches(16):
            out = model(ids)
            outs.append(_value(out))
            out.sum().backward()
        result[mode] = outs
        if mode == "static":
            result["eager_modules"] = dict(state_of(model).static.latest().unsafe)
            result["static_steps"] = state_of(model).static.static_steps
    return result


@pytest.mark.multiproc
def test_a_static_module_never_gets_an_eager_modules_unmasked_lookup():
    result = run_on_ranks(_unmasked_input, 2)[0]
    # 'inner' would get the eager lookup's unmasked local rows; then the root would get them from 'inner'.
    eager = result["eager_modules"]
    assert set(eager) == {"inner", ""} and all("masked Partial" in why for why in eager.values()), eager
    assert result["static_steps"] == STEPS - 2  # one recording found both, the second confirmed it
    for a, b in zip(result["static"], result["eager"]):
        assert torch.equal(a, b)
