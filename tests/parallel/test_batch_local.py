"""``plan.batch_local``: a module computes on its DP rank's share of the batch (vescale/parallel/batch_local.py).

Single-device equivalence of the MoE model under ``moe_plan`` (which states it for the MoE blocks)
is tested in tests/zoo/test_moe_parallel.py (eager) and tests/static/test_static_moe.py (static);
here, on 2 gloo ranks (DP=2), what the statement changes and how it refuses what it cannot do:

* the MoE block's forward issues no collective at all (its input is not gathered over DP), where
  the same plan without the statement all-gathers the tokens (so the count can fail);
* its inputs are this rank's tokens, its parameters plain tensors (no mesh dim left), and the
  gradients match the single device;
* a random op inside (Mixtral's router jitter) is an error naming the module and the fix, and so
  are a statement matching no module, a mesh dim that does not exist, a module both batch-local and
  expert-parallel, an activation statement for a module inside it, a parameter still sharded on DP
  while it runs, and ``moe_plan`` for a model that
  computes HF's load-balancing loss (``output_router_logits=True``) from DP-local router logits.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.tensor import Shard

import vescale
from vescale.debug import CollectiveCounter
from vescale.plan import INIT, RUN
from vescale.testing import error_of, run_on_ranks
from vescale.zoo import moe_plan, synthetic_batches, tiny_hf_mixtral

MLP = "model.layers.0.mlp"
BATCH, SEQ = 4, 8


def _block_collectives(drop_statement: bool) -> tuple[dict, list, float]:
    """Collectives issued by one MoE block's forward (hooks around its body), the shapes of the
    tokens it gets, and the largest gradient difference from the single device after one step."""
    torch.manual_seed(0)
    single = tiny_hf_mixtral()
    input_ids, labels = next(iter(synthetic_batches(1, BATCH, SEQ, 128, seed=1)))
    single(input_ids=input_ids, labels=labels).loss.backward()
    mesh = vescale.init_mesh((2,), ("DP",))
    torch.manual_seed(0)
    model = tiny_hf_mixtral()
    plan = moe_plan(mesh, model.config)
    if drop_statement:
        plan.statements = [s for s in plan.statements if s.kind != "batch_local"]
    vescale.parallelize(model, plan, mesh)
    block = model.get_submodule(MLP)
    counter, seen = CollectiveCounter(), []

    def count_from_here(mod, args):
        seen.append((type(args[0]).__name__, tuple(args[0].shape)))
        counter.__enter__()

    block.register_forward_pre_hook(count_from_here)
    block.register_forward_hook(lambda m, a, o: counter.__exit__(None, None, None))
    model(input_ids=input_ids, labels=labels).loss.backward()
    grads = {n: p.grad for n, p in single.named_parameters()}
    diff = max((p.grad.full_tensor() - grads[n]).abs().max().item() for n, p in model.named_parameters())
    return dict(counter.counts), seen, diff


def _errors() -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2,), ("DP",))
    input_ids, labels = next(iter(synthetic_batches(1, BATCH, SEQ, 128, seed=1)))

    def train_one(plan_fn, model_args=None):
        torch.manual_seed(0)
        model = tiny_hf_mixtral(**(model_args or {}))
        vescale.parallelize(model, plan_fn(model), mesh)
        model(input_ids=input_ids, labels=labels).loss.backward()

    def jitter(model):
        return moe_plan(mesh, model.config)

    def no_match(model):
        return moe_plan(mesh, model.config).batch_local(r"model\.layers\.\d+\.moe")

    def no_dim(model):
        return moe_plan(mesh, model.config).batch_local(r"model\.norm", mesh="CP")

    def with_experts(model):
        plan = moe_plan(mesh, model.config)
        plan.statements = [s for s in plan.statements if s.kind != "experts"]
        return plan.experts(rf"{MLP}\.experts", mesh="DP")

    def inner_activation(model):
        return moe_plan(mesh, model.config).shard(rf"{MLP}\.gate\.<in>", Shard(0), mesh="DP")

    def sharded_param(model):
        plan = moe_plan(mesh, model.config)
        return plan.shard(rf"{MLP}\.gate\.weight", Shard(0), mesh="DP", phase=INIT).shard(
            rf"{MLP}\.gate\.weight", Shard(0), mesh="DP", phase=RUN)

    return {
        "jitter": error_of(train_one, jitter, {"router_jitter_noise": 0.1}),
        "no_match": error_of(train_one, no_match),
        "no_dim": error_of(train_one, no_dim),
        "with_experts": error_of(train_one, with_experts),
        "sharded_param": error_of(train_one, sharded_param),
        "inner_activation": error_of(train_one, inner_activation),
        "router_logits": error_of(lambda: moe_plan(mesh, tiny_hf_mixtral(output_router_logits=True).config)),
    }


@pytest.mark.multiproc
def test_moe_block_runs_on_the_dp_ranks_tokens_without_collectives():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    (counts, seen, diff), = run_on_ranks(_block_collectives, 2, False)[:1]
    assert counts == {}, f"the batch-local MoE block issued collectives: {counts}"
    assert seen == [("Tensor", (BATCH // 2, SEQ, 32))], seen  # this rank's 2 sequences, as a plain tensor
    assert diff <= 1e-5, f"gradients differ from the single device by {diff:.3g}"
    (counts, seen, diff), = run_on_ranks(_block_collectives, 2, True)[:1]
    assert counts.get("all_gather", 0) >= 1, f"without plan.batch_local the block should gather the tokens: {counts}"
    assert seen == [("DTensor", (BATCH, SEQ, 32))], seen
    assert diff <= 1e-5, f"gradients differ from the single device by {diff:.3g}"


@pytest.mark.multiproc
def test_batch_local_errors_name_the_module_and_the_fix():
    e = run_on_ranks(_errors, 2)[0]
    assert MLP in e["jitter"] and "random" in e["jitter"] and "router_jitter_noise=0" in e["jitter"], e["jitter"]
    assert "plan.batch_local" in e["no_match"] and "matches no module" in e["no_match"], e["no_match"]
    assert "'CP' does not exist" in e["no_dim"], e["no_dim"]
    assert "both batch-local and expert-parallel" in e["with_experts"], e["with_experts"]
    assert f"{MLP}.gate.weight" in e["sharded_param"] and "phase=RUN" in e["sharded_param"], e["sharded_param"]
    assert "output_router_logits=False" in e["router_logits"], e["router_logits"]
    assert f"module '{MLP}.gate' lies inside the batch-local '{MLP}'" in e["inner_activation"], e["inner_activation"]
