"""OmegaConf resolvers used by conf/: values derived from others, so no composition can hold
an inconsistent pair (shard ids that do not match the shard count, a target id that names
other weights than the target path holds).

They are registered by `draftline.runtime.params.compose` and, for `dvc exp run -S ...` (DVC
composes in its own process), by the Hydra plugin module `hydra_plugins.draftline_resolvers`, which
Hydra imports when it scans for plugins.
"""

from __future__ import annotations

from omegaconf import ListConfig, OmegaConf

from draftline.core.target import target_id
from draftline.runtime import pipeline_shape


def shard_ids(num_shards: int) -> ListConfig:
    """[0, ..., num_shards - 1]: DVC's foreach needs the list, users set one number."""
    # A ListConfig, not a list: OmegaConf.resolve cannot store a plain list in place.
    return ListConfig(list(range(int(num_shards))))


def chain_links(num_shards: int) -> list[dict[str, int | str]]:
    """The chain of training links over shards 0..num_shards-1, as dvc.yaml's link stage
    describes it (`pipeline_shape.PipelineShape.chain_links`)."""
    return pipeline_shape.read().chain_links(range(int(num_shards)))


def shard_chain(num_shards: int) -> ListConfig:
    """`chain_links` for conf/ (checks compare plain lists: a ListConfig is slow to build)."""
    return ListConfig(chain_links(num_shards))


def register() -> None:
    """Register the resolvers once per process (Hydra may import the plugin module again)."""
    for name, fn in (
        ("draftline.shard_ids", shard_ids),
        ("draftline.shard_chain", shard_chain),
        ("draftline.target_id", target_id),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
