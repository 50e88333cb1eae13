"""Record reuse across sizes (``vescale/static/resize.py``): a new sequence length derives its record.

On gloo ranks, the zoo LLaMA with attention and residual dropout drawn under
``vescale.random.consistent()``:

* bit for bit: with the parameters held fixed, a step at a new length run from a derived record
  gives the loss and every gradient (``torch.equal``) of a static step run from a record made by
  recording at that length (``reuse_records = False``): the same local ops, collectives and dropout
  masks in the same order. (Not against the recording step itself: that one runs eagerly on DTensors,
  whose sums and reductions happen in another order; see ``test_static_llama``.) The zoo LLaMA's
  head_dim is 16, the first length too: its rotary (1, 16, 16) has a dim of the old length that does
  not follow the input, which the first derived step tells apart from the one that does;
* training over lengths 16, 24, 16, 40: the derived records serve every new length (the counters
  say so: ``resized_records`` grows, ``recorded_steps`` does not), and losses and the last gradients
  stay within 1e-5 of the single device (fp32 sums in another order) and within 1e-6 of training
  with reuse off (whose new lengths record, eagerly: the same arithmetic, reduced in another order);
  afterwards each rank checks its split (``split_checks.check_llama_split``);
* a boundary size that follows no factor of the input (a shifted slice, length - 1) on a dim no rank
  splits is taken from the tensor: the record is derived and the losses are eager mode's;
* fallbacks: a length the mesh does not divide under sequence parallelism records; where such a
  size is split over ranks (the shifted slice sequence-sharded), the derived step raises
  ``ResizeMismatch``, leaves nothing behind, and the same step run again records and is right;
* a model that reads a length from values (``.item()``) records its new lengths;
* a view given the whole sequence's length (a global size ``vescale.static.local_sizes`` rewrites)
  on a sequence-split tensor: new lengths derive their records and split the length as recorded;
* HF's LlamaForCausalLM reuses bit for bit as the zoo model does; HF Mixtral (its default experts
  kernel routes with fixed sizes: sort, counts, ``grouped_mm`` offsets) reuses too, under DP=2 +
  ZeRO-3 and TP=2 + SP, within 1e-5 of the single device.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import vescale
from vescale.random import consistent
from vescale.static.resize import ResizeMismatch
from vescale.testing import run_on_ranks
from vescale.zoo import llama_plan, moe_plan, synthetic_batches, tiny_hf_llama, tiny_hf_mixtral, tiny_llama

from split_checks import check_llama_split, probe_batch
from vescale.model_state import state_of

LR, TOL, SEED = 0.05, 1e-5, 1234
MODELS = {
    "ours": lambda: tiny_llama(attention_dropout=0.1, hidden_dropout=0.1),
    "hf": lambda: tiny_hf_llama(use_cache=False, attention_dropout=0.1),
}
CONFIGS = {  # name: (ranks, mesh shape, mesh names, sequence parallel, ZeRO-3)
    "TP=2+SP": (2, (2,), ("TP",), True, False),
    "DP=2xTP=2+SP+ZeRO-3": (4, (2, 2), ("DP", "TP"), True, True),
}
TRAIN_LENGTHS = [16, 24, 16, 40]


def _value(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _quiet_logs():
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _parallel(name: str, config: str, reuse: bool):
    _, shape, names, sp, zero3 = CONFIGS[config]
    mesh = vescale.init_mesh(shape, names)
    torch.manual_seed(0)
    model = MODELS[name]()
    vescale.parallelize(model, llama_plan(mesh, model.config, sequence_parallel=sp, zero3=zero3), mesh, mode="static")
    state_of(model).static.reuse_records = reuse
    return model


def _counters(rt) -> tuple:
    return rt.recorded_steps, rt.static_steps, rt.resized_records


# ---------------------------------------------------------------------------------------------
# Bit for bit, parameters fixed
# ---------------------------------------------------------------------------------------------


def _fixed_steps(model, lengths) -> list:
    """(length, loss, gradients, counters) of each step; no update, so every step at one length
    computes the same thing (its masks are drawn from a seed of the length). A length is a sequence
    length (batch 4) or a (batch, sequence length) pair."""
    rt, out = state_of(model).static, []
    for seq in lengths:
        batch, length = seq if isinstance(seq, tuple) else (4, seq)
        (x, y), = synthetic_batches(1, batch, length, 128, seed=length)
        vescale.manual_seed(batch * length)
        with consistent():
            loss = model(input_ids=x, labels=y).loss
        loss.backward()
        out.append((seq, _value(loss).item(), {n: _value(p.grad) for n, p in model.named_parameters()}, _counters(rt)))
        for p in model.parameters():
            p.grad = None
    return out


BITWISE_LENGTHS = ((16, 16, 24, 16, 40, 40), (16, 16, 24, 24, 16, 40, 40))  # reuse on, reuse off
# Batch and length at once: dims of batch * length (the loss's rows) change by both.
BATCH_AND_LENGTH = (((4, 16), (4, 16), (6, 24), (4, 16), (8, 40), (8, 40)),
                    ((4, 16), (4, 16), (6, 24), (6, 24), (4, 16), (8, 40), (8, 40)))


def _bitwise(name: str, config: str, lengths=BITWISE_LENGTHS):
    _quiet_logs()
    reused = _fixed_steps(_parallel(name, config, True), lengths[0])
    recorded = _fixed_steps(_parallel(name, config, False), lengths[1])
    return reused, recorded


@functools.cache
def _bitwise_results(name: str, config: str, lengths=BITWISE_LENGTHS):
    return run_on_ranks(_bitwise, CONFIGS[config][0], name, config, lengths)[0]


def _check_bitwise(name: str, config: str, lengths=BITWISE_LENGTHS) -> None:
    reused, recorded = _bitwise_results(name, config, lengths)
    static_at = {seq: (loss, grads) for seq, loss, grads, _ in recorded}  # the last step per length: static
    first_recorded = reused[1][3][0]
    for i, (seq, loss, grads, counters) in enumerate(reused[2:], start=2):
        ref_loss, ref_grads = static_at[seq]
        assert loss == ref_loss, f"{name} {config}: step {i} (length {seq}) loss {loss} vs recorded {ref_loss}"
        differ = [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
        assert not differ, f"{name} {config}: step {i} (length {seq}) gradients differ from a recorded record's: {differ[:4]}"
        assert counters[0] == first_recorded, f"{name} {config}: step {i} recorded: {counters}"
    assert reused[-1][3][2] == 2, f"{name} {config}: derived {reused[-1][3][2]} records, want 2 (the two new lengths)"
    assert recorded[-1][3][2] == 0, "reuse_records=False derived a record"


@pytest.mark.multiproc
def test_derived_record_is_bit_for_bit_a_recorded_one_tp2():
    _check_bitwise("ours", "TP=2+SP")


@pytest.mark.multiproc
def test_derived_record_is_bit_for_bit_a_recorded_one_dp2tp2_zero3():
    _check_bitwise("ours", "DP=2xTP=2+SP+ZeRO-3")


@pytest.mark.multiproc
def test_new_batch_and_length_together_dp2tp2_zero3():
    _check_bitwise("ours", "DP=2xTP=2+SP+ZeRO-3", BATCH_AND_LENGTH)


# ---------------------------------------------------------------------------------------------
# Training over lengths, against reuse off and one device
# ---------------------------------------------------------------------------------------------


def _train(model, lengths) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = {"losses": [], "counters": []}
    for step, seq in enumerate(lengths):
        (x, y), = synthetic_batches(1, 4, seq, 128, seed=step)
        loss = model(input_ids=x, labels=y).loss
        loss.backward()
        if step == len(lengths) - 1:
            out["grads"] = {n: _value(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(_value(loss).item())
        if (state_of(model).static is not None):
            out["counters"].append(_counters(state_of(model).static))
    return out


def _train_parallel(name: str, config: str):
    _quiet_logs()
    runs = {}
    for reuse in (True, False):
        model = _parallel(name, config, reuse)
        vescale.manual_seed(SEED)
        with consistent():
            runs[reuse] = _train(model, TRAIN_LENGTHS)
        # Static steps must leave no dispatch mode behind (consistent() is one of its own).
        runs[reuse]["modes_left"] = len(_get_current_dispatch_mode_stack())
    _, shape, names, sp, zero3 = CONFIGS[config]
    sizes = dict(zip(names, shape))
    check_llama_split(model, probe_batch(), tp=sizes.get("TP", 1), dp=sizes.get("DP", 1), sequence_parallel=sp,
                      zero3=zero3, label=config)
    return runs


@functools.cache
def _single_device(name: str, lengths: tuple) -> dict:
    torch.manual_seed(0)
    model = MODELS[name]()
    vescale.manual_seed(SEED)
    with consistent():
        return _train(model, list(lengths))


@pytest.mark.multiproc
@pytest.mark.parametrize("config", list(CONFIGS))
def test_training_over_new_lengths_reuses_records(config):
    lengths = TRAIN_LENGTHS
    runs = run_on_ranks(_train_parallel, CONFIGS[config][0], "ours", config)[0]
    reused, recorded, one = runs[True], runs[False], _single_device("ours", tuple(lengths))
    first = lengths.index(24)  # the first new length: every recording is done by then
    assert [c[0] for c in reused["counters"][first:]] == [reused["counters"][first - 1][0]] * (len(lengths) - first), (
        f"{config}: a new length recorded with reuse on: {reused['counters']}"
    )
    assert reused["counters"][-1][2] == 2, f"{config}: derived records {reused['counters']}"
    assert recorded["counters"][-1][2] == 0 and recorded["counters"][-1][0] > reused["counters"][-1][0], recorded["counters"]
    assert reused["modes_left"] == 0, "dispatch modes left active"
    for step, (a, b, c) in enumerate(zip(reused["losses"], one["losses"], recorded["losses"])):
        assert abs(a - b) <= TOL, f"{config}: step {step} loss {a} vs single device {b}"
        assert abs(a - c) <= 1e-6, f"{config}: step {step} loss {a} vs reuse off {c}"
    diff, where = max(((reused["grads"][k] - one["grads"][k]).abs().max().item(), k) for k in one["grads"])
    assert diff <= TOL, f"{config}: last gradient of {where} differs from single device by {diff:.3g}"


BOUNDED_LENGTHS = [16, 16, 24, 32, 40, 24, 16, 48]


def _bounded_records():
    """At most two records kept: the lengths evicted come back derived again, never recorded."""
    _quiet_logs()
    model = _parallel("ours", "TP=2+SP", True)
    rt = state_of(model).static
    rt.max_records = 2
    kept = []
    vescale.manual_seed(SEED)
    with consistent():
        out = _train(_KeptCounter(model, kept), BOUNDED_LENGTHS)
    return out, kept


class _KeptCounter(nn.Module):
    """The model, noting after each forward how many records its runtime keeps."""

    def __init__(self, model, kept: list):
        super().__init__()
        self.model, self.kept = model, kept
        state_of(self).static = state_of(model).static  # _train reads the counters from here

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        self.kept.append(len(state_of(self.model).static.records))
        return out


@pytest.mark.multiproc
def test_records_beyond_max_records_are_dropped_least_recently_used_first():
    out, kept = run_on_ranks(_bounded_records, 2)[0]
    one = _single_device("ours", tuple(BOUNDED_LENGTHS))
    assert max(kept) <= 2, kept
    recorded = [c[0] for c in out["counters"]]
    # 16 records (once, or twice where the first recording found modules to keep eager); every
    # later length, the evicted 24 and 16 included, is derived from the kept recorded one.
    assert recorded[-1] == recorded[1] <= 2, out["counters"]
    for step, (a, b) in enumerate(zip(out["losses"], one["losses"])):
        assert abs(a - b) <= TOL, f"step {step} loss {a} vs single device {b}"


# ---------------------------------------------------------------------------------------------
# Fallbacks
# ---------------------------------------------------------------------------------------------


def _uneven_length():
    """Length 16 then 25 on TP=2 + SP: the sequence dim would split 13 / 12."""
    _quiet_logs()
    model = _parallel("ours", "TP=2+SP", True)
    vescale.manual_seed(SEED)
    with consistent():
        out = _train(model, [16, 16, 25, 25])
    return out, state_of(model).static.last_refusal


@pytest.mark.multiproc
def test_a_length_the_mesh_does_not_divide_records():
    out, why = run_on_ranks(_uneven_length, 2)[0]
    one = _single_device("ours", (16, 16, 25, 25))
    assert out["counters"][-1][2] == 0 and out["counters"][2][0] == 2, out["counters"]
    assert "do not split evenly" in why, why
    for step, (a, b) in enumerate(zip(out["losses"], one["losses"])):
        assert abs(a - b) <= TOL, f"step {step} loss {a} vs single device {b}"


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Shifted(nn.Module):
    """Its second block gets the sequence less its first position: a size (length - 1) that no
    factor of the input's length describes."""

    def __init__(self):
        super().__init__()
        self.first, self.second = _Block(), _Block()

    def forward(self, x):
        x = x + self.first(x)  # a Partial output meets the residual: the root stays eager
        return self.second(x[:, 1:]).pow(2).mean()


class _Counted(_Shifted):
    """Reads a length from the data (``.item()`` of a count): a size no record is derived over."""

    def forward(self, x):
        x = x + self.first(x)
        n = int((x[0, :, 0] == x[0, :, 0]).sum())  # every position: the length, read from values
        return self.second(x[:, :n]).pow(2).mean()


def _shifted(mode: str, build=_Shifted, split_second: bool = False, lengths=(16, 16, 24, 24)):
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = build()
    plan = vescale.VescalePlan()
    # split_second: the second block gets the shifted sequence split over the ranks (its weights
    # whole, so its body runs static on the local rows), instead of tensor-parallel weights.
    tp_blocks = "first" if split_second else "(first|second)"
    plan.shard(rf"{tp_blocks}\.up\.(weight|bias)", Shard(0), mesh="TP")
    plan.shard(rf"{tp_blocks}\.down\.weight", Shard(1), mesh="TP")
    if split_second:
        plan.shard(r"second\.<in>", Shard(1), mesh="TP")
    vescale.parallelize(model, plan, mesh, mode=mode)
    losses, raised, counters = _over_lengths(model, mode, lengths)
    last_refusal = state_of(model).static.last_refusal if mode == "static" else None
    return losses, raised, counters, last_refusal


def _over_lengths(model, mode: str, lengths) -> tuple[list, list, list]:
    """One backward per length of (4, length, 8) inputs: the losses, what a ``ResizeMismatch``
    said and left behind (dispatch modes, whether the parameters are DTensors) before the same step
    ran again, and the static runtime's counters after each step."""
    data = torch.Generator().manual_seed(1)
    losses, raised, counters = [], [], []
    for seq in lengths:
        x = torch.randn(4, seq, 8, generator=data)
        try:
            loss = model(x)
        except ResizeMismatch as e:
            raised.append(str(e))
            left = (len(_get_current_dispatch_mode_stack()), all(isinstance(p, DTensor) for p in model.parameters()))
            raised.append(left)
            loss = model(x)  # the same step again: it records
        loss.backward()
        for p in model.parameters():
            p.grad = None
        losses.append(_value(loss).item())
        if mode == "static":
            counters.append(_counters(state_of(model).static))
    return losses, raised, counters


def _shifted_both(build=_Shifted, split_second: bool = False, lengths=(16, 16, 24, 24)):
    return _shifted("eager", build, split_second, lengths), _shifted("static", build, split_second, lengths)


@pytest.mark.multiproc
def test_an_unsplit_size_not_following_the_input_is_taken_from_the_tensor():
    # 16 records (twice: the root stays eager, found by the first recording), then runs static once,
    # which checks the record's sized ops; 24 is derived from it. (Derived from a record not yet
    # checked, the first step checks sized ops against the factors, and this model's slice, which
    # follows none, raises there as in the test below.)
    lengths = (16, 16, 16, 24, 24)
    (eager, *_), (static, raised, counters, _) = run_on_ranks(_shifted_both, 2, _Shifted, False, lengths)[0]
    assert not raised, raised
    assert counters[-1][0] == counters[2][0] and counters[-1][2] == 1, f"(recorded, static, derived) {counters}"
    for a, b in zip(static, eager):
        assert abs(a - b) <= 1e-6, (static, eager)


@pytest.mark.multiproc
def test_a_split_size_not_following_the_input_raises_then_records():
    (eager, *_), (static, raised, counters, _) = run_on_ranks(_shifted_both, 2, _Shifted, True)[0]
    assert len(raised) == 2 and "second" in raised[0] and "(4, 12, 8)" in raised[0], raised
    assert raised[1] == (0, True), f"after the mismatch: (dispatch modes left, parameters DTensors) {raised[1]}"
    # The root stays eager (found by the first recording, so 16 records twice); 24 records once.
    assert counters[-1][0] == counters[1][0] + 1 and counters[-1][2] == 0, f"(recorded, static, derived) {counters}"
    for a, b in zip(static, eager):
        assert abs(a - b) <= 1e-6, (static, eager)


@pytest.mark.multiproc
def test_a_length_read_from_values_records():
    (eager, *_), (static, raised, counters, why) = run_on_ranks(_shifted_both, 2, _Counted)[0]
    assert not raised, raised
    assert counters[-1][0] == counters[1][0] + 1 and counters[-1][2] == 0, f"(recorded, static, derived) {counters}"
    assert "_local_scalar_dense" in why and "depends on values" in why, why
    for a, b in zip(static, eager):
        assert abs(a - b) <= 1e-6, (static, eager)


class _Viewer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, length: int):
        # ``length`` is the whole sequence's, ``x`` this rank's piece of it: a global size in a view
        return self.lin(x).view(x.shape[0], length, 2, 4).softmax(-1)


class _GlobalLength(nn.Module):
    """Views its sequence-split block output with the length the root reads from the whole input: a
    global size that follows the inputs (vescale.static.local_sizes rewrites it)."""

    def __init__(self):
        super().__init__()
        self.blk = _Viewer()

    def forward(self, x):
        return self.blk(x, x.shape[1]).pow(2).mean()


def _global_length(mode: str, lengths=(16, 16, 16, 24, 24, 32)):
    mesh = vescale.init_mesh((2,), ("TP",))
    torch.manual_seed(0)
    model = _GlobalLength()
    plan = vescale.VescalePlan().shard(r"blk\.<in>\[x\]", Shard(1), mesh="TP")
    vescale.parallelize(model, plan, mesh, mode=mode)
    losses, raised, counters = _over_lengths(model, mode, lengths)
    rewrites = None
    if mode == "static":
        rewrites = [(r.positions, r.global_sizes, r.local_sizes) for r in state_of(model).static.latest().sizes.get("blk", []) if r]
    return losses, raised, counters, rewrites


@pytest.mark.multiproc
def test_a_global_size_following_the_input_is_split_in_a_derived_record():
    eager, *_ = run_on_ranks(_global_length, 2, "eager")[0]
    static, raised, counters, rewrites = run_on_ranks(_global_length, 2, "static")[0]
    assert not raised, raised
    # view(4, 16, 2, 4) of the sequence-split block: the length (position 1) is 8 on each rank.
    assert rewrites == [((1,), (16,), (8,))], rewrites
    # 16 records (the root may record twice), runs static (its first step keeps the rewrite); 24 and
    # 32 derive their records from it, the view's length split as recorded (12 and 16 a rank).
    recorded = counters[2][0]
    assert counters[-1][0] == recorded and counters[-1][2] == 2, f"(recorded, static, derived) {counters}"
    for a, b in zip(static, eager):
        assert abs(a - b) <= 1e-6, (static, eager)


# ---------------------------------------------------------------------------------------------
# Other models
# ---------------------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_hf_llama_reuses_records_bit_for_bit():
    _check_bitwise("hf", "TP=2+SP")


def _moe(reuse: bool, config: str):
    """HF Mixtral's default experts kernel routes without sizes from values (a sort, counts and
    ``grouped_mm`` offsets over all token copies): its records are derived like the LLaMA's."""
    _quiet_logs()
    tp = config == "TP=2+SP"
    mesh = vescale.init_mesh((2,), ("TP",) if tp else ("DP",))
    torch.manual_seed(0)
    model = tiny_hf_mixtral()
    vescale.parallelize(model, moe_plan(mesh, model.config, sequence_parallel=tp, zero3=not tp), mesh, mode="static")
    state_of(model).static.reuse_records = reuse
    return _train(model, [16, 16, 24, 24]), state_of(model).static.last_refusal


@pytest.mark.multiproc
@pytest.mark.parametrize("config", ["DP=2+ZeRO-3", "TP=2+SP"])
def test_moe_new_length_stays_right(config):
    out, why = run_on_ranks(_moe, 2, True, config)[0]
    torch.manual_seed(0)
    one = _train(tiny_hf_mixtral(), [16, 16, 24, 24])
    recorded, _, derived = out["counters"][-1]
    assert recorded == out["counters"][1][0] and derived == 1, f"(recorded, static, derived) {out['counters']} ({why})"
    for step, (a, b) in enumerate(zip(out["losses"], one["losses"])):
        assert abs(a - b) <= TOL, f"step {step} loss {a} vs single device {b}"


# ---------------------------------------------------------------------------------------------
# The size arithmetic (no ranks)
# ---------------------------------------------------------------------------------------------


def _key(*shapes, dtype=torch.int64, training=(True,)):
    return tuple((s, dtype) for s in shapes), training


def test_size_factors_pair_each_changed_dim_and_their_products():
    from vescale.static.resize import size_factors

    assert size_factors(_key((4, 16), (4, 16)), _key((4, 24), (4, 24))) == ((16, 24),)
    assert set(size_factors(_key((4, 16)), _key((6, 24)))) == {(4, 6), (16, 24), (64, 144)}
    assert size_factors(_key((4, 16)), _key((4, 16), (4, 16))) is None  # another tensor count
    assert size_factors(_key((4, 16)), _key((4, 24), dtype=torch.int32)) is None  # another dtype
    assert size_factors(_key((4, 16)), _key((4, 24), training=(False,))) is None  # another training flag
    assert size_factors(_key((4, 16)), _key((1, 16))) is None  # a unit dim: DTensor decides otherwise
    assert size_factors(_key((4, 16)), _key((4, 16, 1))) is None  # another rank


def test_candidates_are_whole_multiples_of_the_changed_dims():
    from vescale.static.resize import _candidates, _local_candidates

    pairs = ((16, 24),)
    assert _candidates(16, pairs) == (16, 24)  # seq (or a head_dim of 16: the first step tells)
    assert _candidates(64, pairs) == (64, 96)  # 4 * seq, or hidden
    assert _candidates(8, pairs) == (8,)  # a head count is no fraction of seq
    assert _local_candidates(8, pairs) == (8, 12)  # but a shard of seq is


def test_only_sizes_from_values_are_data_dependent():
    from vescale.static.resize import data_dependent_op

    aten = torch.ops.aten
    assert data_dependent_op(aten._local_scalar_dense.default, (torch.tensor(3),))
    assert not data_dependent_op(aten._local_scalar_dense.default, (torch.tensor(True),))  # control flow
    assert data_dependent_op(aten.nonzero.default, (torch.ones(3),))
    assert data_dependent_op(aten.index.Tensor, (torch.ones(3), [torch.tensor([True, False, True])]))
    assert not data_dependent_op(aten.index.Tensor, (torch.ones(3), [torch.tensor([0, 2])]))
