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

import contextlib
import functools
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Sequence

import torch

from vescale.random import _native

if TYPE_CHECKING:
    from vescale.random.kernel import Block, Draw, Launch

_KERNEL_SOURCE = Path(__file__).with_name("_triton_kernel.py")
BLOCK = 512  # elements per program instance


def available() -> bool:
    """Whether a triton with the API this module uses (``triton.knobs``, Triton >= 3.4) can be imported."""
    try:
        from triton import knobs  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=2)
def load(interpret: bool) -> ModuleType:
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


def fill(
    out: torch.Tensor, draw: Draw, seed: int, launches: Sequence[Launch], block: Block, prob: torch.Tensor | None
) -> None:
    """Fill the contiguous ``out`` (CUDA: compiled; CPU: interpreted) with ``block`` (a kernel.Block) of the
    draw, as ``NativeKernel.fill`` does. The block's layout stays on the device between calls."""
    module = load(interpret=out.device.type != "cuda")
    device = out.device
    row_base, inner_off, run = block.layout(device)
    numel = block.global_numel
    table = [launch.start for launch in launches] + [numel]
    table += [launch.threads for launch in launches] + [launch.counter for launch in launches]
    int_params = [seed & 0xFFFFFFFF, seed >> 32, _as_int64(draw.modulus), draw.base, inner_off.numel(), run, out.numel()]
    target = out.view(_STORED_AS.get(out.dtype, out.dtype))
    grid = (triton_cdiv(out.numel(), BLOCK),)
    # Triton launches on the current CUDA device: make it out's
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        module.fill_kernel[grid](
            target,
            target if prob is None else prob.to(device),
            row_base,
            inner_off,
            torch.tensor(table, dtype=torch.int64, device=device),
            torch.tensor(int_params, dtype=torch.int64, device=device),
            torch.tensor([draw.a, draw.b, draw.c], dtype=torch.float64, device=device),
            **_constants(draw, out.dtype, len(launches)),
            **COMPILE_OPTIONS,
        )


# The kernel rounds to half precision itself and stores the bits; bool is stored as bytes.
_STORED_AS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.bool: torch.uint8}
# No contraction of a product and a sum into an FMA (LLVM and ptxas --fmad=false): each rounds on its own.
COMPILE_OPTIONS = {"enable_fp_fusion": False}


def _constants(draw, dtype: torch.dtype, nlaunch: int) -> dict:
    """The kernel's constexpr arguments: one compiled variant per (op, width, dtype, launch count)."""
    return dict(OP=draw.op, WIDE=draw.wide, UNROLL=draw.unroll, DTYPE=_native._DTYPE_CODES[dtype], NLAUNCH=nlaunch,
                IDENTITY=_is_identity(draw), BLOCK=BLOCK)


def compile_ptx(draw: Draw, dtype: torch.dtype, nlaunch: int = 1, capability: int = 90) -> str:
    """The PTX of the variant ``fill`` launches for ``draw`` on an sm_<capability> GPU, compiled with the same
    options. Needs no GPU (Triton's compiler and the ptxas it ships run on any machine): it lets the test
    suite check which floating-point instructions the GPU will execute."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointer = {torch.float32: "*fp32", torch.float64: "*fp64", torch.int16: "*i16", torch.uint8: "*u8",
               torch.int8: "*i8", torch.int32: "*i32", torch.int64: "*i64"}
    out_type = pointer[_STORED_AS.get(dtype, dtype)]
    from vescale.random.kernel import OP_BERNOULLI_TENSOR

    prob_type = ("*fp64" if dtype == torch.float64 else "*fp32") if draw.op == OP_BERNOULLI_TENSOR else out_type
    constants = _constants(draw, dtype, nlaunch)
    signature = {"out_ptr": out_type, "prob_ptr": prob_type, "row_base_ptr": "*i64", "inner_off_ptr": "*i64",
                 "launch_ptr": "*i64", "int_ptr": "*i64", "float_ptr": "*fp64", **{k: "constexpr" for k in constants}}
    source = ASTSource(fn=load(interpret=False).fill_kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=COMPILE_OPTIONS).asm["ptx"]


def _as_int64(value: int) -> int:
    """The int64 with the same 64 bits as ``value`` in [0, 2**64)."""
    return value - 2**64 if value >= 2**63 else value


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
