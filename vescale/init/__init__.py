"""Deferred initialisation: build a model on the meta device, parallelize it, and each rank
allocates and initialises only its own shards, with the values one device would give.

    with torch.device("meta"):
        model = Model(config)                 # no memory, no random draws
    vescale.manual_seed(0)
    vescale.parallelize(model, plan, mesh)    # allocates shards, replays the model's own init code

``parallelize`` calls :func:`materialize` when the model has meta parameters or buffers. The
values are those the model's own init code gives on one device with vescale's RNG, i.e. what
``vescale.manual_seed(s); with vescale.random.consistent(): model.init_weights()`` gives there
(see docs/init.md for the exact rule and what cannot be deferred).
"""

from .deferred import DeferredInitError, has_meta, init_entry_point, materialize

__all__ = ["materialize", "has_meta", "init_entry_point", "DeferredInitError"]
