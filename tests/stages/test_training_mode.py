"""What a training call trains is decided once, by the `train` stage, from the params and the
stage's inputs: never from what happens to be on disk (a stale whole-run index.json once made
the last stage train a whole run from old packs)."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from draftline.drafter.step_plan import CallSteps, StepPlan
from draftline.drafter.training_mode import TrainingMode
from draftline.stages.train import training_mode

SHARDS = {"data": {"shard_ids": [0, 1, 2]}}


def stage_args(tmp_path: Path, shard: int | None = None) -> Namespace:
    return Namespace(
        data=str(tmp_path / "extracted"), chain=str(tmp_path / "chain"), shard=shard,
        curate_summary=str(tmp_path / "summary.json"),
    )  # fmt: skip


def test_the_last_stage_trains_after_the_chain_whatever_is_on_disk(tmp_path: Path) -> None:
    """A stale whole-run extraction (index.json, no shard folders) changes nothing: the params
    have shards, so the last stage trains after the chain over their folders."""
    data = tmp_path / "extracted"
    data.mkdir()
    (data / "index.json").write_text("{}")
    for on_disk in ([], ["shard-0"]):
        for name in on_disk:
            (data / name).mkdir()
        mode = training_mode(stage_args(tmp_path), SHARDS)
        assert mode.after_chain and mode.link is None
        assert mode.folders == tuple(data / f"shard-{k}" for k in range(3))
        assert mode.start_from == tmp_path / "chain" / "shard-2"


def test_without_shards_in_the_params_the_data_folder_is_a_whole_run(tmp_path: Path) -> None:
    mode = training_mode(stage_args(tmp_path), {})
    assert mode == TrainingMode.whole_run(tmp_path / "extracted")
    assert mode.describe() == "whole run" and mode.start_from is None
    with pytest.raises(SystemExit, match="no data.shard_ids"):
        training_mode(stage_args(tmp_path, shard=0), {})


def test_each_link_starts_where_the_params_say(tmp_path: Path) -> None:
    """Link 0 plans the run from curate's rows; the others start from the link before."""
    summary = {"train_rows": 40, "train_turns": 90}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    first = training_mode(stage_args(tmp_path, shard=0), SHARDS)
    assert first.link == 0 and first.planned_rows == 90 and first.start_from is None
    assert first.folders == (tmp_path / "extracted" / "shard-0",)
    assert first.save_to == tmp_path / "chain" / "shard-0"
    second = training_mode(stage_args(tmp_path, shard=2), SHARDS)
    assert second.start_from == tmp_path / "chain" / "shard-1" and second.planned_rows is None
    assert second.describe() == "link 2"
    with pytest.raises(SystemExit, match="not one of data.shard_ids"):
        training_mode(stage_args(tmp_path, shard=3), SHARDS)


def test_a_mode_that_cannot_be_trained_is_refused_when_it_is_made(tmp_path: Path) -> None:
    shard, state = tmp_path / "shard-1", tmp_path / "chain" / "shard-1"
    with pytest.raises(ValueError, match="needs the state the link before it left"):
        TrainingMode.chain_link(1, shard, state)
    with pytest.raises(ValueError, match="needs the state the link before it left"):
        TrainingMode(folders=(shard,), after_chain=True)
    with pytest.raises(ValueError, match="follows that state's plan"):
        TrainingMode.chain_link(1, shard, state, start_from=tmp_path, planned_rows=10)
    with pytest.raises(ValueError, match="its own shard's folder alone"):
        TrainingMode(folders=(shard, shard), link=0, save_to=state)
    with pytest.raises(ValueError, match="fresh plan"):
        TrainingMode(folders=(shard,), start_from=state)
    mode = TrainingMode.whole_run([shard])
    with pytest.raises(AttributeError):
        mode.link = 1  # type: ignore[misc]


def test_a_calls_steps_follow_its_mode() -> None:
    """A link adds its shard to the plan and reads its own sequences (the loaded data is that
    shard alone); after the chain, the packs must be the ones the links trained on."""
    start = StepPlan.planned(100, epochs=2, global_batch_size=8, seed=3)
    first = TrainingMode.chain_link(0, Path("s0"), Path("c0"), planned_rows=100)
    link = CallSteps.of(first, start, sizes=[20], offsets=[0])
    assert link.steps == range(0, 2)
    assert all(0 <= i < 20 for step in link.steps for i in link.batch(step)[1])
    after = TrainingMode.after_the_chain([Path("s0"), Path("s1")], Path("c1"))
    state = StepPlan.from_state({**start.state(), "shard_sizes": [20, 30]})
    call = CallSteps.of(after, state, sizes=[20, 30], offsets=[0, 20])
    assert call.steps == range(2 + 3, 2 * (100 // 8))
    epoch, batch = call.batch(call.steps.start)
    assert epoch == 1 and all(0 <= i < 50 for i in batch)
    with pytest.raises(SystemExit, match="a shard changed after its link trained on it"):
        CallSteps.of(after, StepPlan.from_state(state.state()), sizes=[20, 31], offsets=[0, 20])
