"""The pipeline's shape as `pipeline_shape` reads it from dvc.yaml, held against DVC's own reading
of the same file (its stage index and dependency graph, resolved with params.yaml): the stage
lists two nodes run, generate's shard order and the chain conf/ composes."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest
import yaml

from draftline.runtime import pipeline_shape
from draftline.runtime.resolvers import chain_links

ROOT = Path(__file__).resolve().parents[2]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
SHARDS = [int(k) for k in PARAMS["data"]["shard_ids"]]


@pytest.fixture(scope="module")
def dvc_index():
    """DVC's stages of the project (in dvc.yaml's order) and its graph, edges dependent ->
    dependency, each stage by its address (`extract@3`)."""
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        stages = {s.addressing: s for s in repo.index.stages}
        graph = nx.relabel_nodes(repo.index.graph, {s: s.addressing for s in repo.index.graph})
        yield stages, graph


@pytest.fixture(scope="module")
def shape() -> pipeline_shape.PipelineShape:
    return pipeline_shape.read()


def test_the_default_pipeline_is_the_projects(shape):
    assert pipeline_shape.PIPELINE == ROOT / "dvc.yaml"
    assert shape.names == list(yaml.safe_load(pipeline_shape.PIPELINE.read_text())["stages"])


def test_the_two_nodes_run_every_stage_once_in_an_order_dvc_allows(shape, dvc_index):
    stages, graph = dvc_index
    generating = shape.generation_stages(SHARDS)
    per_shard = [name for k in SHARDS for name in shape.shard_stages(k)]
    order = [*generating, *per_shard, *shape.final_stages]
    assert sorted(order) == sorted(stages)  # each of DVC's stages, once
    for position, name in enumerate(order):  # nothing runs before what it depends on
        assert set(nx.descendants(graph, name)) <= set(order[:position]), name
    # The generating node never waits for the training node.
    for name in generating:
        assert set(nx.descendants(graph, name)) <= set(generating), name
    assert generating == [
        "curate", *(f"generate@{k}" for k in SHARDS), "generate_eval"
    ]  # fmt: skip
    assert shape.final_stages == ["validate", "train", "evaluate"]


def test_a_shards_training_waits_for_the_generation_it_reads(shape, dvc_index):
    """Shard k's stages run after shard k-1's, so what those waited for counts as there."""
    _, graph = dvc_index
    generating = set(shape.generation_stages(SHARDS))
    waited: set[str] = set()
    for k in SHARDS:
        needed = {d for name in shape.shard_stages(k) for d in nx.descendants(graph, name)}
        assert set(shape.generated_for(k)) <= needed, k
        waited |= set(shape.generated_for(k))
        assert needed & generating <= waited, k
        assert shape.shard_stages(k) == [f"validate_shard@{k}", f"extract@{k}", f"train_shard@{k}"]


def test_generate_works_ahead_in_the_order_dvc_lists_its_shards(shape, dvc_index):
    stages, _ = dvc_index
    listed = [int(name.split("@")[1]) for name in stages if name.startswith("generate@")]
    assert shape.generate_order(PARAMS) == listed == SHARDS
    reversed_ids = {**PARAMS, "data": {**PARAMS["data"], "shard_ids": SHARDS[::-1]}}
    assert shape.generate_order(reversed_ids) == SHARDS[::-1]


def test_the_chain_is_what_the_link_stages_depend_on_and_write(shape, dvc_index):
    stages, _ = dvc_index
    assert chain_links(len(SHARDS)) == PARAMS["data"]["shard_chain"]
    for link in shape.chain_links(SHARDS):
        k = link["shard"]
        stage = stages[f"train_shard@{k}"]
        assert link["after"] in {d.def_path for d in stage.deps}
        if k:
            before = {o.def_path for o in stages[f"train_shard@{k - 1}"].outs}
            assert link["after"] in before
    assert shape.chain_links([]) == []


def test_generate_and_generate_eval_differ_only_in_their_split(dvc_index):
    stages, _ = dvc_index

    def params(name: str) -> set[str]:
        return {key for d in stages[name].deps if hasattr(d, "params") for key in d.params}

    def code(name: str) -> set[str]:
        return {d.def_path for d in stages[name].deps if d.def_path.startswith("src/")}

    assert params("generate@0") == params("generate_eval") and len(params("generate_eval")) == 11
    assert code("generate@0") == code("generate_eval")


STANDALONE = """\
stages:
  fetch:
    cmd: get
    outs: [raw]
  curate:
    cmd: curate
    deps: [raw/a.jsonl]
    outs: [data/curated]
  generate:
    foreach: [2, 0, 1]
    do:
      cmd: gen ${item}
      deps:
        - data/curated/shard-${item}.parquet
      outs:
        - data/generated/shard-${item}.parquet
  generate_eval:
    cmd: gen eval
    deps: [data/curated/eval.parquet]
    outs: [data/generated/eval.parquet]
  extract:
    foreach: ${data.shard_ids}
    do:
      cmd: extract ${item}
      deps:
        - data/generated/shard-${item}.parquet
      outs:
        - data/extracted/shard-${item}
  link:
    foreach: ${data.shard_chain}
    do:
      cmd: train ${item.shard}
      meta:
        chain_start: data/curated/plan.json
      deps:
        - data/extracted/shard-${item.shard}
        - ${item.after}
      outs:
        - links/shard-${item.shard}
  report:
    cmd: report
    deps: [links]
    outs:
      - report.json:
          cache: false
"""


def test_a_stage_added_upstream_of_generation_moves_to_the_generating_node(tmp_path: Path):
    (tmp_path / "dvc.yaml").write_text(STANDALONE)
    shape = pipeline_shape.read(tmp_path / "dvc.yaml")
    assert shape.generation_stages([0, 1]) == [
        "fetch", "curate", "generate@0", "generate@1", "generate_eval"
    ]  # fmt: skip
    assert shape.generated_for(1) == ["fetch", "curate", "generate@1"]
    assert shape.shard_stages(1) == ["extract@1", "link@1"]
    assert shape.final_stages == ["report"]
    assert shape.generate_order({}) == [2, 0, 1]  # a foreach's list as written
    assert shape.chain_links([5, 7]) == [
        {"shard": 5, "after": "data/curated/plan.json"},
        {"shard": 7, "after": "links/shard-5"},
    ]
    with pytest.raises(KeyError, match="no stage 'validate'"):
        shape.stage("validate")
