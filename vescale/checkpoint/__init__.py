"""Checkpoints on any mesh: save, resume, reshard, export.

    vescale.checkpoint.save("ckpt", model, optimizer, step=step, keep_last=3, loader_pos=i)
    extras = vescale.checkpoint.load("ckpt", model, optimizer)   # {"step": ..., "loader_pos": ...}
    weights = vescale.checkpoint.export("ckpt")                    # one plain state dict, offline

Built on PyTorch DCP (``torch.distributed.checkpoint``); the model may be re-planned, put on another
mesh or be a plain single-device model when loading. See docs/checkpoint.md.
"""

from .api import AsyncCheckpoint, load, save, wait
from .integrity import CheckpointCorruptError
from .export import consolidated_state_dict, export
from .layout import latest

__all__ = ["save", "load", "wait", "latest", "export", "consolidated_state_dict", "AsyncCheckpoint", "CheckpointCorruptError"]
