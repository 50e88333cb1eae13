"""Consolidated, single-file model weights for inference or ``save_pretrained``.

Two ways, one result (a plain ``{name: tensor}`` dict of global tensors, as the unchanged model's
``state_dict()`` would hold):

* ``consolidated_state_dict(model)`` from a live parallelised model (a collective: every rank calls
  it; each DTensor is gathered with DCP's ``get_model_state_dict(full_state_dict=True)``);
* ``export(path, out_file)`` from a saved checkpoint, offline, in one process with no process group:
  DCP reads every shard of the model part and ``torch.save`` writes one file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from vescale._torch import _EmptyStateDictLoadPlanner, _load_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from . import integrity, layout

__all__ = ["consolidated_state_dict", "export"]


def consolidated_state_dict(model: nn.Module, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor gathered to a plain global tensor, on every rank.

    E.g. ``hf_model.save_pretrained(out, state_dict=consolidated_state_dict(model))`` on rank 0.
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))


def export(path: str | os.PathLike, out_file: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """Read the model weights of the latest checkpoint under ``path`` (or the checkpoint folder
    ``path``) into one plain state dict of global tensors; with ``out_file``, also ``torch.save`` it
    there. Runs in a single process without ``torch.distributed``. The checkpoint's files are checked
    against their recorded checksums first (``CheckpointCorruptError`` names a corrupt one)."""
    folder = layout.latest(Path(path))
    if folder is None:
        raise FileNotFoundError(f"checkpoint.export: no complete checkpoint under {str(path)!r}")
    files = integrity.read_manifest(folder)
    problems = integrity.verify(folder, files) if files is not None else []
    if problems:
        raise integrity.CheckpointCorruptError(f"checkpoint.export: {folder} is corrupt: " + "; ".join(problems))
    state: dict = {}
    # What DCP's own dcp_to_torch_save does (the public dcp.load fills a copy of an empty dict):
    # the planner builds the tensors from the checkpoint's metadata; keys= leaves the optimiser out.
    _load_state_dict(
        state, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True
    )
    weights = state["model"]
    if out_file is not None:
        torch.save(weights, out_file)
    return weights
