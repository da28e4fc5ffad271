"""The vLLM engine: a client of vLLM's OpenAI-compatible `POST /v1/completions` with token ids.

Request (one sample each): `{"prompt": [ids], "max_tokens", "temperature", "top_p", "top_k",
"seed", "stop_token_ids": [end_of_turn, eos], "return_token_ids": true,
"skip_special_tokens": false}`: it stops at the end-of-turn token or the model's EOS (the rule
of every engine: `engines.base.stop_ids`), and the answer carries the generated ids.
Response: `{"choices": [{"token_ids": [...], "finish_reason": "stop" | "length" | "abort" | ...,
"stop_reason": <id> | null, ...}]}`; the matched stop token is part of `token_ids`.
Readiness is `GET /health`.

Scheduling, retries, backoff and the health check are the SGLang client's (`SGLangEngine`):
only the request body and the reading of the answer differ.
"""

from __future__ import annotations

from typing import Any

import orjson

from draftline.core.loss_mask import cut_at_stop
from draftline.generation.engines.base import Request, Result, Sampling, count_or_none, stop_ids
from draftline.generation.engines.sglang import ClientSettings, SGLangEngine

ENDPOINTS_ENV = "DRAFTLINE_VLLM_ENDPOINTS"


def completion_params(
    sampling: Sampling, end_of_turn: int, eos: int | None = None
) -> dict[str, Any]:
    """The sampling fields of a `/v1/completions` body for our sampling."""
    return {
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop_token_ids": stop_ids(end_of_turn, eos),
        "return_token_ids": True,
        "skip_special_tokens": False,
    }


def parse_completion(
    sample_id: str, body: dict[str, Any], end_of_turn: int, eos: int | None = None
) -> Result:
    """A Result from one `/v1/completions` answer; ids kept exactly as returned, cut after the
    first stop token (end of turn or EOS)."""
    result = _finished(sample_id, body, stop_ids(end_of_turn, eos))
    # vLLM counts cached prompt tokens only when started with --enable-prompt-tokens-details.
    usage = body.get("usage") or {}
    result.prompt_tokens = count_or_none(usage.get("prompt_tokens"))
    result.cached_tokens = count_or_none(
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    )
    return result


def _finished(sample_id: str, body: dict[str, Any], stops: list[int]) -> Result:
    choices = body.get("choices") or []
    if not choices or not isinstance(choices[0], dict) or choices[0].get("token_ids") is None:
        return Result(id=sample_id, error=f"answer without token_ids: {str(body)[:300]}")
    choice = choices[0]
    reason = choice.get("finish_reason")
    ids, stopped = cut_at_stop(list(choice["token_ids"]), stops)
    if stopped:
        return Result(id=sample_id, completion_ids=ids, finish_reason="stop")
    if reason == "stop" and choice.get("stop_reason") in stops:
        # A version that leaves the matched stop token out of token_ids still names it.
        matched = int(choice["stop_reason"])
        return Result(id=sample_id, completion_ids=[*ids, matched], finish_reason="stop")
    if reason == "length":
        return Result(id=sample_id, completion_ids=ids, finish_reason="length")
    return Result(
        id=sample_id,
        completion_ids=ids,
        error=f"unexpected finish_reason {reason!r} (stop_reason {choice.get('stop_reason')!r})",
    )


class VLLMEngine(SGLangEngine):
    name = "vllm"
    label = "vLLM"
    route = "/v1/completions"

    def __init__(
        self,
        settings: ClientSettings,
        sampling: Sampling,
        end_of_turn: int,
        serving: str = "",
        eos: int | None = None,
    ) -> None:
        super().__init__(settings, sampling, end_of_turn, serving, eos)
        self.params = completion_params(sampling, end_of_turn, eos)

    def identity(self) -> str:
        return f"vllm:{self.serving}" if self.serving else "vllm"

    def _payload(self, request: Request, attempt: int) -> bytes:
        body = {
            **self.params,
            "prompt": request.prompt_ids,
            "request_id": self.request_key(request, attempt),  # a retry is another request
        }
        if request.max_new_tokens is not None:  # the context leaves less than max_tokens
            body["max_tokens"] = request.max_new_tokens
        if self.params["temperature"] > 0:
            # Seeded per sample and turn, so a retried or resumed turn draws the same tokens.
            body["seed"] = self.sampling.request_seed(request.id)
        return orjson.dumps(body)

    def _parse(self, sample_id: str, body: dict[str, Any]) -> Result:
        return parse_completion(sample_id, body, self.end_of_turn, self.eos)
