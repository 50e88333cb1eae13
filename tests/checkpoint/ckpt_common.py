"""Shared pieces of the checkpoint tests: a tiny LLaMA with dropout on, trained on fixed batches."""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor

import vescale
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

STEPS, SAVE_AT, LR, SEED = 6, 3, 1e-3, 1234
BATCHES = synthetic_batches(STEPS, 4, 16, 128, seed=1)


def build(shape=None, names=None, sp=True, zero3=False, mode="eager", seed=0):
    """Model and AdamW optimiser; ``shape=None``: a plain single-device model. ``seed`` sets the
    initial weights and the RNG state (a resumed run uses another seed to show load overwrites both)."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    model = tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)
    vescale.manual_seed(SEED + seed)
    if shape is not None:
        mesh = vescale.init_mesh(shape, names)
        vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=sp, zero3=zero3), mesh, mode=mode)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def train(model, opt, start: int, stop: int, consistent: bool = False) -> list[float]:
    """Steps ``start``..``stop-1``; the loss of each. ``consistent``: a plain model draws its dropout
    from vescale's generator (the numbers the parallel model draws)."""
    losses = []
    for input_ids, labels in BATCHES[start:stop]:
        if consistent:
            with vescale.random.consistent():
                loss = model(input_ids=input_ids, labels=labels).loss
        else:
            loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return losses


def local_shape(model, name: str) -> tuple:
    p = dict(model.named_parameters())[name]
    return tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
