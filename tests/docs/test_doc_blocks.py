"""Every ```python block of README.md and docs/*.md runs, on real gloo ranks, as the page shows it.

The conventions (docs/testing.md):

* A page's python blocks run in order in one namespace (one *program*), on 4 gloo ranks (a
  ``(2, 2)`` mesh, the docs' usual one); ``<!-- doctest: ranks=N -->`` before a block starts a new
  program on N ranks. Each program runs in its own forked ranks, in a fresh working folder.
* ``<!-- doctest-setup`` ... ``-->`` (an HTML comment holding code, before a block) runs that hidden
  code first, in the program's namespace: what an excerpt takes for granted (``MyModel``, ``loader``).
* ``<!-- doctest: excerpt-of PATH -->``: the block is an excerpt of a file that runs elsewhere (an
  example): each of its code lines (comments stripped, ``...`` lines skipped) must appear in PATH,
  in order. Not run itself.
* ``<!-- doctest: not-run REASON -->``: the block is not run; the test is reported skipped with the
  reason. Use sparingly.
* ``<!-- doctest: run-by TESTFILE -->`` anywhere in a page: the page's blocks are run, with checks
  on what they print, by that test file (docs/plan.md, docs/static.md); it must exist and name the page.

Only ```python blocks are collected (```bash commands run the examples, which
tests/examples/test_examples.py runs; ```text blocks are output or pseudo-code).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  (DTensor imports it lazily: once here, not in every forked rank)

import vescale.zoo  # noqa: F401  (the docs' models: imported once before the ranks fork)
from vescale.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEFAULT_RANKS = 4

_FENCE = re.compile(r"^(`{3,})([^`\s]*)\s*$")  # an opening fence: its backticks and its language
_DIRECTIVE = re.compile(r"^<!--\s*doctest:\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the first code line
    code: str
    setup: list = field(default_factory=list)  # (line, code) of hidden doctest-setup comments
    ranks: int | None = None
    excerpt_of: str | None = None
    not_run: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass
class Program:
    blocks: list
    ranks: int

    @property
    def name(self) -> str:
        return self.blocks[0].where


def parse(page: Path) -> tuple[list[Block], str | None]:
    """The page's python blocks with their directives, and its ``run-by`` test file if any."""
    lines = page.read_text().splitlines()
    blocks, run_by, pending, i = [], None, {"setup": []}, 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:  # closed by a line of at least as many backticks (CommonMark)
            ticks = fence.group(1)
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j].strip().startswith(ticks) and set(lines[j].strip()) == {"`"}), None)
            if end is None:
                raise ValueError(f"{page}:{i + 1}: unclosed code fence")
            if fence.group(2) == "python":
                blocks.append(Block(page, i + 2, "\n".join(lines[i + 1:end]) + "\n", **pending))
            pending, i = {"setup": []}, end + 1
            continue
        directive = _DIRECTIVE.match(line)
        if directive:
            word, _, arg = directive.group(1).partition(" ")
            if word.startswith("ranks="):
                pending["ranks"] = int(word.split("=", 1)[1])
            elif word == "excerpt-of":
                pending["excerpt_of"] = arg.strip()
            elif word == "not-run":
                if not arg.strip():
                    raise ValueError(f"{page}:{i + 1}: `not-run` needs a reason")
                pending["not_run"] = arg.strip()
            elif word == "run-by":
                run_by = arg.strip()
            else:
                raise ValueError(f"{page}:{i + 1}: unknown doctest directive {directive.group(1)!r}")
        elif line.strip() == "<!-- doctest-setup":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->")
            pending["setup"].append((i + 2, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        elif line.strip():  # prose: directives apply only to the block right after them
            pending = {"setup": []}
        i += 1
    return blocks, run_by


def programs(blocks: list[Block]) -> list[Program]:
    out = []
    for block in blocks:
        if block.excerpt_of or block.not_run:
            continue
        if not out or block.ranks is not None:
            out.append(Program([], block.ranks or DEFAULT_RANKS))
        out[-1].blocks.append(block)
    return out


def _collect():
    runs, excerpts, not_run, run_by = [], [], [], []
    for page in PAGES:
        blocks, tested_in = parse(page)
        if tested_in:
            run_by.append(pytest.param(page, tested_in, id=page.name))
            continue
        runs += [pytest.param(p, id=p.name) for p in programs(blocks)]
        excerpts += [pytest.param(b, id=b.where) for b in blocks if b.excerpt_of]
        not_run += [pytest.param(b, id=b.where) for b in blocks if b.not_run and not b.excerpt_of]
    return runs, excerpts, not_run, run_by


RUNS, EXCERPTS, NOT_RUN, RUN_BY = _collect()


# ---- running a program on its ranks --------------------------------------------------------------------


def _compiled(code: str, page: Path, line: int):
    # Padded so that a traceback names the page's own line numbers.
    return compile("\n" * (line - 1) + code, str(page), "exec")


def _run(program: Program, folder: str) -> dict:
    """One rank: the program's setup code and blocks in one namespace, inside ``folder``."""
    import logging
    import torch.distributed as dist

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    namespace = {"__name__": "__doctest__"}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            for block in program.blocks:
                for line, code in block.setup:
                    exec(_compiled(code, block.page, line), namespace)
                exec(_compiled(block.code, block.page, block.line), namespace)
    except BaseException:  # reported per rank; a rank that fails ends, and its peers' collectives fail too
        return {"rank": dist.get_rank(), "error": traceback.format_exc(), "printed": printed.getvalue()}
    return {"rank": dist.get_rank(), "error": None, "printed": printed.getvalue()}


@pytest.mark.multiproc
@pytest.mark.parametrize("program", RUNS)
def test_doc_program_runs(program: Program, tmp_path):
    results = run_on_ranks(_run, program.ranks, program, str(tmp_path), timeout=300)
    errors: dict[str, list[int]] = {}  # traceback -> the ranks that raised it
    for r in results:
        if r["error"]:
            errors.setdefault(r["error"], []).append(r["rank"])
    assert not errors, f"{program.name} failed:\n" + "\n".join(f"--- rank(s) {ranks} ---\n{tb}" for tb, ranks in errors.items())


# ---- excerpts, blocks not run, pages run elsewhere -----------------------------------------------------


def _code_lines(text: str) -> list[str]:
    """Code lines, comments and surrounding space stripped, ``...`` lines dropped."""
    out = []
    for line in text.splitlines():
        code = "" if line.lstrip().startswith("#") else re.sub(r"\s+#.*$", "", line)
        code = " ".join(code.split())
        if code and code != "...":
            out.append(code)
    return out


@pytest.mark.parametrize("block", EXCERPTS)
def test_doc_excerpt_is_in_its_source(block: Block):
    source = ROOT / block.excerpt_of
    assert source.is_file(), f"{block.where}: excerpt of {block.excerpt_of}, which does not exist"
    remaining = iter(_code_lines(source.read_text()))
    for line in _code_lines(block.code):
        assert any(line == have for have in remaining), (
            f"{block.where}: excerpt line {line!r} is not in {block.excerpt_of} (in this order)"
        )


@pytest.mark.parametrize("block", NOT_RUN)
def test_doc_block_not_run(block: Block):
    pytest.skip(f"{block.where}: not run: {block.not_run}")


@pytest.mark.parametrize("page, test_file", RUN_BY)
def test_doc_page_run_by_its_own_test(page: Path, test_file: str):
    path = ROOT / test_file
    assert path.is_file(), f"{page.name} says its blocks run in {test_file}, which does not exist"
    assert page.name in path.read_text(), f"{test_file} does not name {page.name}"


def test_directives_attach_to_the_next_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "intro\n<!-- doctest: ranks=2 -->\n<!-- doctest-setup\nx = 1\n-->\n\n```python\nprint(x)\n```\n"
        "```python\ny = x\n```\n<!-- doctest: not-run needs a GPU -->\nprose in between\n```python\nz\n```\n"
        "<!-- doctest: excerpt-of examples/a.py -->\n```python\nrun()  # comment\n```\n```bash\nls\n```\n"
    )
    blocks, run_by = parse(page)
    assert run_by is None and [b.line for b in blocks] == [8, 11, 16, 20]
    assert blocks[0].ranks == 2 and blocks[0].setup == [(4, "x = 1\n")] and blocks[0].code == "print(x)\n"
    assert blocks[1].ranks is None and blocks[1].setup == []
    assert blocks[2].not_run is None  # prose between the directive and the block drops it
    assert blocks[3].excerpt_of == "examples/a.py" and _code_lines(blocks[3].code) == ["run()"]
    assert [[b.line for b in p.blocks] for p in programs(blocks)] == [[8, 11, 16]]
    assert programs(blocks)[0].ranks == 2
    page.write_text("````markdown\n```python\nnot = code\n```\n````\n```python\nx = 1\n```\n")
    assert [b.line for b in parse(page)[0]] == [7]  # a block shown inside a longer fence is text
    page.write_text("<!-- doctest: rank=2 -->\n```python\n```\n")
    with pytest.raises(ValueError, match="unknown doctest directive 'rank=2'"):
        parse(page)
