"""vLLM serving an exported drafter with its `dflash` method on CPU: greedy answers unchanged by
speculation, and bench's acceptance read from vLLM's counters.

The drafter is exported in the DFlash format (`draftline.drafter.export`) for the random-weight
head_dim-32 target, untrained: what is checked here is that vLLM loads and runs our checkpoint
and that the counters move, not how much is accepted (tests/vllm/test_vllm_serving.py measures
that with a trained drafter). Slow (~1.5 min): vLLM's start.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.generate_helpers import free_port
from helpers.vllm_figures import record
from helpers.vllm_helpers import EOT, PROFILE, ask, greedy, prompts

from draftline.generation import bench, server_process, vllm_server
from draftline.generation.engines.base import Sampling
from draftline.generation.engines.vllm import completion_params
from draftline.generation.server_launch import with_speculation

pytestmark = pytest.mark.vllm

BLOCK = 8


@pytest.fixture(scope="module")
def drafter(random_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3ForCausalLM

    from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
    from draftline.drafter.export import export_drafter

    target = Qwen3ForCausalLM.from_pretrained(random_target, dtype=torch.float32)
    config = DFlashConfig.from_target(
        json.loads((random_target / "config.json").read_text()),
        num_hidden_layers=1,
        block_size=BLOCK,
        mask_token_id=5,  # <|MASK|> of the embedded tokenizer
        target_layer_ids=[1, 2],
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("drafter") / "drafter"
    return export_drafter(DFlashDrafter(config, TargetHead.from_model(target)), out, torch.float32)


@pytest.fixture(scope="module")
def spec_server(
    random_target: Path, drafter: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[server_process.ServerState]:
    """Slow: vLLM's start with the drafter (~80 s of imports on one core)."""
    root = tmp_path_factory.mktemp("vllm-spec")
    model = with_speculation({"path": str(random_target)}, drafter)
    state = vllm_server.start(PROFILE, model, port=free_port(), root=root)
    assert '"method": "dflash"' in " ".join(state.command)
    try:
        yield state
    finally:
        server_process.stop(state, root=root)


def test_speculation_leaves_greedy_answers_as_transformers_gives_them(
    spec_server, random_target: Path
) -> None:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(random_target, dtype=torch.float32).eval()
    requests = prompts(8)
    out = ask(spec_server.url, requests, Sampling(max_new_tokens=32))
    for request in requests:
        expected = greedy(model, request.prompt_ids, 32)
        assert out[request.id].completion_ids == expected, request.id
    record(speculative_prompts_equal=len(requests))


def test_bench_reads_drafts_and_accepted_tokens_from_vllm(spec_server) -> None:
    requests = prompts(6)
    run = bench.run_server(
        spec_server.url,
        [r.prompt_ids for r in requests],
        completion_params(Sampling(max_new_tokens=24), EOT),
        concurrency=3,
        label="speculative",
        protocol="vllm",
    )
    assert run.requests == 6 and run.completion_tokens > 0
    # One draft per verify step; an untrained drafter's drafts are mostly rejected, never more
    # than BLOCK - 1 tokens of one accepted.
    assert run.verify_steps is not None and run.verify_steps > 0
    assert run.accepted_tokens is not None and run.accepted_tokens >= 0
    assert 1.0 <= run.acceptance_length <= BLOCK
    record(untrained_drafter={"acceptance_length": run.acceptance_length,
                              "verify_steps": run.verify_steps})  # fmt: skip
