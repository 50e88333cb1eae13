"""Random-op cases shared by the simulated-mesh and the multi-process tests of vescale.random.

A case is one user-level random call (``x.uniform_``, ``nn.init.kaiming_normal_``, ``F.dropout``,
``torch.distributed.tensor.rand``, ...) written once against an *environment*: :class:`Plain` runs it
on ordinary tensors (the single-device reference, under ``consistent()``), :class:`Dist` on DTensors
with given placements. :func:`compare` checks a distributed result against the reference, rank by
rank: the local shard must equal (torch.equal) the slice DTensor's own ``distribute_tensor`` cuts
from the reference for that rank, so over all ranks the gathered tensor equals the reference.

A call that raises passes only where PyTorch itself refuses it on one device with an error the case
documents (``Case.refusals``) and the distributed run raises that same error (type and message):
an op broken on both paths is a failure, not a pass.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.tensor as dtensor_api
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import vescale.random as vr


# ---- environments --------------------------------------------------------------------------------------


class Plain:
    """The single-device reference: tensors are whole tensors."""

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def make(self, values: torch.Tensor):
        return values.clone()

    def factory(self, name: str, shape, dtype):
        return getattr(torch, name)(shape, dtype=dtype)


@dataclass
class Dist:
    """DTensors on ``mesh`` with ``placements``.

    Value-carrying operands (dropout inputs, probabilities) with Partial placements: on real ranks a
    Partial("sum") operand holds the values on coordinate 0 and zeros elsewhere, so the reduction is
    exact. ``simulated`` (the fake process group, whose collectives do not communicate, so any
    redistribution DTensor does downstream, e.g. in dropout's multiply, gives garbage) uses Replicate
    for them instead; Partial random-op *targets* are still tested there."""

    mesh: object
    placements: tuple
    simulated: bool

    def empty(self, shape, dtype):
        return self._distribute(torch.zeros(shape, dtype=dtype), self.placements)

    def make(self, values: torch.Tensor):
        placements = self.placements
        if self.simulated:
            placements = tuple(Replicate() if p.is_partial() else p for p in placements)
        return self._distribute(values, placements)

    def factory(self, name: str, shape, dtype):
        return getattr(dtensor_api, name)(shape, dtype=dtype, device_mesh=self.mesh, placements=self.placements)

    def _distribute(self, values, placements):
        # Split with DTensor's own code (no scatter), then fill Partial dims so the reduction is exact.
        replicated = tuple(Replicate() if p.is_partial() else p for p in placements)
        local = distribute_tensor(values, self.mesh, replicated, src_data_rank=None).to_local().clone()
        coordinate = self.mesh.get_coordinate()
        for mesh_dim, p in enumerate(placements):
            if p.is_partial() and p.reduce_op == "sum" and coordinate[mesh_dim] != 0:
                local.zero_()
        return DTensor.from_local(
            local, self.mesh, placements, run_check=False, shape=values.shape, stride=values.stride()
        )


# ---- cases ---------------------------------------------------------------------------------------------


def _values(shape, dtype):
    """Deterministic input values (dropout inputs), exactly representable in every tested dtype."""
    n = math.prod(shape)
    return ((torch.arange(n, dtype=torch.float64) % 17) - 8).reshape(shape).to(dtype)


def _probabilities(shape, dtype):
    n = math.prod(shape)
    return ((torch.arange(n, dtype=torch.float64) % 9) / 8).reshape(shape).to(dtype)


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable  # run(env, shape, dtype) -> tensor or tuple of tensors
    min_ndim: int = 1
    factory: bool = False  # built by a DTensor factory: Partial placements are refused
    partial_ok: bool = True  # False: DTensor's own (non-random) arithmetic in the op refuses Partial
    int_dtypes: tuple = ()  # integer / bool dtypes the op takes, besides the float ones
    needs_collectives: bool = False  # control flow depends on a global reduction (real ranks only)
    # PyTorch's own refusals of the call on one device ("Type: message" full-match regexes): the only
    # errors a case may end with, on both paths alike.
    refusals: tuple = ()


def _init(fn, *args, **kwargs):
    return lambda env, shape, dtype: fn(env.empty(shape, dtype), *args, **kwargs)


_SIGNED = (torch.int64, torch.int32, torch.int8)
_EMPTY_FAN = (r"ZeroDivisionError: float division by zero",)
_INTS = _SIGNED + (torch.uint8,)

CASES = [
    Case("Tensor.uniform_", lambda env, s, d: env.empty(s, d).uniform_(-2.0, 3.0)),
    Case("Tensor.normal_", lambda env, s, d: env.empty(s, d).normal_(0.5, 2.0)),
    Case("Tensor.bernoulli_(p)", lambda env, s, d: env.empty(s, d).bernoulli_(0.3), int_dtypes=_INTS + (torch.bool,)),
    Case("Tensor.bernoulli_(tensor)", lambda env, s, d: env.empty(s, d).bernoulli_(env.make(_probabilities(s, d)))),
    Case("torch.bernoulli", lambda env, s, d: torch.bernoulli(env.make(_probabilities(s, d)))),
    Case("torch.bernoulli(x, p)", lambda env, s, d: torch.bernoulli(env.empty(s, d), 0.7)),
    Case("Tensor.random_(from, to)", lambda env, s, d: env.empty(s, d).random_(-5, 17), int_dtypes=_SIGNED),
    Case("Tensor.random_(to)", lambda env, s, d: env.empty(s, d).random_(9), int_dtypes=_INTS),
    Case("Tensor.random_()", lambda env, s, d: env.empty(s, d).random_(), int_dtypes=_INTS + (torch.bool,)),
    Case("init.normal_", _init(torch.nn.init.normal_, 0.1, 0.02)),
    Case("init.uniform_", _init(torch.nn.init.uniform_, -0.5, 0.5)),
    Case("init.kaiming_uniform_", _init(torch.nn.init.kaiming_uniform_, a=math.sqrt(5)), min_ndim=2),
    Case("init.kaiming_normal_", _init(torch.nn.init.kaiming_normal_), min_ndim=2),
    # xavier's std divides by fan_in + fan_out, which is 0 for a tensor with an empty dim 0 or 1.
    Case("init.xavier_uniform_", _init(torch.nn.init.xavier_uniform_), min_ndim=2, refusals=_EMPTY_FAN),
    Case("init.xavier_normal_", _init(torch.nn.init.xavier_normal_), min_ndim=2, refusals=_EMPTY_FAN),
    # std 0.2 within [-2, 2]: no value is ever rejected; std 1 within [-1, 1]: the rejection loop runs
    # until no rank has a value out of range, which takes collectives.
    Case("init.trunc_normal_", _init(torch.nn.init.trunc_normal_, std=0.2)),
    Case("init.trunc_normal_(rejecting)", _init(torch.nn.init.trunc_normal_, a=-1.0, b=1.0), needs_collectives=True),
    # A narrow window (mass < 0.3) takes the other branch: uniform candidates, accepted by a uniform's
    # log. Its empty_like(tensor) buffers keep a Partial placement and DTensor refuses their in-place sub_.
    Case(
        "init.trunc_normal_(narrow)",
        _init(torch.nn.init.trunc_normal_, a=0.5, b=0.7),
        needs_collectives=True,
        partial_ok=False,
    ),
    Case("torch.rand_like", lambda env, s, d: torch.rand_like(env.empty(s, d))),
    Case("torch.randn_like", lambda env, s, d: torch.randn_like(env.empty(s, d))),
    Case(
        "torch.randint_like(low, high)",
        lambda env, s, d: torch.randint_like(env.empty(s, d), 3, 11),
        int_dtypes=_INTS,
    ),
    Case("torch.randint_like(high)", lambda env, s, d: torch.randint_like(env.empty(s, d), 7), int_dtypes=_INTS),
    Case("F.dropout", lambda env, s, d: F.dropout(env.make(_values(s, d)), 0.3, training=True)),
    Case("nn.Dropout", lambda env, s, d: torch.nn.Dropout(0.5)(env.make(_values(s, d)))),
    Case("aten.native_dropout", lambda env, s, d: torch.ops.aten.native_dropout(env.make(_values(s, d)), 0.3, True)),
    Case("uniform_ then randn_like", lambda env, s, d: (env.empty(s, d).uniform_(), torch.randn_like(env.empty(s, d)))),
    Case("dtensor.rand", lambda env, s, d: env.factory("rand", s, d), factory=True),
    Case("dtensor.randn", lambda env, s, d: env.factory("randn", s, d), factory=True),
]
CASES_BY_NAME = {case.name: case for case in CASES}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


# ---- running and comparing --------------------------------------------------------------------------


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def reference(case: Case, shape, dtype, state: torch.Tensor):
    """The single-device result and the generator state after it, or the exception it raised: only
    PyTorch's own refusal of the call (the same error without vescale's generator), and only one the
    case documents in ``refusals``; any other error fails here."""
    vr.set_state(state)
    try:
        with vr.consistent():
            result = _as_tuple(case.run(Plain(), shape, dtype))
    except Exception as error:  # the distributed run must then fail the same way ...
        what = f"{case.name} {dtype} {shape}"
        try:  # ... and only where PyTorch itself refuses the call
            case.run(Plain(), shape, dtype)
        except Exception as own:
            if _error_text(own) != _error_text(error):
                raise AssertionError(f"{what}: vescale raised {error!r}, PyTorch raises {own!r}") from error
            if not any(re.fullmatch(pattern, _error_text(error)) for pattern in case.refusals):
                raise AssertionError(f"{what}: raised {error!r} on one device, not an error the case documents") from error
            return error, vr.get_state()
        raise AssertionError(f"{what}: vescale raised {error!r}, PyTorch does not") from error
    return result, vr.get_state()


def run_distributed(case: Case, env: Dist, shape, dtype, state: torch.Tensor):
    vr.set_state(state)
    try:
        result = _as_tuple(case.run(env, shape, dtype))
    except Exception as error:
        return error, vr.get_state()
    return result, vr.get_state()


def compare(ref, ref_state, out, out_state, mesh, allow_partial: bool = False) -> str | None:
    """None if this rank's results equal their slices of the reference bit for bit and the generator
    advanced exactly as in the single-device run; otherwise what differs.

    A random op never leaves a Partial result, but DTensor's own arithmetic after it may (F.dropout
    multiplies a Partial input by the mask); with ``allow_partial`` such a result is skipped here and
    the caller checks it gathered (full_tensor)."""
    if isinstance(ref, Exception) or isinstance(out, Exception):
        # ``reference`` lets through only PyTorch's own, documented refusals; the distributed run
        # must refuse alike and leave the generator where the single-device run left it.
        if not (isinstance(ref, Exception) and isinstance(out, Exception) and _error_text(ref) == _error_text(out)):
            return f"reference gave {ref!r}, distributed gave {out!r}"
        if not torch.equal(out_state, ref_state):
            return f"after {ref!r}: generator state {out_state.tolist()} != single-device {ref_state.tolist()}"
        return None
    if len(ref) != len(out):
        return f"{len(ref)} results on one device, {len(out)} distributed"
    for i, (r, o) in enumerate(zip(ref, out)):
        if not isinstance(o, DTensor):
            return f"result {i} is a {type(o).__name__}, not a DTensor"
        if o.shape != r.shape or o.dtype != r.dtype:
            return f"result {i}: {tuple(o.shape)} {o.dtype} distributed vs {tuple(r.shape)} {r.dtype}"
        if r.numel() == 0:
            continue  # nothing drawn (nn.init returns empty tensors untouched, Partial placements and all)
        if any(p.is_partial() for p in o.placements):
            if allow_partial:
                continue
            return f"result {i} has Partial placements {o.placements}"
        expected = distribute_tensor(r, mesh, o.placements, src_data_rank=None).to_local()
        if not torch.equal(o.to_local(), expected):
            return f"result {i} ({o.placements}): local shard differs from its slice of the reference"
    if not torch.equal(out_state, ref_state):
        return f"generator state {out_state.tolist()} != single-device {ref_state.tolist()}"
    return None


def destroy_process_group_if_any():
    if dist.is_initialized():
        dist.destroy_process_group()
