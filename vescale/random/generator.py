"""vescale's one random-number generator state, shared by every rank and by the single-device run.

The state is the triple a CUDA Philox generator has, plus the virtual device it pretends to run on:
``seed`` (the 64-bit Philox key), ``offset`` (how far previous random ops have advanced the counter)
and the :class:`DeviceProfile` whose thread count decides which Philox counter each element uses.
Every random op reads the state, then advances ``offset`` by an amount that depends only on the op's
*global* shape, so the state moves identically on every rank and in the single-device run.

This module holds the state and its checkpoint form; ``dtensor.py`` and ``consistent.py`` draw from
it, ``checkpointing.py`` replays it for activation checkpointing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vescale.random import kernel
from vescale.random.kernel import DeviceProfile

__all__ = ["manual_seed", "set_device_profile", "device_profile", "get_state", "set_state", "Draw", "reserve"]

_UINT64_LIMIT = 1 << 64
_STATE_LEN = 4  # get_state() layout: [seed (as int64 bits), offset, sm_count, max_threads_per_sm]


@dataclass
class _GeneratorState:
    seed: int | None = None  # None until manual_seed: random ops then refuse to run
    offset: int = 0
    profile: DeviceProfile | None = None  # None: resolved to the default profile on first use
    replaying: int = 0  # checkpointed regions being recomputed now (checkpointing.py)


_state = _GeneratorState()


def default_profile() -> DeviceProfile:
    """The local CUDA device's profile when there is one, else ``kernel.DEFAULT_PROFILE``."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return DeviceProfile(props.multi_processor_count, props.max_threads_per_multi_processor)
    return kernel.DEFAULT_PROFILE


def set_device_profile(sm_count: int, max_threads_per_sm: int) -> None:
    """Set the virtual GPU that random numbers are computed for (call it with the same values on every rank).

    The numbers a CUDA random op draws depend on the GPU's thread count once a tensor has more than
    ``256 * sm_count * (max_threads_per_sm // 256)`` elements. Pin the profile to get the same numbers
    on different hardware, e.g. a CPU single-device reference and a GPU cluster. Call it before
    :func:`vescale.manual_seed`, which checks that all ranks agree on it.
    """
    _state.profile = DeviceProfile(sm_count, max_threads_per_sm)


def device_profile() -> DeviceProfile:
    """The profile random ops use now (resolving the default on first use)."""
    if _state.profile is None:
        _state.profile = default_profile()
    return _state.profile


def manual_seed(seed: int) -> None:
    """Seed the generator and reset its offset; when torch.distributed is initialised, check that
    every rank passed the same seed and has the same device profile (one all-reduce)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not -(1 << 63) <= seed < _UINT64_LIMIT:
        raise ValueError(f"manual_seed: seed must be an int in [-2**63, 2**64), got {seed!r}")
    seed %= _UINT64_LIMIT  # negative seeds wrap the way torch.manual_seed wraps them
    profile = device_profile()
    if dist.is_available() and dist.is_initialized():
        _check_ranks_agree(seed, profile)
    _state.seed, _state.offset = seed, 0


# (default process group, manual_seed calls made under it): the n-th call's meeting point in the store.
_calls: list = [None, 0]


def _meet_every_rank() -> None:
    """Wait, through the process group's store, until every rank has entered this (n-th)
    ``manual_seed``; raise naming the ranks that did not within the collective timeout.

    The seed agreement below is a collective on the default group: entered by some ranks only, it
    would pair with whatever collective the others run next (gloo then aborts the process on the
    size mismatch). Here each rank writes one key and adds one to a counter, and the last to arrive
    releases the others: a constant number of store operations per rank, and no collective until
    every rank is known to be here."""
    from ..mesh import communicates, run_timeout

    if not communicates():  # a fake process group: the other ranks do not exist
        return
    default = dist.distributed_c10d._get_default_group()
    if _calls[0] is not default:
        _calls[:] = [default, 0]
    _calls[1] += 1
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    prefix = f"vescale/manual_seed/{_calls[1]}"
    store.set(f"{prefix}/rank{rank}", "1")
    if store.add(f"{prefix}/arrived", 1) == world:
        store.set(f"{prefix}/all", "1")
    timeout = run_timeout() or timedelta(minutes=10)
    try:
        store.wait([f"{prefix}/all"], timeout)
    except Exception:
        missing = [r for r in range(world) if not store.check([f"{prefix}/rank{r}"])]
        message = (
            f"vescale.manual_seed: ranks {missing} did not call vescale.manual_seed (call {_calls[1]} on this rank, "
            f"{rank}) within {timeout.total_seconds():.0f} s. Every rank must call it, with the same seed, the same "
            "number of times: it sets the one generator all ranks share, and checks that they agree"
        )
        from ..parallel.faults import publish

        publish(f"rank {rank}: RuntimeError: {message}")
        raise RuntimeError(message) from None


def _check_ranks_agree(seed: int, profile: DeviceProfile) -> None:
    _meet_every_rank()
    # One all-reduce of [x, -x] with MAX gives every rank (max, -min); they agree iff max == min.
    # The seed travels as two 32-bit halves so that no value overflows int64.
    mine = [seed >> 32, seed & 0xFFFFFFFF, profile.sm_count, profile.max_threads_per_sm]
    device = _collective_device()
    both = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, neg_low = both[:4].tolist(), both[4:].tolist()
    low = [-v for v in neg_low]
    if high[:2] != low[:2]:
        lo_seed, hi_seed = (low[0] << 32) | low[1], (high[0] << 32) | high[1]
        raise RuntimeError(
            f"vescale.manual_seed: ranks passed different seeds (this rank {seed}; seeds range from "
            f"{min(lo_seed, hi_seed)} to {max(lo_seed, hi_seed)}). Pass the same seed on every rank: "
            "single-device semantics needs one generator for the whole job."
        )
    if high[2:] != low[2:]:
        raise RuntimeError(
            f"vescale.manual_seed: ranks have different device profiles (this rank {profile}; sm_count "
            f"ranges {low[2]}..{high[2]}, max_threads_per_sm {low[3]}..{high[3]}). Call "
            "vescale.random.set_device_profile(sm_count, max_threads_per_sm) with the same values on "
            "every rank before manual_seed."
        )


def _collective_device() -> torch.device:
    # NCCL only reduces CUDA tensors; every other backend (gloo, fake, mixed "cpu:gloo,cuda:nccl") takes CPU ones.
    backend = str(dist.get_backend())
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class Draw:
    """Where one random op reads the generator: the key, the offset before the op, and the profile."""

    seed: int
    offset: int
    profile: DeviceProfile


class reserve:
    """``with reserve(kind, dtype, global_shape, **params) as draw:`` takes the generator position for one
    random op over a tensor of ``global_shape`` (``draw`` is a :class:`Draw`) and advances the offset past
    it, exactly as a CUDA launch over the whole tensor would. If the block raises, the offset goes back: a
    failed op draws nothing. ``params`` are the kernel's (bernoulli's ``p`` may be a tensor: that kernel
    advances the offset differently). A class rather than a generator-based context manager: it runs for
    every random op, and this is the cheaper form."""

    __slots__ = ("_draw",)

    def __init__(self, kind: str, dtype: torch.dtype, global_shape, **params):
        if _state.seed is None:
            raise RuntimeError(
                "vescale.random: the generator is not seeded. Call vescale.manual_seed(seed) with the same "
                "seed on every rank (and in the single-device reference run) before random ops on DTensors "
                "or inside vescale.random.consistent()."
            )
        if _state.replaying == 0 and torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                "vescale.random: a random op ran during backward, which is where activation checkpointing "
                "recomputes a region's forward. PyTorch's checkpoint restores only its own generators, so "
                "the recomputation would draw other numbers than the forward did (wrong gradients). Pass "
                "context_fn=vescale.random.checkpoint_context with use_reentrant=False, e.g. "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False, "
                "'context_fn': vescale.random.checkpoint_context}) for a HuggingFace model."
            )
        profile = device_profile()
        self._draw = Draw(_state.seed, _state.offset, profile)
        # 0 for an empty tensor: CUDA returns early without touching the generator.
        _state.offset += kernel.offset_increment(kind, dtype, math.prod(global_shape), profile, **params)

    def __enter__(self) -> Draw:
        return self._draw

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None:
            _state.offset = self._draw.offset


def get_state() -> torch.Tensor:
    """The generator state as a 4-element int64 CPU tensor: [seed, offset, sm_count, max_threads_per_sm].

    The seed is stored as the int64 with the same 64 bits. The tensor is equal on every rank, so it can
    go into ``torch.save`` or a ``torch.distributed.checkpoint`` state dict as it is.
    """
    if _state.seed is None:
        raise RuntimeError("vescale.random.get_state: the generator is not seeded; call vescale.manual_seed first")
    profile = device_profile()
    seed_bits = _state.seed - _UINT64_LIMIT if _state.seed >= 1 << 63 else _state.seed
    return torch.tensor([seed_bits, _state.offset, profile.sm_count, profile.max_threads_per_sm], dtype=torch.int64)


def set_state(state: torch.Tensor) -> None:
    """Restore a state returned by :func:`get_state` (seed, offset and device profile)."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.int64 or tuple(state.shape) != (_STATE_LEN,):
        got = f"{type(state).__name__} {getattr(state, 'dtype', '')} {tuple(getattr(state, 'shape', ()))}"
        raise ValueError(
            f"vescale.random.set_state: expected the 4-element int64 tensor from get_state(), got {got}"
        )
    seed_bits, offset, sm_count, max_threads = (int(v) for v in state.cpu().tolist())
    if offset < 0 or offset % 4:
        raise ValueError(f"vescale.random.set_state: offset must be a non-negative multiple of 4, got {offset}")
    set_device_profile(sm_count, max_threads)
    _state.seed, _state.offset = seed_bits % _UINT64_LIMIT, offset

