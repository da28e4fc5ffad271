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

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Tokens of the context no turn asks for: SGLang 0.5.23 counts the draft-token slots of EAGLE
# speculation (MTP: max(topk x steps, draft tokens), 4 for the Qwen3.6 profile) as input when
# it checks `input + max_new_tokens <= context_length`. The same margin on every engine keeps
# the cap, and so the tokens, independent of the engine and its speculative settings.
CONTEXT_RESERVE = 64


@dataclass(frozen=True)
class Sampling:
    """What decides the tokens: recorded with every row, part of the stage's params."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    # The context length every engine serves (`model.serving.context_length`): each turn's
    # `max_new_tokens` is capped to what its prompt leaves of it, so no engine refuses a turn
    # for length and all engines stop at the same token. None: no cap (the embedded targets).
    context_length: int | None = None

    def as_dict(self) -> dict[str, Any]:
        values: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
        }
        if self.context_length is not None:  # absent when unset: older records stay equal
            values["context_length"] = self.context_length
        return values

    def turn_cap(self, prompt_tokens: int) -> int:
        """The most new tokens a turn with this prompt may ask for: `max_new_tokens`, or what
        the prompt leaves of the context when that is less (0 or below: no room at all)."""
        if self.context_length is None:
            return self.max_new_tokens
        room = self.context_length - CONTEXT_RESERVE - prompt_tokens
        return min(self.max_new_tokens, room)

    def request_seed(self, request_id: str) -> int:
        """The seed of one request: from the run's seed and the request id (sample and turn),
        so a retried or resumed turn sends the same seed (31 bits: every engine takes it)."""
        return (self.seed * 1_000_003 + zlib.crc32(request_id.encode())) % 2**31


def count_or_none(value: Any) -> int | None:
    """A token count an engine reported, or None where it reported none."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def stop_ids(end_of_turn: int, eos: int | None) -> list[int]:
    """The tokens that end a turn on every engine: the end-of-turn token and the model's EOS
    (`model.eos_token_id`; SGLang stops on the model's EOS whatever it is asked, and its
    `ignore_eos` would switch off the end-of-turn stop as well)."""
    return [end_of_turn] + ([int(eos)] if eos is not None and int(eos) != end_of_turn else [])


@dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: list[int]
    # Higher first where the engine orders its queue (the SGLang client, and SGLang itself when
    # it schedules by priority); the scheduler passes the conversation's remaining turns.
    priority: int = 0
    # This turn's cap when the context leaves less than `Sampling.max_new_tokens`
    # (`Sampling.turn_cap`); None: the sampling's own.
    max_new_tokens: int | None = None


@dataclass
class Result:
    """One finished sample. `completion_ids` ends with the stop token when `stop` (the
    end-of-turn token, or the model's EOS: `stop_ids`); `context` when a turn capped by the
    context length (`Request.max_new_tokens`) used all of it, or none was left."""

    id: str
    completion_ids: list[int] = field(default_factory=list)
    finish_reason: str = "error"
    error: str | None = None
    # The turn's cap when the context left less than max_new_tokens (journaled with the turn).
    max_new_tokens: int | None = None
    # Prompt tokens the engine counted and those it served from its prefix cache, where it
    # reports them (SGLang's meta_info, vLLM's usage); calibrate's prefix-cache hit rate.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


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
