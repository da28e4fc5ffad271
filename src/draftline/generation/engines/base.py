"""The engine interface: token ids in, token ids out, results reported as they finish.

Engines never see text: the caller renders prompts to ids once (`draftline.core.target.prompt_ids`)
and stores the completion ids exactly as the engine returned them.
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

    def identity(self) -> str:
        """Engine name and version as recorded per row (e.g. `sglang`, `local:transformers-5.2`)."""
        ...

    def generate(self, requests: Sequence[Request], on_result: OnResult) -> None:
        """Generate every request, calling `on_result` once per request as each finishes.

        An exception raised by `on_result` (the guard aborting) stops the engine and propagates.
        """
        ...

    def close(self) -> None: ...
