"""Every public function of ``vescale/`` has annotated parameters and a return type (issue 31's
habit: public and cross-package signatures say what they take). mypy then checks their bodies
(scripts/lint.sh). Exempt: Triton kernels, whose parameter annotations Triton reads to compile them
(annotating them would change the compiled kernel)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRITON_KERNELS = ROOT / "vescale" / "random" / "_triton_kernel.py"


def _unannotated(path: Path, root: Path) -> list[str]:
    """``file:line name: what lacks an annotation`` for each public function of ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            params = [a for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
            params += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
            missing = [a.arg for a in params if a.annotation is None] + (["return"] if node.returns is None else [])
            if missing:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {', '.join(missing)}")
    return found


def test_public_functions_are_annotated():
    paths = [p for p in sorted((ROOT / "vescale").rglob("*.py")) if p != TRITON_KERNELS]
    missing = [line for path in paths for line in _unannotated(path, ROOT)]
    assert not missing, f"{len(missing)} public functions lack annotations:\n" + "\n".join(missing)


def test_the_check_finds_what_lacks_an_annotation(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def public(x, *rest, flag: bool = False) -> int:\n    return x\n\n\n"
                      "def no_return(y: int):\n    return y\n\n\ndef _private(z):\n    return z\n")
    assert _unannotated(sample, tmp_path) == ["sample.py:1 public: x, rest", "sample.py:5 no_return: return"]
