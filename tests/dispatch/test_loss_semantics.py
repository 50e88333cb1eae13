"""A mean ``nll_loss`` / ``cross_entropy`` over a batch split across ranks is the single device's.

PyTorch's rule averages the ranks' own means (``Partial("avg")``), which differs from one device
whenever the ranks count different numbers of labels (``ignore_index``, class weights, an uneven
split). vescale's handler (``vescale/dispatch/coverage/semantics.py``) divides each rank's sum by the global
count. Checked on 2 and 4 gloo ranks against the same computation on one device:

* the loss value within 1e-6 (fp32; the ranks' partial sums are added in another order) and its
  placement: ``Partial("sum")`` on the mesh dims that split the batch, the count replicated;
* the input gradient within 1e-7 (each element is ``-w / count``, the same division on every
  rank once the count is global);
* PyTorch's own rule, on the same input, gives the average of the ranks' means: the check would
  fail without the handler (asserted, so the case is not one where the two happen to agree).

The same for the losses with fused kernels (``mse_loss``, ``smooth_l1_loss``, ``huber_loss``,
``binary_cross_entropy(_with_logits)``, ``soft_margin_loss``), whose mean PyTorch's DTensor gets
wrong in backward even on an even split (the local kernel divides by the local element count).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import vescale
from vescale.dispatch.coverage import semantics
from vescale.dispatch.scope import DTensorRule
from vescale.testing import run_on_ranks

aten = torch.ops.aten


def _case(n: int, classes: int = 8, seed: int = 0, image: bool = False):
    """Logits, targets with ignored labels bunched at the start (so ranks count differently), weights."""
    g = torch.Generator().manual_seed(seed)
    shape = (n, classes, 3, 2) if image else (n, classes)
    logits = torch.randn(shape, generator=g)
    target = torch.randint(0, classes, (n, 3, 2) if image else (n,), generator=g)
    target.view(-1)[: target.numel() // 3] = -100
    weight = torch.rand(classes, generator=g) + 0.5
    return logits, target, weight


def _single(logits, target, weight):
    x = logits.clone().requires_grad_()
    loss = F.cross_entropy(x, target, weight=weight)
    loss.backward()
    return loss.detach(), x.grad


def _on_ranks(shape, names, placements, n, image, use_weight):
    vescale.dispatch.install()
    mesh = vescale.init_mesh(shape, names)
    logits, target, weight = _case(n, image=image)
    weight = weight if use_weight else None
    t_places = [Replicate() if p == Shard(1) else p for p in placements]  # the target has no class dim
    x = distribute_tensor(logits, mesh, placements).requires_grad_()
    t = distribute_tensor(target, mesh, t_places)
    w = None if weight is None else distribute_tensor(weight, mesh, [Replicate()] * mesh.ndim)
    loss = F.cross_entropy(x, t, weight=w)
    loss.backward()
    op = aten.nll_loss2d_forward.default if image else aten.nll_loss_forward.default
    logp = x.detach().log_softmax(1)
    try:  # PyTorch's own rule on the same input (it refuses an uneven split outright)
        theirs = DTensorRule(op)(logp, t, w, 1, -100)[0].full_tensor()
    except Exception:
        theirs = None
    return {
        "loss": loss.full_tensor(), "item": loss.item(), "placements": loss.placements,
        "grad": x.grad.full_tensor(), "local_rows": x._local_tensor.shape[0], "theirs": theirs,
    }


CASES = [  # (world, mesh shape, names, logits placements, batch, image, weight)
    (2, (2,), ("DP",), (Shard(0),), 8, False, False),
    (2, (2,), ("DP",), (Shard(0),), 8, False, True),
    (2, (2,), ("DP",), (Shard(0),), 7, False, False),  # uneven split: PyTorch's rule refuses it
    (2, (2,), ("DP",), (Shard(0),), 6, True, True),  # nll_loss2d
    (4, (2, 2), ("DP", "TP"), (Shard(0), Shard(1)), 8, False, False),  # vocabulary-parallel logits too
]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[2]}-n{c[4]}{'-2d' if c[5] else ''}{'-w' if c[6] else ''}")
def test_mean_loss_over_a_split_batch_is_the_single_devices(case):
    world, shape, names, placements, n, image, use_weight = case
    got = run_on_ranks(_on_ranks, world, shape, names, placements, n, image, use_weight)
    logits, target, weight = _case(n, image=image)
    want_loss, want_grad = _single(logits, target, weight if use_weight else None)
    for rank, r in enumerate(got):
        assert abs(r["loss"] - want_loss).item() <= 1e-6, (rank, r["loss"], want_loss)
        assert abs(r["item"] - want_loss.item()) <= 1e-6, (rank, r["item"], want_loss)
        assert (r["grad"] - want_grad).abs().max().item() <= 1e-7, rank
        assert r["placements"][0] == Partial("sum"), r["placements"]
        assert all(p == Replicate() or p == Partial("sum") for p in r["placements"]), r["placements"]
        assert r["local_rows"] in (n // 2, n - n // 2)  # the batch really is split
        if r["theirs"] is not None:  # PyTorch's own rule: the mean of the ranks' means, not the same
            assert abs(r["theirs"] - want_loss).item() > 1e-4, "the case does not tell the two rules apart"


def _replicated_batch():
    vescale.dispatch.install()
    mesh = vescale.init_mesh((2,), ("TP",))
    logits, target, _ = _case(8)
    x = distribute_tensor(logits, mesh, [Shard(1)])  # vocabulary-parallel only: the batch is whole
    t = distribute_tensor(target, mesh, [Replicate()])
    loss = F.cross_entropy(x, t)
    return loss.placements, loss.to_local()


@pytest.mark.multiproc
def test_a_whole_batch_keeps_pytorchs_rule_and_bits():
    logits, target, _ = _case(8)
    for placements, local in run_on_ranks(_replicated_batch, 2):
        assert placements == (Replicate(),)
        assert torch.equal(local, F.cross_entropy(logits, target))


# --- fused pointwise losses: mse, smooth L1, Huber, BCE, soft margin ----------------------------

POINTWISE = {
    "mse": lambda x, y: F.mse_loss(x, y),
    "smooth_l1": lambda x, y: F.smooth_l1_loss(x, y, beta=0.5),
    "huber": lambda x, y: F.huber_loss(x, y, delta=0.7),
    "bce": lambda x, y: F.binary_cross_entropy(x.sigmoid(), y.sigmoid()),
    "bce_logits": lambda x, y: F.binary_cross_entropy_with_logits(x, y.sigmoid()),
    "soft_margin": lambda x, y: F.soft_margin_loss(x, y.sign()),
}


def _pointwise_data(n: int):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g)


def _pointwise_on_ranks(n, shape, names, placements) -> dict:
    """Every loss of ``POINTWISE`` on one set of ranks: {name: (ours, PyTorch's)}, each
    (value, placements, input gradient)."""
    vescale.dispatch.install()
    handlers = DTensor._op_dispatcher._custom_op_handlers
    mesh = vescale.init_mesh(shape, names)
    x, y = _pointwise_data(n)

    def run(name):
        xd = distribute_tensor(x, mesh, placements).requires_grad_()
        loss = POINTWISE[name](xd, distribute_tensor(y, mesh, placements))
        loss.backward()
        return loss.full_tensor().item(), loss.placements, xd.grad.full_tensor()

    out = {}
    for name in POINTWISE:
        ours = run(name)
        popped = {op: handlers.pop(op) for op in list(handlers) if op in semantics._POINTWISE_LOSSES}
        try:
            out[name] = (ours, run(name))
        finally:
            handlers.update(popped)
    return out


POINTWISE_CASES = [  # (world, mesh shape, names, placements, rows)
    (2, (2,), ("DP",), (Shard(0),), 8),
    (2, (2,), ("DP",), (Shard(0),), 7),  # uneven: PyTorch's averaged value is wrong too
    (4, (2, 2), ("DP", "TP"), (Shard(0), Shard(1)), 8),
]


@pytest.mark.multiproc
@pytest.mark.parametrize("case", POINTWISE_CASES, ids=lambda c: f"{'x'.join(c[2])}-n{c[4]}")
def test_fused_pointwise_loss_mean_over_a_split_input_is_the_single_devices(case):
    """Every fused pointwise loss (one set of ranks per mesh): value within 1e-6 and input gradient
    within 1e-7 of one device (fp32, sums in another order). PyTorch's own rule gets the gradient n
    times too large for the fused-backward losses (asserted, so each case tells the rules apart),
    and the value wrong on an uneven split."""
    world, shape, names, placements, n = case
    results = run_on_ranks(_pointwise_on_ranks, world, n, shape, names, placements, timeout=300)[0]
    assert sorted(results) == sorted(POINTWISE)
    for name, ((value, places, grad), (their_value, _, their_grad)) in results.items():
        x, y = _pointwise_data(n)
        x.requires_grad_()
        want = POINTWISE[name](x, y)
        want.backward()
        assert abs(value - want.item()) <= 1e-6, (name, value, want.item())
        assert (grad - x.grad).abs().max().item() <= 1e-7, name
        assert all(p in (Partial("sum"), Replicate()) for p in places), (name, places)
        wrong_grad = (their_grad - x.grad).abs().max().item() > 1e-4
        wrong_value = abs(their_value - want.item()) > 1e-5
        assert wrong_grad or wrong_value or name == "bce_logits" and n % 2 == 0, f"{name}: PyTorch's rule agrees: the case proves nothing"
