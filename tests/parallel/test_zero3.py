"""ZeRO-3 saves memory for real: state at rest falls as 1/DP, and gathered parameters are freed
after forward (but for what forward used last, which backward needs first) and again after their
gradient is accumulated."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist

import vescale
from vescale.debug import bytes_at_rest
from vescale.parallel.hooks import GatheredParam
from vescale.parallel.zero import unit_of, zero_state
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama
from vescale.model_state import state_of


_ALLOCATED = {"gathered": 0}  # storages of gathered parameters allocated (GatheredParam.refill_target)


# What forward uses last and backward first stays gathered: the last block, the final norm, the head.
_KEPT = re.compile(r"model\.layers\.1\.|model\.norm\.|lm_head\.")


def _one_step(zero3: bool, spy: dict | None = None, keep: bool = True):
    world = dist.get_world_size()
    mesh = vescale.init_mesh((world,), ("DP",))
    torch.manual_seed(0)
    model = vescale.parallelize(tiny_llama(), llama_plan(mesh, zero3=zero3), mesh)
    if zero3:
        state_of(model).gathers.keep_for_backward = keep
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids, labels = synthetic_batches(1, 4, 16, 128, seed=1)[0]
    loss = model(input_ids=input_ids, labels=labels).loss
    if spy is not None:
        gathered = [g for p in model.parameters() for g in zero_state(p).gathered]
        spy["weights"] = len(list(model.parameters()))  # the tiny LLaMA has only weights
        spy["kept"] = sum(bool(_KEPT.match(n)) for n, _ in model.named_parameters()) if keep else 0
        spy["after_forward"] = (len(gathered), sum(g.resident for g in gathered))
        allocated = _ALLOCATED["gathered"]
    loss.backward()
    if spy is not None:
        spy["after_backward"] = sum(len(zero_state(p).gathered) for p in model.parameters())
        spy["refills"] = _ALLOCATED["gathered"] - allocated
    opt.step()
    return bytes_at_rest(model, opt)


def _measure(keep: bool = True):
    original = GatheredParam.refill_target  # every gather into a freed storage allocates it here

    def counting_refill(self, *args):
        _ALLOCATED["gathered"] += 1
        return original(self, *args)

    GatheredParam.refill_target = counting_refill  # test-local instrumentation of the forked rank
    spy: dict = {}
    sharded = _one_step(zero3=True, spy=spy, keep=keep)
    replicated = _one_step(zero3=False)
    return sharded, replicated, spy, spy["refills"]


@pytest.mark.multiproc
@pytest.mark.parametrize("world,keep", [(2, True), (4, True), (2, False)])
def test_state_at_rest_falls_as_one_over_dp(world, keep):
    for sharded, replicated, spy, refills in run_on_ranks(_measure, world, keep):
        n_weights, kept = spy["weights"], spy["kept"]
        assert kept == (11 if keep else 0)  # the last of 2 blocks (9 weights), the final norm, the head
        # Every weight was gathered for its module's forward, and all gathers were freed right after
        # but those of the last block, final norm and head (``keep_for_backward``).
        assert spy["after_forward"] == (n_weights, kept)
        # Backward gathered each freed one again, and freed them all once their gradients were accumulated.
        assert refills == n_weights - kept
        assert spy["after_backward"] == 0
        for kind in ("params", "grads"):
            assert sharded[kind] * world == replicated[kind], (kind, sharded, replicated)
        # AdamW's scalar `step` tensors are not sharded: allow their few bytes.
        assert sharded["optimizer"] * world <= replicated["optimizer"] + 8 * world * n_weights


def _prefetch_spy():
    """Two steps of a 4-layer LLaMA under ZeRO-3 (DP=2): prefetch counts and the most gathered
    bytes held at any module's start, in the second step's forward."""
    mesh = vescale.init_mesh((dist.get_world_size(),), ("DP",))
    torch.manual_seed(0)
    model = vescale.parallelize(tiny_llama(num_hidden_layers=4), llama_plan(mesh, zero3=True), mesh)
    sched = state_of(model).gathers
    peak = [0]
    hooks = [m.register_forward_pre_hook(lambda *_: peak.__setitem__(0, max(peak[0], sched.held_bytes())))
             for m in model.modules()]
    input_ids, labels = synthetic_batches(1, 4, 16, 128, seed=1)[0]
    model(input_ids=input_ids, labels=labels).loss.backward()
    peak[0] = 0
    model(input_ids=input_ids, labels=labels).loss.backward()
    for h in hooks:
        h.remove()
    unit_bytes: dict[str, int] = {}
    for name, p in model.named_parameters():  # gathered (RUN) size of each unit's parameters
        unit = unit_of(name.rsplit(".", 1)[0])
        unit_bytes[unit] = unit_bytes.get(unit, 0) + p.numel() * p.element_size()
    held_after = sched.held_bytes()
    with torch.no_grad():  # an evaluation forward gathers too, but keeps nothing for a backward
        model(input_ids=input_ids, labels=labels)
    held_after += sched.held_bytes()
    return dict(sched.stats), peak[0], unit_bytes, held_after, dict(state_of(model).reducer.stats)


@pytest.mark.multiproc
def test_zero3_prefetch_keeps_memory_bounded():
    for stats, peak, units, held_after, comm in run_on_ranks(_prefetch_spy, 2):
        # 5 units (4 blocks + the rest): after the first step each forward finds the next unit
        # already gathering (4 times), and each backward too (reverse order: blocks 2, 1, 0 and
        # the embedding; the last block, norm and head are still gathered from forward).
        assert stats == {"forward_prefetched": 4 + 4, "backward_prefetched": 4 + 4}, stats
        # One gather per unit and pass but the last block's in backward, one reduce-scatter bucket,
        # per step; 5 for the no-grad forward.
        assert comm == {"all_gather": 2 * (2 * 5 - 1) + 5, "reduce_scatter": 2}, comm
        # Prefetch holds at most the unit outside the blocks (embeddings and head, needed at both
        # ends of forward), the running block and the next one: never the whole model.
        block = max(b for u, b in units.items() if u)
        assert peak <= units[""] + 2 * block < sum(units.values()), (peak, units)
        assert held_after == 0  # everything freed after backward, and after a no-grad forward


@pytest.mark.multiproc
def test_zero3_on_one_rank_keeps_parameters():
    """On DP=1 the RUN gather returns the parameter's own storage; it must not be freed."""
    sharded, replicated, spy, _ = run_on_ranks(_measure, 1, False)[0]
    assert spy["after_forward"] == (spy["weights"], spy["weights"])  # nothing freed
    assert sharded == replicated


def _slot_steps():
    """Three steps of ZeRO-3 (DP=2); before the third, one weight is frozen."""
    mesh = vescale.init_mesh((dist.get_world_size(),), ("DP",))
    torch.manual_seed(0)
    model = vescale.parallelize(tiny_llama(), llama_plan(mesh, zero3=True), mesh)
    sched = state_of(model).gathers
    frozen = "model.layers.0.mlp.up_proj.weight"
    input_ids, labels = synthetic_batches(1, 4, 16, 128, seed=1)[0]
    seen, grads, held = [], [], []
    for step in range(3):
        if step == 2:
            dict(model.named_parameters())[frozen].requires_grad_(False)
        model(input_ids=input_ids, labels=labels).loss.backward()
        seen.append({unit: [id(g.value) if g is not None else None for g in slots] for unit, (_, slots) in sched._slots.items()})
        grads.append({n: p.grad is not None for n, p in model.named_parameters()})
        held.append(sched.held_bytes())
        model.zero_grad()
    return seen, grads, held, frozen


@pytest.mark.multiproc
def test_zero3_gathered_parameters_are_kept_from_step_to_step():
    """A training forward gathers each unit into the same gathered parameters every step (their
    storage freed between uses); a weight frozen since makes its unit's new ones, and gets no gradient."""
    for seen, grads, held, frozen in run_on_ranks(_slot_steps, 2):
        assert seen[0] == seen[1] and all(None not in ids for ids in seen[0].values()), seen
        # Rebuilt for the frozen weight, which has none (it is gathered afresh, as before slots).
        assert seen[2]["model.layers.0"] != seen[1]["model.layers.0"] and seen[2]["model.layers.0"].count(None) == 1
        assert all(seen[2][u] == seen[1][u] for u in seen[1] if u != "model.layers.0")
        assert all(grads[0].values()) and grads[0] == grads[1]
        assert not grads[2][frozen] and sum(grads[2].values()) == len(grads[2]) - 1
        assert held[:2] == [0, 0]  # (a frozen weight's copy is kept until the next forward, as ever)


def _kept_or_not(mode: str):
    """Four training steps of DP=2 x TP=2 + SP + ZeRO-3, alternating ``keep_for_backward`` off and on
    (both rules in one model, as the A/B benchmark flips them): per step the loss, the collectives,
    and after the last step the parameters; then the same with the rule off throughout."""
    from vescale.debug import CollectiveCounter

    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    runs = {}
    for flips in (True, False):
        torch.manual_seed(0)
        model = tiny_llama(num_hidden_layers=3)
        vescale.parallelize(model, llama_plan(mesh, model.config, zero3=True), mesh, mode=mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, counts = [], []
        for step, (x, y) in enumerate(synthetic_batches(4, 4, 16, 128, seed=1)):
            state_of(model).gathers.keep_for_backward = flips and step % 2 == 1
            with CollectiveCounter() as c:
                loss = model(input_ids=x, labels=y).loss
                loss.backward()
            losses.append(loss.item())
            counts.append(c.counts["all_gather"])
            opt.step()
            opt.zero_grad()
        runs[flips] = (losses, counts, [p.to_local().clone() for p in model.parameters()])
    return runs


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_keeping_the_last_unit_changes_no_result(mode):
    """``keep_for_backward`` saves the last block's gather in backward and nothing else: training
    with it on every other step is bit for bit training with it off."""
    for runs in run_on_ranks(_kept_or_not, 4, mode):
        (losses, counts, params), (ref_losses, ref_counts, ref_params) = runs[True], runs[False]
        assert losses == ref_losses
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
        # Steps 1 and 3 kept the last block (and the final norm and head) for backward: one
        # all-gather fewer than the same steps with every unit freed after forward.
        assert [r - k for k, r in zip(counts, ref_counts)] == [0, 1, 0, 1], (counts, ref_counts)


HOOKED = "model.layers.0.mlp.up_proj.weight"


def _hooked_run(bucket_mb, zero3=True):
    """Two SGD steps of the tiny LLaMA with a user's hooks on one weight: a tensor hook that replaces
    the gradient by a non-linear function of it (right only on the whole, reduced gradient) and a
    post-accumulate hook that reads ``p.grad``. ``bucket_mb="single"``: one device."""
    torch.manual_seed(0)
    model = tiny_llama()
    if bucket_mb != "single":
        mesh = vescale.init_mesh((dist.get_world_size(),), ("DP",))
        vescale.parallelize(model, llama_plan(mesh, zero3=zero3), mesh, bucket_mb=bucket_mb)
    param = dict(model.named_parameters())[HOOKED]
    seen = []
    param.register_hook(lambda g: g + 10 * g * g)
    param.register_post_accumulate_grad_hook(
        lambda p: seen.append(None if p.grad is None else vescale.testing.global_value(p.grad).norm().item()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for input_ids, labels in synthetic_batches(2, 4, 16, 128, seed=1):
        model(input_ids=input_ids, labels=labels).loss.backward()
        grads.append({n: vescale.testing.global_value(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"seen": seen, "grads": grads, "placements": str(param.placements) if bucket_mb != "single" else None}


def _three_hooked_runs():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [_hooked_run(25), _hooked_run(None), _hooked_run(25, zero3=False)]
    runs[2]["warnings"] = [str(w.message) for w in caught]
    return runs


@pytest.mark.multiproc
def test_a_parameters_own_hooks_run_on_its_reduced_gradient():
    """Under ZeRO-3 autograd feeds a gathered copy, not the parameter; its own hooks run when the
    reduced gradient lands (vescale.comm.grad), once per backward, on the whole gradient: the
    tensor hook's non-linear replacement and what the post-accumulate hook reads match one device
    (fp32 sums in another order: 1e-5), bucketed and per tensor."""
    single = _hooked_run("single")
    assert len(single["seen"]) == 2
    bucketed, per_tensor, dp_bucketed = run_on_ranks(_three_hooked_runs, 2)[0]
    for run in (bucketed, per_tensor):
        assert "Shard(dim=0)" in run["placements"], run["placements"]  # the weight is ZeRO-3 sharded at rest
        assert run["seen"] == pytest.approx(single["seen"], rel=1e-5), (run["seen"], single["seen"])
        for got, want in zip(run["grads"], single["grads"]):
            for name in want:
                assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), name
    # Without ZeRO-3 autograd accumulates the gradient and the buckets reduce it after backward: a
    # post-accumulate hook runs first (as under DDP) and is told so, not left to read a stale grad.
    assert any("post-accumulate-grad hook on a parameter with bucketed gradient reduction" in w for w in dp_bucketed["warnings"])
