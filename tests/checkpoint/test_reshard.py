"""A checkpoint saved on one mesh and plan loads on another, and on a plain single-device model.

Saved on DP=2 x TP=2 with sequence parallelism and ZeRO-3 at step 3; loaded on TP=2 (2 ranks) and
on one device (a plain model, dropout drawn from vescale's generator under ``consistent()``), then
trained to step 6. Losses must match the uninterrupted DP=2 x TP=2 run within 1e-5: the plans run
the same maths but sum in another order inside collectives and sharded matmuls (fp32 ulps), so bit
equality is not expected. Also: the offline ``export`` and the live ``consolidated_state_dict`` give
the same plain weights, and the loaded TP=2 shards have TP=2 local shapes.
"""

from __future__ import annotations

import pytest
import torch

from vescale import checkpoint
from vescale.testing import run_on_ranks

from ckpt_common import SAVE_AT, STEPS, build, local_shape, train

TOL = 1e-5
Q = "model.layers.0.self_attn.q_proj.weight"


def _save_dp_tp(root: str) -> dict:
    model, opt = build((2, 2), ("DP", "TP"), zero3=True)
    train(model, opt, 0, SAVE_AT)
    checkpoint.save(root, model, opt, step=SAVE_AT)
    weights = checkpoint.consolidated_state_dict(model)
    return {"rest": train(model, opt, SAVE_AT, STEPS), "weights": weights, "q_local": local_shape(model, Q)}


def _load_tp(root: str) -> dict:
    model, opt = build((2,), ("TP",), seed=7)
    step = checkpoint.load(root, model, opt)["step"]
    return {"rest": train(model, opt, step, STEPS), "q_local": local_shape(model, Q)}


@pytest.mark.multiproc
def test_dp2_tp2_zero3_checkpoint_loads_on_tp2_and_single_device(tmp_path):
    root = str(tmp_path)
    saved = run_on_ranks(_save_dp_tp, 4, root, timeout=300)
    ref = saved[0]["rest"]
    assert saved[0]["q_local"] == (16, 64)  # sharded over DP (ZeRO-3) and TP when saved

    tp = run_on_ranks(_load_tp, 2, root, timeout=240)
    for r in tp:
        assert r["q_local"] == (32, 64)
        assert max(abs(a - b) for a, b in zip(r["rest"], ref)) <= TOL, (r["rest"], ref)

    model, opt = build(seed=7)  # plain single-device model
    step = checkpoint.load(root, model, opt)["step"]
    loaded = {n: t.clone() for n, t in model.state_dict().items()}
    single = train(model, opt, step, STEPS, consistent=True)
    assert max(abs(a - b) for a, b in zip(single, ref)) <= TOL, (single, ref)

    # Offline export reads the same chunks as the single-device load: bit-equal.
    exported = checkpoint.export(root, tmp_path / "weights.pt")
    reread = torch.load(tmp_path / "weights.pt")
    assert set(exported) == set(loaded) == set(saved[0]["weights"])
    for name, value in loaded.items():
        assert type(exported[name]) is torch.Tensor and torch.equal(exported[name], value), name
        assert torch.equal(reread[name], value), name
    # The live gather (rank 0's view) matches within 1e-6, not bit for bit: on DP x TP + SP +
    # ZeRO-3 the TP replicas of a norm weight drift apart by an ulp (seen: 1.2e-7 on
    # layers.1.post_attention_layernorm), and DCP writes one replica while rank 0 gathers its own.
    for name, value in saved[0]["weights"].items():
        assert torch.allclose(exported[name], value, rtol=0, atol=1e-6), name
