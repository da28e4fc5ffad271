"""docs/architecture.md's layer rules, held against the code: every draftline import in
src/draftline (inside functions and under TYPE_CHECKING too) runs down to a lower layer or stays
in its own package, no modules import each other round a circle, and the doc's file map names
every module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "draftline"
DOC = ROOT / "docs" / "architecture.md"


def doc_layers() -> dict[str, int]:
    """Package (`core/`) or top-level file (`cli.py`) -> its layer, from the doc's
    `layer N: ...` lines."""
    text = DOC.read_text(encoding="utf-8")
    return {
        name: int(number)
        for number, names in re.findall(r"^layer (\d+): (.+)$", text, re.MULTILINE)
        for name in names.split()
    }


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def package_of(path: Path) -> str:
    """`core/` for anything under src/draftline/core/; "" for the top-level files."""
    parts = path.relative_to(PACKAGE).parts
    return f"{parts[0]}/" if len(parts) > 1 else ""


def layer_name(path: Path) -> str:
    return package_of(path) or path.name


def module_file(name: str) -> Path | None:
    base = PACKAGE.parent / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def absolute(node: ast.ImportFrom, path: Path) -> str:
    """The module a `from` import names (relative ones resolved against `path`)."""
    if not node.level:
        return node.module or ""
    package = path.parent.relative_to(PACKAGE.parent).parts
    base = ".".join(package[: len(package) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def imports(path: Path) -> list[tuple[int, Path]]:
    """(line, module file) of every draftline module `path` imports, at any depth of its code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node, path)
            # `from draftline.quality import checks` imports the module checks.
            names = [
                f"{module}.{alias.name}" if module_file(f"{module}.{alias.name}") else module
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "draftline" and (target := module_file(name)):
                found.append((node.lineno, target))
    return found


def graph() -> dict[Path, list[tuple[int, Path]]]:
    return {path: imports(path) for path in modules()}


def reachable(edges: dict[Path, list[tuple[int, Path]]], start: Path) -> set[Path]:
    seen: set[Path] = set()
    todo = [target for _, target in edges[start]]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += [target for _, target in edges[path]]
    return seen


def test_every_module_is_on_a_layer() -> None:
    layers = doc_layers()
    assert layers, f"{rel(DOC)} names no `layer N: ...` lines"
    unplaced = sorted({layer_name(p) for p in modules()} - set(layers))
    assert not unplaced, f"on no layer of {rel(DOC)}: {unplaced}"
    gone = sorted(n for n in layers if not (PACKAGE / n).exists())
    assert not gone, f"{rel(DOC)} places what src/draftline does not hold: {gone}"


def test_imports_run_down_the_layers() -> None:
    layers = doc_layers()
    upward = [
        f"{rel(path)}:{line} imports {rel(target)} "
        f"(layer {layers[layer_name(path)]} -> {layers[layer_name(target)]})"
        for path, found in graph().items()
        for line, target in found
        if package_of(path) != package_of(target)
        and layers[layer_name(target)] >= layers[layer_name(path)]
    ]
    assert not upward, "imports that do not run down a layer:\n" + "\n".join(upward)


def test_no_modules_import_each_other() -> None:
    edges = graph()
    reach = {path: reachable(edges, path) for path in edges}
    circles = [
        f"{rel(path)}:{line} imports {rel(target)}"
        for path, found in edges.items()
        for line, target in found
        if path in reach[target]  # the target leads back to the importer
    ]
    assert not circles, "imports that close a circle of modules:\n" + "\n".join(circles)


def test_the_rules_read_imports_inside_functions() -> None:
    """Blind rules would pass anything: the library imports its heavy modules where used."""
    found = {
        (path.relative_to(PACKAGE).as_posix(), target.relative_to(PACKAGE).as_posix())
        for path, edges in graph().items()
        for _, target in edges
    }
    assert ("cli.py", "runtime/stage_inputs.py") in found
    assert ("ops/salvage/node_checks.py", "generation/shards.py") in found


def mapped_modules() -> set[str]:
    """The files the doc's map (the block opening `src/draftline/`) names: an entry is a line
    `<indent><name>  <what it holds>`, two spaces of indent per folder."""
    block = DOC.read_text(encoding="utf-8").split("```\nsrc/draftline/\n", 1)[1]
    folders: list[str] = []
    found = set()
    for line in block.split("```", 1)[0].splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.endswith((".py", "/")):
            continue  # a description carried onto a second line
        depth = (len(line) - len(line.lstrip())) // 2 - 1
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name)
        else:
            found.add("".join(folders) + name)
    return found


def test_the_file_map_names_every_module() -> None:
    actual = {p.relative_to(PACKAGE).as_posix() for p in modules() if p.name != "__init__.py"}
    mapped = mapped_modules()
    assert not actual - mapped, f"{rel(DOC)}'s map misses {sorted(actual - mapped)}"
    assert not mapped - actual, f"{rel(DOC)}'s map names no such module: {sorted(mapped - actual)}"
