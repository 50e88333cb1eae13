"""vescale.optim.flat in training: the zoo LLaMA on 4 gloo ranks (DP=2 x TP=2), stepped with flat
runs and per tensor side by side on every rank, bit for bit; static mode, ZeRO-3 and eager mode,
which hold the local shards in different ways (plain leaves over them, gathers from them)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from vescale.optim.local_step import step_state


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _twin_models(mode: str, zero3: bool):
    """On each gloo rank: the zoo LLaMA parallelised twice; one stepped with flat runs, the other
    per tensor (``flat_allowed`` off around its steps), interleaved on the same batches. Returns
    whether every parameter's local shard and state entry is bit-identical after each step."""
    from vescale.optim import local_step as vopt
    import vescale
    from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        vescale.manual_seed(0)
        model = tiny_llama()
        vescale.parallelize(model, llama_plan(mesh, model.config, zero3=zero3), mesh, mode=mode)
        models.append(model)
        opts.append(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    real, equal = vopt.flat_allowed, []
    for step, (input_ids, labels) in enumerate(synthetic_batches(5, 4, 16, 128, seed=1)):
        if step == 3:  # new param group dicts: the flat layout is rebuilt and the shards moved again,
            for opt in opts:  # under static mode's plain leaves made in the static steps before
                opt.load_state_dict(opt.state_dict())
        for k, (model, opt) in enumerate(zip(models, opts)):
            vopt.flat_allowed = real if k == 0 else (lambda group: False)
            try:
                model(input_ids=input_ids, labels=labels).loss.backward()
                opt.step()
                opt.zero_grad()
            finally:
                vopt.flat_allowed = real
        (a, b), (oa, ob) = (list(m.parameters()) for m in models), opts
        same = all(torch.equal(p._local_tensor, q._local_tensor) for p, q in zip(a, b))
        same = same and all(
            torch.equal(_local(oa.state[p][k]), _local(ob.state[q][k])) for p, q in zip(a, b) for k in ob.state[q]
        )
        equal.append(same)
    flat_used = bool(step_state(opts[0]).flat_layouts) and not step_state(opts[1]).flat_layouts
    homed = sum(
        1 for layout in (l for v in step_state(opts[0]).flat_layouts.values() for l in v[2])
        for i, p in enumerate(layout.params) if layout._homed(i, _local(p), layout._buf_ptr)
    )
    return equal, flat_used, homed, len(a)


@pytest.mark.multiproc
@pytest.mark.parametrize("mode,zero3", [("static", True), ("static", False), ("eager", True)])
def test_flat_steps_in_training_equal_per_tensor_steps(mode, zero3):
    """Static mode (plain leaves over the local shards), ZeRO-3 (gathers from the shards, gradients
    reduce-scattered into them) and eager mode: the flat step moves the shards into its buffer
    (at its first step, and again after ``load_state_dict`` rebuilds the layout), and training
    stays bit-identical to the per-tensor step."""
    from vescale.testing import run_on_ranks

    for equal, flat_used, homed, n in run_on_ranks(_twin_models, 4, mode, zero3):
        assert flat_used
        assert equal == [True] * 5, equal
        assert homed == n, f"{homed} of {n} local shards live in the flat buffer"
