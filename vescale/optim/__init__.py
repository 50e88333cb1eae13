"""Stock ``torch.optim`` optimisers stepping DTensor parameters on their local shards.

* ``local_step``: PyTorch's global optimiser step hooks hand an elementwise optimiser (SGD, Adam,
  AdamW, ...) each DTensor parameter's local shard, gradient and state for the step, and put the
  DTensors back after it (updating a shard from its own gradient *is* the global update).
* ``flat``: the shards of a param group stepped as slices of flat buffers (~10 ops a step instead
  of ~10 per parameter, the same bits).

``vescale.dispatch.install()`` (from ``parallelize``) registers the hooks, through
``vescale._torch.PATCHES``; nothing changes at import.
"""

from .flat import FlatLayout, flat_allowed
from .local_step import ELEMENTWISE_OPTIMIZERS, given_params, install_local_optimizer_step, uninstall_local_optimizer_step

__all__ = ["ELEMENTWISE_OPTIMIZERS", "FlatLayout", "flat_allowed", "given_params", "install_local_optimizer_step",
           "uninstall_local_optimizer_step"]
