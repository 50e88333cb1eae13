"""vescale's op semantics apply to the meshes it was given; a plain DTensor program on another
mesh in the same process computes what it computes with stock PyTorch.

Each rank first runs a plain DTensor program (a tensor-parallel linear, dropout, an in-place
normal_, ``item()`` of a Partial sum, a mean-squared-error loss over a batch split and its backward)
with vescale uninstalled, then parallelizes and trains a tiny LLaMA on a vescale mesh, then runs the
program again on its own mesh: every value, gradient and placement equal, bit for bit. The program's
mesh differs from the model's in its dimension name, as two independent programs' meshes would; a
mesh equal to vescale's shares PyTorch's sharding caches with it (docs/architecture.md, known limits).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import vescale
from vescale.testing import run_on_ranks


def _plain_program(mesh) -> dict:
    """Stock DTensor code, none of it vescale's: what it returns is compared bit for bit."""
    torch.manual_seed(1)
    x = distribute_tensor(torch.randn(6, 8), mesh, [Shard(0)])  # rows 3 + 3
    w = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()]).requires_grad_()
    target = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    h = F.dropout(F.linear(x, w), p=0.5, training=True)  # a random op: vescale's handler, or PyTorch's
    loss = F.mse_loss(h, target)  # vescale's global mean, or PyTorch's average of means
    loss.backward()
    partial = DTensor.from_local(torch.full((), float(dist.get_rank() + 1)), mesh, [Partial()])
    filled = distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)])
    torch.nn.init.normal_(filled)
    return {
        "h": h.to_local(), "h placements": h.placements, "loss": loss.to_local(),
        "loss placements": loss.placements, "w.grad": w.grad.to_local(), "partial.item()": partial.item(),
        "filled": filled.to_local(),
    }


def _beside_a_vescale_model() -> dict:
    from vescale.zoo import llama_plan
    from vescale.zoo.hf import tiny_llama

    vescale.uninstall()  # forked from a test process that may have installed vescale
    plain_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("plain",))
    stock = _plain_program(plain_mesh)

    vescale.manual_seed(0)
    torch.manual_seed(0)
    model = tiny_llama()
    mesh = vescale.init_mesh((2,), ("TP",))
    model = vescale.parallelize(model, llama_plan(mesh, model.config), mesh)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    tp_split = model.model.layers[0].mlp.up_proj.weight.to_local().shape  # the model did split
    vescale_item = DTensor.from_local(torch.ones(()), mesh, [Partial()]).item()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # once per place and message, as a user sees them
        beside = _plain_program(plain_mesh)
    return {"stock": stock, "beside": beside, "tp_split": tuple(tp_split), "vescale_item": vescale_item,
            "warnings": [str(w.message) for w in caught]}


def test_a_plain_dtensor_program_beside_a_vescale_model_computes_what_stock_pytorch_computes():
    for rank, found in enumerate(run_on_ranks(_beside_a_vescale_model, 2)):
        assert found["tp_split"] == (64, 64), found["tp_split"]  # tiny LLaMA's 128 x 64 up_proj over TP=2
        assert found["vescale_item"] == 2.0  # on vescale's mesh, item() of a Partial is the global sum
        stock, beside = found["stock"], found["beside"]
        assert stock.keys() == beside.keys()
        for key, value in stock.items():
            same = torch.equal(value, beside[key]) if isinstance(value, torch.Tensor) else value == beside[key]
            assert same, f"rank {rank}: {key} differs beside a vescale model: {value} vs {beside[key]}"
        assert stock["partial.item()"] == rank + 1  # PyTorch's item() of a Partial: this rank's value
        # vescale says once that the program's random ops draw PyTorch's numbers, not its own
        random_notes = [w for w in found["warnings"] if "vescale.random" in w]
        assert len(random_notes) == 1 and "adopt_mesh" in random_notes[0], found["warnings"]


def test_slices_and_flattened_meshes_of_an_adopted_mesh_are_vescale_meshes():
    from vescale.mesh import adopt_mesh, is_vescale_mesh
    from vescale.testing import fake_world

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))  # equal, not the same
        assert not is_vescale_mesh(mesh) and not is_vescale_mesh(mesh["TP"])
        assert adopt_mesh(mesh) is mesh
        assert is_vescale_mesh(mesh) and is_vescale_mesh(mesh["TP"]) and is_vescale_mesh(mesh["DP", "TP"]._flatten("dp_tp"))
        assert not is_vescale_mesh(other) and not is_vescale_mesh(other["DP"])


def test_a_factory_on_a_mesh_pytorch_has_no_tracker_for_draws_vescale_numbers():
    """PyTorch's factories refuse a CPU mesh without its tracker (a bare AssertionError); vescale,
    which can draw there, answers instead of failing."""
    import torch.distributed.tensor as dt

    from vescale.testing import fake_world

    with fake_world(2):
        vescale.manual_seed(3)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("other",))
        w = dt.randn(4, 6, device_mesh=mesh, placements=[Replicate()])
        vescale.manual_seed(3)
        with vescale.random.consistent():
            assert torch.equal(w.to_local(), torch.randn(4, 6))
