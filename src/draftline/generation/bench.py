"""A live benchmark of speculative decoding: the held-out prompts sent to an SGLang server that
serves the target with the trained drafter, and to one that serves it without speculation.

Acceptance length is SGLang's own measure: output tokens over verify steps (target forwards),
`completion_tokens / spec_verify_ct` of each answer's `meta_info`, summed over the requests
(the bonus token counts, as in `tau`). Speed is output tokens per second of wall time with
`concurrency` requests in flight; the speed-up is that over the baseline server's, measured the
same way on the same prompts and sampling.
"""

from __future__ import annotations

import asyncio
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

    @property
    def acceptance_length(self) -> float | None:
        if not self.verify_steps:
            return None
        return self.completion_tokens / self.verify_steps

    @property
    def output_tok_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


async def _generate(
    session: aiohttp.ClientSession, url: str, prompt: list[int], sampling: dict[str, Any]
) -> dict[str, Any]:
    body = {"input_ids": prompt, "sampling_params": sampling, "rid": uuid.uuid4().hex}
    async with session.post(f"{url}/generate", json=body) as response:
        answer = await response.json(content_type=None)
        if response.status != 200:
            message = (answer.get("error") or {}).get("message") if isinstance(answer, dict) else ""
            raise RuntimeError(f"{url}/generate answered {response.status}: {message}")
    return answer["meta_info"]


async def _run(
    url: str, prompts: Sequence[list[int]], sampling: dict[str, Any], concurrency: int, label: str
) -> ServerRun:
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    with tqdm(total=len(prompts), desc=f"bench {label}", unit="req") as bar:
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(prompt: list[int]) -> dict[str, Any]:
                async with gate:
                    meta = await _generate(session, url, prompt, sampling)
                bar.update(1)
                return meta

            began = time.perf_counter()
            metas = await asyncio.gather(*(one(p) for p in prompts))
            wall = time.perf_counter() - began
    tokens = sum(int(m.get("completion_tokens") or 0) for m in metas)
    steps = [m.get("spec_verify_ct") for m in metas]
    verify = sum(int(s) for s in steps) if all(s is not None for s in steps) else None
    return ServerRun(len(metas), tokens, verify, wall)


def run_server(
    url: str,
    prompts: Sequence[list[int]],
    sampling: dict[str, Any],
    concurrency: int = 16,
    label: str = "",
) -> ServerRun:
    """Send every prompt (token ids) to `url` with `concurrency` in flight; wait for all."""
    if not prompts:
        raise ValueError("no prompts to send")
    try:
        return asyncio.run(_run(url.rstrip("/"), prompts, sampling, concurrency, label or url))
    except aiohttp.ClientConnectionError as exc:
        raise SystemExit(
            f"bench: cannot reach {url} ({exc}): start it with `draftline serve start "
            "--drafter models/drafter` (or --no-speculation for the baseline), or pass --url"
        ) from exc


def summary(speculative: ServerRun, baseline: ServerRun | None) -> dict[str, Any]:
    """The figures `draftline bench` records."""
    if speculative.acceptance_length is None:
        raise SystemExit(
            "bench: the server reported no speculative statistics (spec_verify_ct): is it "
            "serving the drafter? `draftline serve start --drafter models/drafter`"
        )
    out: dict[str, Any] = {
        "acceptance_length": speculative.acceptance_length,
        "output_tok_s": speculative.output_tok_s,
        "requests": speculative.requests,
        "completion_tokens": speculative.completion_tokens,
        "verify_steps": speculative.verify_steps,
        "wall_s": speculative.wall_s,
    }
    if baseline is not None:
        out["baseline_output_tok_s"] = baseline.output_tok_s
        out["speedup"] = (
            speculative.output_tok_s / baseline.output_tok_s if baseline.output_tok_s else None
        )
    return out
