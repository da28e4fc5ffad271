"""A live benchmark of speculative decoding: the held-out prompts sent to a server (SGLang or
vLLM) that serves the target with the trained drafter, and to one that serves it without
speculation.

Acceptance length is the server's own measure of tokens per verify step (target forward), the
bonus token counted, as in `tau`. SGLang: `completion_tokens / spec_verify_ct` of each answer's
`meta_info`, summed over the requests; an answer that ended on its first token (written by the
prefill, no verify step) has no `spec_verify_ct` (SGLang leaves it out when 0): its token counts
for speed, not for acceptance. vLLM (`/v1/completions`, which reports no per-request
statistics): its Prometheus counters at `/metrics`, read before and after the run,
`1 + accepted tokens / drafts` (`vllm:spec_decode_num_accepted_tokens`,
`vllm:spec_decode_num_drafts`), vLLM's "mean acceptance length". Speed is output tokens per
second of wall time with `concurrency` requests in flight; the speed-up is that over the
baseline server's, measured the same way on the same prompts and sampling.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm


@dataclass(frozen=True)
class ServerRun:
    """What one server did for the prompts."""

    requests: int
    completion_tokens: int
    verify_steps: int | None  # None: the server reported no speculative statistics
    wall_s: float
    # vLLM: drafted tokens accepted over the run (its counters); None for SGLang.
    accepted_tokens: int | None = None
    # SGLang: completion tokens of the answers that had verify steps (None: all of them).
    verified_tokens: int | None = None

    @property
    def acceptance_length(self) -> float | None:
        if not self.verify_steps:
            return None
        if self.accepted_tokens is not None:
            return 1 + self.accepted_tokens / self.verify_steps
        verified = self.completion_tokens if self.verified_tokens is None else self.verified_tokens
        return verified / self.verify_steps

    @property
    def output_tok_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


async def _ask(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    sampling: dict[str, Any],
    protocol: str,
) -> dict[str, Any]:
    """One request; the answer's statistics: SGLang's `meta_info` (`/generate`), vLLM's
    `usage` (`/v1/completions`)."""
    if protocol == "vllm":
        route, part = "/v1/completions", "usage"
        body = {**sampling, "prompt": prompt, "request_id": uuid.uuid4().hex}
    else:
        route, part = "/generate", "meta_info"
        body = {"input_ids": prompt, "sampling_params": sampling, "rid": uuid.uuid4().hex}
    async with session.post(f"{url}{route}", json=body) as response:
        answer = await response.json(content_type=None)
        if response.status != 200:
            message = (answer.get("error") or {}).get("message") if isinstance(answer, dict) else ""
            raise RuntimeError(f"{url}{route} answered {response.status}: {message}")
    return answer[part]


async def _run(
    url: str,
    prompts: Sequence[list[int]],
    sampling: dict[str, Any],
    concurrency: int,
    label: str,
    protocol: str,
) -> ServerRun:
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    with tqdm(total=len(prompts), desc=f"bench {label}", unit="req") as bar:
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(prompt: list[int]) -> dict[str, Any]:
                async with gate:
                    meta = await _ask(session, url, prompt, sampling, protocol)
                bar.update(1)
                return meta

            before = await spec_counters(session, url) if protocol == "vllm" else None
            began = time.perf_counter()
            metas = await asyncio.gather(*(one(p) for p in prompts))
            wall = time.perf_counter() - began
            after = await spec_counters(session, url) if protocol == "vllm" else None
    tokens = sum(int(m.get("completion_tokens") or 0) for m in metas)
    if before is not None and after is not None:
        drafts = after["drafts"] - before["drafts"]
        accepted = after["accepted"] - before["accepted"]
        return ServerRun(len(metas), tokens, drafts or None, wall, accepted)
    verified = [m for m in metas if m.get("spec_verify_ct")]
    if not verified:  # no answer had a verify step: the server does not speculate
        return ServerRun(len(metas), tokens, None, wall)
    steps = sum(int(m["spec_verify_ct"]) for m in verified)
    verified_tokens = sum(int(m.get("completion_tokens") or 0) for m in verified)
    return ServerRun(len(metas), tokens, steps, wall, verified_tokens=verified_tokens)


# vLLM's speculative-decoding counters (Prometheus text; `_total` suffix on counters).
_COUNTER = re.compile(
    r"^vllm:spec_decode_num_(drafts|accepted_tokens)(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$",
    re.MULTILINE,
)


async def spec_counters(session: aiohttp.ClientSession, url: str) -> dict[str, int] | None:
    """vLLM's drafts and accepted tokens so far (summed over engines); None without them."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    found = {"drafts": 0.0, "accepted": 0.0}
    seen = False
    for name, value in _COUNTER.findall(text):
        found["drafts" if name == "drafts" else "accepted"] += float(value)
        seen = True
    return {k: int(v) for k, v in found.items()} if seen else None


def run_server(
    url: str,
    prompts: Sequence[list[int]],
    sampling: dict[str, Any],
    concurrency: int = 16,
    label: str = "",
    protocol: str = "sglang",
) -> ServerRun:
    """Send every prompt (token ids) to `url` with `concurrency` in flight; wait for all.
    `protocol`: `sglang` (native `/generate`) or `vllm` (`/v1/completions` and `/metrics`)."""
    if not prompts:
        raise ValueError("no prompts to send")
    try:
        return asyncio.run(
            _run(url.rstrip("/"), prompts, sampling, concurrency, label or url, protocol)
        )
    except aiohttp.ClientConnectionError as exc:
        raise SystemExit(
            f"bench: cannot reach {url} ({exc}): start it with `draftline serve start "
            "--drafter models/drafter` (or --no-speculation for the baseline), or pass --url"
        ) from exc


def summary(speculative: ServerRun, baseline: ServerRun | None) -> dict[str, Any]:
    """The figures `draftline bench` records."""
    if speculative.acceptance_length is None:
        raise SystemExit(
            "bench: the server reported no speculative statistics (SGLang's spec_verify_ct, "
            "vLLM's spec_decode counters): is it serving the drafter? `draftline serve start "
            "--drafter models/drafter`"
        )
    out: dict[str, Any] = {
        "acceptance_length": speculative.acceptance_length,
        "output_tok_s": speculative.output_tok_s,
        "requests": speculative.requests,
        "completion_tokens": speculative.completion_tokens,
        "verify_steps": speculative.verify_steps,
        "accepted_tokens": speculative.accepted_tokens,
        "wall_s": speculative.wall_s,
    }
    if baseline is not None:
        out["baseline_output_tok_s"] = baseline.output_tok_s
        out["speedup"] = (
            speculative.output_tok_s / baseline.output_tok_s if baseline.output_tok_s else None
        )
    return out
