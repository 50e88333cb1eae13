"""The package layers of docs/architecture.md hold: a package imports only packages on lower layers.

Every ``import`` in ``vescale/`` counts, at module level and inside functions. The few imports that
break the layering today are listed in ``KNOWN`` (and in the page's table); a new one fails here
with the file, line and layers, so the diagram stays true or is changed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vescale"

LAYERS = {
    "_torch": 0, "model_state": 0, "memo": 0,
    "placement": 1, "mesh": 1, "precision": 1, "data": 1, "optim": 1,
    "dispatch": 2, "plan": 2,
    "comm": 3, "random": 3, "zoo": 3,
    "init": 4,
    "parallel": 5,
    "static": 6,
    "checkpoint": 7, "debug": 7, "testing": 7,
}

# (importing file, imported module): the exceptions docs/architecture.md lists, all inside functions.
KNOWN = {
    ("comm/grad.py", "parallel.faults"),
    ("random/generator.py", "parallel.faults"),
    ("mesh.py", "parallel.faults"),
    ("precision.py", "parallel.hooks"),
    ("parallel/api.py", "static"),
}


def _imported(path: Path) -> list[tuple[int, list[str]]]:
    """(line, module path as parts, e.g. ["vescale", "parallel", "faults"]) of each vescale import."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    package = list(rel if rel[-1] == "__init__" else rel[:-1])
    if package[-1] == "__init__":
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                if node.module:
                    found.append((node.lineno, base + node.module.split(".")))
                else:
                    found += [(node.lineno, base + [a.name]) for a in node.names]
            elif node.module == "vescale":
                found += [(node.lineno, ["vescale", a.name]) for a in node.names]
            elif node.module and node.module.startswith("vescale."):
                found.append((node.lineno, node.module.split(".")))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")) for a in node.names if a.name.startswith("vescale.")]
    return found


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    packages |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert packages == set(LAYERS), f"give each package a layer here and in docs/architecture.md: {packages ^ set(LAYERS)}"


def test_imports_go_down_the_layers():
    bad, seen = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts == ("__init__.py",):
            continue  # the public surface re-exports every layer
        src = rel.parts[0].removesuffix(".py")
        for line, parts in _imported(path):
            dst = parts[1] if len(parts) > 1 else None
            if dst not in LAYERS or dst == src or LAYERS[dst] < LAYERS[src]:
                continue
            key = (rel.as_posix(), ".".join(parts[1:3]) if dst != "static" else "static")
            seen.add(key)
            if key not in KNOWN:
                bad.append(f"vescale/{rel}:{line} imports {'.'.join(parts)}: {src} (layer {LAYERS[src]}) "
                           f"may import only lower layers, {dst} is layer {LAYERS[dst]}")
    assert not bad, "\n".join(bad)
    assert KNOWN <= seen, f"no longer imported, drop from KNOWN and docs/architecture.md: {KNOWN - seen}"


def test_dispatch_coverage_imports_nothing_from_the_fast_path():
    """``dispatch/coverage`` (what users' ops need) stands without ``dispatch/fast`` (caches, replays):
    the fast path may use the coverage modules, never the other way round."""
    bad = []
    for path in sorted((PACKAGE / "dispatch" / "coverage").rglob("*.py")):
        for line, parts in _imported(path):
            if parts[:3] == ["vescale", "dispatch", "fast"]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {'.'.join(parts)}")
    assert not bad, "\n".join(bad)
    assert _imported(PACKAGE / "dispatch" / "fast" / "cache.py"), "the import walk found nothing: the check would pass vacuously"
