"""OmegaConf resolvers used by conf/: values derived from others, so no composition can hold
an inconsistent pair (shard ids that do not match the shard count, a target id that names
other weights than the target path holds).

They are registered by `draftline.runtime.params.compose` and, for `dvc exp run -S ...` (DVC
composes in its own process), by the Hydra plugin module `hydra_plugins.draftline_resolvers`, which
Hydra imports when it scans for plugins.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import ListConfig, OmegaConf

CHUNK = 1 << 20


def shard_ids(num_shards: int) -> ListConfig:
    """[0, ..., num_shards - 1]: DVC's foreach needs the list, users set one number."""
    # A ListConfig, not a list: OmegaConf.resolve cannot store a plain list in place.
    return ListConfig(list(range(int(num_shards))))


def chain_links(num_shards: int) -> list[dict[str, int | str]]:
    """The chain of training links (dvc.yaml `train_shard`): shard k and the file its link
    starts after, link k-1's state, or for shard 0 curate's summary (the planned rows). DVC's
    foreach cannot compute k-1, so the list carries it."""
    return [
        {"shard": k, "after": f"models/chain/shard-{k - 1}" if k else "data/curated/summary.json"}
        for k in range(int(num_shards))
    ]


def shard_chain(num_shards: int) -> ListConfig:
    """`chain_links` for conf/ (checks compare plain lists: a ListConfig is slow to build)."""
    return ListConfig(chain_links(num_shards))


def target_id(path: str, revision: str | None = None) -> str:
    """Identity of the target's weights, independent of where they are stored.

    A local folder: sha256 over the relative names and bytes of its files (config, tokenizer,
    chat template, weights), so a copy elsewhere has the same id and one changed byte a new one.
    A hub id: the id and its revision (a pinned revision names fixed weights).
    """
    folder = Path(str(path))
    if not folder.is_dir():
        return f"hub:{path}@{revision or 'unpinned'}"
    digest = hashlib.sha256()
    files = sorted(
        p for p in folder.rglob("*") if p.is_file() and not _hidden(p.relative_to(folder))
    )
    for file in files:
        digest.update(file.relative_to(folder).as_posix().encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        digest.update(b"\0")
    return f"sha256:{digest.hexdigest()[:16]}"


def _hidden(rel: Path) -> bool:
    # .cache/ and .git/ hold download state, not the model.
    return any(part.startswith(".") for part in rel.parts)


def register() -> None:
    """Register the resolvers once per process (Hydra may import the plugin module again)."""
    for name, fn in (
        ("draftline.shard_ids", shard_ids),
        ("draftline.shard_chain", shard_chain),
        ("draftline.target_id", target_id),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
