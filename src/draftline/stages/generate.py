"""Stage `generate`: regenerate one curated shard (or the eval split) with the target.

  draftline generate --shard K   data/curated/train/shard-K.parquet
                                 -> data/generated/train/shard-K.parquet
  draftline generate --eval      data/curated/eval.parquet -> data/generated/eval.parquet

The engine comes from the hardware profile (`draftline.generation.engines.choose`: `local`
transformers, or `sglang` over HTTP, started on demand with `generate.autostart: true`).
A killed run resumes from `.draftline/journal/generate/`; a journal is keyed on what decides the
tokens (the weights' id computed now, the engine and what it serves, template, sampling) and
stays until DVC has recorded the table it wrote (each run removes those of recorded tables).

Work-ahead (`hardware.work_ahead_shards`, on in the GPU profiles): a train shard stage with turns
left streams its shard together with the next N shards in the order of dvc.yaml's generate
stages (`runtime.pipeline_shape`) that still need generating, into their own journals, so no
shard end leaves the engine idle; the following stages then find their journals complete and
only write their tables. How generation is scheduled is a hardware setting, never a stage param:
the outputs are the same bytes either way (`hardware.generation_schedule: rounds` runs the old
schedule, for comparisons).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from draftline.core import target
from draftline.core.loss_mask import generation_prompt_opens_think, special_ids
from draftline.generation.engines.base import EngineUnavailable
from draftline.generation.engines.choose import make_engine, sampling_from
from draftline.generation.guard import Guard, GuardAbort
from draftline.generation.schedule import stream_shards
from draftline.generation.shards import ShardFailed, run_shard, shard_paths
from draftline.generation.table_record import (
    Identity,
    ShardPaths,
    needs_generating,
    release_recorded,
)
from draftline.quality.checks import thinking_enabled
from draftline.runtime import disk_space, hardware, params, pipeline_shape, run_log

CURATE_SUMMARY = "summary.json"  # curate's, beside its tables (stages/curate.py CURATE_SUMMARY)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--shard", type=int, help="train shard index (data.shard_ids)")
    which.add_argument("--eval", action="store_true", help="the held-out eval split")
    parser.add_argument("--params", default="params.yaml", help="params file (params.yaml)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_curated(paths: ShardPaths, p: dict[str, Any]) -> None:
    """Stop when curate failed: it writes its tables before judging the reject rate, so a hand
    run of this stage would otherwise turn its empty shards into empty tables and exit 0."""
    summary = paths.curated.parent / CURATE_SUMMARY
    if paths.name != "eval":
        summary = paths.curated.parent.parent / CURATE_SUMMARY
    if not summary.is_file():
        return  # a curated folder from elsewhere: its shards speak for themselves
    result = json.loads(summary.read_text(encoding="utf-8"))
    max_rate = float((p.get("data") or {}).get("max_reject_rate", 1.0))
    rate = float(result.get("reject_rate") or 0.0)
    if rate > max_rate:
        raise SystemExit(
            f"generate {paths.name}: curate failed ({rate:.1%} of rows rejected, over "
            f"data.max_reject_rate={max_rate:.1%}); fix the inputs and rerun `dvc repro curate` "
            f"first (reasons: {summary.parent}/rejected.parquet)"
        )
    if not int(result.get("train_rows") or 0) + int(result.get("eval_rows") or 0):
        raise SystemExit(
            f"generate {paths.name}: curate kept no rows ({summary}); fix data.sources and "
            "rerun `dvc repro curate` first"
        )


# Bytes a generated token takes on disk: its id and text in the table, and again in the journal.
GENERATED_BYTES_PER_TOKEN = 16


def check_space(paths: ShardPaths, p: dict[str, Any], work_ahead: int) -> None:
    """The shard's table and journal (and those of the shards worked ahead on) must fit the
    disk, at the completion length and turns data.estimate expects."""
    if not paths.curated.is_file():
        return  # the stage's own check names what is missing
    import pyarrow.parquet as pq

    estimate = (p.get("data") or {}).get("estimate") or {}
    tokens = float(estimate.get("completion_tokens") or p["generate"]["max_new_tokens"])
    turns = float(estimate.get("turns") or 1)
    rows = pq.ParquetFile(paths.curated).metadata.num_rows * (1 + work_ahead)
    disk_space.require_free(
        paths.output.parent,
        rows * turns * tokens * GENERATED_BYTES_PER_TOKEN,
        f"generate {paths.name} ({rows:,} conversations x {turns:g} turns x {tokens:,.0f} tokens)",
        "free space or put data/generated and .draftline/ on a bigger disk (links), and rerun",
    )


def weights_key(model: dict) -> str:
    """The target's weights as the journal is keyed on; stops when params.yaml names other
    weights than the folder holds, and keys an unidentifiable target so nothing resumes."""
    weights = target.weights_id(model)
    recorded = model.get("target_id")
    if weights and recorded and target.is_local(str(model["path"])) and weights != recorded:
        raise SystemExit(
            f"generate: model.path {model['path']} holds other weights ({weights}) than "
            f"params.yaml's model.target_id ({recorded}): run `draftline compose` (with the "
            "overrides params.yaml names) so DVC reruns what the new weights change"
        )
    if weights is None:
        print(
            f"generate: model.path {model['path']} is a hub id at no fixed commit and not in the "
            "local Hugging Face cache, so its weights cannot be identified offline: this run "
            "resumes no journal (and a later run will not resume this one). Pin model.revision "
            "to a commit to make a killed run resumable."
        )
        return f"unidentified:{uuid.uuid4().hex}"
    return weights


def engine_key(identity: str, profile: dict) -> str:
    """The engine with what it computes in: a server's identity names its served settings;
    the local engine's device and precision change its tokens too."""
    if profile.get("engine", "local") == "local":
        return f"{identity}:{profile.get('device')}/{profile.get('precision')}"
    return identity


def dvc_cache_holds(root: Path) -> Callable[[str], bool]:
    """Whether the DVC cache of the project at `root` (wherever its `cache.dir` puts it) holds
    an object; DVC is opened at the first question, which most generate starts never ask."""
    opened: list[Any] = []

    def holds(md5: str) -> bool:
        if not opened:
            from dvc.exceptions import DvcException
            from dvc.repo import Repo

            try:
                with Repo(str(root)) as repo:
                    opened.append(repo.cache.local)
            except DvcException:  # not a DVC project: nothing is cached
                opened.append(None)
        return opened[0] is not None and opened[0].exists(md5)

    return holds


def release_journals(p: dict, lock: Path = Path("dvc.lock")) -> None:
    """Remove the journals of shards whose tables DVC has recorded and cached, from the curated
    shards in place: they saved the table through the window between its rename and DVC's
    record, and have nothing left."""
    try:
        stages = (yaml.safe_load(lock.read_text(encoding="utf-8")) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError):
        return
    entries = {
        str(out.get("path")): entry for entry in stages.values() for out in entry.get("outs") or []
    }
    cached = dvc_cache_holds(lock.parent)
    for shard in [None, *((p.get("data") or {}).get("shard_ids") or [])]:
        paths = shard_paths(shard)
        release_recorded(paths, entries.get(paths.output.as_posix()), cached)


def run(args: argparse.Namespace) -> int:
    p = params.load(args.params)
    model, gen = p["model"], p["generate"]
    profile = hardware.resolve_profile(p["hardware"])
    paths = shard_paths(None if args.eval else args.shard)
    if not args.eval and args.shard not in (p.get("data") or {}).get("shard_ids", []):
        raise SystemExit(f"generate: shard {args.shard} is not in data.shard_ids")
    check_curated(paths, p)
    check_space(paths, p, int(profile.get("work_ahead_shards") or 0))
    sampling = sampling_from(gen, model)
    tokenizer = target.load_tokenizer(model)
    special = special_ids(tokenizer, str(model.get("end_of_turn_token", "<|im_end|>")))
    thinking = thinking_enabled(p)
    guard = (
        Guard(
            p["quality"],
            thinking=thinking,
            max_new_tokens=sampling.max_new_tokens,
            think_in_prompt=generation_prompt_opens_think(
                tokenizer, dict(model.get("chat_template_kwargs") or {}), special
            ),
        )
        if gen.get("guard", True) and p.get("quality")
        else None
    )
    weights = weights_key(model)
    release_journals(p)
    engine = make_engine(p, profile, sampling, tokenizer, special.end_of_turn)
    identity = Identity(
        model=target.model_ref(model),
        target_id=weights,
        engine=engine_key(engine.identity(), profile),
        template_kwargs=dict(model.get("chat_template_kwargs") or {}),
        sampling=sampling,
        chat_template_sha256=hashlib.sha256(
            str(tokenizer.chat_template or "").encode("utf-8")
        ).hexdigest(),
        thinking_share=float((p.get("data") or {}).get("thinking_share", 1.0)),
        regenerate_turns=str((p.get("data") or {}).get("regenerate_turns", "all")),
    )
    work_ahead = int(profile.get("work_ahead_shards") or 0)

    def ahead() -> list[ShardPaths]:
        """The following shards to work ahead on (asked only when this shard has turns left)."""
        if args.eval or not work_ahead:
            return []
        ids = pipeline_shape.read().generate_order(p)
        wanted = stream_shards(
            args.shard, ids, work_ahead, lambda s: needs_generating(shard_paths(s), identity)
        )
        return [shard_paths(s) for s in wanted[1:]]

    extra = {
        **hardware.describe(profile),
        **params.identity(p),
        "work_ahead_shards": 0 if args.eval else work_ahead,
    }
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
            ahead=ahead,
            schedule=str(profile.get("generation_schedule") or "continuous"),
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
    for name, done in metrics["work_ahead"].items():
        print(
            f"  worked ahead on {name}: {done['turns']} turns journaled"
            + (f", {done['turns_left']} left" if done["turns_left"] else ", every turn done")
        )
    return 0
