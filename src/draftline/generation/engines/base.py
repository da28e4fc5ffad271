"""The engine interface: token ids in, token ids out, requests taken while results arrive.

Engines never see text: the caller renders prompts to ids once (`draftline.core.target.prompt_ids`)
and stores the completion ids exactly as the engine returned them.

An engine is fed, not called: `submit` queues requests at any time, `results` blocks until some
have finished and returns them in the order they finished. The scheduler
(`draftline.generation.schedule`) keeps `max_in_flight` requests submitted, so a conversation's
next turn goes in the moment its last one is back. `generate` is the one-shot form (every
request submitted at once, each result handed on as it finishes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Sampling:
    """What decides the tokens: recorded with every row, part of the stage's params."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: list[int]
    # Higher first where the engine orders its queue (the SGLang client, and SGLang itself when
    # it schedules by priority); the scheduler passes the conversation's remaining turns.
    priority: int = 0


@dataclass
class Result:
    """One finished sample. `completion_ids` ends with the end-of-turn token when `stop`."""

    id: str
    completion_ids: list[int] = field(default_factory=list)
    finish_reason: str = "error"
    error: str | None = None


OnResult = Callable[[Result], None]


class EngineUnavailable(RuntimeError):
    """The engine cannot serve at all (server gone): stop the shard, keep the journal."""


class Engine(Protocol):
    name: str
    # Requests the engine works on at once: the scheduler keeps this many submitted.
    max_in_flight: int

    def identity(self) -> str:
        """Engine name and version as recorded per row (e.g. `sglang`, `local:transformers-5.2`)."""
        ...

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests; each starts when the engine has room, higher `priority` first where
        the engine orders its queue. Returns at once."""
        ...

    def results(self) -> list[Result]:
        """Wait until at least one submitted request has finished and return every one finished
        since the last call, in the order they finished; `[]` when none is outstanding. Each
        submitted request gets exactly one result (a failed one an `error` result);
        `EngineUnavailable` when the engine cannot serve any more."""
        ...

    def generate(self, requests: Sequence[Request], on_result: OnResult) -> None:
        """Generate every request, calling `on_result` once per request as each finishes.

        An exception raised by `on_result` (the guard aborting) stops the engine and propagates.
        """
        ...

    def close(self) -> None:
        """Stop: requests still running are dropped."""
        ...


class NoResult(RuntimeError):
    """The engine answered fewer requests than it was given."""


def generate_all(engine: Engine, requests: Sequence[Request], on_result: OnResult) -> None:
    """`Engine.generate` from `submit` and `results`: everything submitted at once (the engine
    queues what it has no room for), every result handed to `on_result` as it finishes."""
    if not requests:
        return
    engine.submit(requests)
    left = len(requests)
    while left:
        finished = engine.results()
        if not finished:
            raise NoResult(f"the engine returned no result for {left} of {len(requests)} requests")
        for result in finished:
            left -= 1
            on_result(result)
