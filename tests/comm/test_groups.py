"""Process groups are made per mesh, never per tensor: ``parallelize`` makes the flattened groups of
its mesh once (``vescale.comm.groups.prepare_groups``), and training steps make none, whatever the
number of parameters. One process as one rank of a fake 16-rank world (no gloo)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

import vescale
from vescale.testing import fake_world, forget_dtensor_caches
from vescale.zoo import llama_plan, tiny_llama

NAMES = ("DPR", "DPS", "TP")


def _counts(layers: int) -> dict:
    """new_group calls and groups this rank joined, while parallelizing and in a training step."""
    c10d = dist.distributed_c10d
    with fake_world(16, rank=5):
        mesh = vescale.init_mesh((2, 2, 4), NAMES)
        torch.manual_seed(0)
        model = tiny_llama(num_hidden_layers=layers)
        plan = llama_plan(mesh, model.config, dp="DPS", zero3=True)
        before = c10d._world.group_count, len(c10d._world.pg_map)
        vescale.parallelize(model, plan, mesh)
        made = c10d._world.group_count - before[0], len(c10d._world.pg_map) - before[1]
        ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
        steps = c10d._world.group_count - before[0] - made[0]
        params = sum(1 for _ in model.parameters())
    forget_dtensor_caches()  # entries made as rank 5 of a fake world
    return {"made": made, "steps": steps, "params": params}


def test_process_groups_are_per_mesh_not_per_parameter():
    one, four = _counts(1), _counts(4)
    assert four["params"] > 2 * one["params"]
    assert one["made"] == four["made"] and one["steps"] == four["steps"] == 0
    # One flattened sub-mesh per set of two or more mesh dims; this rank joins one group of each
    # (the whole mesh's is the default group).
    combos = [c for n in range(2, len(NAMES) + 1) for c in itertools.combinations(range(len(NAMES)), n)]
    sizes = {(0, 1): 4, (0, 2): 8, (1, 2): 8, (0, 1, 2): 16}
    assert one["made"] == (sum(16 // sizes[c] for c in combos if sizes[c] < 16), len(combos) - 1)
