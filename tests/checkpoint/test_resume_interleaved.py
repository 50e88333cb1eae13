"""Checkpoints of models with InterleavedShard parameters, optimiser state included.

HF GPT-2's fused ``c_attn`` is ``InterleavedShard`` under the zoo plan, and so is AdamW's state for
it; DCP cannot describe an interleaved piece ("overlapping chunks"), so ``vescale.checkpoint``
saves such tensors laid out as ``Shard`` and lays the loaded state out like its parameter again.
On 2 gloo ranks (TP=2): train 2 steps, save, load into a fresh model and optimiser, train 2 more;
the losses must equal an uninterrupted 4-step run bit for bit (same mesh, same ops, dropout drawn
by the restored RNG), and the loaded state must be laid out like its parameter (vescale steps
elementwise optimisers on local shards, which needs that).
"""

from __future__ import annotations

import pytest
import torch

import vescale
from vescale.placement import is_interleaved
from vescale.testing import run_on_ranks, train_losses
from vescale.zoo import gpt2_plan, synthetic_batches, tiny_hf_gpt2


def _resume(folder: str):
    mesh = vescale.init_mesh((2,), ("TP",))
    batches = list(synthetic_batches(4, 4, 16, 128, seed=1))

    def build():
        vescale.manual_seed(0)
        model = tiny_hf_gpt2()
        vescale.parallelize(model, gpt2_plan(mesh, model.config), mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = build()
    straight = train_losses(model, batches, opt)
    model, opt = build()
    first = train_losses(model, batches[:2], opt)
    vescale.checkpoint.save(folder, model, opt, step=2)
    model, opt = build()
    vescale.manual_seed(123)  # the RNG must come back from the checkpoint
    vescale.checkpoint.load(folder, model, opt)
    c_attn = model.transformer.h[0].attn.c_attn.weight
    layouts = [tuple(v.placements) == tuple(c_attn.placements) for v in opt.state[c_attn].values() if v.ndim]
    return straight, first + train_losses(model, batches[2:], opt), is_interleaved(c_attn.placements[-1]), layouts


@pytest.mark.multiproc
def test_interleaved_parameters_and_their_optimizer_state_resume_bit_identically(tmp_path):
    straight, resumed, interleaved, layouts = run_on_ranks(_resume, 2, str(tmp_path))[0]
    assert interleaved, "c_attn should be InterleavedShard under the zoo plan"
    assert layouts and all(layouts), "loaded AdamW state must be laid out like its parameter"
    assert resumed == straight, (resumed, straight)
