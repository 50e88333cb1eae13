"""vescale's CPU kernel against PyTorch's own CUDA random ops, bit for bit (needs a CUDA GPU).

The ops documented as designed to be bit-exact with native CUDA (docs/random.md: uniform, rand,
bernoulli with a float p, random_/randint) are drawn natively on the GPU after
``torch.cuda.manual_seed(seed)`` (offset 0) and by vescale's kernel on the CPU with the same seed,
offset 0 and the local GPU's profile. Sizes cover one element per thread, threads wrapping, and
several steps per thread. Skipped without a GPU (CI never has one).
"""

from __future__ import annotations

import pytest
import torch

from vescale.random import kernel
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


def _vescale(seed: int, like: torch.Tensor, kind: str, **params) -> torch.Tensor:
    out = torch.empty(like.shape, dtype=like.dtype)
    kernel.generate(out, kind, seed=seed, offset=0, global_shape=tuple(like.shape), dim_indices=None,
                    profile=default_profile(), **params)
    return out


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_rand_matches_native(size, seed, dtype):
    ref = _native(seed, lambda: torch.rand(size, device="cuda", dtype=dtype))
    assert torch.equal(_vescale(seed, ref, "uniform", low=0.0, high=1.0), ref)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("bounds", [(-2.0, 3.0), (0.5, 0.75)])
def test_uniform_with_bounds_matches_native(size, bounds):
    ref = _native(7, lambda: torch.empty(size, device="cuda").uniform_(*bounds))
    assert torch.equal(_vescale(7, ref, "uniform", low=bounds[0], high=bounds[1]), ref)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bernoulli_float_p_matches_native(size, dtype):
    ref = _native(11, lambda: torch.empty(size, device="cuda", dtype=dtype).bernoulli_(0.3))
    assert torch.equal(_vescale(11, ref, "bernoulli", p=0.3), ref)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype, low, high", [(torch.int64, 0, 10), (torch.int32, -5, 1 << 20), (torch.float32, 0, 100)])
def test_random_matches_native(size, dtype, low, high):
    ref = _native(3, lambda: torch.empty(size, device="cuda", dtype=dtype).random_(low, high))
    assert torch.equal(_vescale(3, ref, "random", low=low, high=high), ref)
