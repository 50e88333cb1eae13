"""docs/architecture.md stays readable in one sitting: no paragraph, list item or table cell over
400 characters (code fences, such as the layer diagram, excepted), and every ``file:function`` the
"life of a step" lists names a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
LIMIT = 400


def _pieces(text: str) -> list[str]:
    """Paragraphs, list items and table cells, each joined into one line; code fences skipped."""
    pieces, current, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        starts_new = not line.strip() or re.match(r"^\s*([*-]|\d+\.)\s", line) or line.startswith(("#", "|"))
        if starts_new and current:
            pieces.append(" ".join(current))
            current = []
        if line.startswith("|"):
            pieces.extend(cell.strip() for cell in line.split("|"))
        elif line.strip():
            current.append(line.strip())
    if current:
        pieces.append(" ".join(current))
    return pieces


def test_no_paragraph_item_or_cell_is_over_the_limit():
    long = [f"{len(p)} chars: {p[:70]}..." for p in _pieces(PAGE.read_text()) if len(p) > LIMIT]
    assert not long, "split these in docs/architecture.md:\n" + "\n".join(long)


def test_the_pieces_are_found():  # the splitter is not vacuous: a long paragraph is caught
    text = "intro\n\n" + "word " * 100 + "\n\n* item\n| a | " + "b" * 500 + " |\n```\n" + "x" * 900 + "\n```\n"
    lengths = sorted(len(p) for p in _pieces(text))
    assert lengths[-2:] == [499, 500] and max(lengths) < 900


def test_files_named_in_the_life_of_a_step_exist():
    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py):", PAGE.read_text()))
    assert len(named) >= 10, named
    missing = sorted(n for n in named if not (ROOT / "vescale" / n.removeprefix("vescale/")).exists())
    assert not missing, f"docs/architecture.md names files that do not exist under vescale/: {missing}"
