"""``pg``'s expression rules (what every rank may evaluate without communicating) and
``breakpoint()`` without torch.distributed (plain pdb on stdin, with ``pg``)."""

from __future__ import annotations

import io
import sys

import pytest
import torch

import vescale.debug
from vescale.debug.distributed_pdb import NotAReference, resolve


def test_names_attributes_and_container_indices_resolve_without_tensor_code():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3))
    outputs = {"logits": torch.arange(6.0).reshape(2, 3)}
    frame = sys._getframe(0)
    value, finish = resolve("model[0].weight", frame)
    assert value is model[0].weight and finish(value) is value
    # Indexing a tensor is deferred: it must apply to the gathered global tensor, not a local shard.
    value, finish = resolve("outputs['logits'][1, :2]", frame)
    assert value is outputs["logits"]
    assert finish(torch.ones(2, 3) * 7).tolist() == [7.0, 7.0]


@pytest.mark.parametrize("expr", ["len(x)", "x.sum()", "x + 1", "x[f(0)]", "[x][0]"])
def test_calls_and_arithmetic_are_refused(expr):
    x = torch.zeros(2)  # noqa: F841  (looked up by name)
    with pytest.raises(NotAReference):
        resolve(expr, sys._getframe(0))


def test_breakpoint_without_a_process_group_is_pdb_on_stdin(monkeypatch, capsys):
    t = torch.arange(6.0).reshape(2, 3)  # noqa: F841  (inspected from pdb)
    monkeypatch.setattr(sys, "stdin", io.StringIO("pg t[1]\npg t.sum()\nc\n"))
    vescale.debug.breakpoint()
    after = "ran on"  # noqa: F841  (the line pdb stops at)
    out = capsys.readouterr().out
    assert "t[1]: from a Tensor of global shape (2, 3), torch.float32\ntensor([3., 4., 5.])" in out, out
    assert "*** NotAReference: pg takes a variable" in out, out
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] are outside this run of 1 rank\(s\); use ranks 0..0"):
        vescale.debug.breakpoint(rank=1)
