"""init_mesh(): the device mesh of a run, built from torchrun's environment.

Initialises the default process group when needed (gloo on CPU, nccl on CUDA) and returns a
``DeviceMesh`` with named dimensions, so plans can say ``mesh="TP"`` and code can say ``mesh["DP"]``.
A plain ``python script.py`` (no torchrun) gets a one-rank group, so a mesh of shape (1, ...) works
for single-process runs and debugging.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["init_mesh"]


def _single_process_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")


def init_mesh(shape: Sequence[int], names: Sequence[str], device_type: str | None = None) -> DeviceMesh:
    """A DeviceMesh of ``shape`` with dimension ``names`` over all ranks of this run.

    ``device_type`` defaults to "cuda" when CUDA is available, else "cpu".
    """
    shape, names = tuple(int(s) for s in shape), tuple(names)
    if len(shape) != len(names):
        raise ValueError(f"init_mesh: shape {shape} has {len(shape)} dimensions but names {names} has {len(names)}")
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"init_mesh: dimension names must be distinct non-empty strings, got {names}")
    if any(s < 1 for s in shape):
        raise ValueError(f"init_mesh: every mesh dimension needs at least one rank, got {shape}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            if math.prod(shape) != 1:
                raise RuntimeError(
                    f"init_mesh{shape}: needs {math.prod(shape)} ranks but this process was not started by "
                    f"torchrun; run e.g. `torchrun --standalone --nproc-per-node {math.prod(shape)} script.py`"
                )
            _single_process_env()
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(
            f"init_mesh: mesh shape {shape} holds {math.prod(shape)} ranks but the run has {world}; "
            f"make the product of the shape equal the number of processes"
        )
    return init_device_mesh(device_type, shape, mesh_dim_names=names)
