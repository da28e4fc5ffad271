"""The experiment's parameters: Hydra composition of conf/ into params.yaml, and reading it.

`compose` writes exactly what DVC's Hydra integration writes on `dvc exp run` (resolved
OmegaConf YAML), so both paths give the same file.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from draftline.runtime import config_schema, config_values

CONFIG_NAME = "config"
# First line of a params.yaml composed with overrides: `compose --check` and `doctor` recompose
# with them. A YAML comment, so no stage (and no DVC param) ever sees it.
HEADER = "# draftline compose"


def compose(overrides: list[str] | None = None, config_dir: str | Path = "conf") -> dict[str, Any]:
    """Compose conf/config.yaml with Hydra overrides into a plain, resolved dict; a key the
    schema does not know fails (`config_schema`), unless an override added it with `+`."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from draftline.runtime.resolvers import register

    register()
    config_schema.check_overrides(list(overrides or []))
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(Path(config_dir).resolve()), version_base=None):
        cfg = hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides or []))
    # As written, before interpolation: which key a copied value comes from.
    raw = OmegaConf.to_container(cfg)
    assert isinstance(raw, dict)
    sources = config_values.set_as(raw)
    shards = OmegaConf.select(cfg, "data.num_shards", default=None)
    if shards is not None:  # the derived shard lists grow with it: check it before building them
        _refuse(config_values.problems({"data": {"num_shards": shards}}))
    # The values OmegaConf.resolve gives (what DVC writes), without storing the derived lists
    # back into the config first, which costs more than building them.
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    config_schema.check(data, list(overrides or []))
    _refuse(config_values.problems(data, sources))
    return data


def _refuse(problems: list[str]) -> None:
    if problems:
        raise config_values.BadValueError(problems[0])


def looks_local(path: str) -> bool:
    """Whether model.path is meant as a folder on this machine, not a hub id `org/name`:
    absolute, `./`, `../` or `~`, or its parent folder exists here (`models/my-target`)."""
    if path.startswith(("/", "./", "../", "~")) or path in (".", ".."):
        return True
    parent = Path(path).expanduser().parent
    return parent != Path(".") and parent.is_dir()


def check_model_path(data: dict[str, Any]) -> None:
    """A local-looking model.path that does not exist, or whose JSON files are cut short,
    fails with one line naming the fix;
    a hub id is left to the hub (a local path must never be recorded as a hub id)."""
    model = data.get("model") or {}
    path = str(model.get("path") or "")
    if not path or not looks_local(path):
        return
    if Path(path).expanduser().exists():
        from draftline.core.target import missing_model

        if message := missing_model(model):  # no config.json, or a cut JSON file
            raise SystemExit(message)
        return
    raise SystemExit(
        f"model.path {path} does not exist on this machine: point model.path at a model folder "
        f"(with config.json) or a hub id such as Qwen/Qwen3-8B (`draftline compose "
        f"model={model.get('name')} model.path=...`)"
    )


def identity(p: dict[str, Any]) -> dict[str, Any]:
    """What a run computed on: stages record it in their metrics, and `draftline plan` uses
    measured figures only for the same target (path@revision), data and drafter."""
    from draftline.core.target import model_ref

    drafter = p.get("drafter") or {}
    return {
        "model": model_ref(p["model"]),
        "data": (p.get("data") or {}).get("name"),
        "drafter": drafter.get("name"),
        # Named by the profiles of the families other than DFlash (drafter.family).
        **({"drafter_family": drafter["family"]} if drafter.get("family") else {}),
    }


def to_yaml(data: dict[str, Any], overrides: list[str] | None = None) -> str:
    """YAML of `data`; with overrides, headed by the command that composed it."""
    from omegaconf import OmegaConf

    text = OmegaConf.to_yaml(OmegaConf.create(data))
    return f"{HEADER} {shlex.join(overrides)}\n{text}" if overrides else text


def recorded_overrides(path: str | Path = "params.yaml") -> list[str]:
    """The overrides `draftline compose` wrote `path` with ([] when none or no file)."""
    p = Path(path)
    if not p.is_file():
        return []
    with p.open(encoding="utf-8") as f:
        first = f.readline().rstrip("\n")
    if first == HEADER or first.startswith(HEADER + " "):
        return shlex.split(first[len(HEADER) :])
    return []


def is_current(
    path: str | Path = "params.yaml",
    config_dir: str | Path = "conf",
    overrides: list[str] | None = None,
) -> tuple[bool, list[str], dict[str, Any]]:
    """Whether `path` equals conf/ composed with `overrides` (default: those it records).

    Returns (current, the overrides used, the composition).
    """
    used = recorded_overrides(path) if overrides is None else list(overrides)
    composed = compose(used, config_dir)
    p = Path(path)
    current = yaml.safe_load(p.read_text(encoding="utf-8")) if p.is_file() else None
    return current == composed, used, composed


def hydra_message(text: str) -> str:
    """Hydra's short error on one line: options listed under a heading joined by commas, and
    the config search path (Hydra's internals) left out."""
    parts: list[str] = []
    for line in text.split("Config search path:")[0].splitlines():
        if line.startswith("\t") and parts:
            sep = " " if parts[-1].endswith(":") else ", "
            parts[-1] += sep + line.strip()
        elif line.strip():
            parts.append(line.strip().rstrip("."))
    return "; ".join(parts)


def load(path: str | Path = "params.yaml") -> dict[str, Any]:
    """Read params.yaml; a clear error names the fix when it is missing or inconsistent."""
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"{p} not found: run `draftline compose` in the repository root")
    data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    # `dvc exp run -S` composes without `compose`: its values are checked here, as a stage starts.
    if bad := config_values.problems(data):
        raise SystemExit(f"{p}: {bad[0]}")
    for path in config_schema.unknown_keys(data):
        if meant := config_schema.close_key(path):
            raise SystemExit(
                f"{p}: {path} is not a key any stage reads; did you mean {meant}? "
                f"(`dvc exp run -S {meant}=...`, without +)"
            )
    return data
