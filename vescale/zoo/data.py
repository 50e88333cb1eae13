"""Deterministic synthetic token batches for training demos and end-to-end tests.

Every rank calls ``synthetic_batches`` with the same arguments and gets the same global batches
(a private CPU ``torch.Generator`` is used, so the global RNG state is neither read nor changed);
the parallel runtime, not the data, decides which part of a batch each rank sees.
"""

from __future__ import annotations

import torch

__all__ = ["synthetic_batches"]

MAX_STRIDE = 8


def synthetic_batches(
    num_steps: int, batch_size: int, seq_len: int, vocab_size: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_steps`` global batches of (input_ids, labels), each of shape (batch_size, seq_len), int64.

    Each sequence counts modulo ``vocab_size`` from a random start with a random stride in
    [1, MAX_STRIDE): learnable from context, so a few optimiser steps visibly lower the loss.
    ``labels`` equals ``input_ids``; the model shifts them (as HF causal LMs do).
    """
    for name, value in dict(num_steps=num_steps, batch_size=batch_size, seq_len=seq_len).items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"synthetic_batches: {name} must be a positive int, got {value!r}")
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"synthetic_batches: vocab_size must be an int >= 2, got {vocab_size!r}")

    generator = torch.Generator(device="cpu").manual_seed(seed)
    positions = torch.arange(seq_len)
    batches = []
    for _ in range(num_steps):
        start = torch.randint(0, vocab_size, (batch_size, 1), generator=generator)
        stride = torch.randint(1, MAX_STRIDE, (batch_size, 1), generator=generator)
        input_ids = (start + stride * positions) % vocab_size
        batches.append((input_ids, input_ids.clone()))
    return batches
