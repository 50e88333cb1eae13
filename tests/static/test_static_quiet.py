"""Quiet modules: hooks off for static steps where they have nothing to do.

From a record's second static step on, a module that is static, called by a static module, with
nothing wrapped, moved or placed at its boundary, no random op and no hooks but the runtime's
loses its hooks for the step, and the root swaps its parameters for local tensors once per
forward. On 2 gloo ranks (zoo LLaMA with dropout, TP=2 + SP) these tests check that

* training with quiet modules gives the losses and parameters of training without them, bit for
  bit, through recording steps, a new sequence length and an evaluation forward in between;
* while a quiet step's forward runs, those modules (every TP Linear among them) have no hooks and
  plain tensors as parameters; the modules whose random ops are replayed, or whose boundary moves
  a tensor, keep theirs; an evaluation forward and a recording step see every hook back;
* after each forward the parameters are DTensors again, also when the forward raised;
* a hook registered on a module while its hooks are off runs in the next step (the module is not
  quiet any more), and removing it works.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.tensor import DTensor

import vescale
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama
from vescale.model_state import state_of

LINEAR = "model.layers.0.mlp.up_proj"


def _train(quiet: bool) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)
    vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True), mesh, mode="static")
    rt = state_of(model).static
    if not quiet:  # the reference path: every module keeps its hooks in static steps
        rt._quiet_now = dict
    rt.reuse_records = False  # the new length records (a derived record would run quiet from its first step)
    modules = dict(model.named_modules())
    silenced_seen: list[set] = []

    def look(mod, args, kwargs):  # a root pre-hook of the user's: runs after the runtime's step begins
        off = {p for p, m in modules.items() if p and not m._forward_pre_hooks and not m._forward_hooks and p in rt.own_hooks}
        for p in off:
            for name, param in modules[p]._parameters.items():
                assert param is None or type(param) is torch.Tensor, f"{p}.{name} is {type(param).__name__} in a quiet step"
        silenced_seen.append(off)

    model.register_forward_pre_hook(look, with_kwargs=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vescale.manual_seed(3)
    losses, fired = [], []
    user_hook = None
    lengths = [16] * 5 + [24] * 4 + [16] * 3
    for step, seq in enumerate(lengths):
        (x, y), = synthetic_batches(1, 4, seq, 128, seed=step)
        if step == 10:
            user_hook = modules[LINEAR].register_forward_hook(lambda m, a, o: fired.append(step))
        if step == 11:
            user_hook.remove()
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach())
        assert all(isinstance(p, DTensor) for p in model.parameters()), f"step {step}: a parameter was left swapped"
        if step == 3:
            with torch.no_grad():  # an evaluation forward: eager, every hook back
                model(input_ids=x)
    # A forward that raises (in a hook of the user's after the body) still gives the parameters back.
    boom = model.register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model(input_ids=x, labels=y)
    boom.remove()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    rec = rt.latest()
    return {
        "losses": torch.stack(losses),
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        "silenced": silenced_seen,
        "quiet": sorted(rec.quiet or {}),
        "random": sorted(rec.random),
        "moves": sorted(p for p, s in rec.program.items() if s.moves_in or s.moves_out or s.wrap_in or s.wrap_out),
        "fired": fired,
    }


def _both():
    return _train(True), _train(False)


@pytest.mark.multiproc
def test_quiet_modules_match_hooked_training_bit_for_bit():
    quiet, hooked = run_on_ranks(_both, 2)[0]
    assert torch.equal(quiet["losses"], hooked["losses"]), (quiet["losses"] - hooked["losses"]).abs().max()
    for name, p in quiet["params"].items():
        assert torch.equal(p, hooked["params"][name]), name
    assert all(not s for s in hooked["silenced"]), "the hooked reference path took hooks off"

    silenced = quiet["silenced"]
    # Step 0 records (no module stays eager under TP, the vocabulary-parallel lookup included),
    # step 1 checks shapes with every hook on; the eval forward after step 3 (index 4 here) and the
    # recording at the new length (index 6) have every hook back.
    assert not silenced[0] and not silenced[1] and silenced[2], silenced[:3]
    assert LINEAR in silenced[3] and "model.layers.1.self_attn.q_proj" in silenced[3], sorted(silenced[3])
    assert not silenced[4], f"evaluation forward ran with hooks off: {sorted(silenced[4])}"
    assert not silenced[6], f"recording step ran with hooks off: {sorted(silenced[6])}"
    assert LINEAR in silenced[9], sorted(silenced[9])  # the 24-long record's quiet steps
    # Modules that replay random ops or move tensors at their boundary keep their hooks.
    kept = set(quiet["random"]) | set(quiet["moves"])
    assert kept and not kept & set().union(*silenced), kept & set().union(*silenced)
    assert set(quiet["quiet"]) <= set(silenced[-2]) | {LINEAR}
    # The user's hook on a silenced module ran in the step it was added for (index 11 of the
    # forwards: 10 steps, one eval forward) and not after it was removed.
    assert quiet["fired"] == [10], quiet["fired"]
    assert LINEAR not in silenced[11], "a module with a user hook was silenced"
