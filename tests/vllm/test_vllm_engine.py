"""The vLLM engine against a real vLLM server: ids token for token equal to transformers'
greedy generate, finish reasons, and seeded sampling that a retry reproduces.

The server is started as `draftline serve start --hardware vllm_cpu` starts it
(`vllm_server.start`: eager, fp32, health-checked, its own process group) on a random-weight
Qwen3 with head_dim 32 (`random_target`). Slow (~1.5 min): vLLM's start, mostly imports on the
one core it uses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.generate_helpers import free_port
from helpers.vllm_figures import record
from helpers.vllm_helpers import EOT, PROFILE, ask, greedy, prompts

from draftline.generation import server_process, vllm_server
from draftline.generation.engines.base import Sampling

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(
    random_target: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[server_process.ServerState]:
    """Slow: vLLM's start (~80 s of imports on one core)."""
    root = tmp_path_factory.mktemp("vllm-engine")
    began = time.perf_counter()
    state = vllm_server.start(PROFILE, {"path": str(random_target)}, port=free_port(), root=root)
    record(server_start_s=round(time.perf_counter() - began, 1))
    try:
        yield state
    finally:
        server_process.stop(state, root=root)


def test_greedy_ids_equal_transformers_token_for_token(server, random_target: Path) -> None:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(random_target, dtype=torch.float32).eval()
    requests = prompts(8)
    began = time.perf_counter()
    out = ask(server.url, requests, Sampling(max_new_tokens=32))
    wall = time.perf_counter() - began
    for request in requests:
        expected = greedy(model, request.prompt_ids, 32)
        got = out[request.id]
        assert got.error is None and got.completion_ids == expected, (request.id, got, expected)
        assert got.finish_reason == ("stop" if expected[-1] == EOT else "length")
        assert len(set(got.completion_ids)) > 8  # the answer wanders: the comparison is real
    tokens = sum(len(r.completion_ids) for r in out.values())
    record(engine_prompts_equal=len(requests), engine_tokens_equal=tokens,
           engine_tok_s=round(tokens / wall, 1))  # fmt: skip


def test_sampled_answers_follow_the_seed_so_a_retry_draws_the_same(server) -> None:
    requests = prompts(4)
    sampling = Sampling(max_new_tokens=16, temperature=1.0, seed=7)
    first = ask(server.url, requests, sampling)
    again = ask(server.url, requests, sampling)
    other = ask(server.url, requests, Sampling(max_new_tokens=16, temperature=1.0, seed=8))
    assert {k: r.completion_ids for k, r in first.items()} == {
        k: r.completion_ids for k, r in again.items()
    }
    assert {k: r.completion_ids for k, r in first.items()} != {
        k: r.completion_ids for k, r in other.items()
    }
