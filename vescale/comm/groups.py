"""Process groups over (flattened) sub-meshes, made once per mesh and cached.

N-D fusion reduces a gradient that is Partial on several mesh dimensions with one collective over
the flattened sub-mesh of those dimensions, instead of one collective per dimension. Creating a
process group is itself collective (every rank of the world must make every group, in the same
order), so all flattened sub-meshes a mesh can need are made together, at ``parallelize`` time, by
``prepare_groups``; later look-ups (from backward hooks, where ranks must not diverge) only read the
cache.

A member's index in a flattened group is the row-major index of its coordinates over the chosen
dimensions (``DeviceMesh._flatten``'s order), which the layout code in ``vescale.comm.layout``
relies on.
"""

from __future__ import annotations

import itertools

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..mesh import TEARDOWN, apply_run_timeout

__all__ = ["prepare_groups", "group_of", "group_size"]

# (id(mesh), dims) -> (mesh, group). Holding the mesh keeps its id from being reused by another.
_CACHE: dict[tuple[int, tuple[int, ...]], tuple[DeviceMesh, dist.ProcessGroup]] = {}


def _flat_name(mesh: DeviceMesh, dims: tuple[int, ...]) -> str:
    return "vescale_flat_" + "_".join(mesh.mesh_dim_names[d] for d in dims)


def prepare_groups(mesh: DeviceMesh) -> None:
    """Make (collectively, on every rank, in a fixed order) the flattened group of every set of two or
    more mesh dimensions. Cheap for the 2-4 dimensional meshes of real runs; idempotent."""
    if mesh.ndim < 2:
        return
    if mesh.mesh_dim_names is None:
        raise ValueError(
            "vescale.comm: fused reduction on a multi-dimensional mesh needs named mesh dimensions "
            "(vescale.init_mesh gives them); name them, or pass bucket_mb=None to parallelize"
        )
    for n in range(2, mesh.ndim + 1):
        for dims in itertools.combinations(range(mesh.ndim), n):
            key = (id(mesh), dims)
            if key not in _CACHE:
                names = tuple(mesh.mesh_dim_names[d] for d in dims)
                sub = mesh[names] if len(dims) < mesh.ndim else mesh
                group = sub._flatten(_flat_name(mesh, dims)).get_group()
                apply_run_timeout(group)  # new groups start with the backend's default timeout
                TEARDOWN.track(group)
                _CACHE[key] = (mesh, group)


def group_of(mesh: DeviceMesh, dims: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group over mesh dimensions ``dims`` (sorted), flattened when there are several."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    try:
        return _CACHE[(id(mesh), dims)][1]
    except KeyError:
        raise RuntimeError(
            f"vescale.comm: no flattened group for mesh dims {dims}; prepare_groups(mesh) must run on "
            "every rank first (parallelize does it)"
        ) from None


def group_size(mesh: DeviceMesh, dims: tuple[int, ...]) -> int:
    size = 1
    for d in dims:
        size *= mesh.size(d)
    return size
