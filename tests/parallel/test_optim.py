"""Stock optimisers and gradient clipping work on parallelised parameters with no wrapper.

On a DP=2 x TP=2 mesh with ZeRO-3 (parameters of mixed placements: Shard on DP at rest, Shard or
Replicate on TP), `clip_grad_norm_` must return the single-device total norm and SGD / AdamW must
produce the single-device parameters. Tolerance 1e-5 (fp32 reduction order; the norm is a sum of
squares over differently split shards). Each rank also checks its split after training
(``split_checks.check_llama_split``).
"""

from __future__ import annotations

import logging

import pytest
import torch

import vescale
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

from split_checks import check_llama_split, probe_batch

TOL = 1e-5
OPTIMIZERS = {"SGD": torch.optim.SGD, "AdamW": torch.optim.AdamW}


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _train(model, opt_name):
    opt = OPTIMIZERS[opt_name](model.parameters(), lr=1e-3)
    norms = []
    for input_ids, labels in synthetic_batches(3, 4, 16, 128, seed=1):
        model(input_ids=input_ids, labels=labels).loss.backward()
        norms.append(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)).item())
        opt.step()
        opt.zero_grad()
    return norms, {n: _full(p) for n, p in model.named_parameters()}


def _distributed(opt_name):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    torch.manual_seed(0)
    model = tiny_llama()
    vescale.parallelize(model, llama_plan(mesh, model.config, zero3=True), mesh)
    result = _train(model, opt_name)
    check_llama_split(model, probe_batch(), tp=2, dp=2, sequence_parallel=True, zero3=True, label="DP=2xTP=2+SP+ZeRO-3")
    return result


@pytest.mark.multiproc
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_optimizer_and_clipping_match_single_device(opt_name):
    norms, params = run_on_ranks(_distributed, 4, opt_name)[0]
    torch.manual_seed(0)
    ref_norms, ref_params = _train(tiny_llama(), opt_name)
    assert all(n > 0.5 for n in ref_norms), "clipping must be active for the test to mean something"
    for a, b in zip(norms, ref_norms):
        assert abs(a - b) <= TOL * b, (norms, ref_norms)
    for name, value in ref_params.items():
        diff = (params[name] - value).abs().max().item()
        assert diff <= TOL, f"{opt_name}: {name} differs by {diff:.3g}"
