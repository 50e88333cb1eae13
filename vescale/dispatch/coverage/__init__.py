"""Op coverage: what users' ops need from DTensor where PyTorch answers differently or not at all.

Single-device answers (``semantics``: ``item()`` of a Partial tensor, loss means over a split
batch), sharding rules PyTorch 2.13 lacks (``attention``: the CPU SDPA kernel; ``conv``: plain
tensors meeting DTensor weights; ``datadep``: data-dependent ops), and an error that names the
module and the plan statement where an op has no rule (``errors``). Patched under the owner
``dispatch.coverage``; answers only for DTensors on vescale's meshes (``dispatch.scope``).
"""
