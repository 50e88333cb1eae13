"""Every change vescale makes to PyTorch goes through ``vescale._torch.PATCHES`` and comes undone.

The whole-process test compares PyTorch's tables (DTensor's op handlers and strategies, the classes
and objects vescale sets attributes on, the RNG tracker, global optimiser hooks, implicit
replication) before ``import vescale``, after training a parallelized model, and after
``vescale.uninstall()``: equal keys, and values that are the very objects PyTorch had. It runs in a
fresh interpreter, since the suite's process has had vescale installed for a while.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vescale._torch import PatchLayer

_PROGRAM = textwrap.dedent('''
    import torch
    import torch.distributed.tensor._random as dtensor_random
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.optim import optimizer as optim_module


    def snapshot():
        d = DTensor._op_dispatcher
        p = d.sharding_propagator
        tables = {
            "dispatcher attributes": vars(d), "custom op handlers": d._custom_op_handlers,
            "propagator attributes": vars(p), "op strategies": p.op_strategy_funcs,
            "single-dim strategies": p.op_single_dim_strategy_funcs, "schema infos": p.op_to_schema_info,
            "shape adjusters": p.op_to_scalar_shape_adjuster, "size arguments": p.op_to_shape_and_stride_idx,
            "Shard": vars(Shard), "Replicate": vars(Replicate), "Partial": vars(Partial), "DTensor": vars(DTensor),
            "optimizer pre hooks": optim_module._global_optimizer_pre_hooks,
            "optimizer post hooks": optim_module._global_optimizer_post_hooks,
        }
        found = {name: dict(table) for name, table in tables.items()}
        found["RNG tracker"] = {"tracker": dtensor_random._rng_tracker}
        found["implicit replication"] = {"on": torch._C._get_dtensor_allow_implicit_replication()}
        return found


    def differences(before, after):
        out = []
        for name, table in before.items():
            now = after[name]
            for key in table.keys() | now.keys():
                if key not in now or key not in table or (now[key] is not table[key] and now[key] != table[key]):
                    out.append(f"{name}[{key}]: {table.get(key, '<absent>')!r:.60} -> {now.get(key, '<absent>')!r:.60}")
        return out


    pytorch = snapshot()
    import vescale
    from vescale.testing import fake_world
    from vescale.zoo import llama_plan
    from vescale.zoo.hf import tiny_llama

    assert not differences(pytorch, snapshot()), "import vescale changed PyTorch"
    with fake_world(4):
        torch.manual_seed(0)
        model = tiny_llama()
        mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
        vescale.manual_seed(0)
        model = vescale.parallelize(model, llama_plan(mesh, model.config), mesh)
        vescale.dispatch.install()  # twice: idempotent
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, model.config.vocab_size, (4, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        changed = differences(pytorch, snapshot())
        print("CHANGED", len(changed), sorted({line.split("[")[0] for line in changed}))
        vescale.uninstall()
    left = differences(pytorch, snapshot())
    print("LEFT", len(left))
    print("\\n".join(left[:20]))
''')


def test_uninstall_gives_pytorch_back_exactly_what_it_had():
    done = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    changed = next(line for line in done.stdout.splitlines() if line.startswith("CHANGED"))
    # vescale did change each kind of place (else this test would compare nothing) ...
    for kind in ("custom op handlers", "op strategies", "single-dim strategies", "propagator attributes",
                 "dispatcher attributes", "Shard", "RNG tracker", "optimizer pre hooks", "implicit replication"):
        assert kind in changed, f"{kind} not changed by parallelize: {changed}"
    # ... and put every one back.
    assert "LEFT 0" in done.stdout, done.stdout


def test_undo_restores_an_entry_an_attribute_and_a_deleted_entry():
    patches, table = PatchLayer(), {"kept": 1, "replaced": 2, "deleted": 3}

    class Owner:
        def method(self):
            return "class"

    thing = Owner()
    patches.set_item("a.one", table, "replaced", 20)
    patches.set_item("a.one", table, "added", 40)
    patches.delete_item("a.two", table, "deleted")
    patches.set_attr("a.one", thing, "method", lambda: "instance")
    assert table == {"kept": 1, "replaced": 20, "added": 40} and thing.method() == "instance"
    assert patches.owners("a") == ["a.one", "a.two"]
    patches.undo("a")
    assert table == {"kept": 1, "replaced": 2, "deleted": 3} and thing.method() == "class"
    assert "method" not in vars(thing) and patches.owners() == [] and patches.changes() == []


def test_a_value_two_owners_put_stays_until_both_are_undone():
    """vescale's RNG and its dispatch both install the global ``item()`` handler."""
    patches, table = PatchLayer(), {}
    handler = object()
    patches.set_item("dispatch.coverage.semantics", table, "item", handler)
    patches.set_item("random", table, "item", handler)
    patches.undo("dispatch")
    assert table["item"] is handler
    patches.undo("random")
    assert table == {}


def test_a_wrapper_over_a_wrapper_is_undone_newest_first():
    patches, table = PatchLayer(), {"mm": "pytorch"}
    patches.set_item("dispatch.fast.search", table, "mm", "searched")
    patches.set_item("dispatch.fast.interleaved", table, "mm", "interleaved(searched)")
    with pytest.raises(RuntimeError, match=r"undo \['dispatch.fast.interleaved'\] before 'dispatch.fast.search'"):
        patches.undo("dispatch.fast.search")
    assert table["mm"] == "interleaved(searched)"  # the refused undo changed nothing
    patches.undo("dispatch.fast")
    assert table == {"mm": "pytorch"}


def test_a_place_changed_after_vescale_keeps_the_newer_value():
    """A PyTorch registration made after vescale's (a later-imported op library) is not overwritten."""
    patches, table = PatchLayer(), {"op": "pytorch"}
    patches.set_item("dispatch", table, "op", "vescale")
    table["op"] = "registered later"
    patches.undo("dispatch")
    assert table["op"] == "registered later"


def test_removers_run_on_undo():
    patches, calls = PatchLayer(), []
    patches.on_undo("parallel.faults", lambda: calls.append("hook removed"))
    assert patches.owners() == ["parallel.faults"]
    patches.undo("parallel")
    assert calls == ["hook removed"] and patches.owners() == []


def _private_torch_imports(path) -> list[str]:
    """``path``'s imports of a private PyTorch module or name (a dotted part or name starting with _)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".")[1:] + [a.name for a in node.names]
            if any(p.startswith("_") for p in parts):
                found.append(f"{path.name}:{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(p.startswith("_") for p in a.name.split(".")[1:])]
    return found


def test_private_pytorch_names_are_imported_in_vescale_torch_only():
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "vescale"
    outside = [line for path in sorted(package.rglob("*.py")) if path != package / "_torch.py"
               for line in _private_torch_imports(path)]
    assert not outside, "import these through vescale._torch:\n" + "\n".join(outside)
    assert _private_torch_imports(package / "_torch.py"), "the check would find nothing"


def test_original_shows_pytorchs_value_for_a_block_and_keeps_what_pytorch_put_there():
    patches = PatchLayer()

    class Module:
        tracker = None

    module = Module()
    module.tracker = None
    patches.set_attr("random", module, "tracker", "vescale's")
    with patches.original("attr", module, "tracker"):
        assert module.tracker is None
        with patches.original("attr", module, "tracker"):  # nested: the outer block keeps the place
            module.tracker = "made by PyTorch on first use"
        assert module.tracker == "made by PyTorch on first use"
    assert module.tracker == "vescale's"
    patches.undo("random")
    assert module.tracker == "made by PyTorch on first use"  # what PyTorch had made is what it gets back

    table = {"op": "pytorch's handler"}
    patches.set_item("dispatch", table, "op", "vescale's handler")
    with patches.original("item", table, "op"):
        assert table["op"] == "pytorch's handler"
    assert table["op"] == "vescale's handler"
    with patches.original("item", table, "not changed"):  # a place vescale never changed: nothing to do
        assert "not changed" not in table
