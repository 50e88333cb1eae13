"""Static Eager's hooks: one forward pre-hook and one forward hook per module.

The hooks a module had before Static Eager was installed (the plan's) run inside the runtime's two
(``vescale.static.install.ModuleHooks``), called by ``vescale._torch.run_pre_hooks`` /
``run_post_hooks`` as nn.Module calls them. These tests check

* that those two run hooks exactly as ``nn.Module.__call__`` does: the same calls in the same order,
  the same inputs and outputs, including when forward raises and when a forward hook raises (the
  ``always_call`` hooks still run, their own errors turned into warnings);
* on 2 gloo ranks (zoo LLaMA, TP=2 + SP, dropout, Static Eager), that every module that runs
  forward carries exactly the runtime's two hooks, and that steps run inside a user's ``except``
  block (a retry loop) train as the same steps outside one, bit for bit, every static step
  verified: the post-hook tells forward's own error from one the caller is handling;
* that a record's program (``Record.program``: every module's ``Steps``) is decided once, for
  every module, when the record's first static step begins, read-only and unchanged after, also
  for a record derived for a new sequence length (its quiet modules' steps carried over).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import vescale
from vescale._torch import ForwardErrors, run_post_hooks, run_pre_hooks, take_forward_hooks
from vescale.model_state import state_of
from vescale.plan.lower import runs_forward
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama


class _Double(nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.fail = fail

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if self.fail:
            raise ValueError("forward failed")
        return 2 * x * scale


def _hooked(log: list, raising_post: bool = False, fail: bool = False) -> nn.Module:
    """A module with one hook of every kind nn.Module knows, each writing to ``log``."""
    mod = _Double(fail)
    mod.register_forward_pre_hook(lambda m, a: log.append("pre") or a[0] + 1)  # a bare value: nn.Module wraps it
    mod.register_forward_pre_hook(lambda m, a, k: log.append(("pre_kw", dict(k))) or (a, {**k, "scale": 3.0}),
                                  with_kwargs=True)
    mod.register_forward_hook(lambda m, a, o: log.append(("post", a[0].item())) or o + 10)
    if raising_post:
        mod.register_forward_hook(lambda m, a, o: (_ for _ in ()).throw(RuntimeError("hook failed")))
    mod.register_forward_hook(lambda m, a, k, o: log.append(("post_kw", k["scale"])) or None, with_kwargs=True)
    mod.register_forward_hook(lambda m, a, o: log.append("always") or (_ for _ in ()).throw(KeyError("cleanup failed")),
                              always_call=True)
    return mod


def _taken_over(mod: nn.Module) -> nn.Module:
    """``mod`` with its hooks run by one pre-hook and one always-called forward hook of its own."""
    taken = take_forward_hooks(mod)
    assert not mod._forward_pre_hooks and not mod._forward_hooks
    errors = ForwardErrors()

    def pre(m, args, kwargs):
        errors.begin()
        return run_pre_hooks(m, taken.pre, args, kwargs)

    def post(m, args, kwargs, output):
        return run_post_hooks(m, taken.post, args, kwargs, output, errors.error() is not None)

    mod.register_forward_pre_hook(pre, with_kwargs=True)
    mod.register_forward_hook(post, with_kwargs=True, always_call=True)
    return mod


def _call(mod: nn.Module) -> tuple:
    """(output or the error's type and message, the warnings' messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = mod(torch.tensor([1.0]))
        except Exception as e:
            out = (type(e).__name__, str(e))
    return out, [str(w.message) for w in caught]


@pytest.mark.parametrize("case", ["plain", "raising_post", "failing_forward"])
def test_taken_hooks_run_as_nn_module_runs_them(case):
    kwargs = {"raising_post": case == "raising_post", "fail": case == "failing_forward"}
    native_log: list = []
    taken_log: list = []
    native = _call(_hooked(native_log, **kwargs))
    taken = _call(_taken_over(_hooked(taken_log, **kwargs)))
    assert taken_log == native_log, (taken_log, native_log)
    if isinstance(native[0], torch.Tensor):
        assert torch.equal(taken[0], native[0])
        assert native[0].item() == 2 * (1 + 1) * 3 + 10  # every hook's change arrived
    else:
        assert taken[0] == native[0]
    assert taken[1] == native[1]
    if case != "plain":  # the always-called hook ran after the error, its own error a warning
        assert native_log[-1] == "always" and any("cleanup failed" in w for w in native[1]), native


def test_forward_errors_tell_forwards_error_from_the_callers():
    errors = ForwardErrors()
    errors.begin()
    assert errors.error() is None  # a plain call
    try:
        raise KeyError("the caller's")
    except KeyError:
        errors.begin()  # a call made inside the caller's except block
        assert errors.error() is None
        errors.begin()
        try:
            raise ValueError("forward's")
        except ValueError as raised:
            assert errors.error() is raised  # as nn.Module's except block calls always-called hooks


# -- on a parallelised model ----------------------------------------------------------------------

STEPS = 4


def _train(in_except_block: bool) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = tiny_llama(hidden_dropout=0.1)
    vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True), mesh, mode="static")
    rt = state_of(model).static
    hooks = {p: (set(m._forward_pre_hooks), set(m._forward_hooks)) for p, m in model.named_modules() if runs_forward(m)}
    own = {p: h.ids for p, h in rt.own_hooks.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vescale.manual_seed(3)
    losses, verified = [], []
    for x, y in synthetic_batches(STEPS, 4, 16, 128, seed=1):
        if in_except_block:
            try:
                raise ConnectionError("a retry loop's first try")
            except ConnectionError:
                loss = model(input_ids=x, labels=y).loss
                loss.backward()
        else:
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).detach())
        verified.append(bool(rt.record is not None and rt.record.verified))
    return {"hooks": hooks, "own": own, "losses": torch.stack(losses), "verified": verified,
            "static_steps": rt.static_steps,
            "local_q": dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"].to_local().shape}


def _programs() -> dict:
    """Per step (sequence lengths 16, 16, 16, 8, 8, 8: the 8s run static at once on a record derived
    from the 16s' one), the record's program
    as ids of its ``Steps``, and what the program held when ``_decide_program`` returned."""
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = tiny_llama(hidden_dropout=0.1)
    vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=True), mesh, mode="static")
    rt = state_of(model).static
    decided, decide = [], rt._decide_program

    def watched(rec):
        program = decide(rec)
        decided.append((id(rec), len(rt.stack), set(program)))  # stack: the modules entered so far
        return program

    rt._decide_program = watched
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for seq in (16, 16, 16, 8, 8, 8):
        x, y = synthetic_batches(1, 4, seq, 128, seed=seq)[0]
        model(input_ids=x, labels=y).loss.backward()
        opt.step()
        opt.zero_grad()
        rec = rt.record
        steps.append((id(rec), {p: id(s) for p, s in (rec.program or {}).items()}))
    rec = rt.record
    try:
        rec.program["model"] = None
        writable = True
    except TypeError:
        writable = False
    source = rec.resized_from
    carried = sorted(p for p in rec.quiet or () if source is not None and rec.program[p] is source.program[p])
    return {"steps": steps, "decided": decided, "modules": set(rt.modules), "writable": writable,
            "derived": source is not None, "quiet": sorted(rec.quiet or ()), "carried": carried}


def _both() -> tuple[dict, dict, dict]:
    return _train(False), _train(True), _programs()


@pytest.mark.multiproc
def test_one_pre_and_one_post_hook_per_module_and_steps_inside_an_except_block():
    plain, in_except, _ = run_on_ranks(_both, 2)[0]
    for path, (pre, post) in plain["hooks"].items():
        assert len(pre) == 1 and len(post) == 1, (path, pre, post)
        assert pre | post == set(plain["own"][path]), path
    assert plain["local_q"] == (32, 64)  # TP=2 split the q projection's rows (64 x 64 whole)
    # Recorded at step 0, static from step 1 on, each record verified by its first static step.
    assert plain["static_steps"] == in_except["static_steps"] == STEPS - 1
    assert plain["verified"][1:] == in_except["verified"][1:] == [True] * (STEPS - 1), (plain["verified"], in_except["verified"])
    assert torch.equal(plain["losses"], in_except["losses"]), (plain["losses"], in_except["losses"])


@pytest.mark.multiproc
def test_a_records_program_is_decided_once_for_every_module_before_its_first_static_step():
    programs = run_on_ranks(_both, 2)[0][2]
    steps, modules = programs["steps"], programs["modules"]
    assert [len(p) for _, p in steps] == [0] + [len(modules)] * 5, steps  # step 0 records
    # Once per record (the recorded one, the derived one), before any module's hook ran, for all.
    assert [(rec, stack) for rec, stack, _ in programs["decided"]] == [(steps[1][0], 0), (steps[3][0], 0)]
    assert all(held == modules for _, _, held in programs["decided"])
    assert steps[1] == steps[2] and steps[3] == steps[4] == steps[5]  # the same Steps objects: never changed
    assert steps[1][0] != steps[3][0] and programs["derived"]
    assert not programs["writable"]
    # The derived record's quiet modules run on their source's steps; the rest decided anew.
    assert programs["quiet"] and programs["carried"] == programs["quiet"], programs
    assert set(steps[3][1].items()) & set(steps[1][1].items()) == {(p, steps[1][1][p]) for p in programs["quiet"]}
