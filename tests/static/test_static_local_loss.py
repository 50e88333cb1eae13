"""Static Eager's local cross entropy (``vescale/static/local_loss.py``) against one device.

The kernel computes a cross entropy whose logits have their classes split over a mesh dim (gathered
over it, as DTensor's ``log_softmax`` does in eager mode, then the whole rows' loss) and / or their
rows split by data parallelism (each rank's sum over the label count all-reduced over the row dims).
Checked on gloo ranks against ``F.cross_entropy`` of the whole tensors, with labels ignored unevenly,
classes that do not split evenly, both reductions; the classifier declines what the kernel does not
compute, a target out of range raises what one device raises, and a module whose loss it declines
(label smoothing) stays eager with eager mode's losses; and in the zoo LLaMA (whose plan gathers the
logits at the LM head) the causal-LM root runs its loss static under TP and DP, with eager mode's
losses bit for bit.

Tolerance: with the rows whole (TP only) the kernel runs one device's kernel on the whole rows:
equal, bit for bit. With the rows split, 1e-6 on values and gradients (fp32: the row sums add in
another order than one device's).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import vescale
from vescale.static.local_loss import loss_kernel
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama
from vescale.model_state import state_of

TOL = 1e-6


def _global_case(classes: int):
    g = torch.Generator().manual_seed(classes)
    logits = torch.randn(12, classes, generator=g) * 3
    target = torch.randint(0, classes, (12,), generator=g)
    target[[1, 2, 3, 4, 7]] = -100  # the first DP rank's rows are mostly ignored, the second's not
    return logits, target


def _kernel_against_one_device(shape, names, classes):
    mesh = vescale.init_mesh(shape, names)
    results = {}
    for reduction in ("mean", "sum"):
        logits, target = _global_case(classes)
        whole = logits.clone().requires_grad_()
        want = F.cross_entropy(whole, target, reduction=reduction)
        want.backward()
        rows = [Shard(0) if n == "DP" else Replicate() for n in names]
        cols = [Shard(1) if n == "TP" else Shard(0) for n in names]
        d_logits = distribute_tensor(logits, mesh, cols).requires_grad_()
        d_target = distribute_tensor(target, mesh, rows)
        call = {"input": d_logits, "target": d_target, "weight": None, "size_average": None, "ignore_index": -100,
                "reduce": None, "reduction": reduction, "label_smoothing": 0.0}
        kernel = loss_kernel(call)
        out = kernel.on_dtensors(call)
        got = out.full_tensor()
        got.backward()
        results[reduction] = {
            "kernel": (kernel.class_dim, kernel.row_dims, kernel.classes, kernel.total),
            "local_classes": d_logits.to_local().shape[1],
            "placements": out.placements,
            "value": (got.item(), want.item()),
            "grad": (d_logits.grad.full_tensor(), whole.grad),
        }
    return results


@pytest.mark.multiproc
@pytest.mark.parametrize("shape,names,classes", [((2, 2), ("DP", "TP"), 10), ((2,), ("TP",), 7), ((2,), ("DP",), 5)],
                         ids=["DP=2xTP=2", "TP=2, 7 classes", "DP=2"])
def test_kernel_matches_one_device(shape, names, classes):
    for rank, results in enumerate(run_on_ranks(_kernel_against_one_device, math.prod(shape), shape, names, classes)):
        for reduction, r in results.items():
            class_dim, row_dims, local, total = r["kernel"]
            assert class_dim == (names.index("TP") if "TP" in names else None), r["kernel"]
            assert row_dims == ((names.index("DP"),) if "DP" in names else ()), r["kernel"]
            assert (local, total) == (r["local_classes"], classes), r["kernel"]
            if "TP" in names:  # the classes really are split (7 over 2 ranks: 4 and 3)
                assert local < classes
            got, want = r["value"]
            if "DP" not in names:  # one device's kernel on the whole rows
                assert got == want and torch.equal(*r["grad"]), (rank, reduction, got, want)
            assert abs(got - want) <= TOL * max(1.0, abs(want)), (rank, reduction, got, want)
            diff = (r["grad"][0] - r["grad"][1]).abs().max().item()
            assert diff <= TOL, (rank, reduction, diff)


def _declined_and_checked():
    mesh = vescale.init_mesh((2,), ("TP",))
    logits, target = _global_case(8)
    d_logits = distribute_tensor(logits, mesh, [Shard(1)])
    base = {"input": d_logits, "target": target, "weight": None, "size_average": None, "ignore_index": -100,
            "reduce": None, "reduction": "mean", "label_smoothing": 0.0}
    declined = {
        "label_smoothing": {"label_smoothing": 0.1},
        "class weights": {"weight": torch.ones(8)},
        "reduction none": {"reduction": "none"},
        "probabilities": {"target": torch.softmax(logits, 1)},
        "plain logits": {"input": logits},
        "rows sharded, target whole": {"input": distribute_tensor(logits, mesh, [Shard(0)])},
    }
    out = {name: loss_kernel({**base, **change}) is None for name, change in declined.items()}
    bad = target.clone()
    bad[0] = 8  # no such class: one device raises too, and the kernel raises what it raises
    errors = []
    for run in (lambda: F.cross_entropy(logits, bad), lambda: loss_kernel(base).on_dtensors({**base, "target": bad})):
        try:
            run()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - compared below
            errors.append((type(e), str(e)))
    out["out of range raises as on one device"] = errors[0] is not None and errors[1] == errors[0]
    return out


@pytest.mark.multiproc
def test_kernel_declines_what_it_does_not_compute():
    out = run_on_ranks(_declined_and_checked, 2)[0]
    assert all(out.values()), out


def _llama_loss_runs_static(shape, names):
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh(shape, names)
    runs = {}
    for mode in ("eager", "static"):
        torch.manual_seed(0)
        model = tiny_llama()
        vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True, zero3="DP" in names), mesh, mode=mode)
        losses, logits = [], None
        for input_ids, labels in synthetic_batches(4, 4, 16, 128, seed=3):
            out = model(input_ids=input_ids, labels=labels)
            out.loss.backward()
            losses.append(out.loss.full_tensor().item())
            logits = out.logits
        runs[mode] = {"losses": losses, "logits": (logits.placements, tuple(logits.to_local().shape))}
        if mode == "static":
            rt = state_of(model).static
            rec = rt.latest()
            runs[mode]["kernels"] = {p: [(k.class_dim, k.row_dims) if k else None for k in ks] for p, ks in rec.losses.items()}
            runs[mode]["unsafe"] = sorted(rec.unsafe)
            runs[mode]["static_steps"] = rt.static_steps
    return runs


@pytest.mark.multiproc
@pytest.mark.parametrize("shape,names", [((2,), ("TP",)), ((2, 2), ("DP", "TP"))], ids=["TP=2+SP", "DP=2xTP=2+SP+ZeRO-3"])
def test_llama_loss_runs_static(shape, names):
    runs = run_on_ranks(_llama_loss_runs_static, math.prod(shape), shape, names)[0]
    eager, static = runs["eager"], runs["static"]
    tp = names.index("TP")
    # The root (its loss included) runs static. llama_plan gathers the logits at the LM head (all
    # 128 classes on every TP rank), so under TP alone the loss is local as it is (no kernel); under
    # DP the kernel divides by the label count all-reduced over DP.
    assert static["unsafe"] == [] and static["static_steps"] >= 2, (static["unsafe"], static["static_steps"])
    want = [None] if "DP" not in names else [(None, (names.index("DP"),))]
    assert static["kernels"] == {"": want}, static["kernels"]
    assert static["logits"][1][-1] == 128 and static["logits"][0][tp] == Replicate(), static["logits"]
    assert static["logits"] == eager["logits"], (static["logits"], eager["logits"])
    assert static["losses"] == eager["losses"], (static["losses"], eager["losses"])  # eager mode's bits


class _Classifier(nn.Module):
    """A vocabulary-parallel head whose caller (the root) takes the loss: ``smoothing`` > 0 asks
    cross_entropy for what the kernel does not compute."""

    def __init__(self, smoothing: float):
        super().__init__()
        self.smoothing = smoothing
        self.proj = nn.Linear(16, 32, bias=False)
        self.head = nn.Linear(32, 10, bias=False)

    def forward(self, x, y):
        return F.cross_entropy(self.head(torch.relu(self.proj(x))), y, label_smoothing=self.smoothing)


def _classifier_runs(smoothing: float):
    mesh = vescale.init_mesh((2,), ("TP",))
    data = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 16, generator=data), torch.randint(0, 10, (8,), generator=data)) for _ in range(4)]
    for _, y in batches:
        y[:2] = -100
    runs = {}
    for mode in ("single", "eager", "static"):
        torch.manual_seed(0)
        model = _Classifier(smoothing)
        if mode != "single":
            plan = vescale.VescalePlan()
            plan.shard(r"(proj|head)\.weight", Shard(0), mesh="TP")  # the head's classes split: 5 a rank
            plan.shard(r"head\.<in>", Replicate(), mesh="TP")
            plan.shard(r"head\.<out>", Shard(-1), mesh="TP")
            vescale.parallelize(model, plan, mesh, mode=mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for x, y in batches:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
        runs[mode] = {"losses": losses}
        if mode == "static":
            rec = state_of(model).static.latest()
            runs[mode]["kernels"] = {p: [k is not None for k in ks] for p, ks in rec.losses.items()}
            runs[mode]["unsafe"] = sorted(rec.unsafe)
    return runs


@pytest.mark.multiproc
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["kernel", "label smoothing: declined"])
def test_a_declined_loss_keeps_its_module_eager(smoothing):
    runs = run_on_ranks(_classifier_runs, 2, smoothing)[0]
    static = runs["static"]
    if smoothing:
        # Left to the op watcher: DTensor gathers the classes for log_softmax, so the root stays eager.
        assert static["kernels"] == {"": [False]} and static["unsafe"] == [""], static
    else:
        assert static["kernels"] == {"": [True]} and static["unsafe"] == [], static
    for a, b, c in zip(static["losses"], runs["eager"]["losses"], runs["single"]["losses"]):
        assert abs(a - b) <= TOL and abs(a - c) <= TOL, (static["losses"], runs["eager"]["losses"], runs["single"]["losses"])
