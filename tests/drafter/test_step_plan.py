"""The step plan that lets training follow generation: what each step reads is fixed before the
shards it does not read arrive."""

from __future__ import annotations

import pytest

from draftline.drafter.step_plan import StepPlan


def plan_of(sizes: list[int], planned: int = 300, epochs: int = 3, gbs: int = 16) -> StepPlan:
    plan = StepPlan.planned(planned, epochs, gbs, seed=7)
    for shard, n in enumerate(sizes):
        plan.add_shard(shard, n)
    return plan


def test_the_step_count_comes_from_the_planned_rows_not_the_shards() -> None:
    assert plan_of([70, 80]).total_steps == 3 * (300 // 16)
    assert plan_of([10, 10, 10]).total_steps == plan_of([90, 90, 90]).total_steps


def test_each_link_reads_whole_batches_of_its_own_shard_once() -> None:
    plan = plan_of([70, 83, 40])
    start = 0
    for shard, n in enumerate([70, 83, 40]):
        steps = range(start, start + n // 16)
        seen = [i for step in steps for i in plan.link_batch(shard, step)]
        assert len(seen) == len(set(seen)) == (n // 16) * 16
        assert all(0 <= i < n for i in seen)
        assert {plan.shard_of(step) for step in steps} == {shard}
        start = steps.stop
    assert plan.chain_steps == start == 4 + 5 + 2


def test_a_links_batches_do_not_depend_on_shards_after_it() -> None:
    early, late = plan_of([70]), plan_of([70, 83, 40, 99])
    assert [early.link_batch(0, s) for s in range(4)] == [late.link_batch(0, s) for s in range(4)]


def test_after_the_chain_every_shard_is_read_each_epoch_until_the_planned_count() -> None:
    plan = plan_of([70, 83, 40])
    rest = plan.rest_steps()
    assert rest == range(plan.chain_steps, plan.total_steps)
    per_epoch = sum([70, 83, 40]) // 16
    first = [plan.rest_batch(s) for s in rest[:per_epoch]]
    assert {epoch for epoch, _ in first} == {1}
    seen = [i for _, batch in first for i in batch]
    assert len(set(seen)) == len(seen) == per_epoch * 16
    assert plan.rest_batch(rest[per_epoch])[0] == 2
    assert plan.rest_batch(rest[0])[1] != plan.rest_batch(rest[per_epoch])[1]


def test_links_run_in_shard_order_and_the_state_round_trips() -> None:
    plan = plan_of([70])
    with pytest.raises(ValueError, match="shard order"):
        plan.add_shard(2, 50)
    again = StepPlan.from_state(plan.state())
    assert again == plan
    with pytest.raises(SystemExit, match="global_batch_size"):
        StepPlan.planned(10, 1, 16, seed=0)
