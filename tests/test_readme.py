"""README.md's "Layout" section names every module under dsjax/ and every script, and states the import
order that tests/test_imports.py checks."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_imports import LEVELS

REPO = Path(__file__).resolve().parents[1]


def layout_bullets(readme: str) -> list[str]:
    """The top-level bullets of the Layout section, each with its continuation lines."""
    section = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    bullets: list[str] = []
    for line in section.splitlines():
        if line.startswith("- "):
            bullets.append(line)
        elif bullets and line.startswith(" "):
            bullets[-1] += " " + line.strip()
    return bullets


def _words(bullet: str) -> set[str]:
    """The backticked words of a bullet, each also without a trailing `/` or `.py`."""
    out = set()
    for quoted in re.findall(r"`([^`]+)`", bullet):
        for word in re.split(r"[\s,()]+", quoted):
            out |= {word, word.rstrip("/"), word.removesuffix(".py")}
    return out


def unnamed_modules(bullets: list[str], repo: Path = REPO) -> list[str]:
    """Modules under dsjax/ that no bullet names: by their path, or by their name in a bullet that names a
    folder above them and every folder between (e.g. `dsjax/kernels/` … `sparse_attention/` … `op`)."""
    missing = []
    for path in sorted((repo / "dsjax").rglob("*.py")):
        rel = path.relative_to(repo).as_posix()
        if path.name == "__init__.py" and path.stat().st_size == 0:
            continue
        parts = rel.removesuffix(".py").split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        named = False
        for bullet in bullets:
            if f"`{rel}`" in bullet or f"`{'/'.join(parts)}/`" in bullet:
                named = True
                break
            words = _words(bullet)
            for depth in range(2, len(parts)):
                if f"{'/'.join(parts[:depth])}/" in words and all(p in words for p in parts[depth:]):
                    named = True
                    break
            if named:
                break
        if not named:
            missing.append(rel)
    return missing


def unnamed_scripts(bullets: list[str], repo: Path = REPO) -> list[str]:
    words = set().union(*map(_words, bullets))
    return [p.name for p in sorted((repo / "scripts").iterdir())
            if p.is_file() and p.suffix in (".py", ".sh") and p.name not in words]


def test_layout_names_every_module_and_script():
    bullets = layout_bullets((REPO / "README.md").read_text())
    assert not unnamed_modules(bullets), f"README.md's Layout does not name {unnamed_modules(bullets)}"
    assert not unnamed_scripts(bullets), f"README.md's Layout does not name {unnamed_scripts(bullets)}"


def test_layout_states_the_import_order():
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    order = " → ".join(name for name, _ in LEVELS)
    assert order in section, f"README.md's Layout should state the import order: {order}"


def test_the_check_finds_a_module_left_out(tmp_path):
    (tmp_path / "dsjax" / "layers").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    for rel in ("dsjax/model.py", "dsjax/layers/rope.py", "dsjax/layers/mhc.py", "scripts/run.py"):
        (tmp_path / rel).write_text("x = 1\n")
    bullets = layout_bullets("# t\n\n## Layout\n\n- `dsjax/model.py`: the model.\n"
                             "- `dsjax/layers/`: `rope`,\n  and more.\n\n## Next\n- `dsjax/layers/mhc.py`\n")
    assert unnamed_modules(bullets, tmp_path) == ["dsjax/layers/mhc.py"]
    assert unnamed_scripts(bullets, tmp_path) == ["run.py"]
