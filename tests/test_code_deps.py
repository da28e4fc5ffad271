"""Code deps in dvc.yaml cover every module a stage runs: a stage's import closure (draftline
modules reachable from its entry point, found by reading the import statements) must lie under
its declared deps, or a change there would silently skip a rerun."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def module_file(name: str) -> Path | None:
    for path in (
        SRC / f"{name.replace('.', '/')}.py",
        SRC / name.replace(".", "/") / "__init__.py",
    ):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path) -> set[str]:
    """draftline modules `path` imports, at any depth of its code (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("draftline"):
            assert node.module is not None
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if module_file(sub) else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("draftline")}
    return found


def import_closure(entry: str) -> set[Path]:
    """Files of every draftline module reachable from `entry`, with the packages' __init__s."""
    seen: set[str] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen or (path := module_file(name)) is None:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parents run first
        todo += imported_modules(path)
    return {p for name in seen if (p := module_file(name)) is not None}


def stage_entries() -> dict[str, tuple[str, list[str]]]:
    """dvc.yaml stage -> (the stage module its cmd runs, its code deps)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    out = {}
    for name, stage in stages.items():
        body = stage.get("do", stage)
        command = body["cmd"].split()[1]  # `draftline <command> ...`
        deps = [d for d in body["deps"] if str(d).startswith("src/")]
        out[name] = (f"draftline.stages.{command}", deps)
    return out


def covered(path: Path, deps: list[str]) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return any(rel == d or rel.startswith(d.rstrip("/") + "/") for d in deps)


# Package markers every stage passes through that hold no code (a docstring and a version).
ENTRY_ONLY = {"src/draftline/__init__.py", "src/draftline/stages/__init__.py"}


@pytest.mark.parametrize("stage", sorted(stage_entries()))
def test_every_module_a_stage_imports_is_one_of_its_deps(stage: str) -> None:
    entry, deps = stage_entries()[stage]
    assert module_file(entry) is not None, f"{stage}: no module {entry}"
    missing = sorted(
        p.relative_to(ROOT).as_posix()
        for p in import_closure(entry)
        if not covered(p, deps) and p.relative_to(ROOT).as_posix() not in ENTRY_ONLY
    )
    assert not missing, f"dvc.yaml stage {stage} runs modules it does not depend on: {missing}"


def test_the_closure_follows_function_level_imports() -> None:
    """The check would be blind if it missed imports inside functions (the library imports torch
    and its own heavy modules lazily)."""
    closure = {p.relative_to(SRC).as_posix() for p in import_closure("draftline.stages.generate")}
    assert "draftline/quality/checks.py" in closure  # completion_hash, imported where used
    assert "draftline/generation/engines/sglang.py" in closure
