"""docs/static.md stays true: its example runs on 2 real ranks and prints what the page says, and the
page's excerpt of ``export_plan``'s output is in the text the example's model exports."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from vescale.testing import run_on_ranks

DOC = Path(__file__).resolve().parents[2] / "docs" / "static.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def _printed_after(block: str) -> str:
    """The ```text block after "prints" that follows the python block ``block``."""
    text = DOC.read_text()
    return re.search(r"```text\n(.*?)```", text[text.index(block):], flags=re.S).group(1)


def _run_example() -> dict:
    import logging

    import vescale.static

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    namespace = {"__name__": "docs_static"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_python_blocks()[0], str(DOC), "exec"), namespace)
    checkpointed = io.StringIO()  # the activation checkpointing section's example
    with contextlib.redirect_stdout(checkpointed):
        exec(compile(_python_blocks()[1], str(DOC), "exec"), {"__name__": "docs_static_checkpointing"})
    return {"printed": printed.getvalue(), "export": vescale.static.export_plan(namespace["model"]),
            "checkpointed": checkpointed.getvalue()}


@pytest.fixture(scope="module")
def example() -> dict:
    return run_on_ranks(_run_example, 2)[0]


@pytest.mark.multiproc
def test_static_example_prints_what_the_page_says(example):
    expected = re.findall(r"```text\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    assert example["printed"] == expected


@pytest.mark.multiproc
def test_the_checkpointing_example_prints_what_the_page_says(example):
    assert example["checkpointed"] == _printed_after(_python_blocks()[1])


@pytest.mark.multiproc
def test_the_export_excerpt_is_what_the_example_exports(example):
    blocks = _python_blocks()
    assert len(blocks) == 3, "docs/static.md: a new python block must be run or checked here"
    exported = example["export"].splitlines()
    for line in blocks[2].splitlines():
        assert line in exported, f"docs/static.md's export excerpt line {line!r} is not exported:\n{example['export']}"
