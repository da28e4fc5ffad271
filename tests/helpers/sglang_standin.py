"""A stand-in for an SGLang server, for tests and benchmarks (SGLang itself needs a GPU).

It speaks SGLang's native protocol faithfully for what draftline uses:
- `POST /generate` with `input_ids` (one list, or a batch of lists), `sampling_params`
  (`max_new_tokens`, `stop_token_ids`, ...) and `rid`; it answers `{"text", "output_ids",
  "meta_info": {"id", "finish_reason": {"type": "stop", "matched": <id>} | {"type": "length",
  "length": n}, "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}}` (a list
  of those for a batch), and `{"error": {"message"}}` with HTTP 400 for a malformed request;
- stopping as SGLang 0.5.23 does (`Req._check_token_based_finish`): at the first token in
  `stop_token_ids` or the model's EOS (`--model-eos`, the stand-in's model property: SGLang reads
  it from the model's config whatever the request says), the stop token kept in `output_ids`;
  `ignore_eos` turns off both; `--mode eos` makes the model write its EOS mid-answer;
- the context length (`--context-length`): HTTP 400 with SGLang's messages when the input, plus
  the draft-token slots EAGLE/NEXTN speculation reserves, reaches it, or when that plus
  `max_new_tokens` passes it (`TokenizerManager._validate_input_ids_in_context_length`);
- `GET /health`: 200 once ready (503 during `--startup-delay`), as SGLang does while loading;
- `GET /server_info` (and its deprecated alias `/get_server_info`), as SGLang 0.5.23 answers it:
  the configured `max_running_requests` (`--max-running-requests`, SGLang's flag), the KV pool
  `max_total_num_tokens` (`--max-total-num-tokens`) and `internal_states` with the cap the
  scheduler settled on, `effective_max_running_requests_per_dp`: the configured one, or
  `--running-cap` when that is lower (SGLang lowers it to what memory and CUDA graphs allow);
- `GET /model_info` (and its deprecated alias `/get_model_info`), SGLang 0.5.23's fields: the
  `--model-path` served (also its tokenizer path and served name, as SGLang defaults them). The
  real router (sglang-router 0.3.2) asks it when it registers a worker, and loads the tokenizer
  from that path: a local folder in tests, never a hub id;
- a router in front of DP engines when started with `--dp-size N` (N > 1), as
  `python -m sglang_router.launch_server` (sglang-router 0.3.2) is: it starts N engines on ports
  of their own, logging `Launching DP server process <i> on port <port>` for each as its
  launcher does, each loading for `--startup-delay`; the router's own `/health` is its liveness
  probe and answers 200 at once, before any engine is ready, and its `/generate` answers 503
  while no engine is (the gateway's docs: docs/advanced_features/sgl_model_gateway.md). It
  registers its workers in a background job: `--router-ready-delay S` more seconds after the
  engines load, during which `GET /readiness` answers 503 `{"status": "not ready"}` and
  `/generate` 503; then 200 `{"status": "ready", "healthy_workers": N, "total_workers": N}`.
  `--early-log FILE` appends the time of every `/generate` refused that way;
- speculative decoding: started with SGLang's `--speculative-algorithm` (and
  `--speculative-num-draft-tokens`), `meta_info` also carries `spec_verify_ct`, the number of
  verify steps (target forwards) the request took, as SGLang reports it; each step commits
  `--accept-length` tokens (capped by the draft tokens), so `completion_tokens /
  spec_verify_ct` is that length. `--step-s` is the time of one target forward: an answer takes
  (verify steps or completion tokens) x step-s, so speculation speeds answers up as on a GPU.

The "model" is a deterministic function of the prompt ids, so a sample regenerated after a
resume is identical. `--mode` shapes completions: `think` (`<think> t.. </think> a.. <eot>`),
`empty` (two tokens then end of turn: the "OK." failure), `truncated` (never ends a turn);
`--think-tokens N` makes every think block N tokens long (realistic response sizes).

Faults, for the fault tests: `--p500` / `--p429` (share of requests answered 500 / 429),
`--pdrop` (share whose connection is closed without an answer), `--delay` (seconds per answer;
`--delay-spread S` adds up to S more, a function of the prompt, so answers take unequal times),
`--die-after N` (the process exits abruptly after N answers), `--nan-token ID` (a prompt holding
ID hits a NaN step: SGLang's `"matched": "NaN happened"` stop). `--log FILE` appends every received
`rid` (flushed), so tests count what was generated; `--timing-log FILE` appends `<arrived>
<answered> <rid>` (monotonic seconds) per answer, so tests measure how many requests the server
had in flight. `--argv-log FILE` records the command line; `--body-log FILE` appends every
`/generate` body as received (what a router in front forwarded).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import sys
import time
from typing import Any

from aiohttp import web


def completion_for(prompt: list[int], params: dict[str, Any], opts: argparse.Namespace) -> dict:
    max_new = int(params.get("max_new_tokens", 128))
    stops = [int(t) for t in params.get("stop_token_ids") or []]
    digest = hashlib.sha256(json.dumps(prompt).encode()).digest()
    vocab_low, vocab_high = opts.vocab_low, opts.vocab_high
    body = [vocab_low + b % (vocab_high - vocab_low) for b in digest]  # 32 "content" tokens
    if opts.mode == "think":
        n_think, n_answer = 4 + digest[0] % 12, 2 + digest[1] % 10
        think = body[:n_think]
        if opts.think_tokens:  # realistic lengths: the seed averaged ~2,500 tokens a sample
            think = (body * (opts.think_tokens // len(body) + 1))[: opts.think_tokens]
        out = [opts.think_start, *think, opts.think_end, *body[n_think : n_think + n_answer]]
    elif opts.mode == "empty":
        out = body[:2]
    elif opts.mode == "eos":  # the model ends the document mid-answer, then would go on
        out = [*body[:3], opts.model_eos, *body[3:6]]
    else:  # truncated: keeps going
        out = (body * (max_new // len(body) + 1))[: max_new + 1]
    if opts.mode not in ("truncated", "eos") and stops:
        out.append(stops[0])
    if digest[4] < 256 * opts.one_token_share and stops:
        out = [stops[0]]  # the answer ends on its first token
    if opts.nan_token in prompt:
        # A step that sampled no valid token (NaN logits): SGLang 0.5.23 writes the first stop
        # token, then the model's EOS, in its place and ends the request as a "stop"
        # (`Req._check_vocab_boundary_finish`).
        nan_at = min(3, len(out), max_new - 1)
        written = opts.model_eos if opts.model_eos != -1 else (stops or [-1])[0]
        return {
            "output_ids": [*out[:nan_at], written],
            "reason": {"type": "stop", "matched": "NaN happened"},
        }
    ends = {*stops, opts.model_eos} - {-1}
    if params.get("ignore_eos"):
        ends = set()  # SGLang 0.5.23 skips stop_token_ids as well under ignore_eos
    first = next((i for i, t in enumerate(out) if t in ends), None)
    if first is not None and first < max_new:
        out = out[: first + 1]
        reason: dict[str, Any] = {"type": "stop", "matched": out[-1]}
    else:
        out = out[:max_new]
        reason = {"type": "length", "length": len(out)}
    return {"output_ids": out, "reason": reason}


def reserved_tokens(opts: argparse.Namespace) -> int:
    """Output slots SGLang counts as input for EAGLE-family speculation (MTP's NEXTN included):
    max(topk x steps, draft tokens) (`managers.utils.compute_num_reserved_tokens`)."""
    if (opts.speculative_algorithm or "").upper() not in ("EAGLE", "EAGLE3", "NEXTN"):
        return 0
    steps, topk = opts.speculative_num_steps or 1, opts.speculative_eagle_topk or 1
    return max(topk * steps, opts.speculative_num_draft_tokens or 0)


def context_error(prompt: list[int], params: dict[str, Any], opts: argparse.Namespace) -> str:
    """SGLang's refusal of a request that does not fit the context length, or ""."""
    if not opts.context_length:
        return ""
    used = len(prompt) + reserved_tokens(opts)
    if used >= opts.context_length:
        return (
            f"The input ({used} tokens) is longer than the model's context length "
            f"({opts.context_length} tokens)."
        )
    max_new = int(params.get("max_new_tokens", 128))
    if used + max_new > opts.context_length:
        return (
            "Requested token count exceeds the model's maximum context length of "
            f"{opts.context_length} tokens. You requested a total of {used + max_new} tokens"
        )
    return ""


class StandIn:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.ready_at = time.monotonic() + opts.startup_delay
        self.answers = 0
        # Sequences served so far (prompt + answer), for `cached_tokens`: as SGLang's radix
        # cache, the longest prefix of a new prompt that an earlier request computed.
        self.served: list[list[int]] = []
        self.log = open(opts.log, "a", encoding="utf-8") if opts.log else None  # noqa: SIM115
        self.timing = (
            open(opts.timing_log, "a", encoding="utf-8")  # noqa: SIM115
            if opts.timing_log
            else None
        )

    def cached_prefix(self, prompt: list[int]) -> int:
        """The longest prefix of `prompt` an earlier request held (never the whole prompt:
        SGLang computes at least its last token)."""
        best = 0
        for seq in self.served[-4096:]:
            n = 0
            for a, b in zip(seq, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1)

    async def health(self, request: web.Request) -> web.Response:
        if time.monotonic() < self.ready_at:
            return web.Response(status=503, text="loading")
        return web.Response(text="")

    async def server_info(self, request: web.Request) -> web.Response:
        o = self.opts
        configured = o.max_running_requests
        caps = [c for c in (configured, o.running_cap) if c]
        return web.json_response(
            {
                "max_running_requests": configured,
                "max_total_num_tokens": o.max_total_num_tokens,
                "internal_states": [
                    {"effective_max_running_requests_per_dp": min(caps) if caps else 4096}
                ],
                "version": "stand-in",
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        path = self.opts.model_path
        return web.json_response(
            {
                "model_path": path,
                "served_model_name": path,
                "tokenizer_path": path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        try:
            raw = await request.read()
            if self.opts.body_log:
                with open(self.opts.body_log, "ab") as f:
                    f.write(raw + b"\n")
            data = json.loads(raw)
            rid = data.get("rid")
            if self.log:
                self.log.write(f"{rid}\n")
                self.log.flush()
            ids = data["input_ids"]
            if not ids:
                raise ValueError("input_ids is empty")
        except (ValueError, KeyError) as exc:
            return web.json_response({"error": {"message": f"bad request: {exc}"}}, status=400)
        roll = self.rng.random()
        o = self.opts
        if roll < o.p500:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        if roll < o.p500 + o.p429:
            return web.json_response({"error": {"message": "too many"}}, status=429)
        if roll < o.p500 + o.p429 + o.pdrop:
            assert request.transport is not None
            request.transport.close()  # the client sees the connection drop mid-request
            return web.Response(status=500)
        if o.delay or o.delay_spread:
            spread = hashlib.sha256(json.dumps(ids).encode()).digest()[2] / 255 * o.delay_spread
            await asyncio.sleep(o.delay + spread)
        batch = ids and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        answers = []
        forwards = 0
        for prompt in prompts:
            if error := context_error(prompt, data.get("sampling_params") or {}, o):
                return web.json_response({"error": {"message": error}}, status=400)
        for prompt, one_rid in zip(prompts, rids, strict=True):
            gen = completion_for(prompt, data.get("sampling_params") or {}, o)
            n = len(gen["output_ids"])
            meta = {
                "id": one_rid,
                "finish_reason": gen["reason"],
                "prompt_tokens": len(prompt),
                "completion_tokens": n,
                "cached_tokens": self.cached_prefix(prompt),
            }
            self.served.append([*prompt, *gen["output_ids"]])
            if o.speculative_algorithm:
                per_step = min(o.accept_length, (o.speculative_num_draft_tokens or 16))
                # The prefill writes the first token: an answer of one token had no verify
                # step, and SGLang leaves spec_verify_ct out when it is 0.
                steps = max(1, math.ceil(n / per_step)) if n > 1 else 0
                if steps:
                    meta["spec_verify_ct"] = steps
                forwards = max(forwards, steps, 1)
            else:
                forwards = max(forwards, n)
            answers.append({"text": "", "output_ids": gen["output_ids"], "meta_info": meta})
        if o.step_s:
            await asyncio.sleep(forwards * o.step_s)
        for answer in answers:
            answer["meta_info"]["e2e_latency"] = time.monotonic() - started
        self.answers += 1
        if self.timing:
            self.timing.write(f"{started:.6f} {time.monotonic():.6f} {rid}\n")
            self.timing.flush()
        if o.die_after and self.answers > o.die_after:
            os._exit(1)  # the server dies abruptly, mid-shard
        return web.json_response(answers if batch else answers[0], dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--mode", choices=["think", "empty", "truncated", "eos"], default="think")
    p.add_argument("--model-eos", type=int, default=-1, help="the model's EOS id (-1: none)")
    p.add_argument("--think-start", type=int, default=5)
    p.add_argument("--think-end", type=int, default=6)
    p.add_argument("--think-tokens", type=int, default=0)
    p.add_argument("--vocab-low", type=int, default=20)
    p.add_argument("--vocab-high", type=int, default=200)
    p.add_argument("--p500", type=float, default=0.0)
    p.add_argument("--p429", type=float, default=0.0)
    p.add_argument("--pdrop", type=float, default=0.0)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--delay-spread", type=float, default=0.0)
    p.add_argument("--die-after", type=int, default=0)
    p.add_argument("--startup-delay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default=None)
    p.add_argument("--timing-log", default=None)
    p.add_argument("--argv-log", default=None)
    p.add_argument("--body-log", default=None, help="appends every /generate body received")
    p.add_argument("--step-s", type=float, default=0.0, help="seconds per target forward")
    p.add_argument("--accept-length", type=float, default=3.0, help="tokens per verify step")
    # SGLang's own flags this stand-in honours (the rest of a real command line is ignored).
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--model-path", default=None)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-total-num-tokens", type=int, default=1_000_000)
    p.add_argument("--running-cap", type=int, default=None, help="what the scheduler settles on")
    p.add_argument("--router-ready-delay", type=float, default=0.0)
    p.add_argument("--early-log", default=None, help="router: times of /generate before ready")
    p.add_argument("--one-token-share", type=float, default=0.0, help="answers of one token")
    p.add_argument(
        "--nan-token", type=int, default=-1, help="a prompt with this id hits a NaN step"
    )
    return p


def make_app(opts: argparse.Namespace) -> web.Application:
    server = StandIn(opts)
    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_get("/health", server.health)
    app.router.add_get("/server_info", server.server_info)
    app.router.add_get("/get_server_info", server.server_info)
    app.router.add_get("/model_info", server.model_info)
    app.router.add_get("/get_model_info", server.model_info)
    app.router.add_post("/generate", server.generate)
    return app


def make_router_app(opts: argparse.Namespace) -> web.Application:
    """The router: alive at once, serving only once its engines (same model, same loading
    time) are ready and it has registered them (`--router-ready-delay` later)."""
    server = StandIn(opts)
    registered_at = server.ready_at + opts.router_ready_delay

    async def liveness(request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy"})

    async def readiness(request: web.Request) -> web.Response:
        if time.monotonic() < registered_at:
            body = {"status": "not ready", "reason": "insufficient healthy workers"}
            return web.json_response(body, status=503)
        n = opts.dp_size
        return web.json_response({"status": "ready", "healthy_workers": n, "total_workers": n})

    async def generate(request: web.Request) -> web.StreamResponse:
        if time.monotonic() < registered_at:
            if opts.early_log:
                with open(opts.early_log, "a", encoding="utf-8") as f:
                    f.write(f"{time.time():.3f}\n")
            return web.json_response({"error": {"message": "No available workers"}}, status=503)
        return await server.generate(request)

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_get("/health", liveness)
    app.router.add_get("/readiness", readiness)
    app.router.add_post("/generate", generate)
    return app


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


async def _serve_router(opts: argparse.Namespace) -> None:
    sites = []
    for rank in range(opts.dp_size):
        port = _free_port(opts.host)
        print(
            f"[Router (Python)] {time.strftime('%Y-%m-%d %H:%M:%S')} - INFO - Launching DP "
            f"server process {rank} on port {port} - launch_server.py:182",
            file=sys.stderr,
            flush=True,
        )
        sites.append((make_app(opts), port))
    sites.append((make_router_app(opts), opts.port))
    for app, port in sites:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, opts.host, port, backlog=4096).start()
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    opts, _unknown = build_parser().parse_known_args(argv)  # real SGLang flags are accepted
    if opts.argv_log:
        with open(opts.argv_log, "w", encoding="utf-8") as f:
            json.dump(sys.argv if argv is None else argv, f)
    if opts.dp_size > 1:
        asyncio.run(_serve_router(opts))
        return
    web.run_app(
        make_app(opts), host=opts.host, port=opts.port, print=None, access_log=None, backlog=4096
    )


if __name__ == "__main__":
    main()
