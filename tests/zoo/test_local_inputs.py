"""Zoo plans with ``local_inputs``: each data-parallel rank passes only its share of the batch.

* Lowering (fake 4-rank world): with ``local_inputs=True`` every batch input the global-batch plan
  splits is annotated as this rank's share on the same mesh dims instead (``llama_plan``,
  ``gpt2_plan``, ``dit_plan``, ``moe_plan`` with DP and with EP, where the batch is split over both);
  a list of names annotates those; anything else is a TypeError.
* Training (2 gloo ranks, 2 AdamW steps, eager): the DiT on DP=2 (latents, timesteps and class
  labels as shares) and Mixtral under ``moe_plan`` on DP=2 (batch-local MoE blocks) and on EP=2
  (experts split, the batch split over EP) fed their shares give
  the losses, gradients and parameters of the same plan fed the global batch, ``torch.equal``: the
  same local tensors reach the same DTensor layouts.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.tensor import Shard

import vescale
from vescale.testing import fake_world, global_value, run_on_ranks
from vescale.zoo import dit_plan, gpt2_plan, llama_plan, moe_plan, synthetic_batches, tiny_llama

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
from vescale.zoo import tiny_dit, tiny_hf_gpt2, tiny_hf_llama, tiny_hf_mixtral  # noqa: E402


def _root_inputs(model, plan, mesh) -> dict:
    """{input name: (action, placements)} of the root's input entries."""
    entries = vescale.explain(model, plan, mesh).hooks().get(("", "forward_pre"), [])
    return {e.key: (e.action, tuple(str(p) if p is not None else "-" for p in e.targets)) for e in entries if e.tensor == "<in>"}


S0, DASH = str(Shard(0)), "-"


@pytest.mark.parametrize("name", ["llama", "gpt2", "dit", "moe_dp", "moe_ep"])
def test_local_inputs_annotates_the_batch_inputs_as_shares(name):
    shape, names = ((2, 2), ("DP", "TP")) if name != "moe_ep" else ((2, 2), ("DP", "EP"))
    with fake_world(4, 0):
        mesh = vescale.init_mesh(shape, names)
        model = {"llama": tiny_llama, "gpt2": tiny_hf_gpt2, "dit": tiny_dit, "moe_dp": tiny_hf_mixtral, "moe_ep": tiny_hf_mixtral}[name]()
        make = {"llama": llama_plan, "gpt2": gpt2_plan, "dit": dit_plan, "moe_dp": moe_plan, "moe_ep": moe_plan}[name]
        config = getattr(model, "config", None)
        batch = {"dit": ("hidden_states", "timestep", "class_labels")}.get(name, ("input_ids", "labels"))
        split = (S0, S0) if name == "moe_ep" else (S0, DASH)  # EP splits the batch like DP
        assert _root_inputs(model, make(mesh, config), mesh) == {k: ("redist", split) for k in batch}
        assert _root_inputs(model, make(mesh, config, local_inputs=True), mesh) == {k: ("annotate", split) for k in batch}
        if name == "llama":  # HF's LLaMA takes an attention mask (the zoo's does not: a plan error names its arguments)
            model = tiny_hf_llama()
            chosen = make(mesh, model.config, local_inputs=["input_ids", "labels", "attention_mask"])
            assert _root_inputs(model, chosen, mesh) == {k: ("annotate", split) for k in ("input_ids", "labels", "attention_mask")}
            with pytest.raises(TypeError, match="local_inputs must be True / False or a list of the root's argument names"):
                make(mesh, config, local_inputs=[1])


def _train(model, batches, loss_of) -> dict:
    """Two AdamW steps of ``loss_of(model, batch)``: losses, first gradients, final parameters (global
    values) and the first dimension of the root's first input at each call."""
    out = {"losses": [], "shapes": []}
    model.register_forward_pre_hook(lambda m, a, kw: out["shapes"].append((a or list(kw.values()))[0].shape[0]), with_kwargs=True, prepend=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        out.setdefault("grads", {n: global_value(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        out["losses"].append(global_value(loss))
    out["params"] = {n: global_value(p) for n, p in model.named_parameters()}
    return out


def _dit_steps(local: bool, mesh) -> dict:
    torch.manual_seed(0)
    model = tiny_dit()
    vescale.parallelize(model, dit_plan(mesh, model.config, local_inputs=local), mesh)
    g, k = torch.Generator().manual_seed(1), mesh.get_coordinate()[0]
    batches = [(torch.randn(4, 4, 8, 8, generator=g), torch.randint(0, 1000, (4,), generator=g),
                torch.randint(0, 10, (4,), generator=g), torch.randn(4, 4, 8, 8, generator=g)) for _ in range(2)]
    if local:  # this rank's rows, as vescale.data would load them
        batches = [tuple(v[2 * k: 2 * k + 2] for v in batch) for batch in batches]

    def loss_of(model, batch):
        x, t, c, target = batch
        sample = model(x, timestep=t, class_labels=c).sample
        if local:  # the target, outside the model, is this rank's share too
            target = vescale.data.as_global(target, mesh)
        return ((sample - target) ** 2).mean()

    return _train(model, batches, loss_of)


def _moe_steps(local: bool, mesh) -> dict:
    """Mixtral under moe_plan on a 1-D mesh: DP (batch-local MoE blocks) or EP (experts split, the
    batch split over EP too)."""
    torch.manual_seed(0)
    model = tiny_hf_mixtral()
    vescale.parallelize(model, moe_plan(mesh, model.config, local_inputs=local), mesh)
    k = vescale.data.data_shard(mesh, mesh.mesh_dim_names[0])[0]
    batches = synthetic_batches(2, 4, 8, 128, seed=1)
    if local:
        batches = [(ids[2 * k: 2 * k + 2], labels[2 * k: 2 * k + 2]) for ids, labels in batches]
    return _train(model, batches, lambda model, b: model(input_ids=b[0], labels=b[1]).loss)


def _both():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dp, ep = vescale.init_mesh((2,), ("DP",)), vescale.init_mesh((2,), ("EP",))
    cases = (("dit", _dit_steps, dp), ("moe DP", _moe_steps, dp), ("moe EP", _moe_steps, ep))
    return {name: (steps(False, mesh), steps(True, mesh)) for name, steps, mesh in cases}


@pytest.mark.multiproc
def test_dit_and_moe_dp_ep_shares_train_bit_for_bit_like_the_global_batch():
    for out in run_on_ranks(_both, 2, timeout=600):
        for name, (whole, share) in out.items():
            assert whole["shapes"] == [4, 4] and share["shapes"] == [2, 2], (name, whole["shapes"], share["shapes"])
            assert all(torch.equal(a, b) for a, b in zip(whole["losses"], share["losses"])), (name, whole["losses"], share["losses"])
            for what in ("grads", "params"):
                bad = [n for n in whole[what] if not torch.equal(whole[what][n], share[what][n])]
                assert not bad, f"{name}: {what} differ: {bad[:3]}"
