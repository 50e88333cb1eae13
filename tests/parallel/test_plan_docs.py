"""docs/plan.md stays true: its Python examples run, in order, on 4 real ranks (a (2, 2) mesh), print
what the page says they print, and the lowering errors in its table are the ones users see."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  (DTensor imports it lazily; import once here, not in every forked rank)
import torch.distributed as dist

from vescale.testing import run_on_ranks

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan.md"


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), flags=re.S)


def _error_rows() -> list[tuple[str, str]]:
    """(statement code, message) for table rows whose first cell is a plan.shard(...) call."""
    rows = re.findall(r"^\| `(plan\.shard\(.*?\))` \| `(.*)` \|$", DOC.read_text(), flags=re.M)
    assert len(rows) >= 6, "the error table in docs/plan.md was not found"
    return rows


def _run_examples(rows) -> dict:
    namespace: dict = {"__name__": "docs_plan"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for code in _blocks("python"):
            exec(compile(code, str(DOC), "exec"), namespace)
    errors = []
    for code, _ in rows:
        plan = namespace["VescalePlan"]()
        exec(code, {**namespace, "plan": plan})
        try:
            namespace["vescale"].explain(namespace["Net"](), plan, namespace["mesh"])
            errors.append(None)
        except Exception as e:  # noqa: BLE001  (compared with the table below)
            errors.append(str(e))
    return {"rank": dist.get_rank(), "printed": printed.getvalue(), "errors": errors}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(_run_examples, 4, _error_rows())


def test_examples_run_on_every_rank_alike(ranks):
    assert all(r["printed"] == ranks[0]["printed"] for r in ranks)


def test_printed_losses_fall(ranks):
    losses = [float(line.split()[1]) for line in ranks[0]["printed"].splitlines() if re.fullmatch(r"\d \S+", line)]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_zero3_lines_are_printed(ranks):
    zero3_lines = _blocks("text")[0].splitlines()
    assert zero3_lines and all(line in ranks[0]["printed"].splitlines() for line in zero3_lines)


def test_explain_output_is_printed(ranks):
    doc = DOC.read_text()
    pasted = doc[doc.index("```text\n", doc.index("<!-- explain-output -->")) + 8 :].split("```")[0]
    assert pasted in ranks[0]["printed"]


def test_tied_weight_example_prints_a_gather_before_each_module(ranks):
    doc = DOC.read_text()
    pasted = doc[doc.index("```text\n", doc.index("<!-- tied-output -->")) + 8 :].split("```")[0]
    assert pasted.strip() and all(line in ranks[0]["printed"].splitlines() for line in pasted.strip().splitlines())


def test_gathers_example_prints_its_report(ranks):
    """The vescale.debug.gathers example prints the lines the page shows (the source line's file and
    code aside: the examples run from the page, not from attention.py)."""
    doc = DOC.read_text()
    shown = doc[doc.index("```text\n", doc.index("<!-- gathers-output -->")) + 8 :].split("```")[0].splitlines()
    printed = ranks[0]["printed"].splitlines()
    for line in shown:
        head, _, tail = line.partition(" at attention.py:17: ")
        assert any(p.startswith(head) and p.endswith(tail[-10:]) for p in printed), line


def test_factory_example_prints_its_comment(ranks):
    comment = re.search(r"print\(out\.placements\)\s+# (\(.*?\)):", DOC.read_text()).group(1)
    assert comment in ranks[0]["printed"].splitlines()


def test_error_table_shows_real_messages(ranks):
    for (code, shown), got in zip(_error_rows(), ranks[0]["errors"]):
        assert got is not None, f"{code} raised nothing"
        if shown.startswith("... "):
            assert got.endswith(shown[4:]), (code, got)
        else:
            assert got == shown, (code, got)


def test_per_rank_shares_example_prints_its_comment(ranks):
    comment = re.search(r"\n# (per-rank shares train like the global batch: \w+)\n", DOC.read_text()).group(1)
    assert comment == "per-rank shares train like the global batch: True"
    assert comment in ranks[0]["printed"].splitlines()
