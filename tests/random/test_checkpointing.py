"""Activation checkpointing draws the forward's random numbers again (``checkpoint_context``).

``torch.utils.checkpoint`` recomputes a region in backward after restoring PyTorch's generators;
vescale's generator is not one of them, and the recomputation runs outside a ``consistent()``
block around the forward. With ``context_fn=vescale.random.checkpoint_context``:

* one device, plain tensors under ``consistent()``: the gradient of a checkpointed dropout MLP is
  bit-for-bit the un-checkpointed one (the same masks in forward and recomputation; without the
  context it is not, which the test also asserts so the case can tell the two apart);
* a DTensor dropout recomputed without the context raises a clear error instead of drawing others;
* HF's ``LlamaForCausalLM`` with ``gradient_checkpointing_enable`` and attention dropout on TP=2,
  DP=2, DP=2 with ZeRO-3 and DP=2 x TP=2 with SP and ZeRO-3 (eager; ZeRO-3's recomputation gathers
  the parameters forward freed): losses and gradients within 1e-6 of the single device's un-checkpointed run (fp32;
  sharded matmuls add in another order); Static Eager mode too (TP=2).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

import vescale
from vescale.plan.ir import PlanError
from vescale.testing import fake_world, run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_hf_llama


def _mlp(x, w1, w2):
    return F.dropout(torch.relu(x @ w1), p=0.3) @ w2


def _mlp_grad(context_fn=None):
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(s, generator=g) for s in ((8, 16), (16, 32), (32, 4)))
    w1.requires_grad_()
    vescale.manual_seed(3)
    with vescale.random.consistent():
        if context_fn is False:
            out = _mlp(x, w1, w2)
        else:
            kwargs = {} if context_fn is None else {"context_fn": context_fn}
            out = checkpoint(_mlp, x, w1, w2, use_reentrant=False, **kwargs)
    out.square().sum().backward()
    return w1.grad


def test_recomputation_draws_the_forwards_numbers_on_one_device():
    plain = _mlp_grad(False)
    assert torch.equal(_mlp_grad(vescale.random.checkpoint_context), plain)
    assert not torch.equal(_mlp_grad(None), plain), "without the context the recomputation draws other masks"


def test_a_dtensor_draw_in_backward_without_the_context_raises():
    with fake_world(2):
        mesh = vescale.init_mesh((2,), ("DP",))
        vescale.manual_seed(0)
        x = distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)]).requires_grad_()
        out = checkpoint(lambda t: F.dropout(t, 0.5) * 2, x, use_reentrant=False)
        with pytest.raises(RuntimeError, match="context_fn=vescale.random.checkpoint_context"):
            out.to_local().sum().backward()


# mesh name -> (mesh shape, dim names, sequence parallel, ZeRO-3)
_MESHES = {
    "TP": ((2,), ("TP",), False, False),
    "DP": ((2,), ("DP",), False, False),
    "DP-ZeRO-3": ((2,), ("DP",), False, True),  # recomputation needs the freed parameters again
    "DPxTP-SP-ZeRO-3": ((2, 2), ("DP", "TP"), True, True),
}


def _llama(dim: str | None, mode: str = "eager", checkpointed: bool = True):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    vescale.manual_seed(0)
    torch.manual_seed(0)
    model = tiny_hf_llama(use_cache=False, attention_dropout=0.1)
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": vescale.random.checkpoint_context})
    if dim is not None:
        shape, names, sp, zero3 = _MESHES[dim]
        mesh = vescale.init_mesh(shape, names)
        vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=sp, zero3=zero3), mesh, mode=mode)
        if "TP" in names or zero3:  # the plan did split the weights (equal losses alone cannot show it)
            assert all(p.to_local().numel() < p.numel() for n, p in model.named_parameters() if "proj" in n)
    input_ids, labels = synthetic_batches(1, 4, 16, 128, seed=1)[0]
    losses, grads = [], []
    try:
        for step in range(2):
            vescale.manual_seed(7 + step)
            with vescale.random.consistent():
                loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            losses.append(loss.item())
            grads.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                          for n, p in model.named_parameters()})
            model.zero_grad()
    except PlanError as e:
        return str(e)
    return losses, grads


@pytest.mark.multiproc
@pytest.mark.parametrize("dim", list(_MESHES))
def test_checkpointed_hf_llama_matches_the_uncheckpointed_single_device(dim):
    want_losses, want_grads = _llama(None, checkpointed=False)
    losses, grads = run_on_ranks(_llama, 4 if "x" in dim else 2, dim)[0]
    for step in range(2):
        assert abs(losses[step] - want_losses[step]) <= 1e-6, (step, losses[step], want_losses[step])
        diff, name = max(((grads[step][k] - want_grads[step][k]).abs().max().item(), k) for k in want_grads[step])
        assert diff <= 1e-6, f"{dim}=2 step {step}: gradient of {name} differs by {diff:.3g}"


@pytest.mark.multiproc
def test_static_mode_recomputes_with_the_forwards_numbers():
    """Static Eager mode follows the recomputation too (vescale/static/recompute.py; more in
    tests/static/test_static_checkpointing.py)."""
    want_losses, _ = _llama(None, checkpointed=False)
    result = run_on_ranks(_llama, 2, "TP", "static")[0]
    assert not isinstance(result, str), result
    for step, (loss, want) in enumerate(zip(result[0], want_losses)):
        assert abs(loss - want) <= 1e-6, (step, loss, want)
