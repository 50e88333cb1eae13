"""The data contract at the root: what the ranks pass the model must fit the plan and agree.

vescale takes each root input in one of two modes, chosen per input by the plan:

* **global batch** (``plan.shard("<in>[input_ids]", Shard(0), mesh="DP")``): a plain tensor passed to
  the root is the *global* tensor, identical on every rank, and the plan slices it. A rank fed its
  own part of the data (the ``DistributedSampler`` habit) breaks that silently: under DP half of each
  rank's batch is dropped, under TP the ranks compute with different activations.
* **per-rank share** (``plan.annotate("<in>[input_ids]", Shard(0), mesh="DP")``, the zoo plans'
  ``local_inputs=True``): each rank passes only its share along the annotated mesh dims (what
  ``vescale.data`` loads); ranks that differ only along the other mesh dims (TP peers) pass the same
  share, and all shares have one shape (``DTensor.from_local`` takes even shares).

So the root pre-hook:

* checks, with no communication, that every root input the plan splits can be split evenly: a
  ``Shard(d)`` over mesh dims of total size n needs ``size(d) % n == 0`` (otherwise DTensor fails
  deep inside the model, naming neither the input nor the mesh dim);
* compares cheap exact checksums (shapes, dtypes and raw bits) on the first ``FIRST_STEPS`` forward
  calls and whenever the inputs' shapes change: the global inputs' values and every input's shape
  across all ranks with one all-reduce; per-rank shares with one all-reduce per mesh dim of size > 1
  on that dim's group (peers must agree; identical shares along every split dim are a global batch
  fed in the per-rank mode). ``check_inputs="always"`` (the debug mode) compares on every call,
  ``"off"`` never. A steady step with unchanged shapes adds no collective; a checked one a fixed
  number of small ones, whatever the world size. Only a failed check gathers from every rank, to
  name who differs.
"""

from __future__ import annotations

import re
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from vescale._torch import _is_shard_like

from ..plan.ir import Entry
from ..plan.lower import KeyPattern

__all__ = ["InputContract", "DataContractError", "checksum", "fingerprint_parts", "fingerprint_of", "FIRST_STEPS", "MODES"]

FIRST_STEPS = 2
MODES = ("auto", "always", "off")
_SLOTS = 16  # inputs compared one by one; more are folded into the last slot
_SAMPLED_WORDS = 4096  # the step check's fingerprint reads at most this many 32-bit words of a tensor

# How to choose between the two modes: ends every contract error about what the ranks passed.
_TWO_MODES = (
    "vescale takes each root input in one of two modes. Global batch (plan.shard('<in>[input_ids]', Shard(0), "
    "mesh='DP')): give every rank the same global batch (same seed, same order) and the plan splits it; do not "
    "shard the data yourself, e.g. with DistributedSampler. Per-rank share (plan.annotate('<in>[input_ids]', "
    "Shard(0), mesh='DP'); zoo plans: local_inputs=True): each data-parallel rank passes only its rows, every "
    "share of one shape, and ranks that differ only along other mesh dims (TP) the same rows; "
    "vescale.data.GlobalBatchSampler(dataset, global_batch_size, mesh, dims='DP') loads them, keyed by the "
    "data-parallel coordinate, not the global rank. The global batch is the simpler; the per-rank share spares "
    "each rank reading and decoding the whole batch (large DP)"
)


class DataContractError(RuntimeError):
    """Ranks were given root inputs that disagree, or inputs the plan cannot split."""


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


def _signature(inputs: list[tuple[str, torch.Tensor]]) -> tuple:
    return tuple((n, tuple(t.shape), t.dtype) for n, t in inputs)


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _slotted(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Checksums of ``tensors`` in ``_SLOTS`` fixed slots (more folded into the last): one length
    on every rank whatever each passed, so a collective over them cannot mismatch."""
    v = torch.zeros(2 * _SLOTS, dtype=torch.int64)
    for i, t in enumerate(tensors):
        slot = 2 * min(i, _SLOTS - 1)
        v[slot: slot + 2] += checksum([t.cpu()])
    return v


def _equal_max(v: torch.Tensor, group=None) -> torch.Tensor:
    """Per element: whether every rank of ``group`` holds the same value (one all-reduce MAX of
    ``v`` and ``-v``)."""
    both = torch.cat([v, -v])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return both[: len(v)] == -both[len(v):]


def _ranks(ranks: list[int]) -> str:
    """A rank list for a message, shortened at large worlds."""
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:6]))}, ... ({len(ranks)} ranks)]"


def _code(p) -> str:
    """A placement as plan code: Shard(0), Replicate()."""
    return f"Shard({p.dim})" if type(p) is Shard else "Replicate()" if p.is_replicate() else repr(p)


def _groups(items: dict[int, object]) -> dict[object, list[int]]:
    """{value: [rank, ...]} from {rank: value}, in rank order."""
    out: dict[object, list[int]] = {}
    for r, v in items.items():
        out.setdefault(v, []).append(r)
    return out


class InputContract:
    """Called by the root pre-hook with the root's ``(args, kwargs)`` before the plan touches them."""

    def __init__(self, entries: list[Entry], arg_names: list[str], mesh: DeviceMesh, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"parallelize: check_inputs must be one of {MODES}, got {mode!r}")
        self.mesh, self.names, self.mode = mesh, arg_names, mode
        self.splits = [e for e in entries if e.action == "redist"]
        # Inputs a plan.annotate takes as this rank's local share: they differ across ranks by design.
        self.local_shards = [e for e in entries if e.action == "annotate" and any(p is not None and not p.is_replicate() for p in e.targets)]
        self.calls = 0
        self.signature: tuple | None = None
        self._deferred: tuple | None = None  # a GPU call's fingerprint in flight: (head, pinned sums, event)

    def _global_inputs(self, args, kwargs) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of the plain root inputs that stand for global tensors (not those a
        ``plan.annotate`` takes as this rank's local shard)."""
        inputs = _plain_inputs(args, kwargs, self.names)
        if self.local_shards:
            local = {n for _, n in self._named(self.local_shards, dict(inputs))}
            inputs = [(n, t) for n, t in inputs if n not in local]
        return inputs

    def __call__(self, args, kwargs) -> None:
        inputs = _plain_inputs(args, kwargs, self.names)
        shares = {n: e.targets for e, n in self._named(self.local_shards, dict(inputs))}
        self._check_splittable(dict(inputs), shares)
        if self.mode == "off" or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        signature = _signature(inputs)
        due = self._due(signature)
        self.calls += 1
        if due:
            self._check_agreement(inputs, shares, signature)
            self.signature = signature

    def _due(self, signature) -> bool:
        """Whether this call compares the inputs across ranks (first calls, a shape change, or always)."""
        return self.mode == "always" or self.calls < FIRST_STEPS or signature != self.signature

    def fingerprint(self, args: tuple, kwargs: dict) -> int:
        """The step check's fingerprint (``fingerprint_parts``) of this forward call's global plain
        inputs; 0 with ``check_inputs="off"``, where the ranks' inputs may differ by design.

        Inputs on a GPU: reading their values now would wait for everything queued on the stream
        before them (the previous step), so this call's sums are copied out without waiting and the
        fingerprint returned is the previous call's (a skipped batch is then found one call later)."""
        if self.mode == "off":
            return 0
        if self._due(_signature(_plain_inputs(args, kwargs, self.names))):
            # The contract compares this call's inputs exactly, right after the step check, and
            # names the input and the ranks that differ: leave the verdict to it. (A rank not due
            # sends its fingerprint, not 0: the ranks then differ in shapes, and the step check
            # stops all of them before the contract's collective, which only some would enter.)
            self._deferred = None
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

    def _named(self, entries: list[Entry], inputs: dict[str, torch.Tensor]):
        """(entry, input name) for every root input one of ``entries`` names in this call (a key of
        a ``**kwargs`` forward is a regex over the keywords passed)."""
        for e in entries:
            if isinstance(e.key, KeyPattern):
                names = [n for n in inputs if re.fullmatch(e.key, n)]
            else:
                names = [e.key if isinstance(e.key, str) else self.names[e.key] if e.key < len(self.names) else f"args[{e.key}]"]
            yield from ((e, n) for n in names if n in inputs)

    def _check_splittable(self, inputs: dict[str, torch.Tensor], shares: dict[str, tuple]) -> None:
        for e, name in self._named(self.splits, inputs):
            t, share = inputs[name], shares.get(name)
            ways: dict[int, list[tuple[str, int]]] = {}
            for i, p in enumerate(e.targets):
                if share is not None and share[i] is not None and not share[i].is_replicate():
                    continue  # this rank's share is already split on mesh dim i: the plan splits nothing there
                if isinstance(p, Shard):
                    ways.setdefault(p.dim % max(t.ndim, 1), []).append((self.mesh.mesh_dim_names[i], self.mesh.size(i)))
            for d, dims in ways.items():
                n = 1
                for _, size in dims:
                    n *= size
                if d < t.ndim and t.shape[d] % n:
                    over = " x ".join(f"{dim!r} ({size})" for dim, size in dims)
                    lower, upper = t.shape[d] // n * n, (t.shape[d] // n + 1) * n
                    what = f"root input {name!r}" + (" (this rank's share)" if share is not None else "")
                    raise DataContractError(
                        f"{what} has size {t.shape[d]} along dim {d}, which the plan splits over "
                        f"mesh dim {over}: {n} equal parts are impossible. Make it a multiple of {n} (e.g. "
                        f"{lower or n} or {upper}; drop or pad the last incomplete batch, e.g. drop_last=True), "
                        f"or change the plan for this input"
                    )

    def _check_agreement(self, inputs, shares: dict[str, tuple], signature) -> None:
        """Global inputs' values and every input's shape and dtype equal on all ranks (one
        all-reduce over the world); per-rank shares checked along each mesh dim (``_compare_shares``).
        Their verdicts travel in the world all-reduce, so every rank knows the outcome alike: all
        raise together and none waits in a collective the others skip."""
        whole = [t for n, t in inputs if n not in shares]
        local = [(n, t) for n, t in inputs if n in shares]
        on = torch.device("cuda", torch.cuda.current_device()) if self.mesh.device_type == "cuda" else torch.device("cpu")
        header = torch.tensor([_crc(repr([(n, s, str(dt)) for n, s, dt in signature]))])
        peers_differ, duplicated = self._compare_shares([shares[n] for n, _ in local], _slotted([t for _, t in local]), on)
        # Flags ride along as -flag: a rank that raised one makes its -(-1) = 1 the MAX of the negated half.
        mine = torch.cat([header, _slotted(whole), torch.tensor([-int(peers_differ), -int(not duplicated)])])
        equal = _equal_max(mine.to(on)).cpu()
        peers_differ = not equal[-2] or peers_differ
        duplicated = bool(local) and equal[-1] and duplicated
        if bool(equal[:-2].all()) and not peers_differ and not duplicated:
            return
        # Every rank reached the same verdict, so all of them take this second collective.
        everyone = [None] * dist.get_world_size()
        sums = {n: tuple(checksum([t.cpu()]).tolist()) for n, t in inputs}
        dist.all_gather_object(everyone, ([(n, tuple(s), str(dt)) for n, s, dt in signature], sums, tuple(self.mesh.get_coordinate())))
        raise DataContractError(self._explain(everyone, shares))

    def _compare_shares(self, placements: list[tuple], sums: torch.Tensor, on: torch.device) -> tuple[bool, bool]:
        """Per-rank shares along each mesh dim of size > 1, on its group: peers (a share not split
        there) must pass equal shares; ranks along a split dim passing identical shares, on every
        split dim, are a global batch fed in the per-rank mode. Returns (some peers of this rank
        differ, every split dim found identical shares around this rank)."""
        if not self.local_shards:  # the plan's statements, not this call's inputs: the same on every rank
            return False, False
        slots = [min(j, _SLOTS - 1) for j in range(len(placements))]
        peers_differ, split_dims, duplicated_dims = False, 0, 0
        for i in range(self.mesh.ndim):
            if self.mesh.size(i) == 1:
                continue
            group = self.mesh.get_group(i)
            same = _equal_max(sums.to(on), group).cpu().view(_SLOTS, 2).all(dim=1)
            peers_differ |= any(not same[s] for s, p in zip(slots, placements) if p[i] is None or p[i].is_replicate())
            split = [s for s, p in zip(slots, placements) if p[i] is not None and _is_shard_like(p[i])]
            # The fake process group does not communicate: there, equal proves nothing.
            if split and dist.get_backend(group) != "fake":
                split_dims += 1
                duplicated_dims += all(bool(same[s]) for s in split)
        return peers_differ, split_dims > 0 and duplicated_dims == split_dims

    # -- messages (the error path only) -----------------------------------------------------------

    def _explain(self, everyone, shares: dict[str, tuple]) -> str:
        """``everyone[r]``: rank r's (signature, {input: checksum}, mesh coordinate)."""
        names = [n for n, _, _ in everyone[0][0]]
        for name in dict.fromkeys(names + [n for sig, _, _ in everyone for n, _, _ in sig]):
            seen = _groups({r: next(((s, dt) for n, s, dt in sig if n == name), None) for r, (sig, _, _) in enumerate(everyone)})
            if len(seen) > 1:
                shown = "; ".join(f"ranks {_ranks(rs)}: {'not passed' if k is None else f'shape {k[0]}, {k[1]}'}" for k, rs in seen.items())
                if name in shares:
                    return (
                        f"root input {name!r} is this rank's share ({self._placed(shares[name])}), and every rank's share "
                        f"must have one shape and dtype (the global tensor is the shares put together), but {shown}. "
                        f"Give every rank an equal share: drop or pad an uneven last batch (drop_last=True). {_TWO_MODES}"
                    )
                return f"ranks passed root input {name!r} with different shapes or dtypes ({shown}). {_TWO_MODES}"
        for name in names:
            if name in shares:
                continue
            values = _groups({r: sums[name] for r, (_, sums, _) in enumerate(everyone)})
            if len(values) > 1:
                parts = " vs ".join(f"ranks {_ranks(rs)}" for rs in values.values())
                hint = (
                    f" The plan takes {sorted(shares)} as per-rank shares and every other root input as the global tensor, "
                    f"the same on every rank: if {name!r} is a per-rank share too, annotate it like them "
                    f"({self._annotation(name, next(iter(shares.values())))}; zoo plans: local_inputs="
                    f"{sorted(shares) + [name]}), else pass every rank the same {name!r}."
                    if shares else ""
                )
                return f"root input {name!r} differs across ranks ({parts} hold different values).{hint} {_TWO_MODES}"
        for name in names:
            if name in shares:
                msg = self._explain_peers(everyone, name, shares[name])
                if msg:
                    return msg
        name = next(n for n in names if n in shares)
        shape = next(s for n, s, _ in everyone[0][0] if n == name)
        split = [d for d, p, size in zip(self.mesh.mesh_dim_names, shares[name], self.mesh.shape) if p is not None and _is_shard_like(p) and size > 1]
        return (
            f"every rank along mesh dim(s) {split} passed the same {sorted(shares)} (e.g. {name!r} of shape {shape}), but the "
            f"plan takes them as this rank's share ({self._placed(shares[name])}): the model would train on copies of one "
            f"batch. Pass each rank only its rows (vescale.data.GlobalBatchSampler), or pass the global batch in the "
            f"global-batch mode (plan.shard instead of plan.annotate; zoo plans: local_inputs=False). If identical shares "
            f"are meant (a benchmark on constant data), pass parallelize(..., check_inputs='off'). {_TWO_MODES}"
        )

    def _explain_peers(self, everyone, name: str, placed: tuple) -> str | None:
        """Ranks that differ only along a mesh dim the share is not split on, holding different values."""
        for i, p in enumerate(placed):
            if self.mesh.size(i) == 1 or not (p is None or p.is_replicate()):
                continue
            peers = _groups({r: tuple(c for k, c in enumerate(coord) if k != i) for r, (_, _, coord) in enumerate(everyone)})
            for ranks in peers.values():
                values = _groups({r: everyone[r][1][name] for r in ranks})
                if len(values) > 1:
                    dim = self.mesh.mesh_dim_names[i]
                    parts = " vs ".join(f"ranks {_ranks(rs)}" for rs in values.values())
                    return (
                        f"root input {name!r} is this rank's share ({self._placed(placed)}), so ranks that differ only along "
                        f"mesh dim {dim!r} must pass the same share, but {dim!r} peers {parts} hold different values. Key the "
                        f"data by the data-parallel coordinate, not the global rank (vescale.data.GlobalBatchSampler(dataset, "
                        f"global_batch_size, mesh, dims=...) does). {_TWO_MODES}"
                    )
        return None

    def _annotation(self, name: str, placed: tuple) -> str:
        """The plan statement that takes input ``name`` as a share laid out as ``placed``."""
        split = [(i, p) for i, p in enumerate(placed) if p is not None and not p.is_replicate()]
        if len(split) == 1:
            i, p = split[0]
            return f"plan.annotate('<in>[{name}]', {_code(p)}, mesh={self.mesh.mesh_dim_names[i]!r})"
        return f"plan.annotate('<in>[{name}]', [{', '.join(_code(p) if p is not None else 'Replicate()' for p in placed)}])"

    def _placed(self, placed: tuple) -> str:
        from ..plan.api import placement_str

        parts = [f"{placement_str(p)} on {d!r}" for p, d in zip(placed, self.mesh.mesh_dim_names) if p is not None and not p.is_replicate()]
        return "annotated " + ", ".join(parts)
