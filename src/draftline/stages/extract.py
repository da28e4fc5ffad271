"""Stage `extract`: generated shards -> token packs, plus target features when offline.

`draftline extract --shard K` extracts shard K alone into `data/extracted/shard-K/`, once
its own validation passed (`data/validated/shards/shard-K.json`): the chain of training
stages reads it as soon as the shard is generated. Without --shard, every shard of
`data.shard_ids` into one folder (the whole run's verdict must have passed). With a
hardware profile of several processes per node it reruns itself as that many processes
(`distributed.run_in_local_processes`, rendezvous on loopback); under a torchrun the user
started (several nodes) it takes its rank from the environment.
"""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path
from typing import Any

from draftline.data.curation import shard_file_name
from draftline.runtime import distributed, hardware, params, run_log

# What the packs are (the same on any hardware, in any run); timings and world size go to the
# run log.
RESULT_KEYS = (
    "features", "rows", "num_sequences", "num_tokens", "num_supervised_tokens", "num_packs",
    "generated_tokens", "yield", "dropped", "truncated_sequences", "prompt_tokens_cut",
    "completion_tokens_cut", "bytes_per_token",
)  # fmt: skip
# What `dvc exp show` compares when one folder holds every shard (the rest is in the report);
# a shard's extraction (`--shard`) writes only its report, reports/extract/shard-K.json.
COMPARE_KEYS = ("num_supervised_tokens", "num_tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="composed parameters")
    parser.add_argument("--shards", default="data/generated/train", help="generated shards")
    parser.add_argument(
        "--verdict", default="data/validated/verdict.json", help="validate's verdict (must pass)"
    )
    parser.add_argument("--out", default="data/extracted", help="output folder")
    parser.add_argument(
        "--shard", type=int, default=None, help="extract only this shard, into OUT/shard-K/"
    )
    parser.add_argument(
        "--metrics", default="metrics/extract.json", help="metrics file (metrics/extract.json)"
    )
    run_log.add_arguments(parser, "extract", throughput=True)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def require_passed_verdict(path: Path) -> dict[str, Any]:
    """The validation verdict; exits with the fix when it is missing or not passed."""
    if not path.is_file():
        raise SystemExit(
            f"extract: {path} not found: the generated data has not passed validation; "
            "run `dvc repro validate` and fix what it reports"
        )
    verdict = json.loads(path.read_text(encoding="utf-8"))
    if verdict.get("passed") is not True:
        raise SystemExit(f"extract: {path} does not say passed: extraction refused ({verdict})")
    return verdict


def settings_from_params(p: dict[str, Any], profile: dict[str, Any]):
    from draftline.core.target import model_ref, weights_id
    from draftline.drafter.extraction import ExtractSettings

    offline = p["extract"]["features"] == "offline"
    return ExtractSettings(
        features=str(p["extract"]["features"]),
        max_length=int(p["extract"]["max_length"]),
        target_layer_ids=[int(i) for i in p["model"]["target_layer_ids"]],
        model_ref=model_ref(p["model"]),
        hidden_size=int(p["model"]["hidden_size"]),
        pack_tokens=int(p["extract"]["pack_tokens"]),
        tokens_per_batch=hardware.Execution.of(profile).extract_tokens_per_batch,
        rows=str(p["extract"].get("rows", "turn")),
        # Only offline features come from the weights (hashed now, not as params.yaml says);
        # weights that cannot be identified key packs no later run resumes.
        weights_id=(weights_id(p["model"]) or f"unidentified:{uuid.uuid4().hex}")
        if offline
        else "",
    )


def run(args: argparse.Namespace) -> int:
    p = params.load(args.params)
    profile = hardware.resolve_profile(p["hardware"])
    execution = hardware.Execution.of(profile)
    shard_ids = [int(k) for k in p["data"]["shard_ids"]] if args.shard is None else [args.shard]
    out, verdict = Path(args.out), Path(args.verdict)
    if args.shard is not None:
        from draftline.drafter.packs import shard_folder

        if args.shard not in p["data"]["shard_ids"]:
            raise SystemExit(f"extract --shard {args.shard}: not one of data.shard_ids")
        out = shard_folder(out, args.shard)
        args.metrics = None  # a shard's figures are a report; the runs compare on train's
        verdict = verdict.parent / "shards" / f"shard-{args.shard}.json"
    require_passed_verdict(verdict)
    if p["extract"]["features"] == "offline":
        relaunched = distributed.run_in_local_processes(
            execution.processes_per_node,
            ["draftline", "extract", *_forwarded(args)],
        )
        if relaunched is not None:
            return relaunched
    # Online extraction only copies token ids: one process does it at disk speed.

    from draftline.core.target import load_model
    from draftline.drafter.extraction import extract

    execution.set_threads()
    distributed.init()
    try:
        device = distributed.device(execution.device)
        precision = execution.precision
        result = extract(
            [Path(args.shards) / shard_file_name(k) for k in shard_ids],
            out,
            settings_from_params(p, profile),
            model_loader=lambda: load_model(p["model"], device=str(device), dtype=precision),
            device=device,
            progress=not args.no_progress and distributed.rank() == 0,
        )
        if distributed.rank() == 0:
            record = {**metrics(result, profile), **params.identity(p)}
            run_log.write(
                args, "extract", record, RESULT_KEYS, COMPARE_KEYS, record["tokens_per_s"]
            )
            idx = result.index
            print(
                f"extract: {idx['num_sequences']} sequences, {idx['num_tokens']} tokens in "
                f"{len(idx['shards'])} packs ({result.packs_skipped} already complete), "
                f"{result.bytes_written / 2**20:.1f} MiB; supervised "
                f"{idx['num_supervised_tokens']} of the {record['generated_tokens']} tokens "
                f"generated (yield {record['yield']:.3f}, {record['rows']} rows); cut to "
                f"{p['extract']['max_length']} tokens: {result.truncated} sequences, "
                f"{record['prompt_tokens_cut']} prompt and {record['completion_tokens_cut']} "
                "completion tokens"
            )
    finally:
        distributed.close()
    return 0


def metrics(result: Any, profile: dict[str, Any]) -> dict[str, Any]:
    idx = result.index
    tokens = result.tokens_this_run
    generated = int(result.yields.get("generated_tokens", 0))
    return {
        "features": idx["features"],
        "rows": idx.get("rows", "conversation"),
        "num_sequences": idx["num_sequences"],
        "num_tokens": idx["num_tokens"],
        "num_supervised_tokens": idx["num_supervised_tokens"],
        "num_packs": len(idx["shards"]),
        # Every turn the target wrote, reasoning included, against what the packs supervise.
        "generated_tokens": generated,
        "yield": round(idx["num_supervised_tokens"] / generated, 6) if generated else 1.0,
        "prompt_tokens_cut": int(result.yields.get("prompt_tokens_cut", 0)),
        "completion_tokens_cut": int(result.yields.get("completion_tokens_cut", 0)),
        "packs_skipped": result.packs_skipped,
        "dropped": result.dropped,
        "truncated_sequences": result.truncated,
        "bytes_written": result.bytes_written,
        "bytes_per_token": result.bytes_written / max(1, idx["num_tokens"]),
        "tokens_this_run": tokens,
        "seconds": round(result.seconds, 3),
        # None when every pack was reused: nothing was measured, and 0 tok/s would read as
        # "infinitely slow" to `draftline plan`.
        "tokens_per_s": tokens / result.seconds if tokens and result.seconds > 0 else None,
        "padding_share": 1 - tokens / result.padded_tokens_this_run
        if result.padded_tokens_this_run
        else 0.0,
        "world_size": distributed.world_size(),
        **hardware.describe(profile),
    }


def _forwarded(args: argparse.Namespace) -> list[str]:
    out = [
        f"--params={args.params}", f"--shards={args.shards}", f"--verdict={args.verdict}",
        f"--out={args.out}", f"--metrics={args.metrics}", f"--report={args.report}",
        f"--run-log={args.run_log}",
        f"--throughput={args.throughput}",
    ]  # fmt: skip
    if args.shard is not None:
        out.append(f"--shard={args.shard}")
    return [*out, "--no-progress"] if args.no_progress else out
