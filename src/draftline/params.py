"""The experiment's parameters: Hydra composition of conf/ into params.yaml, and reading it.

`compose` writes exactly what DVC's Hydra integration writes on `dvc exp run` (resolved
OmegaConf YAML), so both paths give the same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CONFIG_NAME = "config"


def compose(overrides: list[str] | None = None, config_dir: str | Path = "conf") -> dict[str, Any]:
    """Compose conf/config.yaml with Hydra overrides into a plain, resolved dict."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from draftline.resolvers import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(Path(config_dir).resolve()), version_base=None):
        cfg = hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides or []))
    OmegaConf.resolve(cfg)
    data = OmegaConf.to_container(cfg)
    assert isinstance(data, dict)
    return data


def to_yaml(data: dict[str, Any]) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(data))


def load(path: str | Path = "params.yaml") -> dict[str, Any]:
    """Read params.yaml; a clear error names the fix when it is missing or inconsistent."""
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"{p} not found: run `draftline compose` in the repository root")
    data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    data_cfg = data.get("data") or {}
    if "num_shards" in data_cfg and data_cfg.get("shard_ids") != list(
        range(int(data_cfg["num_shards"]))
    ):
        n = int(data_cfg["num_shards"])
        raise SystemExit(
            f"params.yaml: data.shard_ids must be [0..{n - 1}] for data.num_shards={n}; "
            f"run `draftline compose data.num_shards={n}` or pass "
            f"-S 'data.shard_ids=[{','.join(map(str, range(n)))}]' to dvc exp run"
        )
    return data
