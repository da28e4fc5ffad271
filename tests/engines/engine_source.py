"""Load an installed engine module's own source when importing it for real cannot work on CPU.

Runs in the engines' environment (.venv-engines). SGLang's model files import its layer package,
whose import chain reaches `sglang.srt.configs` and from there torchvision, whose PyPI build
links CUDA and does not import here. `load_module` executes the module's own source unchanged,
except that each `from <engine package> import name` is tried for real and, only where that
import fails, bound to the stand-in the caller names for it (or to a placeholder that raises
when touched, so an unnamed stand-in can never be used silently).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any


class Missing:
    """A name whose module does not import on CPU and that the check does not need."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        raise RuntimeError(f"{self._name} is not importable here and has no stand-in")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is not importable here and has no stand-in")


_real: dict[str, Any] = {}


def _import(module: str) -> Any:
    if module not in _real:
        try:
            _real[module] = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - any import failure means: not usable on CPU
            _real[module] = None
    return _real[module]


def source_path(module: str) -> Path:
    """The installed file of `module`, found without importing its package."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.submodule_search_locations, f"{top} is not installed"
    return Path(next(iter(spec.submodule_search_locations)), *rest).with_suffix(".py")


def load_module(
    module: str, package: str, standins: dict[str, Any], used: set[str]
) -> types.ModuleType:
    """Execute `module`'s installed source; names from `package` that fail to import come from
    `standins` (recorded in `used`) or are `Missing`."""
    path = source_path(module)
    tree = ast.parse(path.read_text(), str(path))
    namespace: dict[str, Any] = {}
    body = []
    for node in tree.body:
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == package
        ):
            real = _import(node.module)
            for alias in node.names:
                bound = alias.asname or alias.name
                if real is not None and hasattr(real, alias.name):
                    namespace[bound] = getattr(real, alias.name)
                elif alias.name in standins:
                    namespace[bound] = standins[alias.name]
                    used.add(alias.name)
                else:
                    namespace[bound] = Missing(f"{node.module}.{alias.name}")
            continue
        body.append(node)
    tree.body = body
    loaded = types.ModuleType(f"_engine_source.{module}")
    loaded.__file__ = str(path)
    loaded.__dict__.update(namespace)
    sys.modules[loaded.__name__] = loaded
    exec(compile(tree, str(path), "exec"), loaded.__dict__)
    return loaded


def function_from(module: str, name: str, namespace: dict[str, Any]) -> Any:
    """One top-level function of `module`'s installed source, defined in `namespace`."""
    path = source_path(module)
    tree = ast.parse(path.read_text(), str(path))
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(compile(ast.Module([node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]
