"""vescale's kernels on a real GPU, bit for bit (needs a CUDA GPU; skipped without one, CI never has one).

1. The ops documented as designed to be bit-exact with native CUDA (docs/random.md: uniform, rand,
   bernoulli with a float p, random_/randint) are drawn natively on the GPU after
   ``torch.cuda.manual_seed(seed)`` (offset 0) and by vescale with the same seed, offset 0 and the local
   GPU's profile: by the C kernel on the CPU and by the Triton kernel compiled for the GPU.
2. The Triton kernel, compiled and run natively, against the C kernel on the CPU for every op and dtype
   and for blocks (shards) of the global tensor: the claim docs/random.md makes and the CPU suite can
   check only in Triton's interpreter (tests/random/test_triton_kernel.py).
3. Random ops on CUDA tensors reach the Triton kernel through vescale's dispatch and equal the CPU run.
Sizes cover one element per thread, threads wrapping, and several steps per thread.
"""

from __future__ import annotations

import pytest
import torch

import vescale.random as vr
from test_kernel import CROSS_KINDS
from vescale.random import _triton, kernel
from vescale.random.generator import default_profile

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to compare with native torch.cuda"),
]

SIZES = [1, 1000, 4099, 1 << 20, (1 << 22) + 3]
SEEDS = [0, 1234, 2**40 + 7]


def _native(seed: int, fill) -> torch.Tensor:
    torch.cuda.manual_seed(seed)
    return fill().cpu()


DEVICES = ["cpu", "cuda"]  # cpu: the C kernel; cuda: the Triton kernel, compiled


def _vescale(seed: int, like: torch.Tensor, kind: str, device: str = "cpu", **params) -> torch.Tensor:
    out = torch.empty(like.shape, dtype=like.dtype, device=device)
    kernel.generate(out, kind, seed=seed, offset=0, global_shape=tuple(like.shape), dim_indices=None,
                    profile=default_profile(), **params)
    return out.cpu()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_rand_matches_native(size, seed, dtype, device):
    ref = _native(seed, lambda: torch.rand(size, device="cuda", dtype=dtype))
    assert torch.equal(_vescale(seed, ref, "uniform", device, low=0.0, high=1.0), ref)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("bounds", [(-2.0, 3.0), (0.5, 0.75)])
@pytest.mark.parametrize("device", DEVICES)
def test_uniform_with_bounds_matches_native(size, bounds, device):
    ref = _native(7, lambda: torch.empty(size, device="cuda").uniform_(*bounds))
    assert torch.equal(_vescale(7, ref, "uniform", device, low=bounds[0], high=bounds[1]), ref)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("device", DEVICES)
def test_bernoulli_float_p_matches_native(size, dtype, device):
    ref = _native(11, lambda: torch.empty(size, device="cuda", dtype=dtype).bernoulli_(0.3))
    assert torch.equal(_vescale(11, ref, "bernoulli", device, p=0.3), ref)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype, low, high", [(torch.int64, 0, 10), (torch.int32, -5, 1 << 20), (torch.float32, 0, 100)])
@pytest.mark.parametrize("device", DEVICES)
def test_random_matches_native(size, dtype, low, high, device):
    ref = _native(3, lambda: torch.empty(size, device="cuda", dtype=dtype).random_(low, high))
    assert torch.equal(_vescale(3, ref, "random", device, low=low, high=high), ref)


# ---- the Triton kernel, compiled, against the C kernel ----


def _generate(device, shape, kind, dtype, index, seed, offset, **params):
    dim_indices = None if index is None else [torch.tensor(ix, dtype=torch.int64) for ix in index]
    local = tuple(shape) if index is None else tuple(len(ix) for ix in index)
    out = torch.empty(local, dtype=dtype, device=device)
    if isinstance(params.get("p"), torch.Tensor):
        params["p"] = params["p"].to(device)
    kernel.generate(out, kind, seed=seed, offset=offset, global_shape=tuple(shape), dim_indices=dim_indices,
                    profile=default_profile(), **params)
    return out.cpu()


def test_cuda_tensors_use_the_compiled_triton_kernel():
    from triton.runtime.jit import JITFunction

    assert isinstance(_triton.load(interpret=False).fill_kernel, JITFunction)


BLOCKS = [  # (global shape, per-dim indices; None: the whole dim): whole tensors, row and column shards, ...
    (((1 << 20) + 3,), None), ((4099,), None), ((2048, 700), None), ((2048, 700), [range(512, 1024), None]),
    ((2048, 700), [None, range(350, 700)]), ((64, 33, 17), [range(63, -1, -2), None, [16, 0, 5, 5]]),
]


@pytest.mark.parametrize("kind, dtype, params", CROSS_KINDS)
@pytest.mark.parametrize("shape, index", BLOCKS, ids=str)
def test_triton_kernel_on_gpu_equals_c_kernel(kind, dtype, params, shape, index):
    if index is not None:
        index = [list(range(size)) if ix is None else list(ix) for ix, size in zip(index, shape)]
    args = dict(seed=2**63 + 99, offset=1 << 40, **params)
    gpu = _generate("cuda", shape, kind, dtype, index, **args)
    assert torch.equal(gpu, _generate("cpu", shape, kind, dtype, index, **args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_triton_bernoulli_with_tensor_p_on_gpu_equals_c_kernel(dtype):
    p = torch.rand((300, 77), generator=torch.Generator().manual_seed(2))
    index = [list(range(1, 301)), list(range(0, 154, 2))]
    args = dict(seed=17, offset=8, p=p)
    assert torch.equal(_generate("cuda", (400, 160), "bernoulli", dtype, index, **args),
                       _generate("cpu", (400, 160), "bernoulli", dtype, index, **args))


def test_random_ops_on_cuda_tensors_are_drawn_on_the_gpu_and_equal_the_cpu_run(fresh_rng):
    def run(device):
        vr.manual_seed(7)
        with vr.consistent():
            w = torch.empty(300, 257, device=device)
            torch.nn.init.kaiming_uniform_(w)
            z = torch.randn(4099, device=device, dtype=torch.bfloat16)
            ints = torch.randint(-5, 5, (999,), device=device)
        return [t.cpu() for t in (w, z, ints)], vr.get_state()

    gpu, gpu_state = run("cuda")
    cpu, cpu_state = run("cpu")
    assert all(torch.equal(a, b) for a, b in zip(gpu, cpu)) and torch.equal(gpu_state, cpu_state)
