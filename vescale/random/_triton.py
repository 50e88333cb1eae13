"""Launches the Triton kernel of vescale.random (``_triton_kernel.py``): kernel.generate's CUDA path.

Takes exactly what the compiled C kernel takes (``_native.NativeKernel.fill``: the resolved ``Draw``, the
seed, the launches and the local layout of ``_native.local_layout``) and writes the same bits, on the
output tensor's own device. triton is imported only here, on first use, so vescale imports without it.

The kernel runs compiled on a CUDA tensor. On a CPU tensor it runs in Triton's interpreter (numpy, one
program instance at a time): that is how the test suite checks the kernel's bits on a machine without a
GPU. The two modes are two module objects of the same source, each decorated under its own value of
``triton.knobs.runtime.interpret`` (Triton fixes the mode when ``@triton.jit`` runs), so a process can use
both and nothing depends on TRITON_INTERPRET being set before an import.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from pathlib import Path

import torch

from vescale.random import _native

_KERNEL_SOURCE = Path(__file__).with_name("_triton_kernel.py")
BLOCK = 512  # elements per program instance


def available() -> bool:
    """Whether triton can be imported (without importing it twice)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=2)
def load(interpret: bool):
    """The kernel module, compiled for the GPU (``interpret=False``) or run by Triton's interpreter."""
    from triton import knobs

    name = "vescale.random._triton_kernel" + ("_interpreted" if interpret else "")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _KERNEL_SOURCE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton reads jit functions' globals and source through their module
    try:
        with knobs.runtime.scope():  # restores the knob (and TRITON_INTERPRET) afterwards
            knobs.runtime.interpret = interpret
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _is_identity(draw) -> bool:
    # the C kernel's `identity`: fma(x, 1, +0) is x + 0, computed without the fma
    return math.copysign(1.0, draw.a) > 0 and draw.a == 0.0 and draw.b == 1.0


def fill(out, draw, seed: int, launches, global_shape, dim_indices, scans, prob) -> None:
    """Fill the contiguous ``out`` (CUDA: compiled; CPU: interpreted) as ``NativeKernel.fill`` does."""
    from vescale.random._native import _DTYPE_CODES

    module = load(interpret=out.device.type != "cuda")
    device = out.device
    row_base, inner_off, run = _native.local_layout(global_shape, dim_indices, scans)
    numel = math.prod(global_shape)
    table = [launch.start for launch in launches] + [numel]
    table += [launch.threads for launch in launches] + [launch.counter for launch in launches]
    int_params = [seed & 0xFFFFFFFF, seed >> 32, _as_int64(draw.modulus), draw.base, inner_off.numel(), run, out.numel()]
    if out.dtype in (torch.float16, torch.bfloat16):
        target = out.view(torch.int16)  # the kernel rounds to half precision itself and stores the bits
    elif out.dtype == torch.bool:
        target = out.view(torch.uint8)
    else:
        target = out
    grid = (triton_cdiv(out.numel(), BLOCK),)
    module.fill_kernel[grid](
        target,
        target if prob is None else prob.to(device),
        row_base.to(device),
        inner_off.to(device),
        torch.tensor(table, dtype=torch.int64, device=device),
        torch.tensor(int_params, dtype=torch.int64, device=device),
        torch.tensor([draw.a, draw.b, draw.c], dtype=torch.float64, device=device),
        OP=draw.op, WIDE=draw.wide, UNROLL=draw.unroll, DTYPE=_DTYPE_CODES[out.dtype], NLAUNCH=len(launches),
        IDENTITY=_is_identity(draw), BLOCK=BLOCK,
        enable_fp_fusion=False,  # no contraction into FMAs: every product and sum rounds on its own
    )


def _as_int64(value: int) -> int:
    """The int64 with the same 64 bits as ``value`` in [0, 2**64)."""
    return value - 2**64 if value >= 2**63 else value


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
