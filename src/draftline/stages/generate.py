"""Stage `generate`: regenerate one curated shard (or the eval split) with the target.

  draftline generate --shard K   data/curated/train/shard-K.parquet
                                 -> data/generated/train/shard-K.parquet
  draftline generate --eval      data/curated/eval.parquet -> data/generated/eval.parquet

The engine comes from the hardware profile (`local` transformers, or `sglang` over HTTP).
SGLang endpoints: $DRAFTLINE_SGLANG_ENDPOINTS (comma-separated URLs), else `generate.endpoints`,
else the profile's own server; when none answers, `generate.autostart: true` starts it
(`draftline serve start`), otherwise the stage stops and names the command to run.
A killed run resumes from `.draftline/journal/generate/`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

from draftline.core import target
from draftline.core.loss_mask import special_ids
from draftline.data.curation import shard_file_name
from draftline.generation.engines.base import Engine, EngineUnavailable, Sampling
from draftline.generation.guard import Guard, GuardAbort
from draftline.generation.shards import Identity, ShardFailed, ShardPaths, run_shard
from draftline.quality.checks import thinking_enabled
from draftline.runtime import hardware, params, run_log

JOURNAL_DIR = Path(".draftline/journal/generate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--shard", type=int, help="train shard index (data.shard_ids)")
    which.add_argument("--eval", action="store_true", help="the held-out eval split")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def shard_paths(shard: int | None) -> ShardPaths:
    if shard is None:
        return ShardPaths(
            name="eval",
            curated=Path("data/curated/eval.parquet"),
            output=Path("data/generated/eval.parquet"),
            run_log=run_log.RUNS_DIR / "generate/eval.json",
            journal=JOURNAL_DIR / "eval.jsonl",
        )
    return ShardPaths(
        name=f"shard-{shard}",
        curated=Path(f"data/curated/train/{shard_file_name(shard)}"),
        output=Path(f"data/generated/train/{shard_file_name(shard)}"),
        run_log=run_log.RUNS_DIR / f"generate/shard-{shard}.json",
        journal=JOURNAL_DIR / f"shard-{shard}.jsonl",
    )


def sampling_from(gen: dict[str, Any]) -> Sampling:
    return Sampling(
        max_new_tokens=int(gen["max_new_tokens"]),
        temperature=float(gen.get("temperature", 0.0)),
        top_p=float(gen.get("top_p", 1.0)),
        top_k=int(gen.get("top_k", -1)),
        seed=int(gen.get("seed", 0)),
    )


def make_engine(
    p: dict[str, Any],
    profile: dict[str, Any],
    sampling: Sampling,
    tokenizer: Any,
    end_of_turn: int,
) -> Engine:
    kind = profile.get("engine", "local")
    if kind == "local":
        from draftline.generation.engines.local import LocalEngine

        return LocalEngine.from_config(p["model"], sampling, tokenizer, end_of_turn, profile)
    if kind == "sglang":
        return make_sglang_engine(p, profile, sampling, end_of_turn)
    raise SystemExit(f"hardware.engine={kind!r} is not an engine: use local or sglang")


def make_sglang_engine(
    p: dict[str, Any], profile: dict[str, Any], sampling: Sampling, end_of_turn: int
) -> Engine:
    from draftline.generation import sglang_server
    from draftline.generation.engines.sglang import (
        ClientSettings,
        SGLangEngine,
        reachable,
        resolve_endpoints,
    )

    gen = p.get("generate") or {}
    sg = sglang_server.sglang_settings(profile)
    endpoints = resolve_endpoints(
        gen.get("endpoints"), str(sg.get("host") or "127.0.0.1"), int(sg.get("port") or 30000)
    )
    if not reachable(endpoints):
        own = sglang_server.server_url(profile)
        if gen.get("autostart") and endpoints == [own]:
            print(f"no SGLang server at {own}: starting one (generate.autostart)")
            try:
                sglang_server.start(
                    profile, p["model"], timeout_s=float(gen.get("serve_timeout_s", 1800))
                )
            except sglang_server.ServeError as exc:
                raise SystemExit(f"generate: autostart failed: {exc}") from exc
        else:
            raise SystemExit(
                f"generate: no SGLang server answers /health at {', '.join(endpoints)}. Start one "
                f"with `draftline serve start` (hardware={profile.get('name')}), or set "
                "generate.autostart=true, or point $DRAFTLINE_SGLANG_ENDPOINTS at running servers"
            )
    settings = ClientSettings(
        endpoints=tuple(endpoints),
        max_in_flight=int(sg.get("max_in_flight") or 256),
        request_timeout_s=float(gen.get("request_timeout_s", 3600)),
        max_retries=int(gen.get("max_retries", 5)),
        backoff_base_s=float(gen.get("backoff_base_s", 0.5)),
        backoff_max_s=float(gen.get("backoff_max_s", 30)),
    )
    return SGLangEngine(settings, sampling, end_of_turn)


def run(args: argparse.Namespace) -> int:
    p = params.load(args.params)
    model, gen = p["model"], p["generate"]
    profile = hardware.resolve_profile(p["hardware"])
    paths = shard_paths(None if args.eval else args.shard)
    if not args.eval and args.shard not in (p.get("data") or {}).get("shard_ids", []):
        raise SystemExit(f"generate: shard {args.shard} is not in data.shard_ids")
    sampling = sampling_from(gen)
    tokenizer = target.load_tokenizer(model)
    special = special_ids(tokenizer, str(model.get("end_of_turn_token", "<|im_end|>")))
    thinking = thinking_enabled(p)
    guard = (
        Guard(
            p["quality"],
            thinking=thinking,
            max_new_tokens=sampling.max_new_tokens,
            think_in_prompt=target.generation_prompt_opens_think(
                tokenizer, dict(model.get("chat_template_kwargs") or {}), special
            ),
        )
        if gen.get("guard", True) and p.get("quality")
        else None
    )
    identity = Identity(
        model=target.model_ref(model),
        template_kwargs=dict(model.get("chat_template_kwargs") or {}),
        sampling=sampling,
        chat_template_sha256=hashlib.sha256(
            str(tokenizer.chat_template or "").encode("utf-8")
        ).hexdigest(),
    )
    engine = make_engine(p, profile, sampling, tokenizer, special.end_of_turn)
    extra = {**hardware.describe(profile), **params.identity(p)}
    try:
        metrics = run_shard(
            paths,
            engine,
            tokenizer,
            identity,
            special,
            guard,
            max_error_share=float(gen.get("max_error_share", 0.01)),
            extra_metrics=extra,
            progress=not args.no_progress,
        )
    except (GuardAbort, ShardFailed, EngineUnavailable) as exc:
        print(f"generate {paths.name} stopped: {exc}")
        return 1
    finally:
        engine.close()
    if not args.eval:  # one generate figure: output tokens/s over this node's train shards
        shards = [json.loads(p.read_text()) for p in paths.run_log.parent.glob("shard-*.json")]
        run_log.record_throughput(
            run_log.THROUGHPUT_PATH, "generate", run_log.generation_rate(shards), metrics
        )
    print(
        f"generate {paths.name}: {metrics['samples']} samples ({metrics['resumed_samples']} "
        f"resumed), {metrics['output_tokens']} output tokens, "
        f"{metrics['output_tok_s'] or 0:,.0f} out tok/s, finish {metrics['finish_reasons']}"
    )
    return 0
