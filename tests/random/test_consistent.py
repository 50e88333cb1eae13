"""vescale.random on one device: consistent(), the generator state, seeding and checkpointing.

The DTensor side (each rank's shard equals its slice of what these single-device draws give) is
tested in test_dtensor_rng.py and test_multiproc_rng.py.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

import vescale.random as vr
from vescale.random import generator as vr_generator, kernel


def kernel_draw(kind, dtype, shape, offset, **params):
    """What the kernel gives for the whole tensor at ``offset`` under the current seed and profile."""
    out = torch.empty(shape, dtype=dtype)
    seed = vr_generator._state.seed
    kernel.generate(
        out, kind, seed=seed, offset=offset, global_shape=shape, dim_indices=None, profile=vr.device_profile(), **params
    )
    return out


def offset() -> int:
    return int(vr.get_state()[1])


def test_consistent_draws_the_kernel_values_and_advances_like_cuda(fresh_rng):
    vr.manual_seed(7)
    with vr.consistent():
        a = torch.rand(5, 33)
        b = torch.randn(3, 4, dtype=torch.float64)
        c = torch.randint(3, 9, (4, 5))
        d = torch.empty(6, 2, dtype=torch.bfloat16).bernoulli_(0.25)
    after_a = kernel.offset_increment("uniform", torch.float32, 165, vr.device_profile(), low=0.0, high=1.0)
    after_b = after_a + kernel.offset_increment("normal", torch.float64, 12, vr.device_profile(), mean=0.0, std=1.0)
    after_c = after_b + kernel.offset_increment("random", torch.int64, 20, vr.device_profile(), low=3, high=9)
    assert torch.equal(a, kernel_draw("uniform", torch.float32, (5, 33), 0, low=0.0, high=1.0))
    assert torch.equal(b, kernel_draw("normal", torch.float64, (3, 4), after_a, mean=0.0, std=1.0))
    assert c.dtype == torch.int64 and torch.equal(c, kernel_draw("random", torch.int64, (4, 5), after_b, low=3, high=9))
    assert torch.equal(d, kernel_draw("bernoulli", torch.bfloat16, (6, 2), after_c, p=0.25))
    assert offset() == after_c + kernel.offset_increment("bernoulli", torch.bfloat16, 12, vr.device_profile(), p=0.25)


def test_factories_and_like_ops_follow_their_arguments(fresh_rng):
    state = vr.get_state()
    with vr.consistent():
        x = torch.normal(2.0, 3.0, size=(3, 7))
        y = torch.randint_like(torch.empty(2, 3, dtype=torch.float16), 10)
        z = torch.rand_like(torch.empty(4, 2), dtype=torch.float64)
    assert x.dtype == torch.get_default_dtype() and y.dtype == torch.float16 and z.dtype == torch.float64
    vr.set_state(state)
    assert torch.equal(x, kernel_draw("normal", x.dtype, (3, 7), offset(), mean=2.0, std=3.0))


def test_state_restores_the_next_draw_and_survives_torch_save(fresh_rng):
    with vr.consistent():
        torch.rand(10)
    buffer = io.BytesIO()
    torch.save({"rng": vr.get_state()}, buffer)
    with vr.consistent():
        first = (torch.randn(4, 5), F.dropout(torch.ones(8, 8), 0.5))
    buffer.seek(0)
    vr.set_state(torch.load(buffer)["rng"])
    with vr.consistent():
        second = (torch.randn(4, 5), F.dropout(torch.ones(8, 8), 0.5))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_state_carries_the_device_profile(fresh_rng):
    vr.set_device_profile(1, 256)
    state = vr.get_state()
    assert state.tolist()[2:] == [1, 256]
    vr.set_device_profile(2, 512)
    vr.set_state(state)
    assert vr.device_profile() == vr.DeviceProfile(1, 256)


def test_device_profile_changes_only_tensors_larger_than_the_virtual_gpu(fresh_rng):
    def draw(profile, n):
        vr.set_device_profile(*profile)
        vr.manual_seed(3)
        with vr.consistent():
            return torch.rand(n)

    # (1, 256) has 256 threads, (2, 256) has 512: up to 256 elements every element has its own thread.
    assert torch.equal(draw((1, 256), 256), draw((2, 256), 256))
    assert not torch.equal(draw((1, 256), 2048), draw((2, 256), 2048))


def test_manual_seed_also_seeds_torch(fresh_rng):
    vr.manual_seed(5)
    a = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(a, torch.rand(3))


def test_negative_seed_wraps_like_torch(fresh_rng):
    vr.manual_seed(-1)
    assert vr_generator._state.seed == 2**64 - 1 and int(vr.get_state()[0]) == -1


@pytest.mark.parametrize("seed", [1.5, True, 2**64, "0"])
def test_bad_seed_is_refused(fresh_rng, seed):
    with pytest.raises(ValueError, match="seed"):
        vr.manual_seed(seed)


@pytest.mark.parametrize(
    "state",
    [torch.zeros(4), torch.zeros(3, dtype=torch.int64), torch.tensor([1, 6, 132, 2048]), [1, 0, 132, 2048]],
    ids=["float", "short", "offset-not-multiple-of-4", "list"],
)
def test_bad_state_is_refused(fresh_rng, state):
    with pytest.raises(ValueError, match="set_state"):
        vr.set_state(state)


def test_unseeded_generator_tells_user_to_seed(fresh_rng):
    vr_generator._state.seed = None
    with pytest.raises(RuntimeError, match=r"vescale\.manual_seed"):
        with vr.consistent():
            torch.rand(3)
    with pytest.raises(RuntimeError, match=r"manual_seed"):
        vr.get_state()


def test_only_the_block_is_routed(fresh_rng):
    before = vr.get_state()
    torch.rand(5)
    torch.empty(3).normal_()
    assert torch.equal(vr.get_state(), before)
    with pytest.raises(ZeroDivisionError):
        with vr.consistent():
            1 / 0  # noqa: B018  (raises inside the context)
    torch.rand(5)  # the mode is gone after an exception too
    assert torch.equal(vr.get_state(), before)


def test_explicit_generator_draws_from_it_unchanged(fresh_rng):
    before = vr.get_state()
    with vr.consistent():
        inside = torch.rand(6, generator=torch.Generator().manual_seed(11))
        init = torch.nn.init.normal_(torch.empty(4), generator=torch.Generator().manual_seed(11))
    assert torch.equal(inside, torch.rand(6, generator=torch.Generator().manual_seed(11)))
    assert torch.equal(init, torch.empty(4).normal_(generator=torch.Generator().manual_seed(11)))
    assert torch.equal(vr.get_state(), before)


@pytest.mark.parametrize(
    "call",
    [
        lambda: torch.empty(3).exponential_(),
        lambda: torch.randperm(5),
        lambda: torch.multinomial(torch.ones(4), 2),
        lambda: torch.normal(torch.zeros(3), 1.0),
        lambda: torch.poisson(torch.ones(3)),
        lambda: torch.rand(3, out=torch.empty(3)),
    ],
    ids=["exponential_", "randperm", "multinomial", "normal(tensor, float)", "poisson", "rand(out=)"],
)
def test_unsupported_random_ops_raise_instead_of_drawing_unmatched_numbers(fresh_rng, call):
    with pytest.raises(NotImplementedError, match="single-device"):
        with vr.consistent():
            call()


def test_non_contiguous_tensor_is_filled_in_logical_order(fresh_rng):
    state = vr.get_state()
    with vr.consistent():
        transposed = torch.empty(6, 4).t().uniform_()  # shape (4, 6), column-major in memory
    vr.set_state(state)
    with vr.consistent():
        contiguous = torch.empty(4, 6).uniform_()
    assert torch.equal(transposed, contiguous)


def test_invalid_arguments_raise_pytorch_errors_without_advancing(fresh_rng):
    before = vr.get_state()
    with vr.consistent():
        with pytest.raises(RuntimeError, match=r"uniform_ expects"):
            torch.empty(3).uniform_(3.0, 1.0)
        with pytest.raises(RuntimeError, match=r"bernoulli_ expects p"):
            torch.empty(3).bernoulli_(1.5)
        with pytest.raises(RuntimeError, match=r"normal expects std >= 0"):
            torch.empty(3).normal_(0.0, -1.0)
        with pytest.raises(RuntimeError, match=r"random_ expects 'from'"):
            torch.empty(3).random_(5, 2)
    assert torch.equal(vr.get_state(), before)


def test_dropout_in_eval_and_empty_tensors_draw_nothing(fresh_rng):
    before = vr.get_state()
    x = torch.randn(4, 4)
    with vr.consistent():
        assert torch.equal(F.dropout(x, 0.5, training=False), x)
        out, mask = torch.ops.aten.native_dropout(x, 0.5, False)
        torch.empty(0, 3).uniform_()
        torch.rand(0)
    assert torch.equal(out, x) and mask.dtype == torch.bool and bool(mask.all())
    assert torch.equal(vr.get_state(), before)


def test_native_dropout_mask_is_a_float32_bernoulli_of_the_keep_probability(fresh_rng):
    x = torch.arange(1.0, 41.0, dtype=torch.float16).reshape(5, 8)
    state = vr.get_state()
    with vr.consistent():
        out, mask = torch.ops.aten.native_dropout(x, 0.25, True)
    vr.set_state(state)
    keep = kernel_draw("bernoulli", torch.float32, (5, 8), offset(), p=0.75)
    assert mask.dtype == torch.bool and torch.equal(mask, keep.bool())
    assert torch.equal(out, x * keep.to(x.dtype) * (1 / 0.75))


def test_a_failing_draw_and_meta_tensors_leave_the_generator_alone(fresh_rng):
    before = vr.get_state()
    with vr.consistent():
        with pytest.raises(ValueError, match=r"p values must lie in \[0, 1\]"):
            torch.empty(4).bernoulli_(torch.tensor([0.5, 1.5, 0.2, 0.1]))
        torch.empty(3, 4, device="meta").uniform_()
        assert torch.rand(2, 5, device="meta").is_meta
    assert torch.equal(vr.get_state(), before)
