"""Imports flow one way: each module imports only from its own level or the levels below it, and the
modules of one level import each other without a cycle. Imports inside functions count as much as those
at the top of a file (a cycle hidden in a function is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dsjax"

# Lowest first. A module belongs to the first level naming it or a package above it. README.md's
# "Layout" section states the same order.
LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations", ("dsjax.config", "dsjax.config_v41", "dsjax.presets", "dsjax.quant", "dsjax.cache_formats",
                     "dsjax.numerics", "dsjax.run_config", "dsjax.engram_hash", "dsjax.parallel", "dsjax.stacked",
                     "dsjax.compile_cache", "dsjax.embedded")),
    ("cache", ("dsjax.cache",)),
    ("kernels", ("dsjax.kernels",)),
    ("layers", ("dsjax.layers",)),
    ("model", ("dsjax.model", "dsjax.model_v41", "dsjax.quantize")),
    ("engine", ("dsjax.engine",)),
    ("checkpoint", ("dsjax.checkpoint",)),
    ("batch", ("dsjax.batch",)),
    ("tools", ("dsjax.plan", "dsjax.export", "dsjax.bench", "dsjax.info", "dsjax.demo", "dsjax.training")),
    ("cli", ("dsjax.cli", "dsjax")),  # `dsjax` itself: the package's public names, gathered from all
)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name → file of every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the package's modules it imports (anywhere in the file)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target in mods and target != name and target.split(".")[0] == "dsjax":
                    found.add(target)
        graph[name] = found
    return graph


def level_of(name: str, levels=LEVELS) -> int:
    for i, (_, prefixes) in enumerate(levels):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    raise KeyError(name)


def violations(graph: dict[str, set[str]], levels=LEVELS) -> list[str]:
    """Every import against the order, and every cycle, as readable lines (empty: the order holds)."""
    out = []
    for name in sorted(graph):
        for target in sorted(graph[name]):
            if target == "dsjax":
                out.append(f"{name} imports the package facade `dsjax` (import the module that defines the name)")
            elif level_of(target, levels) > level_of(name, levels):
                out.append(f"{name} ({levels[level_of(name, levels)][0]}) imports {target} "
                           f"({levels[level_of(target, levels)][0]}), a higher level")
    # Cycles: a depth-first search that reports each back edge's loop once.
    state: dict[str, int] = {}
    stack: list[str] = []
    seen_loops = set()

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                loop = stack[stack.index(nxt):] + [nxt]
                key = frozenset(loop)
                if key not in seen_loops:
                    seen_loops.add(key)
                    out.append("import cycle: " + " → ".join(loop))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return out


def test_every_module_has_a_level():
    unplaced = []
    for name in modules():
        try:
            level_of(name)
        except KeyError:
            unplaced.append(name)
    assert not unplaced, f"modules with no level in LEVELS: {unplaced}"


def test_imports_flow_one_way():
    found = violations(imports(modules()))
    assert not found, "imports against the order (tests/test_imports.py LEVELS):\n" + "\n".join(found)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "dsjax"


@pytest.mark.parametrize("files, expected", [
    # a cycle inside one level, one side hidden in a function
    ({"dsjax/__init__.py": "", "dsjax/layers/__init__.py": "",
      "dsjax/layers/a.py": "from dsjax.layers import b\n",
      "dsjax/layers/b.py": "def f():\n    from dsjax.layers.a import x\n"},
     ["import cycle: dsjax.layers.a → dsjax.layers.b → dsjax.layers.a"]),
    # a kernel importing a layer (a level above it), through a relative import
    ({"dsjax/__init__.py": "", "dsjax/layers/__init__.py": "", "dsjax/layers/norms.py": "",
      "dsjax/kernels/__init__.py": "", "dsjax/kernels/k.py": "from ..layers.norms import RMSNorm\n"},
     ["dsjax.kernels.k (kernels) imports dsjax.layers.norms (layers), a higher level"]),
    # the order kept: nothing to report
    ({"dsjax/__init__.py": "", "dsjax/cache.py": "import dsjax.quant\n", "dsjax/quant.py": "import numpy\n"},
     []),
])
def test_the_check_reports_what_breaks_the_order(tmp_path, files, expected):
    root = _write(tmp_path, files)
    assert violations(imports(modules(root))) == expected
