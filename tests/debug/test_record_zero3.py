"""record() saves every gradient also when vescale.comm writes it: under ZeRO-3 the unit gathers and
gradient buckets put reduced gradients into ``param.grad`` in their own end-of-backward callback,
not through autograd's accumulation, so hooks on accumulation alone would record none of them."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import vescale
import vescale.debug
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama


def _record_zero3(directory: str):
    mesh = vescale.init_mesh((2,), ("DP",))
    torch.manual_seed(0)
    model = tiny_llama()
    vescale.parallelize(model, llama_plan(mesh, model.config, zero3=True), mesh)
    with vescale.debug.record(model, directory, steps=1):
        for input_ids, labels in synthetic_batches(1, 4, 16, 128, seed=1):
            model(input_ids=input_ids, labels=labels).loss.backward()
    return sorted(n for n, p in model.named_parameters() if p.grad is not None) if dist.get_rank() == 0 else None


@pytest.mark.multiproc
def test_zero3_gradients_are_recorded(tmp_path):
    directory = os.path.join(tmp_path, "zero3")
    with_grad = run_on_ranks(_record_zero3, 2, directory)[0]
    index = json.load(open(os.path.join(directory, "index.json")))
    recorded = sorted(e["key"].removeprefix("grad:") for e in index["entries"] if e["kind"] == "grad")
    assert with_grad and recorded == with_grad
