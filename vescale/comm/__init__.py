"""Communication for gradients and ZeRO-3: bucketed, N-D fused, overlapped.

``grad`` (``GradReducer``, ``attach_grad_reduction``, ``no_grad_sync``): gradients reduced to their
parameters' placements, one collective per bucket. ``layout``: which single collective turns one
DTensor layout into another. ``groups``: flattened sub-mesh process groups, made once. ``gather``:
ZeRO-3 gathers, one collective per parameter or per unit of parameters. ``direct``: the collectives
themselves, called on the process group without torch.distributed's per-call wrappers.
"""

from .grad import DEFAULT_BUCKET_MB, GradReducer, attach_grad_reduction, no_grad_sync

__all__ = ["DEFAULT_BUCKET_MB", "GradReducer", "attach_grad_reduction", "no_grad_sync"]
