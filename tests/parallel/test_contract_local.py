"""The data contract with per-rank batches (``plan.annotate`` of root inputs, ``local_inputs=True``).

On 4 gloo ranks (DP=2 x TP=2, zoo LLaMA), each mistake is a ``DataContractError`` naming the input,
the ranks and the fix, raised on every rank (none left waiting in a collective):

* TP peers given different rows (a loader keyed by the global rank, not the DP coordinate);
* the global batch passed on every rank in the per-rank mode (every DP rank the same rows);
* uneven shares (one DP rank 2 rows, the other 3);
* a per-rank input the plan does not annotate (an attention mask), which differs across ranks:
  the message says to annotate it.

Cost: correct per-rank inputs are checked with 1 + (mesh dims of size > 1) all-reduces on the
first calls and on shape changes, none on steady calls — on a fake 1,024-rank world (DP=128 x
TP=8) exactly as many as on 8 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

import vescale
from vescale.debug import CollectiveCounter
from vescale.parallel.contract import FIRST_STEPS, DataContractError, InputContract
from vescale.plan.lower import forward_arg_names
from vescale.testing import fake_world, run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

ROWS, SEQ = 4, 8  # global batch rows


def _model(**kw):
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    torch.manual_seed(0)
    model = tiny_llama()
    vescale.manual_seed(0)
    return mesh, vescale.parallelize(model, llama_plan(mesh, model.config, local_inputs=True), mesh, **kw)


def _error(model, **inputs) -> str:
    try:
        model(**inputs)
    except DataContractError as e:
        return str(e)
    return "no error"


def _mistakes() -> dict:
    mesh, model = _model(check_inputs="always")
    dp = mesh.get_coordinate()[0]
    ids, _ = synthetic_batches(1, ROWS, SEQ, 128, seed=1)[0]
    share = ids[dp * 2: dp * 2 + 2]
    out = {}
    mine = synthetic_batches(1, 2, SEQ, 128, seed=10 + dist.get_rank())[0][0]  # keyed by the global rank
    out["peers"] = _error(model, input_ids=mine, labels=mine)
    out["global"] = _error(model, input_ids=ids, labels=ids)
    uneven = ids[:2] if dp == 0 else ids[1:]
    out["uneven"] = _error(model, input_ids=uneven, labels=uneven)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[:, : dp + 1] = 0  # left padding that differs between the DP ranks
    out["mask"] = _error(model, input_ids=share, labels=share, attention_mask=mask)
    out["right"] = _error(model, input_ids=share, labels=share)
    return out


@pytest.mark.multiproc
def test_per_rank_mistakes_are_named_on_every_rank():
    for out in run_on_ranks(_mistakes, 4, timeout=300):
        peers = out["peers"]
        assert "root input 'input_ids' is this rank's share (annotated S(0) on 'DP')" in peers, peers
        assert "'TP' peers ranks [0] vs ranks [1] hold different values" in peers, peers
        assert "not the global rank" in peers and "vescale.data.GlobalBatchSampler" in peers
        dup = out["global"]
        assert dup.startswith("every rank along mesh dim(s) ['DP'] passed the same ['input_ids', 'labels']"), dup
        assert "copies of one batch" in dup and "plan.shard instead of plan.annotate" in dup and "check_inputs='off'" in dup
        uneven = out["uneven"]
        assert "root input 'input_ids' is this rank's share" in uneven, uneven
        assert "ranks [0, 1]: shape (2, 8), torch.int64; ranks [2, 3]: shape (3, 8), torch.int64" in uneven, uneven
        assert "drop_last=True" in uneven
        mask = out["mask"]
        assert "root input 'attention_mask' differs across ranks (ranks [0, 1] vs ranks [2, 3]" in mask, mask
        assert ("annotate it like them (plan.annotate('<in>[attention_mask]', Shard(0), mesh='DP'); "
                "zoo plans: local_inputs=['input_ids', 'labels', 'attention_mask'])") in mask, mask
        for msg in (peers, dup, uneven, mask):  # every message says how to choose between the modes
            assert "Global batch (plan.shard(" in msg and "Per-rank share (plan.annotate(" in msg, msg
        assert out["right"] == "no error", out["right"]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 4)

    def forward(self, input_ids, labels=None):
        return self.emb(input_ids).sum()


def _collectives_per_call(world: int, shape: tuple) -> list[int]:
    """All-reduces of the contract per call (fake process group, this process as rank 5): calls
    1-2 checked, 3-4 steady, 5 a new local shape."""
    with fake_world(world, 5):
        mesh = vescale.init_mesh(shape, ("DP", "TP"))
        plan = vescale.VescalePlan().annotate(r"<in>[(input_ids|labels)]", Shard(0), mesh="DP")
        root = [e for e in vescale.explain(_Net(), plan, mesh).hooks()[("", "forward_pre")] if e.tensor == "<in>"]
        contract = InputContract(root, forward_arg_names(_Net())[0], mesh)
        counts = []
        for rows in (2, 2, 2, 2, 1):
            ids = torch.zeros(rows, 8, dtype=torch.long)
            with CollectiveCounter() as counter:
                contract((), {"input_ids": ids, "labels": ids})
            counts.append(counter.counts["all_reduce"])
            assert counter.total == counts[-1]  # all-reduces only
        return counts


def test_checks_cost_a_fixed_number_of_collectives_at_any_world_size():
    assert FIRST_STEPS == 2
    small, large = _collectives_per_call(8, (2, 4)), _collectives_per_call(1024, (128, 8))
    assert small == large == [3, 3, 0, 0, 3]  # the world's all-reduce + one per mesh dim (DP, TP)
