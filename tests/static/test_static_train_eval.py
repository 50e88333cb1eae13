"""A Static Eager record serves only steps in the training mode it was made in.

A forward with gradients in evaluation mode (a probe or saliency pass: dropout off, nothing drawn)
records no random op. Served from that record, a later training step would run its dropouts on
the local shards with nothing replaying them as the single-device draws (each rank drawing as if
its shard were the whole tensor): the losses were ~1e-2 off. The modules' training flags are part
of the record's key, so the training step records again and stays consistent.

Checked on TP=2 (zoo LLaMA, dropout 0.1 on the residual branches): three evaluation steps with
gradients, then three training steps, losses within 1e-6 of one device (fp32; the row-parallel
sums add in another order), and the runtime kept one record per mode; afterwards each rank checks
its split (``split_checks.check_llama_split``).
"""

from __future__ import annotations

import logging

import pytest
import torch

import vescale
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

from split_checks import check_llama_split, probe_batch

TOL = 1e-6


def _run(parallel: bool):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    vescale.manual_seed(0)
    torch.manual_seed(0)
    model = tiny_llama(hidden_dropout=0.1)
    if parallel:
        mesh = vescale.init_mesh((2,), ("TP",))
        vescale.parallelize(model, llama_plan(mesh, model.config), mesh, mode="static")
    input_ids, labels = synthetic_batches(1, 4, 16, 128, seed=1)[0]
    losses = []
    for training in (False, False, False, True, True, True):
        model.train(training)
        vescale.manual_seed(100 + len(losses))
        with vescale.random.consistent():
            loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        model.zero_grad()
        losses.append(loss.item())
    records = len(vescale.static.static_runtime(model).records) if parallel else 0
    if parallel:
        check_llama_split(model, probe_batch(), tp=2, sequence_parallel=True, label="static TP=2+SP")
    return losses, records


@pytest.mark.multiproc
def test_a_record_made_in_evaluation_does_not_serve_training():
    want, _ = _run(False)
    assert want[3] != want[4], "dropout must draw in training for the check to mean something"
    got, records = run_on_ranks(_run, 2, True)[0]
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= TOL, f"step {step} ({'train' if step >= 3 else 'eval'}): loss {a} vs one device {b}"
    assert records == 2, f"{records} records: one per training mode expected"
