"""What the `vllm` tests ask a real vLLM server and what they compare its answers with: the
vllm_cpu profile, random prompts, the vLLM engine's answers and transformers' greedy ones."""

from __future__ import annotations

from pathlib import Path

import torch

from draftline.generation.engines.base import Request, Result, Sampling
from draftline.generation.engines.sglang import ClientSettings
from draftline.generation.engines.vllm import VLLMEngine
from draftline.runtime import hardware

EOT = 2
PROFILE = hardware.load_profiles(Path(__file__).resolve().parents[2] / "conf")["vllm_cpu"]


def prompts(n: int) -> list[Request]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 40, (n,), generator=g).tolist()
    return [Request(f"p{i}", torch.randint(6, 1536, (k,), generator=g).tolist()) for i, k in
            enumerate(lengths)]  # fmt: skip


def ask(url: str, requests: list[Request], sampling: Sampling) -> dict[str, Result]:
    engine = VLLMEngine(ClientSettings(endpoints=(url,), max_in_flight=8), sampling, EOT)
    out: dict[str, Result] = {}
    engine.generate(requests, lambda r: out.__setitem__(r.id, r))
    assert sorted(out) == sorted(r.id for r in requests)  # each exactly once
    return out


def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=EOT, pad_token_id=0,
        )  # fmt: skip
    ids = out[0, len(prompt) :].tolist()
    return ids[: ids.index(EOT) + 1] if EOT in ids else ids
