"""Measure the trained drafter against a live SGLang or vLLM server, before deploying it.

  draftline bench --drafter models/drafter     # on one node: each server in turn
  draftline bench --url http://node-a:30000 --baseline-url http://node-b:30000
  draftline serve start --hardware vllm_cpu --drafter models/drafter     # vLLM, port 31000
  draftline bench --engine vllm --url http://127.0.0.1:31000

With `--drafter`, bench starts the profile's server with the drafter, measures it, stops it, then
does the same without speculation: each takes all of the node's GPUs (mem_fraction_static of
each), so the two never run at once. With `--url` (and `--baseline-url`) it measures servers
already running, e.g. on two nodes.

Sends the held-out prompts (`data/generated/eval.parquet`, `evaluate.max_prompts` of them, as
token ids) at the serving temperature (`evaluate.temperature`, top_p, top_k) to both servers and
records the server's acceptance length, output tokens/s and the speed-up over the baseline in
`metrics/bench/bench.json` (a DVC metric: `dvc exp show` lists it beside tau); every result and
the model and drafter in `reports/bench.json`; the whole record in `logs/runs/bench.json`, with
evaluate's offline tau and tau_sampled on the same prompts (`metrics/evaluate.json`) beside the
served acceptance length. Library:
`draftline.generation.bench`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftline.runtime import hardware, params, run_log

RESULT_KEYS = ("acceptance_length", "speedup", "output_tok_s", "baseline_output_tok_s", "requests")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="composed params")
    parser.add_argument(
        "--url", default=None, help="server with the drafter (default: the profile's address)"
    )
    parser.add_argument("--baseline-url", default=None, help="server without speculation")
    parser.add_argument(
        "--drafter",
        default=None,
        help="exported drafter: start its server and the baseline's on this node, one after "
        "the other (each takes every GPU), measure each and stop it",
    )
    parser.add_argument("--eval", default="data/generated/eval.parquet", help="held-out prompts")
    parser.add_argument("--max-prompts", type=int, default=None, help="default evaluate's")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument(
        "--engine",
        choices=["sglang", "vllm"],
        default=None,
        help="the servers' protocol (default: the profile's engine when vllm, else sglang)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (default evaluate.temperature); 0 compares with greedy tau",
    )
    parser.add_argument(
        "--offline", default="metrics/evaluate.json", help="evaluate's metrics: the offline tau"
    )
    parser.add_argument(
        "--metrics", default="metrics/bench/bench.json", help="metrics file (a DVC metric)"
    )
    run_log.add_arguments(parser, "bench")


def run(args: argparse.Namespace) -> int:
    from draftline.core import target
    from draftline.generation import bench, sglang_server, vllm_server
    from draftline.generation.engines.base import Sampling
    from draftline.generation.engines.sglang import sampling_params
    from draftline.generation.engines.vllm import completion_params
    from draftline.stages.evaluate import held_out_prompts

    p = params.load(args.params)
    model, ev = p["model"], p["evaluate"]
    profile = hardware.resolve_profile(p["hardware"])
    engine = args.engine or ("vllm" if profile.get("engine") == "vllm" else "sglang")
    server = vllm_server if engine == "vllm" else sglang_server
    url = args.url or server.server_url(profile)
    prompts = held_out_prompts(Path(args.eval), args.max_prompts or int(ev["max_prompts"]))
    eot = target.special_token_id(target.load_tokenizer(model), str(model["end_of_turn_token"]))
    sampling = Sampling(
        max_new_tokens=int(ev["max_new_tokens"]),
        temperature=float(
            args.temperature if args.temperature is not None else ev.get("temperature") or 0.0
        ),
        top_p=float(ev.get("top_p") or 1.0),
        top_k=int(ev.get("top_k") or -1),
    )
    eos = model.get("eos_token_id")
    request = (completion_params if engine == "vllm" else sampling_params)(sampling, eot, eos)

    def measure(at: str, label: str) -> bench.ServerRun:
        return bench.run_server(at, prompts, request, args.concurrency, label, engine)

    baseline = None
    if args.drafter:  # this node's servers, one at a time
        generate = p.get("generate") or {}
        timeout = float(generate.get("serve_timeout_s", 1800))
        speculative = served(
            server, profile, model, args.drafter, timeout, measure, "drafter", generate
        )
        baseline = served(server, profile, model, None, timeout, measure, "baseline", generate)
        url = args.baseline_url = server.server_url(profile)
    else:
        speculative = measure(url, "drafter")
        if args.baseline_url:
            baseline = measure(args.baseline_url, "baseline")
    offline = offline_tau(Path(args.offline))
    record = {
        **bench.summary(speculative, baseline),
        **offline,
        "engine": engine,
        "url": url,
        "baseline_url": args.baseline_url,
        "sampling": sampling.as_dict(),
        "concurrency": args.concurrency,
        **params.identity(p),
    }
    run_log.write(args, "bench", record, RESULT_KEYS, RESULT_KEYS)
    speed = f", x{record['speedup']:.2f} over the baseline" if record.get("speedup") else ""
    offline_key = "offline_tau_sampled" if sampling.temperature > 0 else "offline_tau"
    beside = (
        f"; offline {offline_key.removeprefix('offline_')} {record[offline_key]:.2f} on the "
        "same prompts"
        if record.get(offline_key) is not None
        else ""
    )
    print(
        f"bench: acceptance length {record['acceptance_length']:.2f} at temperature "
        f"{sampling.temperature:g}{beside}, {record['output_tok_s']:,.0f} output tok/s{speed} "
        f"({record['requests']} prompts, {engine})"
    )
    return 0


def served(
    server: Any,
    profile: dict[str, Any],
    model: dict[str, Any],
    drafter: str | None,
    timeout_s: float,
    measure: Callable[[str, str], Any],
    label: str,
    generate: dict[str, Any] | None = None,
) -> Any:
    """Start the profile's server with `drafter` (None: without speculation), measure it and
    stop it, so the next one has the node's GPUs to itself. `generate`: the run's section, for
    SGLang's router timeout."""
    from draftline.generation import server_launch, server_process, sglang_server

    port = server.bind_port(profile)
    running = [
        s for s in server_process.read_states() if s.port == port and server_process.alive(s)
    ]
    if running:
        raise SystemExit(
            f"bench --drafter starts its own servers on port {port}, which a server started "
            f"earlier holds (pid {running[0].pid}): `draftline serve stop --port {port}` first"
        )
    spec = server_launch.with_speculation(model, drafter, off=drafter is None)
    print(f"bench: starting the {label} server ({server.server_url(profile)})")
    try:
        options = {"generate": generate} if server is sglang_server else {}
        state = server.start(profile, spec, timeout_s=timeout_s, **options)
    except server_process.ServeError as exc:
        raise SystemExit(f"bench: the {label} server did not start: {exc}") from exc
    try:
        return measure(state.url, label)
    finally:
        server_process.stop(state)


def offline_tau(path: Path) -> dict[str, float | None]:
    """Evaluate's tau (greedy) and tau_sampled (at the serving temperature) on the held-out
    prompts, to stand beside the served acceptance length; empty without evaluate's metrics."""
    if not path.is_file():
        return {}
    figures = json.loads(path.read_text(encoding="utf-8"))
    return {"offline_tau": figures.get("tau"), "offline_tau_sampled": figures.get("tau_sampled")}
