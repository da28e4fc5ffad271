"""Which turn goes to the engine next, so the engine stays full.

A conversation's turns are generated one after another (turn k's prompt holds the answers to
turns 0..k-1), so what the engine can work on at any moment is one turn per unfinished
conversation. Two schedules:

- `continuous` (the default): `max_in_flight` requests are kept submitted. A conversation's next
  turn is submitted the moment its last one is back (it takes the slot that turn freed); a free
  slot goes to the not yet started conversation with the most turns, so the long chains of turns
  start first and the last minutes of a run are not one conversation's tenth turn. Each request
  carries its conversation's remaining turns as its priority, for engines that order a queue.
- `rounds` (how generate ran before; kept for comparisons): turn k of every conversation that
  needs one, all at once, then turn k+1; every round waits for its slowest request.

A stream may hold several shards (`stream_shards`: a generate stage's own shard and the shards
after it, in dvc.yaml order): the scheduler does not care which shard a conversation belongs
to, so the end of one shard is filled with the next shard's turns instead of idling, and only
the end of the stream drains. Outputs never depend on the schedule or on the order results
arrive in: every turn's request is the same whenever it is sent.

The scheduler knows nothing of tokenizers, journals or files: a conversation is a `Work`, and
`on_result` (the caller's) journals each result before the scheduler asks for the next turn.
`benchmarks/generation_schedule.py` drives this same class against a simulated engine.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from draftline.generation.engines.base import Engine, NoResult, Request, Result

SCHEDULES = ("continuous", "rounds")


class Work(Protocol):
    """One conversation as the scheduler sees it."""

    # A fixed tie-break between conversations: (position of its shard in the stream, id).
    order: tuple[Any, ...]
    # Its shard: wall time is attributed per group.
    group: Hashable

    def remaining_turns(self) -> int:
        """Turns still to generate; 0 once it is done or has failed."""
        ...

    def next_request(self) -> Request | None:
        """The request of its next turn; None when that turn cannot be asked (the conversation
        has recorded why and failed: `remaining_turns()` is 0 from then on)."""
        ...


OnWorkResult = Callable[[Work, Result], None]


def stream_shards(
    own: int, shard_ids: Sequence[int], work_ahead: int, needs_work: Callable[[int], bool]
) -> list[int]:
    """The shards a generate stage streams: its own, then those of the next `work_ahead`
    shards in `shard_ids` order (the order of dvc.yaml's `foreach`) that `needs_work`."""
    ids = list(shard_ids)
    position = ids.index(own)
    following = ids[position + 1 : position + 1 + max(0, int(work_ahead))]
    return [own, *(s for s in following if needs_work(s))]


class Scheduler:
    """Feeds `engine` the turns of `Work`s until none has a turn left.

    `on_result(work, result)` is called once per result, in the order results arrive; it must
    record the result so that `work.remaining_turns()` and `work.next_request()` move on (an
    `error` result ends the conversation). The engine's `max_in_flight` (or `max_in_flight`) is
    never exceeded in `continuous`; `rounds` submits a whole round and lets the engine queue it.
    `clock` is the time the attribution and occupancy figures use (a simulated engine's own).
    """

    def __init__(
        self,
        engine: Engine,
        on_result: OnWorkResult,
        *,
        schedule: str = "continuous",
        max_in_flight: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
        self.engine = engine
        self.on_result = on_result
        self.schedule = schedule
        self.limit = max(1, int(max_in_flight or engine.max_in_flight))
        self.clock = clock
        self.in_flight: dict[str, Work] = {}
        self._per_group: Counter[Hashable] = Counter()
        self._wall: defaultdict[Hashable, float] = defaultdict(float)
        self._last: float | None = None
        self.started: float | None = None
        self.in_flight_s = 0.0  # time integral of requests in flight
        self.peak_in_flight = 0
        self.requests = 0

    # Figures -------------------------------------------------------------------------------

    def attributed_s(self, group: Hashable) -> float:
        """Seconds of this run spent on `group`'s requests: each moment's time is shared among
        the groups in proportion to their requests in flight (the shards of a stream overlap)."""
        return self._wall.get(group, 0.0)

    def mean_in_flight(self) -> float:
        """Requests in flight on average since the run started."""
        if self.started is None or self._last is None or self._last <= self.started:
            return 0.0
        return self.in_flight_s / (self._last - self.started)

    # Running -------------------------------------------------------------------------------

    def run(self, works: Iterable[Work]) -> None:
        todo = [w for w in works if w.remaining_turns() > 0]
        self.started = self._last = self.clock()
        if self.schedule == "rounds":
            self._rounds(todo)
        else:
            self._continuous(todo)
        self._tick()

    def _continuous(self, todo: list[Work]) -> None:
        fresh = sorted(todo, key=lambda w: (-w.remaining_turns(), w.order))
        next_fresh = 0
        batch: list[Request] = []
        while True:
            while len(self.in_flight) < self.limit and next_fresh < len(fresh):
                self._ask(fresh[next_fresh], batch, prioritise=True)
                next_fresh += 1
            self._submit(batch)
            batch = []
            if not self.in_flight:
                return
            for work in self._collect():
                if work.remaining_turns() > 0:  # its next turn takes the slot just freed
                    self._ask(work, batch, prioritise=True)

    def _rounds(self, todo: list[Work]) -> None:
        ordered = sorted(todo, key=lambda w: w.order)
        while True:
            batch: list[Request] = []
            asked = 0
            for work in ordered:
                if work.remaining_turns() > 0:
                    asked += 1
                    self._ask(work, batch, prioritise=False)
            if not asked:
                return
            self._submit(batch)
            while self.in_flight:
                self._collect()

    def _ask(self, work: Work, batch: list[Request], *, prioritise: bool) -> None:
        request = work.next_request()
        if request is None:  # the turn cannot be asked: the conversation failed
            return
        if request.id in self.in_flight:
            raise RuntimeError(f"request {request.id!r} is already in flight")
        if prioritise:
            request = replace(request, priority=work.remaining_turns())
        self.in_flight[request.id] = work
        self._per_group[work.group] += 1
        batch.append(request)

    def _submit(self, batch: list[Request]) -> None:
        if not batch:
            return
        self._tick()
        self.engine.submit(batch)
        self.requests += len(batch)
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))

    def _collect(self) -> list[Work]:
        """Wait for results; hand each to `on_result`; the conversations they belong to."""
        finished = self.engine.results()
        self._tick()  # the time waited belongs to what was in flight while waiting
        if not finished:
            raise NoResult(
                f"the engine returned no result for {len(self.in_flight)} requests in flight"
            )
        works = []
        for result in finished:
            work = self.in_flight.pop(result.id, None)
            if work is None:
                raise NoResult(f"the engine returned {result.id!r}, which was not in flight")
            self._per_group[work.group] -= 1
            self.on_result(work, result)
            works.append(work)
        return works

    def _tick(self) -> None:
        now = self.clock()
        last = now if self._last is None else self._last
        elapsed, total = now - last, len(self.in_flight)
        if elapsed > 0 and total:
            self.in_flight_s += elapsed * total
            for group, count in self._per_group.items():
                if count:
                    self._wall[group] += elapsed * count / total
        self._last = now
