"""docs/static.md stays true: its example runs on 2 real ranks and prints what the page says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from vescale.testing import run_on_ranks

DOC = Path(__file__).resolve().parents[2] / "docs" / "static.md"


def _run_example() -> str:
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(DOC), "exec"), {"__name__": "docs_static"})
    return printed.getvalue()


@pytest.mark.multiproc
def test_static_example_prints_what_the_page_says():
    expected = re.findall(r"```text\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    assert run_on_ranks(_run_example, 2)[0] == expected
