"""ZeRO-3 under tensor parallelism communicates over DP only, as FSDP2 does.

On a DP x TP mesh the at-rest shard of a TP-sharded weight is a piece of the rank's own TP shard
(``vescale.placement.nested``), so the RUN gathers and the gradient reduce-scatters of the zoo
LLaMA run over the DP group alone and move the RUN (TP) shard, 1/TP of a TP-sharded weight, not the
whole weight over all DP x TP ranks.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

import vescale
from vescale.comm import direct
from vescale.placement import InterleavedShard, blockwise, nest_zero_shards
from vescale.testing import run_on_ranks, train_losses
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

R = Replicate()


def test_zero_shard_nests_inside_tp_shard_where_it_divides():
    col = nest_zero_shards((Shard(0), Shard(0)), (R, Shard(0)), (64, 32), (2, 4))
    assert col == (InterleavedShard(0, 4), Shard(0))
    assert blockwise((64, 32), (2, 4), col)
    # Row-wise weights and norms already shard another dim on TP (or none): unchanged.
    assert nest_zero_shards((Shard(0), Shard(1)), (R, Shard(1)), (64, 32), (2, 4)) == (Shard(0), Shard(1))
    assert nest_zero_shards((Shard(0), R), (R, R), (64,), (2, 4)) == (Shard(0), R)
    # 12 rows do not split into 2 x 4 even blocks: PyTorch cannot distribute it, keep (S, S).
    assert nest_zero_shards((Shard(0), Shard(0)), (R, Shard(0)), (12, 32), (2, 4)) == (Shard(0), Shard(0))
    # TP before DP in mesh order already nests; fused q|k|v sections are not blocks.
    assert nest_zero_shards((Shard(0), Shard(0)), (Shard(0), R), (64, 32), (4, 2)) == (Shard(0), Shard(0))
    assert not blockwise((12, 4), (2,), (InterleavedShard(0, 3),))


def _spy_step(bucket_mb, vocab: int = 128):
    """Two training steps of the zoo LLaMA (TP + SP + ZeRO-3) on DP=2 x TP=2; every gather and
    reduce-scatter vescale.comm issues for ZeRO-3 and the gradients in the second step: (kind, group
    ranks, bytes moved). The activations' moves (sequence parallelism, over TP; vescale.comm.moves)
    call the same functions and are left out."""
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    torch.manual_seed(0)
    # check_inputs="off": no input checksums (all-reduces of their own) among the collectives counted.
    model = vescale.parallelize(tiny_llama(vocab_size=vocab), llama_plan(mesh, zero3=True), mesh, bucket_mb=bucket_mb,
                                check_inputs="off")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    input_ids, labels = synthetic_batches(1, 4, 16, vocab, seed=1)[0]
    seen = []
    real_ag, real_rs, real_ar = direct.all_gather, direct.reduce_scatter, direct.all_reduce

    def ours(kind, group, nbytes):
        if sys._getframe(2).f_code.co_filename.endswith(("comm/gather.py", "comm/grad.py")):
            seen.append((kind, tuple(dist.get_process_group_ranks(group)), nbytes))

    def ag(out, inp, group, **kw):
        ours("all_gather", group, out.numel() * out.element_size())
        return real_ag(out, inp, group, **kw)

    def rs(out, inp, group, **kw):
        ours("reduce_scatter", group, inp.numel() * inp.element_size())
        return real_rs(out, inp, group, **kw)

    def ar(tensor, group, **kw):
        ours("all_reduce", group, tensor.numel() * tensor.element_size())
        return real_ar(tensor, group, **kw)

    losses = []
    for step in range(2):
        if step == 1:  # vescale.comm issues its collectives through vescale.comm.direct
            direct.all_gather, direct.reduce_scatter, direct.all_reduce = ag, rs, ar
        try:
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
        finally:
            direct.all_gather, direct.reduce_scatter, direct.all_reduce = real_ag, real_rs, real_ar
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    run_bytes = full_bytes = norm_bytes = kept_bytes = 0
    at_rest = {}
    for name, p in model.named_parameters():
        at_rest[name] = tuple(p.placements)
        nbytes = p.numel() * p.element_size()
        tp_sharded = any(isinstance(q, Shard) for q in p.placements[1:])
        full_bytes += nbytes
        run_bytes += nbytes // (2 if tp_sharded else 1)  # the RUN shard: 1/TP of a TP-sharded weight
        norm_bytes += nbytes if p.ndim == 1 else 0
        # what forward uses last stays gathered for backward: the last block, the final norm, the head
        if re.match(r"model\.layers\.1\.|model\.norm\.|lm_head\.", name):
            kept_bytes += nbytes // (2 if tp_sharded else 1)
    groups = tuple(tuple(dist.get_process_group_ranks(mesh.get_group(d))) for d in ("DP", "TP"))
    # Rank (dp, tp) holds block tp * DP + dp of dim 0: a piece of its own TP shard.
    q = dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    dp, tp = mesh.get_coordinate()
    rows = q.shape[0] // 4
    block = q.full_tensor()[(tp * 2 + dp) * rows : (tp * 2 + dp + 1) * rows]
    assert torch.equal(q.to_local(), block), (dp, tp)
    return seen, groups, (run_bytes, full_bytes, norm_bytes, kept_bytes), at_rest, losses


@pytest.mark.multiproc
def test_zero3_gathers_and_reduce_scatters_run_over_dp_only():
    for seen, (dp_group, tp_group), (run_bytes, full_bytes, norm_bytes, kept), at_rest, _ in run_on_ranks(_spy_step, 4, 25.0):
        # Column-wise weights are nested at rest; row-wise ones and norms keep Shard(0) on DP.
        assert at_rest["model.layers.0.self_attn.q_proj.weight"] == (InterleavedShard(0, 2), Shard(0))
        assert at_rest["model.embed_tokens.weight"] == (InterleavedShard(0, 2), Shard(0))
        assert at_rest["model.layers.0.self_attn.o_proj.weight"] == (Shard(0), Shard(1))
        assert at_rest["model.layers.0.input_layernorm.weight"] == (Shard(0), R)
        by_kind = {k: [(g, b) for kind, g, b in seen if kind == k] for k in ("all_gather", "reduce_scatter", "all_reduce")}
        # Every gather and reduce-scatter is over this rank's DP group (2 ranks), none over
        # DP x TP (4), and each moves RUN shards only: per pass (forward, backward's refills but for
        # what forward kept, the gradients) the bytes of the TP shards (half a TP-sharded weight at
        # TP=2), not whole weights.
        assert {g for g, _ in by_kind["all_gather"] + by_kind["reduce_scatter"]} == {dp_group}, seen
        assert 0 < kept < run_bytes < full_bytes, (kept, run_bytes, full_bytes)
        assert sum(b for _, b in by_kind["all_gather"]) == 2 * run_bytes - kept, (seen, run_bytes)
        assert sum(b for _, b in by_kind["reduce_scatter"]) == run_bytes, (seen, run_bytes)
        # The norms' gradients are Partial on TP too (SP splits the tokens there): after the
        # reduce-scatter over DP their shards (1/DP) are all-reduced over TP, once for all of them.
        assert by_kind["all_reduce"] == [(tp_group, norm_bytes // 2)], by_kind["all_reduce"]


def _single_device_losses(vocab: int) -> list[float]:
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=vocab)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = synthetic_batches(1, 4, 16, vocab, seed=1)[0]
    return train_losses(model, [batch, batch], opt)


@pytest.mark.multiproc
def test_zero3_tp_losses_match_single_device_and_the_per_tensor_path():
    single = _single_device_losses(128)
    for bucket_mb in (25.0, None):  # vescale.comm's collectives and DTensor's per-tensor path
        for *_, losses in run_on_ranks(_spy_step, 4, bucket_mb):
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), rtol=1e-5, atol=1e-5)


@pytest.mark.multiproc
def test_a_dim_that_does_not_split_evenly_keeps_shard_shard_and_its_own_gather():
    """130 rows do not split into DP x TP = 4 even blocks: the embedding and head keep
    ``(Shard(0), Shard(0))`` and are gathered over DP x TP, in a collective of their own; the rest
    of their unit (the final norm) is still gathered over DP alone. Losses still match one device."""
    single = _single_device_losses(130)
    for seen, (dp_group, _), _, at_rest, losses in run_on_ranks(_spy_step, 4, 25.0, 130):
        assert at_rest["model.embed_tokens.weight"] == (Shard(0), Shard(0))
        assert at_rest["model.layers.0.self_attn.q_proj.weight"] == (InterleavedShard(0, 2), Shard(0))
        groups = [g for k, g, _ in seen if k == "all_gather"]
        assert set(groups) == {dp_group, (0, 1, 2, 3)}, groups
        assert groups.count((0, 1, 2, 3)) == 2  # the rest unit, in forward and in backward
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), rtol=1e-5, atol=1e-5)
