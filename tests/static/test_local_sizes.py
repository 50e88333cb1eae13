"""``vescale.static.local_sizes`` on its own: how a recorded global size becomes the local one.

The model-level behaviour (HF's loss view, a global head count, a global length in a derived record)
is tested in ``test_static_llama.py``, ``test_static_errors.py`` and ``test_static_resize.py``; here
the rule itself, case by case, and the parsing of the calls it rewrites.
"""

from __future__ import annotations

import pytest
import torch

from vescale import PlanError
from vescale.static.local_sizes import GlobalSizes, SizeRewrite, size_call, size_rewrite
from vescale.static.resize import ResizeMismatch

VIEW = torch.Tensor.view
# logits.view(-1, 512) recorded on logits split 4 ways along the vocabulary: 128 a rank
VOCAB = SizeRewrite(2, (1,), (512,), (128,))


def test_the_global_size_becomes_the_local_one_and_minus_one_stays():
    assert VOCAB.local((-1, 512), "", VIEW, derived=False) == (-1, 128)


def test_a_call_passing_the_local_size_runs_as_it_is():
    assert VOCAB.local((-1, 128), "", VIEW, derived=False) is None  # read from the local tensor


def test_another_size_is_refused_naming_the_module_and_the_fix():
    with pytest.raises(PlanError, match=r"module 'lm': view\(-1, 300\).*plan\.eager\('lm'\)"):
        VOCAB.local((-1, 300), "lm", VIEW, derived=False)
    with pytest.raises(PlanError, match="module 'lm'"):
        VOCAB.local((4, -1, 512), "lm", VIEW, derived=False)  # another rank of sizes


def test_a_whole_share_of_the_global_size_gets_the_local_size():
    # HF Mixtral's MoE block under DP=2 x EP=2: reshape(batch, 4, 16) of an output split over DP x EP
    # (global batch 4, 1 a rank), with the batch read from its input, split over DP only (2 a rank).
    batch = SizeRewrite(3, (0,), (4,), (1,))
    assert batch.local((2, 4, 16), "moe", torch.Tensor.reshape, derived=False) == (1, 4, 16)
    assert batch.local((4, 4, 16), "moe", torch.Tensor.reshape, derived=False) == (1, 4, 16)
    with pytest.raises(PlanError, match=r"reshape\(3, 4, 16\)"):
        batch.local((3, 4, 16), "moe", torch.Tensor.reshape, derived=False)  # no share of 4


def test_a_derived_record_splits_a_global_size_that_follows_the_inputs():
    length = SizeRewrite(4, (1,), (16,), (8,))  # view(b, 16, 2, 4) of a sequence split 2 ways
    # Derived from a record whose first static step kept the rewrite: the new global length is split.
    assert length.local((4, 24, 2, 4), "blk", VIEW, derived=True, scale=True) == (4, 12, 2, 4)
    assert length.local((4, 16, 2, 4), "blk", VIEW, derived=True, scale=True) == (4, 8, 2, 4)
    # A length the two ranks do not split evenly, or a record whose source was never checked: record.
    with pytest.raises(ResizeMismatch, match="records instead"):
        length.local((4, 25, 2, 4), "blk", VIEW, derived=True, scale=True)
    with pytest.raises(ResizeMismatch, match="records instead"):
        length.local((4, 24, 2, 4), "blk", VIEW, derived=True, scale=False)
    # Not derived: the same call must pass the same sizes every step.
    with pytest.raises(PlanError):
        length.local((4, 24, 2, 4), "blk", VIEW, derived=False)


def _parsed(func, args, kwargs=None):
    call = size_call(func, args, kwargs or {})
    return None if call is None else (call.tensor, call.sizes, call.split_dim)


EXPAND = torch.Tensor.expand


def test_a_plain_tensor_call_with_the_recorded_sizes_runs_as_it_is():
    note = size_rewrite(size_call(EXPAND, (torch.zeros(1, 16), 8, -1), {}), torch.zeros(8, 16))
    assert note == GlobalSizes((8, -1))  # a plain tensor: the global one, the same on every rank
    assert note.local((8, -1), "model", EXPAND, derived=False) is None  # the same sizes: dropped for good


def test_a_plain_tensor_call_sized_from_a_local_share_gets_the_recorded_global_size():
    # HF's mask code: position_ids.expand(inputs_embeds.shape[0], -1), the batch of 8 split 2 ways on DP.
    note = GlobalSizes((8, -1))
    assert note.local((4, -1), "model", EXPAND, derived=False) == (8, -1)
    assert (note.positions, note.global_sizes, note.local_sizes) == ((0,), (8,), (4,))  # learnt
    assert note.local((4, -1), "model", EXPAND, derived=False) == (8, -1)  # every later step
    with pytest.raises(PlanError, match=r"module 'model': expand\(2, -1\) on a plain tensor.*plan\.eager\('model'\)"):
        note.local((2, -1), "model", EXPAND, derived=False)  # not the share it was
    # A derived record (new sizes): a learnt share that follows the inputs gives the new global size.
    assert note.local((6, -1), "model", EXPAND, derived=True, scale=True) == (12, -1)
    with pytest.raises(ResizeMismatch):
        note.local((2, -1), "model", EXPAND, derived=True)


def test_a_plain_tensor_call_whose_sizes_are_no_share_is_refused():
    with pytest.raises(PlanError, match="module 'm'"):
        GlobalSizes((8, 16)).local((3, 16), "m", VIEW, derived=False)  # 3 is no share of 8
    with pytest.raises(PlanError, match="module 'm'"):
        GlobalSizes((8, 16)).local((16, 16), "m", VIEW, derived=False)  # larger than the recorded size
    # In a derived record no static step has run the call yet: it runs as it is (the derived
    # record's first step checks its local shapes).
    assert GlobalSizes((8, 16)).local((8, 20), "m", VIEW, derived=True) == (8, 20)


def test_size_calls_are_parsed_in_every_spelling():
    t = torch.zeros(2, 3)
    assert _parsed(VIEW, (t, 3, 2)) == (t, (3, 2), None)
    assert _parsed(VIEW, (t, (3, 2))) == (t, (3, 2), None)
    assert _parsed(VIEW, (t, torch.Size([6]))) == (t, (6,), None)
    assert _parsed(torch.Tensor.reshape, (t, [-1])) == (t, (-1,), None)
    assert _parsed(torch.reshape, (t, (3, -1))) == (t, (3, -1), None)
    assert _parsed(torch.reshape, (), {"input": t, "shape": (6,)}) == (t, (6,), None)
    assert _parsed(VIEW, (t, torch.float32)) is None  # a dtype view: no sizes
    # splits: the section size and the dim (negative dims normalised); listed sections are left alone
    assert _parsed(torch.Tensor.split, (t, 1, -1)) == (t, (1,), 1)
    assert _parsed(torch.Tensor.split, (t, 1), {"dim": 1}) == (t, (1,), 1)
    assert _parsed(torch.split, (t, 1)) == (t, (1,), 0)
    assert _parsed(torch.Tensor.split, (t, [1, 2], 1)) is None
    call = size_call(torch.Tensor.split, (t, 1, 1), {})
    assert [p.shape for p in call.run((2,))] == [(2, 2), (2, 1)]
