"""The data contract at the root: every rank is given the same global batch, and the plan can split it.

vescale takes a plain tensor passed to the root module as the *global* tensor, identical on every
rank, and slices it as the plan says. A rank fed its own part of the data (the ``DistributedSampler``
habit) breaks that silently: under DP half of each rank's batch is dropped, under TP the ranks compute
with different activations. So the root pre-hook:

* checks, with no communication, that every root input the plan shards can be split evenly: a
  ``Shard(d)`` over mesh dims of total size n needs ``size(d) % n == 0`` (otherwise DTensor fails
  deep inside the model, naming neither the input nor the mesh dim);
* compares a cheap exact checksum of every plain-tensor input (shapes, dtypes and raw bits) across all
  ranks with one all-reduce, on the first ``FIRST_STEPS`` forward calls and whenever the inputs'
  shapes change; ``check_inputs="always"`` (the debug mode) does it on every call, ``"off"`` never.
  A steady step with unchanged shapes adds no collective.
"""

from __future__ import annotations

import re
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..plan.ir import Entry
from ..plan.lower import KeyPattern

__all__ = ["InputContract", "DataContractError", "checksum", "fingerprint_parts", "fingerprint_of", "FIRST_STEPS", "MODES"]

FIRST_STEPS = 2
MODES = ("auto", "always", "off")
_SLOTS = 16  # inputs compared one by one; more are folded into the last slot
_SAMPLED_WORDS = 4096  # the step check's fingerprint reads at most this many 32-bit words of a tensor


class DataContractError(RuntimeError):
    """Ranks were given different root inputs, or inputs the plan cannot split."""


def checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Exact, order-independent integer checksums (two per tensor) of the raw bits."""
    sums = []
    for t in tensors:
        raw = t.detach().contiguous().view(-1)
        words = raw.view(torch.int32) if raw.numel() * raw.element_size() % 4 == 0 else raw.view(torch.uint8)
        weights = torch.arange(words.numel(), dtype=torch.int64) % 65521 + 1
        # int64 sums of 32-bit words cannot overflow below 2**31 words per tensor.
        sums += [words.sum(dtype=torch.int64), (words * weights).sum()]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def fingerprint_parts(tensors: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
    """The step check's fingerprint of the tensors' shapes, dtypes and bits, in two parts: an int
    for the shapes and dtypes, and per tensor a pair of int64 sums (on the tensor's device) over at
    most ``_SAMPLED_WORDS`` evenly spaced 32-bit words of it, so that the cost does not grow with the
    batch. ``fingerprint`` folds them into one int. Equal tensors give equal fingerprints; another
    batch almost surely another (not a proof of equality: ``checksum`` reads every bit)."""
    sums = []
    for t in tensors:
        raw = t.detach().reshape(-1)
        if raw.numel() == 0:
            continue
        if not raw.is_contiguous():
            raw = raw.contiguous()
        words = raw.view(torch.int32) if raw.numel() * raw.element_size() % 4 == 0 else raw.view(torch.uint8)
        if words.numel() > _SAMPLED_WORDS:
            words = words[:: words.numel() // _SAMPLED_WORDS][:_SAMPLED_WORDS]
        weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
        sums.append(torch.stack([(words * weights).sum(), words.sum(dtype=torch.int64)]))
    return _crc(repr([(tuple(t.shape), str(t.dtype)) for t in tensors])), sums


def fingerprint_of(head: int, sums: list[int]) -> int:
    """Fold ``fingerprint_parts`` (the sums read back as ints) into one int below 2**62."""
    total = head
    for s in sums:
        total = (total * 1000003 + s) & ((1 << 62) - 1)
    return total


def _plain_inputs(args, kwargs, names: list[str]) -> list[tuple[str, torch.Tensor]]:
    named = [(names[i] if i < len(names) else f"args[{i}]", a) for i, a in enumerate(args)]
    named += list(kwargs.items())
    return [(n, t) for n, t in named if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)]


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


class InputContract:
    """Called by the root pre-hook with the root's ``(args, kwargs)`` before the plan touches them."""

    def __init__(self, entries: list[Entry], arg_names: list[str], mesh: DeviceMesh, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"parallelize: check_inputs must be one of {MODES}, got {mode!r}")
        self.mesh, self.names, self.mode = mesh, arg_names, mode
        self.splits = [e for e in entries if e.action == "redist"]
        # Inputs a plan.annotate takes as this rank's local shard: they differ across ranks by design.
        self.local_shards = [e for e in entries if e.action == "annotate" and any(p is not None and not p.is_replicate() for p in e.targets)]
        self.calls, self.signature = 0, None
        self._deferred = None  # a GPU call's fingerprint in flight: (head, pinned sums, event)

    def _global_inputs(self, args, kwargs) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the plain root inputs that stand for global tensors (not those a
        ``plan.annotate`` takes as this rank's local shard)."""
        inputs = _plain_inputs(args, kwargs, self.names)
        if self.local_shards:
            local = {n for _, n in self._named(self.local_shards, dict(inputs))}
            inputs = [(n, t) for n, t in inputs if n not in local]
        return inputs

    def __call__(self, args, kwargs) -> None:
        inputs = self._global_inputs(args, kwargs)
        self._check_splittable(dict(inputs))
        if self.mode == "off" or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        signature = tuple((n, tuple(t.shape), t.dtype) for n, t in inputs)
        due = self.mode == "always" or self.calls < FIRST_STEPS or signature != self.signature
        self.calls += 1
        if due:
            self._check_same_everywhere(inputs, signature)
            self.signature = signature

    def fingerprint(self, args, kwargs) -> int:
        """The step check's fingerprint (``fingerprint_parts``) of this forward call's global plain
        inputs; 0 with ``check_inputs="off"``, where the ranks' inputs may differ by design.

        Inputs on a GPU: reading their values now would wait for everything queued on the stream
        before them (the previous step), so this call's sums are copied out without waiting and the
        fingerprint returned is the previous call's (a skipped batch is then found one call later)."""
        if self.mode == "off":
            return 0
        head, sums = fingerprint_parts([t for _, t in self._global_inputs(args, kwargs)])
        if not sums:
            return head
        both = torch.cat(sums)
        if both.device.type == "cpu":
            return fingerprint_of(head, both.tolist())
        previous, self._deferred = self._deferred, None
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        host.copy_(both, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._deferred = (head, host, done)
        if previous is None:
            return 0
        head, host, done = previous
        done.synchronize()
        return fingerprint_of(head, host.tolist())

    def _split_inputs(self, inputs: dict[str, torch.Tensor]):
        """(entry, input name) for every root input a shard statement names in this call."""
        return self._named(self.splits, inputs)

    def _named(self, entries: list[Entry], inputs: dict[str, torch.Tensor]):
        """(entry, input name) for every root input one of ``entries`` names in this call (a key of
        a ``**kwargs`` forward is a regex over the keywords passed)."""
        for e in entries:
            if isinstance(e.key, KeyPattern):
                names = [n for n in inputs if re.fullmatch(e.key, n)]
            else:
                names = [e.key if isinstance(e.key, str) else self.names[e.key] if e.key < len(self.names) else f"args[{e.key}]"]
            yield from ((e, n) for n in names if n in inputs)

    def _check_splittable(self, inputs: dict[str, torch.Tensor]) -> None:
        for e, name in self._split_inputs(inputs):
            t = inputs[name]
            ways: dict[int, list[tuple[str, int]]] = {}
            for i, p in enumerate(e.targets):
                if isinstance(p, Shard):
                    ways.setdefault(p.dim % max(t.ndim, 1), []).append((self.mesh.mesh_dim_names[i], self.mesh.size(i)))
            for d, dims in ways.items():
                n = 1
                for _, size in dims:
                    n *= size
                if d < t.ndim and t.shape[d] % n:
                    over = " x ".join(f"{name!r} ({size})" for name, size in dims)
                    lower, upper = t.shape[d] // n * n, (t.shape[d] // n + 1) * n
                    raise DataContractError(
                        f"root input {name!r} has size {t.shape[d]} along dim {d}, which the plan splits over "
                        f"mesh dim {over}: {n} equal parts are impossible. Make it a multiple of {n} (e.g. "
                        f"{lower or n} or {upper}; drop or pad the last incomplete batch, e.g. drop_last=True), "
                        f"or change the plan for this input"
                    )

    def _check_same_everywhere(self, inputs, signature) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if self.mesh.device_type == "cuda" else "cpu"
        mine = self._vector(inputs, signature)
        both = torch.cat([mine, -mine]).to(device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        both = both.cpu()
        if torch.equal(both[: len(mine)], -both[len(mine):]):
            return
        # Disagreement is seen by every rank alike, so all of them take this second collective.
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, [(n, tuple(s), str(dt)) for n, s, dt in signature]))
        raise DataContractError(self._explain(everyone))

    @staticmethod
    def _vector(inputs, signature) -> torch.Tensor:
        header = _crc(repr([(n, s, str(dt)) for n, s, dt in signature]))
        v = torch.zeros(1 + 2 * _SLOTS, dtype=torch.int64)
        v[0] = header
        for i, (_, t) in enumerate(inputs):
            slot = min(i, _SLOTS - 1)
            v[1 + 2 * slot: 3 + 2 * slot] += checksum([t.cpu()])
        return v

    @staticmethod
    def _explain(everyone) -> str:
        fix = (
            "vescale takes a plain tensor passed to the model as the whole global batch, identical on every "
            "rank, and splits it as the plan says: give every rank the same global batch (same seed, same "
            "order; do not shard the data yourself, e.g. with DistributedSampler)"
        )
        signatures = [sig for _, sig in everyone]
        if any(sig != signatures[0] for sig in signatures):
            shown = "; ".join(f"rank {r}: {sig}" for r, sig in enumerate(signatures))
            return f"ranks passed root inputs of different names, shapes or dtypes ({shown}). {fix}"
        for i, (name, _, _) in enumerate(signatures[0]):
            slot = 1 + 2 * min(i, _SLOTS - 1)
            groups: dict[tuple, list[int]] = {}
            for r, (vec, _) in enumerate(everyone):
                groups.setdefault(tuple(vec[slot: slot + 2].tolist()), []).append(r)
            if len(groups) > 1:
                parts = " vs ".join(f"ranks {ranks}" for ranks in groups.values())
                return f"root input {name!r} differs across ranks ({parts} hold different values). {fix}"
        return f"root inputs differ across ranks. {fix}"
