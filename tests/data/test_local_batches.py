"""Per-rank batches (each DP rank loads only its rows) train exactly like the global batch.

The zoo LLaMA under ``llama_plan(..., local_inputs=True)`` fed by ``vescale.data.DataLoader`` with the
mesh, against the same plan with ``local_inputs=False`` fed the whole global batches by the same
loader with ``mesh=None`` (the global-batch mode), on 2 gloo ranks (DP=2) and 4 (DP=2 x TP=2, SP,
ZeRO-3), eager and Static Eager. Two epochs of a shuffled dataset (``set_epoch``), gradient
accumulation over two micro-batches (``no_grad_sync``), labels with ``ignore_index`` positions that
differ per row (so the DP ranks count different numbers of labels: the mean over the global labels
must not become a mean of the ranks' means).

* Against the global-batch mode: losses, first-step gradients and final parameters ``torch.equal``.
  Both modes put the same local rows into the same DTensor layout, so every op sees the same
  local tensors: any difference is a bug, not rounding.
* Against one device (the global batches on an unparallelised model): within 1e-5. fp32 sums
  in another order (collectives, sharded matmuls) move the results by a few ulps. (SGD, lr 0.5:
  parameters move by lr x gradient, no amplification of rounding noise as in AdamW's first steps.)
* Each rank's root got a plain tensor of B/DP rows, exactly its rows of the global batch (the
  global-mode rows at its DP coordinate; TP peers the same), and the model saw a DTensor of the
  global shape whose local shard is that tensor: a plan that silently did nothing fails.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch.distributed.tensor import DTensor

import vescale
from vescale.testing import global_value, run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama
from vescale.model_state import state_of

pytestmark = pytest.mark.multiproc

ROWS, BATCH, SEQ, VOCAB = 8, 4, 8, 128  # 2 global batches an epoch
EPOCHS, MICRO, LR, TOL = 2, 2, 0.5, 1e-5


def _dataset() -> torch.utils.data.TensorDataset:
    ids, _ = synthetic_batches(1, ROWS, SEQ, VOCAB, seed=1)[0]
    labels = ids.clone()
    # A prompt of 1..SEQ-1 positions per row left out of the loss (ignore_index), unlike on every row.
    prompt = torch.randint(1, SEQ - 1, (ROWS,), generator=torch.Generator().manual_seed(2))
    labels[torch.arange(SEQ) < prompt[:, None]] = -100
    return torch.utils.data.TensorDataset(ids, labels)


def _train(model, loader) -> dict:
    """``EPOCHS`` epochs; an optimiser step every ``MICRO`` batches (the others under no_grad_sync)."""
    # SGD: parameters move by lr x gradient, so the one-device comparison of parameters is one of
    # gradients. (AdamW's first steps move a parameter by ~lr x the sign of its gradient, so
    # near-zero gradients' rounding noise becomes lr-sized differences from one device.)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads, given = [], None, []
    hook = model.register_forward_pre_hook(lambda m, a, kw: given.append(kw["input_ids"]), with_kwargs=True, prepend=True)
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for i, (ids, labels) in enumerate(loader):
            last = (i + 1) % MICRO == 0
            sync = vescale.no_grad_sync(model) if not last and (state_of(model).ir is not None) else _nothing()
            with sync:
                loss = model(input_ids=ids, labels=labels).loss
                (loss / MICRO).backward()
            losses.append(global_value(loss))
            if last:
                if grads is None:
                    grads = {n: global_value(p.grad) for n, p in model.named_parameters()}
                opt.step()
                opt.zero_grad()
    hook.remove()
    params = {n: global_value(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "given": given}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _model():
    torch.manual_seed(0)
    return tiny_llama()


@functools.cache
def _single_device() -> dict:
    return _train(_model(), vescale.data.DataLoader(_dataset(), BATCH, shuffle=True, seed=3))


def _run(shape, names, sp: bool, zero3: bool) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh(shape, names)
    out = {"coordinate": mesh.get_coordinate()}
    for mode in ("eager", "static"):
        for local in (False, True):
            model = _model()
            plan = llama_plan(mesh, model.config, sequence_parallel=sp, zero3=zero3, local_inputs=local)
            vescale.parallelize(model, plan, mesh, mode=mode)
            seen = []  # what the model body got: its global shape (a DTensor; None: a static step's local tensor), local rows
            model.model.embed_tokens.register_forward_pre_hook(
                lambda m, a: seen.append((tuple(a[0].shape), a[0].to_local()) if isinstance(a[0], DTensor) else (None, a[0]))
            )
            loader = vescale.data.DataLoader(_dataset(), BATCH, mesh if local else None, "DP", shuffle=True, seed=3)
            result = _train(model, loader)
            result["seen"] = seen
            out[mode, local] = result
    return out


def _check(results, dp: int) -> None:
    ref = _single_device()
    for rank, out in enumerate(results):
        k = out["coordinate"][0]  # the DP coordinate
        for mode in ("eager", "static"):
            g, l = out[mode, False], out[mode, True]
            label = f"rank {rank}, {mode}"
            # What each rank was given, and what the model body saw.
            assert len(l["given"]) == len(ref["given"]) == EPOCHS * ROWS // BATCH
            for whole, mine, (shape, local) in zip(g["given"], l["given"], l["seen"]):
                share = whole[k * BATCH // dp: (k + 1) * BATCH // dp]
                assert tuple(mine.shape) == (BATCH // dp, SEQ), (label, mine.shape)
                assert torch.equal(mine, share), f"{label}: the loader gave other rows than the global batch's share"
                assert shape in ((BATCH, SEQ), None) and torch.equal(local, share), (label, shape)
            assert l["seen"][0][0] == (BATCH, SEQ), "the first (recording) step runs on DTensors of the global shape"
            for whole, single in zip(g["given"], ref["given"]):
                assert torch.equal(whole, single)  # the global mode saw the single device's batches
            # Bit for bit against the global-batch mode.
            for what in ("losses",):
                assert all(torch.equal(a, b) for a, b in zip(g[what], l[what])), f"{label}: {what} {g[what]} vs {l[what]}"
            for what in ("grads", "params"):
                bad = [n for n in g[what] if not torch.equal(g[what][n], l[what][n])]
                assert not bad, f"{label}: {what} differ from the global-batch mode: {bad[:3]}"
            # Within 1e-5 of one device (fp32 reduction order).
            for a, b in zip(l["losses"], ref["losses"]):
                assert abs(a.item() - b.item()) <= TOL, (label, a, b)
            for what in ("grads", "params"):
                diff, name = max(((l[what][n] - ref[what][n]).abs().max().item(), n) for n in ref[what])
                assert diff <= TOL, f"{label}: {what} {name} differs from one device by {diff:.3g}"
    assert ref["losses"][-1] < ref["losses"][0], "training must make progress for the check to mean something"


def test_dp2_per_rank_batches_equal_the_global_batch():
    _check(run_on_ranks(_run, 2, (2,), ("DP",), False, False, timeout=600), dp=2)


def test_dp2_tp2_sp_zero3_per_rank_batches_equal_the_global_batch():
    results = run_on_ranks(_run, 4, (2, 2), ("DP", "TP"), True, True, timeout=600)
    # TP peers (same DP coordinate) were given the same rows.
    for a in results:
        for b in results:
            if a["coordinate"][0] == b["coordinate"][0]:
                assert all(torch.equal(x, y) for x, y in zip(a["eager", True]["given"], b["eager", True]["given"]))
    _check(results, dp=2)
