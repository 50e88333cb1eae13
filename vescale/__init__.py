"""vescale: train an unchanged single-device PyTorch model on many devices from a short plan.

    mesh = vescale.init_mesh((2, 2), ("DP", "TP"))
    vescale.manual_seed(0)
    model = vescale.parallelize(MyModel(), plan, mesh)

The public surface is small on purpose; everything else lives in one package per concept:
``plan`` (VescalePlan and its IR), ``parallel`` (parallelize), ``random`` (single-device-semantic
distributed RNG), ``dispatch`` (fast eager DTensor dispatch), ``static`` (Static Eager mode),
``comm`` (gradient reduction), ``placement`` (InterleavedShard), ``init`` (deferred initialisation of
meta-device models), ``checkpoint`` (save / load / resume), ``data`` (each data-parallel rank
loading only its share of the batch), ``zoo`` (ready models and plans).
"""

from . import _torch  # noqa: F401  (first: warns on a PyTorch release vescale is not built on)
from torch.distributed.tensor import Partial, Replicate, Shard

from . import dispatch, static  # packages users reach as vescale.dispatch / vescale.static
from . import checkpoint  # vescale.checkpoint.save / load
from . import data  # vescale.data.GlobalBatchSampler: per-rank batches
from .comm.grad import no_grad_sync
from .mesh import adopt_mesh, init_mesh
from .parallel import OutOfStepError, explain, parallelize
from .placement import InterleavedShard
from .plan import INIT, RUN, PlanError, VescalePlan
from .precision import MixedPrecision, apply_mixed_precision


def uninstall() -> None:
    """Undo every change vescale has made to PyTorch in this process (DTensor's dispatch tables, the
    RNG tracker, global optimiser hooks, this thread's implicit replication): DTensor behaves as
    stock PyTorch again. Models parallelized before need vescale's changes: ``parallelize`` and
    ``manual_seed`` put them back."""
    from ._torch import PATCHES

    dispatch.uninstall()
    PATCHES.undo()


def manual_seed(seed: int) -> None:
    """Seed vescale's distributed RNG on every rank (see ``vescale.random.manual_seed``)."""
    from . import random

    random.manual_seed(seed)


__all__ = [
    "init_mesh", "adopt_mesh", "VescalePlan", "parallelize", "explain", "manual_seed", "no_grad_sync",
    "Shard", "Replicate", "Partial", "INIT", "RUN", "PlanError", "InterleavedShard",
    "checkpoint", "data", "dispatch", "static", "OutOfStepError", "uninstall", "MixedPrecision", "apply_mixed_precision",
]
