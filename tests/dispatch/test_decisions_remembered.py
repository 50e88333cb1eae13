"""``decisions_remembered``: asking whether an op that just ran was local costs no second propagation.

Static Eager's recording asks, after each DTensor op of the step, whether DTensor's rule ran it on
the local shards (``why_rule_not_local``). DTensor's C++ cache and the Python propagator's LRU are
separate, so without the remembered decisions the question searched the op's strategies a second
time on every first-seen op (about half of a recording step's CPU time on DP=2 x TP=4). Checked on a
fake (DP=2, TP=2) mesh: inside the context the answers equal those outside it (a local op and one
that redistributes), and the propagator is not asked for an op that ran; outside, it is.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from vescale.dispatch.local import decisions_remembered, why_rule_not_local
from vescale.testing import forget_dtensor_caches

aten = torch.ops.aten



def _dt(mesh, shape, placements, seed):
    return distribute_tensor(torch.randn(shape, generator=torch.Generator().manual_seed(seed)), mesh, placements)


CASES = {  # name: (a placements, b placements, whether DTensor's rule runs mm locally)
    "row-parallel (local)": ((Shard(0), Replicate()), (Replicate(), Replicate()), True),
    "inner dims split on different mesh dims (redistributes)": ((Replicate(), Shard(1)), (Shard(0), Replicate()), False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_remembered_decision_answers_without_propagating(mesh, monkeypatch, case):
    a_placements, b_placements, local = CASES[case]
    prop = DTensor._op_dispatcher.sharding_propagator
    asked = []
    real = prop.propagate_op_sharding

    def counted(schema):
        asked.append(schema)
        return real(schema)

    counted.cache_clear = real.cache_clear  # forget_dtensor_caches clears it
    monkeypatch.setattr(prop, "propagate_op_sharding", counted)
    answers = {}
    for remembered in (False, True):
        forget_dtensor_caches()  # both runs start cold: the op is first-seen each time
        a, b = _dt(mesh, (8, 16), a_placements, 1), _dt(mesh, (16, 8), b_placements, 2)
        asked.clear()
        if remembered:
            with decisions_remembered():
                torch.mm(a, b)
                answers[remembered] = why_rule_not_local(aten.mm.default, (a, b), {})
        else:
            torch.mm(a, b)
            answers[remembered] = why_rule_not_local(aten.mm.default, (a, b), {})
        assert len(asked) == (0 if remembered else 1), (case, remembered, len(asked))
    assert answers[False] == answers[True], answers
    assert (answers[True] is None) == local, answers
