"""Placements vescale adds to DTensor's Shard / Replicate / Partial.

``InterleavedShard(dim, interleave)`` (the paper's appendix): ``dim`` is ``interleave`` equal
sections laid end to end (q|k|v of a fused attention projection, gate|up of a fused MLP), and every
section is sharded over the mesh dimension on its own. A rank holds its slice of each section, in
section order, so the model's own ``split`` / ``chunk`` into the sections runs on the local shard.
"""

from .interleaved import InterleavedShard, as_interleaved, interleave_of, is_interleaved
from .nested import blockwise, nest_zero_shards, shard_indices, splits

__all__ = [
    "InterleavedShard", "as_interleaved", "interleave_of", "is_interleaved", "blockwise", "nest_zero_shards", "shard_indices", "splits",
]
