"""The fast path: the same decisions DTensor's own dispatch makes, for less CPU time.

A sharding cache keyed without sizes (``cache``, with ``viewkey`` and ``zerocost`` saying which
decisions hold at every size, ``unitdims`` deciding on a mesh without its size-1 dims), cheap
misses (``search``), replayed decisions for ops that take sizes (``sized``), a shorter argument
unwrap (``unwrap``), a one-view Replicate -> Shard (``pick``), and strategies that keep tensors
local where PyTorch's would move them (``interleaved``, ``partial``, ``viewrule``). Patched under
the owner ``dispatch.fast``: ``vescale.dispatch.uninstall(keep_coverage=True)`` takes it away.
"""
