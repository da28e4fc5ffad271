"""Every request body the SGLang and vLLM clients build goes through the pinned engines' own
request validation (tests/engines/check_requests.py says which code, in the order the servers
run it): first turns and later turns of a real conversation (prompts built by the generate
path's `Conversation` with the tiny target's tokenizer), with and without priorities, at
temperature 0 and > 0. The bodies are the clients' own (`_payload`, the bytes they POST)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from conftest import HERE, REPO, run_in_engines

from draftline.core.loss_mask import special_ids
from draftline.core.target import load_tokenizer
from draftline.generation.engines.base import Request, Result, Sampling
from draftline.generation.engines.sglang import ClientSettings, SGLangEngine
from draftline.generation.engines.vllm import VLLMEngine
from draftline.generation.turns import Conversation

pytestmark = pytest.mark.engines

CHECKER = HERE / "check_requests.py"
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


def test_every_request_body_passes_the_engines_own_validation(engine_python: Path):
    sglang, vllm = bodies(SGLangEngine), bodies(VLLMEngine)
    assert any("priority" in b for b in sglang) and any(b["temperature"] > 0 for b in vllm)
    verdict = run_in_engines(
        engine_python, CHECKER, {"sglang": sglang, "vllm": vllm, "vocab_size": 1536}
    )
    failed = [
        f"{engine}: {error}\n  {body}"
        for engine, sent in (("sglang", sglang), ("vllm", vllm))
        for body, error in zip(sent, verdict[engine], strict=True)
        if error
    ]
    assert not failed, "\n".join(failed)


def test_an_unknown_sampling_key_is_refused(engine_python: Path):
    """The check can fail: a sampling key SGLang does not know, a field vLLM would ignore."""
    [sglang], [vllm] = bodies(SGLangEngine)[:1], bodies(VLLMEngine)[:1]
    sglang["sampling_params"]["sampling_seed_typo"] = 1
    vllm["max_new_tokens"] = 5
    verdict = run_in_engines(
        engine_python, CHECKER, {"sglang": [sglang], "vllm": [vllm], "vocab_size": 1536}
    )
    assert verdict["sglang"][0] and "sampling_seed_typo" in verdict["sglang"][0], verdict
    assert verdict["vllm"][0] and "max_new_tokens" in verdict["vllm"][0], verdict
