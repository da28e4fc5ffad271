"""The scheduler (draftline.generation.schedule) against an in-process engine whose answers
arrive in a shuffled order: continuous keeps the engine full without passing its limit, starts
the conversations with the most turns first, and gives every turn the same answer whatever the
schedule or the order results arrive in."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from draftline.generation.engines.base import NoResult, Request, Result
from draftline.generation.schedule import Scheduler, stream_shards


def answer(prompt: Sequence[int]) -> list[int]:
    """The engine's "model": a function of the prompt only."""
    digest = hashlib.sha256(bytes(str(list(prompt)), "ascii")).digest()
    return [10 + b % 50 for b in digest[: 2 + digest[0] % 6]]


class ShuffledEngine:
    """`max_in_flight` slots; each `results` call finishes a random one of the requests
    running (a random batch of them with `batch`), so results arrive in any order."""

    name = "shuffled"

    def __init__(self, max_in_flight: int, seed: int, batch: int = 1) -> None:
        self.max_in_flight = max_in_flight
        self.rng = random.Random(seed)
        self.batch = batch
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.submitted: list[Request] = []
        self.occupancy: list[int] = []  # requests running at each results call
        self.peak_outstanding = 0
        self.events: list[tuple[str, list[str]]] = []  # ("submit" | "results", ids)

    def identity(self) -> str:
        return self.name

    def submit(self, requests: Sequence[Request]) -> None:
        self.events.append(("submit", [r.id for r in requests]))
        self.submitted += requests
        self.waiting += requests
        self.waiting.sort(key=lambda r: -r.priority)  # stable: FIFO within a priority
        self.peak_outstanding = max(self.peak_outstanding, len(self.waiting) + len(self.running))

    def results(self) -> list[Result]:
        while self.waiting and len(self.running) < self.max_in_flight:
            self.running.append(self.waiting.pop(0))
        if not self.running:
            return []
        self.occupancy.append(len(self.running))
        done = []
        for _ in range(min(self.batch, len(self.running))):
            request = self.running.pop(self.rng.randrange(len(self.running)))
            done.append(Result(request.id, answer(request.prompt_ids), "stop"))
        self.events.append(("results", [r.id for r in done]))
        return done

    def generate(self, requests, on_result):  # pragma: no cover - not used here
        raise NotImplementedError

    def close(self) -> None:
        pass


@dataclass
class Chat:
    """A conversation of `turns` turns: each prompt holds the earlier answers."""

    id: str
    turns: int
    group: int = 0
    answers: list[list[int]] = field(default_factory=list)

    @property
    def order(self) -> tuple[int, str]:
        return (self.group, self.id)

    def remaining_turns(self) -> int:
        return self.turns - len(self.answers)

    def prompt(self) -> list[int]:
        return [1, *[t for a in self.answers for t in (*a, 2)], 3]

    def next_request(self) -> Request:
        return Request(f"{self.id}#{len(self.answers)}", self.prompt())


def chats(n: int, seed: int = 0) -> list[Chat]:
    rng = random.Random(seed)
    return [Chat(f"c{i:03d}", rng.choice([1, 1, 1, 2, 2, 3, 5, 8])) for i in range(n)]


def run(engine: ShuffledEngine, works: list[Chat], schedule: str) -> tuple[dict, list[str]]:
    journal: dict[str, list[int]] = {}
    arrived: list[str] = []

    def on_result(work: Chat, result: Result) -> None:
        assert result.id == f"{work.id}#{len(work.answers)}"  # the turn asked, in order
        assert result.id not in journal  # never twice
        journal[result.id] = list(result.completion_ids)
        arrived.append(result.id)
        work.answers.append(list(result.completion_ids))

    Scheduler(engine, on_result, schedule=schedule).run(works)
    return journal, arrived


@pytest.mark.parametrize("batch", [1, 3])
def test_arrival_order_and_schedule_change_no_answer(batch):
    journals, orders = [], []
    for schedule, seed in (("rounds", 0), ("continuous", 1), ("continuous", 2)):
        journal, arrived = run(ShuffledEngine(4, seed, batch), chats(40), schedule)
        journals.append(journal)
        orders.append(arrived)
    assert journals[0] == journals[1] == journals[2]  # same key -> same answer
    assert sum(c.turns for c in chats(40)) == len(journals[0])  # every turn, once
    assert orders[1] != orders[2]  # the results really arrived in another order


def test_continuous_keeps_the_engine_full_within_its_limit():
    engine = ShuffledEngine(6, seed=3)
    works = chats(60)
    run(engine, works, "continuous")
    assert engine.peak_outstanding <= 6  # never more than max_in_flight submitted
    # Full for as long as there are more conversations with turns left than slots.
    full = engine.occupancy[: len(engine.occupancy) * 3 // 4]
    assert min(full) == 6


def test_rounds_send_turn_k_of_every_conversation_before_turn_k_plus_1():
    engine = ShuffledEngine(6, seed=3)
    run(engine, chats(30), "rounds")
    turns = [int(r.id.rpartition("#")[2]) for r in engine.submitted]
    assert turns == sorted(turns)
    assert {r.priority for r in engine.submitted} == {0}
    # A round waits for its slowest request: the engine runs below its slots between rounds.
    assert min(engine.occupancy) < 6


def test_next_turn_goes_in_at_once_and_the_longest_conversations_start_first():
    engine = ShuffledEngine(3, seed=5)
    works = chats(20)
    run(engine, works, "continuous")
    firsts = [r for r in engine.submitted if r.id.endswith("#0")]
    turns = {c.id: c.turns for c in works}
    started = [turns[r.id.rpartition("#")[0]] for r in firsts]
    assert started == sorted(started, reverse=True)  # most turns first (ids break ties)
    # Each request's priority is its conversation's remaining turns.
    for r in engine.submitted:
        conversation, _, k = r.id.rpartition("#")
        assert r.priority == turns[conversation] - int(k)
    # A conversation's turn k+1 is submitted the moment its turn k is back, in the slot it
    # freed; a conversation not yet started gets the slot of one that has ended.
    events = engine.events
    for i, (kind, done) in enumerate(events):
        if kind != "results":
            continue
        (key,) = done
        conversation, _, k = key.rpartition("#")
        following = events[i + 1] if i + 1 < len(events) else None
        if int(k) + 1 < turns[conversation]:
            assert following == ("submit", [f"{conversation}#{int(k) + 1}"])
        elif any(e[0] == "submit" and e[1][0].endswith("#0") for e in events[i + 1 :]):
            assert following is not None and following[0] == "submit"
            assert len(following[1]) == 1 and following[1][0].endswith("#0")


def test_time_is_attributed_to_the_shards_in_flight():
    clock = iter(range(10_000))
    engine = ShuffledEngine(4, seed=1)
    works = [*chats(10, seed=1), *(Chat(f"x{i}", 2, group=1) for i in range(10))]
    scheduler = Scheduler(engine, lambda w, r: w.answers.append(r.completion_ids),
                          clock=lambda: float(next(clock)))  # fmt: skip
    scheduler.run(works)
    total = scheduler.attributed_s(0) + scheduler.attributed_s(1)
    assert scheduler.attributed_s(0) > 0 and scheduler.attributed_s(1) > 0
    elapsed = scheduler.in_flight_s / scheduler.mean_in_flight()
    assert elapsed - 1 <= total <= elapsed  # every moment with a request in flight, once


def test_an_engine_that_loses_a_request_stops_the_run():
    class Lossy(ShuffledEngine):
        def results(self):
            self.running.clear()
            self.waiting.clear()
            return []

    with pytest.raises(NoResult, match="no result for"):
        run(Lossy(4, seed=0), chats(5), "continuous")


def test_stream_shards_follow_dvc_order_within_the_bound():
    ids = [0, 1, 2, 3, 4, 5]
    assert stream_shards(1, ids, 3, lambda s: True) == [1, 2, 3, 4]
    assert stream_shards(1, ids, 3, lambda s: s != 3) == [1, 2, 4]
    assert stream_shards(4, ids, 3, lambda s: True) == [4, 5]
    assert stream_shards(2, ids, 0, lambda s: True) == [2]


def test_each_turn_asks_for_what_its_prompt_leaves_of_the_context_and_a_full_one_closes(
    tmp_path,
):
    """`Conversation`: a turn's request is capped to its room in the context (no engine
    refuses it), a result that used all of a cap below max_new_tokens ends `context`, and a
    conversation whose next prompt leaves no room asks nothing more and is done."""
    from draftline.core.turn_prompts import TurnPrompt
    from draftline.generation.engines.base import CONTEXT_RESERVE, Sampling
    from draftline.generation.turns import Conversation

    sampling = Sampling(max_new_tokens=100, context_length=CONTEXT_RESERVE + 150)
    conversation = Conversation("c", [], [1, 3, 5], {}, sampling=sampling)
    lengths = [40, 120, 160]  # prompt tokens of turns 0, 1, 2 (as the template renders them)
    conversation.prompts = [TurnPrompt(list(range(n)), []) for n in lengths]
    first = conversation.next_request(None, None)
    assert isinstance(first, Request) and first.max_new_tokens is None  # 100 fits in 110
    conversation.results.append(conversation.take(Result("c#0", [7] * 20 + [2], "stop")))
    second = conversation.next_request(None, None)
    assert isinstance(second, Request) and second.max_new_tokens == 30  # 150 - 120
    cut = conversation.take(Result("c#1", [7] * 30, "length"))
    assert (cut.finish_reason, cut.max_new_tokens) == ("context", 30)  # the cap, recorded
    assert conversation.take(cut) == cut
    stopped = conversation.take(Result("c#1", [7] * 5 + [2], "stop"))
    assert (stopped.finish_reason, stopped.max_new_tokens) == ("stop", 30)
    from draftline.generation.journal import Journal  # the cap is journaled with the turn

    journal = Journal(tmp_path / "j.jsonl", {"x": 1})
    journal.lock(wait=False)
    journal.open()
    journal.append([cut, Result("c#0", [2], "stop")])
    journal.close()
    again = Journal(tmp_path / "j.jsonl", {"x": 1})
    again.lock(wait=False)
    assert again.open() == {"c#1": cut, "c#0": Result("c#0", [2], "stop")}
    again.close()
    # Had turn 1 stopped, turn 2's prompt (160 tokens) would leave nothing: closed, not asked.
    conversation.results.append(Result("c#1", [7] * 10 + [2], "stop"))
    assert conversation.next_request(None, None) is None
    assert conversation.closed and conversation.done() and conversation.remaining_turns() == 0
    # Without a context length nothing is capped (the embedded targets' runs are unchanged).
    free = Conversation("f", [], [1], {}, sampling=Sampling(max_new_tokens=100))
    free.prompts = [TurnPrompt(list(range(10_000)), [])]
    assert free.next_request(None, None).max_new_tokens is None
