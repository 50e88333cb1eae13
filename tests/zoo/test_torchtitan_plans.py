"""The TorchTitan-style baselines in benchmarks/torchtitan_plans.py run and are the same training.

docs/zoo.md compares plan sizes against them, so they must really parallelise the same models: on
4 gloo ranks (DP=2 x TP=2) one forward/backward gives the single-device loss (mean of the DP ranks'
losses) and single-device gradients (FSDP averages over DP) within 1e-5 (fp32, other summation
order), with the expert and attention weights really sharded (local shapes checked).
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import vescale
from vescale.testing import run_on_ranks
from vescale.zoo import synthetic_batches, tiny_hf_llama, tiny_hf_mixtral

TOL = 1e-5
PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "torchtitan_plans.py"


def _module():
    spec = importlib.util.spec_from_file_location("torchtitan_plans", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # inspect.getsource (its plan_sizes) finds classes through their module
    spec.loader.exec_module(mod)
    return mod


BUILD = {"llama": lambda: tiny_hf_llama(), "mixtral": lambda: tiny_hf_mixtral()}
CHECKED = {"llama": ["model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"],
           "mixtral": ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                       "model.layers.0.self_attn.q_proj.weight"]}


def _batch():
    return synthetic_batches(1, 4, 8, 128, seed=1)[0]


@functools.cache
def _single(name):
    torch.manual_seed(0)
    model = BUILD[name]()
    ids, labels = _batch()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if n in CHECKED[name]}


def _parallel(name):
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    vescale.dispatch.install()  # DTensor rules for HF's experts kernels (PyTorch has none)
    # HF's kernels make plain tensors (arange) that meet DTensors; PyTorch refuses that by default.
    torch._C._set_dtensor_allow_implicit_replication(True)
    torch.manual_seed(0)
    model = BUILD[name]()
    fn = _module().torchtitan_llama if name == "llama" else _module().torchtitan_moe
    fn(model, mesh)
    ids, labels = _batch()
    dp = mesh.get_coordinate()[0]
    loss = model(input_ids=ids[2 * dp: 2 * dp + 2], labels=labels[2 * dp: 2 * dp + 2]).loss
    loss.backward()
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    total = loss.detach().clone()
    dist.all_reduce(total)
    params = dict(model.named_parameters())
    grads = {n: params[n].grad.full_tensor() for n in CHECKED[name]}
    shapes = {n: tuple(params[n]._local_tensor.shape) for n in CHECKED[name]}
    return total.item() / 4, grads, shapes  # every loss counted once per TP rank


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_torchtitan_style_plans_run_and_match_single_device(name):
    want_loss, want_grads = _single(name)
    loss, grads, shapes = run_on_ranks(_parallel, 4, name, timeout=300)[0]
    assert abs(loss - want_loss) <= TOL
    for n, g in grads.items():
        torch.testing.assert_close(g, want_grads[n], rtol=0, atol=TOL, msg=n)
    if name == "mixtral":  # experts: TP on the intermediate dim, FSDP on the experts dim
        assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (2, 64, 32)
        assert shapes["model.layers.0.mlp.experts.down_proj"] == (2, 32, 32)
    # q_proj: TP splits its rows, then FSDP splits them again
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == ((8, 32) if name == "mixtral" else (16, 64))


def _irs():
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    mod = _module()
    from vescale.zoo import llama_plan, moe_plan

    body = lambda ir: str(ir).splitlines()[1:]  # noqa: E731  (the header counts statements)
    llama, mixtral = tiny_hf_llama(), tiny_hf_mixtral()
    return (
        body(vescale.explain(llama, mod.vescale_llama(), mesh)) == body(vescale.explain(llama, llama_plan(mesh, llama.config, zero3=True), mesh)),
        body(vescale.explain(mixtral, mod.vescale_moe(), mesh))
        == body(vescale.explain(mixtral, moe_plan(mesh, mixtral.config, sequence_parallel=True, zero3=True), mesh)),
    )


@pytest.mark.multiproc
def test_written_out_vescale_plans_are_the_zoo_plans():
    # docs/zoo.md counts the lines of the written-out plans: they must lower to the zoo's IR.
    assert run_on_ranks(_irs, 4)[0] == (True, True)


def test_the_plan_size_table_in_docs_zoo_md_is_what_the_code_counts():
    doc = (PATH.parents[1] / "docs" / "zoo.md").read_text()
    section = doc[doc.index("## Plan sizes"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].isdigit():
            rows[cells[0]] = tuple(int(c) for c in cells[1:])
    sizes = _module().plan_sizes()
    assert rows == {name: tuple(counts) for name, *counts in sizes}, (rows, sizes)
    # The ratios quoted under the table.
    ratios = " / ".join(f"{vescale_lines / titan_lines:.2f}x" for _, vescale_lines, titan_lines, _ in sizes)
    assert f"are {ratios} the TorchTitan-style code" in " ".join(section.split()), ratios
