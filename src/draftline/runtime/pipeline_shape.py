"""The pipeline's shape as dvc.yaml writes it, its one description: the stages in order, which
run once per train shard, which generate, which node of a two-node run owns which, and the
chain of training links. Generate's work-ahead order, the chain conf/ composes
(`data.shard_chain`) and `draftline lead`/`follow`'s stage lists are all derived here, so a
stage added to dvc.yaml, or moved there, changes each of them.

dvc.yaml is read as YAML, not through DVC (whose import alone takes longer than a stage's
start should): a `foreach` stage keeps its template (`do:`) and is named per item as DVC names
it (`generate@3`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The project's dvc.yaml, beside src/ in the checkout the package is installed from (editable).
PIPELINE = Path(__file__).resolve().parents[3] / "dvc.yaml"
# The generation stages: one per train shard (its foreach gives the shards' order) and the
# held-out split. The generating node runs them and every stage they depend on.
GENERATE = "generate"
GENERATE_EVAL = "generate_eval"
# Where the chain's first link starts: a key of the link stage's `meta` (DVC ignores `meta`).
CHAIN_START = "chain_start"
# libyaml's loader where PyYAML has it: every params.load asks for the chain.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class Stage:
    """One dvc.yaml stage: a single stage, or a per-shard `foreach` with its template."""

    name: str
    body: dict[str, Any]  # the stage, or its `do:` template
    foreach: Any = None  # what a per-shard stage iterates (`${data.shard_ids}`)

    @property
    def per_shard(self) -> bool:
        return self.foreach is not None

    def at(self, shard: int) -> str:
        """The stage's name for `shard` as DVC addresses it (`extract@3`, or `curate`)."""
        return f"{self.name}@{shard}" if self.per_shard else self.name

    @property
    def deps(self) -> list[str]:
        return [str(d) for d in self.body.get("deps") or []]

    @property
    def outs(self) -> list[str]:
        """Output paths as written (an out with options is a one-key mapping)."""
        return [o if isinstance(o, str) else next(iter(o)) for o in self.body.get("outs") or []]

    def feeds(self, other: Stage) -> bool:
        """Whether `other` reads what this stage writes: a dep that is one of its outs or lies
        inside one (compared as written, `${item}` and all)."""
        return any(
            dep == out or dep.startswith(out.rstrip("/") + "/")
            for dep in other.deps
            for out in self.outs
        )


@dataclass(frozen=True)
class PipelineShape:
    """The stages of a dvc.yaml in its order, and what follows from them."""

    stages: tuple[Stage, ...]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"dvc.yaml has no stage {name!r}")

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def generate_order(self, params: dict[str, Any]) -> list[int]:
        """The train shards in the order of the per-shard generate stages (their foreach):
        the order generate works ahead in."""
        return [int(k) for k in foreach_items(self.stage(GENERATE).foreach, params)]

    @property
    def generating(self) -> list[Stage]:
        """The generating node's stages, in dvc.yaml's order: the generation stages and every
        stage they depend on, however far up (curate)."""
        owned = {GENERATE, GENERATE_EVAL}
        while more := {
            a.name
            for a in self.stages
            for b in self.stages
            if a.name not in owned and b.name in owned and a.feeds(b)
        }:
            owned |= more
        return [s for s in self.stages if s.name in owned]

    @property
    def before_generation(self) -> list[Stage]:
        """The generating node's stages that generation depends on (curate: it reads the raw
        sources, which may live on that node only)."""
        return [s for s in self.generating if s.name not in (GENERATE, GENERATE_EVAL)]

    def generation_stages(self, shard_ids: Iterable[int]) -> list[str]:
        """The generating node's stages by name, in the order it runs them."""
        ids = list(shard_ids)
        return [
            name
            for s in self.generating
            for name in ([s.at(k) for k in ids] if s.per_shard else [s.name])
        ]

    def generated_for(self, shard: int) -> list[str]:
        """The generating node's stages a shard's training waits for: what generation depends
        on, and that shard's generate stage."""
        return [*(s.at(shard) for s in self.before_generation), self.stage(GENERATE).at(shard)]

    @property
    def training(self) -> list[Stage]:
        """The training node's stages: every other one, in dvc.yaml's order."""
        generating = {s.name for s in self.generating}
        return [s for s in self.stages if s.name not in generating]

    def shard_stages(self, shard: int) -> list[str]:
        """The training node's stages for one shard, in order."""
        return [s.at(shard) for s in self.training if s.per_shard]

    @property
    def final_stages(self) -> list[str]:
        """The training node's whole-run stages, run once every shard is through."""
        return [s.name for s in self.training if not s.per_shard]

    def chain_links(self, shard_ids: Iterable[int]) -> list[dict[str, int | str]]:
        """The chain of training links (`data.shard_chain`, which the link stage iterates):
        shard k and the file its link starts after, link k-1's state (the link stage's output
        for k-1), or for the first link its `meta.chain_start`. DVC's foreach cannot compute
        k-1, so the list carries it."""
        (stage,) = [s for s in self.stages if CHAIN_START in (s.body.get("meta") or {})]
        (state,) = [o for o in stage.outs if "${item.shard}" in o]
        links: list[dict[str, int | str]] = []
        after = str(stage.body["meta"][CHAIN_START])
        for k in shard_ids:
            links.append({"shard": k, "after": after})
            after = state.replace("${item.shard}", str(k))
        return links


def foreach_items(foreach: Any, params: dict[str, Any]) -> list[Any]:
    """The items a foreach iterates: its list as written, or the params value a
    `${dotted.key}` names (all dvc.yaml's foreach use)."""
    if isinstance(foreach, str) and foreach.startswith("${") and foreach.endswith("}"):
        value: Any = params
        for key in foreach[2:-1].split("."):
            value = value[key]
        return list(value)
    if isinstance(foreach, list):
        return foreach
    raise ValueError(f"a foreach of {foreach!r}: only a list or a `${{dotted.key}}` is read")


def read(path: str | Path = PIPELINE) -> PipelineShape:
    """The shape of the dvc.yaml at `path` (the project's by default)."""
    stages = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_LOADER)["stages"]
    return PipelineShape(
        tuple(
            Stage(name, body["do"], body["foreach"]) if "foreach" in body else Stage(name, body)
            for name, body in stages.items()
        )
    )
