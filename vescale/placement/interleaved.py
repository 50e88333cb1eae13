"""``InterleavedShard``: shard each of ``interleave`` equal sections of a tensor dimension.

Example, a fused q|k|v weight of 6 rows (2 per section) over 2 ranks::

    global rows:  q0 q1 | k0 k1 | v0 v1        InterleavedShard(0, interleave=3)
    rank 0:       q0 k0 v0                     rank 1:  q1 k1 v1

Sharding with ``Shard(0)`` instead would give rank 0 ``q0 q1 k0`` — not a set of heads.

The layout is exactly that of DTensor's ``_StridedShard(dim, split_factor=interleave)`` (chunk the
dim into ``interleave`` pieces, chunk each piece over the mesh dimension, and give rank ``r`` the
``r``-th chunk of every piece), which PyTorch uses internally for FSDP x TP and for flattened
views. ``InterleavedShard`` subclasses it, so DTensor's own machinery serves it unchanged:
``distribute_tensor``, redistribution to and from Replicate (all-gather and re-ordering), local
shapes, pointwise and matmul sharding rules (a linear with an ``InterleavedShard(0, k)`` weight
gives an output interleaved on its last dim), and vescale's RNG (which reads a shard's global
indices with the placement's own ``_select_split_tensor``).

What this class adds is the public name and a checked constructor. DTensor's sharding rules build
their outputs as plain ``_StridedShard``; both compare equal and mean the same layout, so code
should test with :func:`is_interleaved`, not ``type(p) is InterleavedShard``.
"""

from __future__ import annotations

from torch.distributed.tensor import Placement
from vescale._torch import _StridedShard

__all__ = ["InterleavedShard", "is_interleaved", "interleave_of", "as_interleaved"]


class InterleavedShard(_StridedShard):
    """Shard every one of ``interleave`` equal sections of tensor dim ``dim`` over a mesh dimension.

    ``InterleavedShard(0, 3)`` on a fused q|k|v weight splits by heads; ``InterleavedShard(0, 2)``
    on a fused gate|up weight keeps each rank's gate and up rows paired. ``interleave=1`` is
    ``Shard(dim)``. The size of ``dim`` must divide by ``interleave``.
    """

    def __init__(self, dim: int, interleave: int) -> None:
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise TypeError(f"InterleavedShard: dim must be an int, got {dim!r}")
        if not isinstance(interleave, int) or isinstance(interleave, bool) or interleave < 1:
            raise ValueError(
                f"InterleavedShard: interleave must be a positive int (the number of fused sections, "
                f"e.g. 3 for q|k|v), got {interleave!r}"
            )
        super().__init__(dim, split_factor=interleave)

    @property
    def interleave(self) -> int:
        return self._split_factor_int()

    def __reduce__(self):
        # The C++ base pickles by its own constructor, which takes split_factor as a keyword.
        return (InterleavedShard, (self.dim, self.interleave))

    def __deepcopy__(self, memo):
        return InterleavedShard(self.dim, self.interleave)

    def __copy__(self):
        return InterleavedShard(self.dim, self.interleave)

    def __repr__(self) -> str:
        return f"InterleavedShard(dim={self.dim}, interleave={self.interleave})"

    def __str__(self) -> str:
        return f"IS({self.dim}, {self.interleave})"


def is_interleaved(p: Placement) -> bool:
    """True for an ``InterleavedShard`` and for the equal ``_StridedShard`` DTensor's rules produce."""
    return isinstance(p, _StridedShard)


def interleave_of(p: Placement) -> int:
    """The number of sections of an interleaved placement (1 for anything else)."""
    return p._split_factor_int() if isinstance(p, _StridedShard) else 1


def as_interleaved(p: Placement) -> Placement:
    """``p`` with the public type where it is an interleaved shard (for messages and dumps)."""
    if isinstance(p, _StridedShard) and not isinstance(p, InterleavedShard):
        return InterleavedShard(p.dim, p._split_factor_int())
    return p
