"""diffusers ``DiTTransformer2DModel`` (unchanged, default config and attention processor) under
``dit_plan``: TP=2 and DP=2 x TP=2 + ZeRO-3 against one device.

10 AdamW steps of a denoising-style MSE loss on fixed random latents, timesteps and class labels:
losses at every step, first-step gradients and final parameters within 1e-5 (fp32; the only
differences are the order of floating-point sums in sharded matmuls, all-reduces and the SDPA
kernel's blocking over local sizes — a few ulps; a mis-paired head or a missed reduction moves the
loss by ~1e-2). The DiT's default dropout is 0, so no randomness is involved.

One exception, by mathematics: the key projection's bias adds ``q . b_k`` to every score of a
softmax row, which softmax ignores, so its gradient is exactly zero and what autograd returns is
fp32 rounding noise (~1e-9, different on any reordering of sums). AdamW divides by the root of that
noise's own square, so it takes lr-sized steps in the noise's sign: its final values cannot be
compared. For these (and only these: the test asserts the set) the gradients must be ~0 on both
sides instead.

Equal losses cannot show that a split happened: each run records, in its first step, the local
shapes of the q projection and FFN outputs and the placements and local shape of q at the SDPA
kernel (heads split over TP, batch over DP), and ZeRO-3's at-rest shard of a weight.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

import vescale
from vescale.testing import run_on_ranks

pytest.importorskip("diffusers")
from vescale.zoo import dit_plan, tiny_dit  # noqa: E402

STEPS, LR, TOL, BATCH = 10, 1e-3, 1e-5, 4
# name: (mesh shape, mesh names, ZeRO-3, attention processor: None = the model's default)
CONFIGS_2 = {"TP=2": ((2,), ("TP",), False, None), "TP=2, head_to_batch_dim processor": ((2,), ("TP",), False, "AttnProcessor")}
CONFIGS_4 = {"DP=2xTP=2+ZeRO-3": ((2, 2), ("DP", "TP"), True, None)}
SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
SOFTMAX = torch.ops.aten._softmax.default


def _batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield (torch.randn(BATCH, 4, 8, 8, generator=g), torch.randint(0, 1000, (BATCH,), generator=g),
               torch.randint(0, 10, (BATCH,), generator=g), torch.randn(BATCH, 4, 8, 8, generator=g))


def _value(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class _SdpaInputs(TorchDispatchMode):
    """The placements and local shape of q at the first SDPA kernel call, and of the scores at the
    first softmax (diffusers' older ``AttnProcessor``: baddbmm, softmax, bmm on (batch x heads))."""

    def __init__(self):
        super().__init__()
        self.q = self.scores = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (SDPA, SOFTMAX):
            t = args[0]
            seen = (getattr(t, "placements", None), tuple(getattr(t, "_local_tensor", t).shape))
            if func is SDPA and self.q is None:
                self.q = seen
            if func is SOFTMAX and self.scores is None:
                self.scores = seen
        return func(*args, **(kwargs or {}))


def _train(model) -> dict:
    shapes = {}
    block = model.transformer_blocks[0]
    for name, mod in (("to_q", block.attn1.to_q), ("ff_in", block.ff.net[0].proj)):
        mod.register_forward_hook(
            lambda m, a, out, name=name: shapes.setdefault(name, tuple(getattr(out, "_local_tensor", out).shape)) and None
        )
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads, sdpa = [], None, _SdpaInputs()
    for step, (x, t, c, target) in enumerate(_batches()):
        if step == 0:
            with sdpa:
                loss = ((model(x, timestep=t, class_labels=c).sample - target) ** 2).mean()
                loss.backward()
        else:
            loss = ((model(x, timestep=t, class_labels=c).sample - target) ** 2).mean()
            loss.backward()
        if grads is None:
            grads = {n: _value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(_value(loss).item())
    rest = tuple(getattr(block.ff.net[2].weight, "_local_tensor", block.ff.net[2].weight).shape)
    return {"losses": losses, "grads": grads, "params": {n: _value(p) for n, p in model.named_parameters()},
            "shapes": shapes, "sdpa_q": sdpa.q, "scores": sdpa.scores, "ff_out_weight_at_rest": rest}


def _build(processor: str | None):
    torch.manual_seed(0)
    model = tiny_dit()
    if processor is not None:
        from diffusers.models import attention_processor

        for block in model.transformer_blocks:
            block.attn1.set_processor(getattr(attention_processor, processor)())
    else:
        assert type(model.transformer_blocks[0].attn1.processor).__name__ == "AttnProcessor2_0"
    return model


@functools.cache
def _single_device(processor: str | None) -> dict:
    return _train(_build(processor))


def _distributed(configs):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    results = {}
    for name, (shape, names, zero3, processor) in configs.items():
        mesh = vescale.init_mesh(shape, names)
        model = _build(processor)
        vescale.parallelize(model, dit_plan(mesh, model.config, zero3=zero3), mesh)
        out = _train(model)
        results[name] = out if dist.get_rank() == 0 else None
    return results


def _check(results, configs):
    heads, head_dim = 4, 8
    for name, (shape, names, zero3, processor) in configs.items():
        got, ref = results[name], _single_device(processor)
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= TOL, f"{name}: step {step} loss {a} vs single-device {b}"
        noise = {k for k, g in ref["grads"].items() if g.abs().max() <= 1e-6}
        assert noise == {f"transformer_blocks.{i}.attn1.to_k.bias" for i in range(2)}, noise
        assert all(got["grads"][k].abs().max() <= 1e-6 for k in noise)
        for key in ("grads", "params"):
            diff, where = max(((got[key][k] - ref[key][k]).abs().max().item(), k) for k in ref[key] if k not in noise)
            assert diff <= TOL, f"{name}: {key} of {where} differs by {diff:.3g}"
        assert ref["losses"][-1] < ref["losses"][0], "training must make progress for the check to mean something"
        sizes = dict(zip(names, shape))
        tp, dp = sizes.get("TP", 1), sizes.get("DP", 1)
        tokens = (8 // 2) ** 2
        assert got["shapes"] == {"to_q": (BATCH // dp, tokens, heads * head_dim // tp),
                                 "ff_in": (BATCH // dp, tokens, 4 * heads * head_dim // tp)}, got["shapes"]
        if processor is None:
            expected = ((Shard(0),) if dp > 1 else ()) + (Shard(1),)
            assert got["sdpa_q"] == (expected, (BATCH // dp, heads // tp, tokens, head_dim)), (
                f"{name}: q at SDPA {got['sdpa_q']}: attention must run on local heads (and local batch)"
            )
        else:  # scores of (batch x heads) rows: this rank's heads only, not gathered
            assert got["scores"][1] == (BATCH * heads // (dp * tp), tokens, tokens), f"{name}: scores {got['scores']}"
            assert not any(p.is_replicate() for p in got["scores"][0]), f"{name}: scores {got['scores']}"
        # ff.net.2 is row-parallel (Shard(1) on TP); with ZeRO-3 it also rests as Shard(0) on DP.
        assert got["ff_out_weight_at_rest"] == (heads * head_dim // (dp if zero3 else 1), 4 * heads * head_dim // tp)


@pytest.mark.multiproc
def test_dit_tp2_matches_single_device():
    _check(run_on_ranks(_distributed, 2, CONFIGS_2)[0], CONFIGS_2)


@pytest.mark.multiproc
def test_dit_dp2_tp2_zero3_matches_single_device():
    _check(run_on_ranks(_distributed, 4, CONFIGS_4)[0], CONFIGS_4)
