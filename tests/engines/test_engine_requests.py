"""Every request body the SGLang and vLLM clients build goes through the pinned engines' own
request validation (tests/engines/check_requests.py says which code, in the order the servers
run it): first turns and later turns of a real conversation (prompts built by the generate
path's `Conversation` with the tiny target's tokenizer), with and without priorities, at
temperature 0 and > 0. The bodies are the clients' own (`_payload`, the bytes they POST)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from helpers.engine_helpers import CHECKS, REPO, run_in_engines

from draftline.core.loss_mask import special_ids
from draftline.core.target import load_tokenizer
from draftline.generation.engines.base import Request, Result, Sampling
from draftline.generation.engines.sglang import ClientSettings, SGLangEngine
from draftline.generation.engines.vllm import VLLMEngine
from draftline.generation.turns import Conversation

pytestmark = pytest.mark.engines

CHECKER = CHECKS / "check_requests.py"
SAMPLINGS = (
    Sampling(max_new_tokens=128),  # greedy
    Sampling(max_new_tokens=8192, temperature=1.0, top_p=0.95, top_k=20, seed=7),
)


def turn_requests() -> list[Request]:
    """Turn 0 and turn 1 of a two-turn conversation; turn 1's prompt holds turn 0's answer."""
    model = {"path": str(REPO / "models/tiny-target"), "revision": None}
    tokenizer = load_tokenizer(model)
    special = special_ids(tokenizer, "<|im_end|>")
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "20"},
    ]
    conversation = Conversation("c1", messages, [1, 3], {"enable_thinking": True})
    first = conversation.next_request(tokenizer, special)
    assert isinstance(first, Request)
    answer = tokenizer.encode("<think>\n\n</think>\n\n5", add_special_tokens=False)
    conversation.results.append(Result(first.id, [*answer, special.end_of_turn], "stop"))
    second = conversation.next_request(tokenizer, special)
    assert isinstance(second, Request) and len(second.prompt_ids) > len(first.prompt_ids)
    return [first, Request(second.id, second.prompt_ids, priority=1)]


def bodies(engine_class: type[SGLangEngine]) -> list[dict]:
    out = []
    for sampling in SAMPLINGS:
        for priorities in (False, True):
            settings = ClientSettings(endpoints=("http://127.0.0.1:9",), priorities=priorities)
            engine = engine_class(settings, sampling, end_of_turn=2, serving="{}")
            for attempt, request in enumerate(turn_requests()):
                out.append(orjson.loads(engine._payload(request, attempt)))
    return out


@pytest.fixture(scope="module")
def verdict(engine_python: Path) -> dict:
    """The clients' bodies, then one of each with a key the engine does not know, through the
    engines' request validation in one subprocess."""
    sglang, vllm = bodies(SGLangEngine), bodies(VLLMEngine)
    wrong_sglang = {**sglang[0], "sampling_params": {**sglang[0]["sampling_params"]}}
    wrong_sglang["sampling_params"]["sampling_seed_typo"] = 1
    wrong_vllm = {**vllm[0], "max_new_tokens": 5}
    out = run_in_engines(
        engine_python,
        CHECKER,
        {"sglang": [*sglang, wrong_sglang], "vllm": [*vllm, wrong_vllm], "vocab_size": 1536},
    )
    return {"sent": {"sglang": sglang, "vllm": vllm}, **out}


def test_every_request_body_passes_the_engines_own_validation(verdict: dict):
    sglang, vllm = verdict["sent"]["sglang"], verdict["sent"]["vllm"]
    assert any("priority" in b for b in sglang) and any(b["temperature"] > 0 for b in vllm)
    failed = [
        f"{engine}: {error}\n  {body}"
        for engine, sent in (("sglang", sglang), ("vllm", vllm))
        for body, error in zip(sent, verdict[engine][: len(sent)], strict=True)
        if error
    ]
    assert not failed, "\n".join(failed)


def test_an_unknown_sampling_key_is_refused(verdict: dict):
    """The check can fail: a sampling key SGLang does not know, a field vLLM would ignore."""
    assert verdict["sglang"][-1] and "sampling_seed_typo" in verdict["sglang"][-1], verdict
    assert verdict["vllm"][-1] and "max_new_tokens" in verdict["vllm"][-1], verdict
