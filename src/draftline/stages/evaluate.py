"""Stage `evaluate`: offline acceptance length of the exported drafter, greedy (tau) and under
speculative sampling at the serving temperature (tau_sampled, `evaluate.temperature`, top_p,
top_k; formula in `draftline.drafter.evaluation`).

On the held-out prompts (`data/generated/eval.parquet`) the target writes its greedy
continuation, one target forward gives the features, and the chained walk scores the trained
drafter (`models/drafter/`) and, as the baseline, the same drafter untrained (same config,
random init seeded by `drafter.seed`). Metrics for `dvc exp show`; plots of the per-position
acceptance and of the commit-length histogram.
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path
from typing import Any

from draftline.runtime import hardware, params, run_log
from draftline.runtime.atomic import write_text

# The figures that compare drafters; per-position acceptance and the commit histogram are plots.
RESULT_KEYS = (
    "tau", "tau_untrained", "tau_ratio", "tau_sampled", "tau_sampled_untrained", "tau_thinking",
    "tau_no_thinking", "tau_per_cycle", "num_prompts", "continuation_tokens_mean",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="composed parameters")
    parser.add_argument("--eval", default="data/generated/eval.parquet", help="held-out split")
    parser.add_argument("--drafter", default="models/drafter", help="exported drafter")
    parser.add_argument("--metrics", default="metrics/evaluate.json")
    run_log.add_arguments(parser, "evaluate")
    parser.add_argument("--plots", default="plots/evaluate", help="folder of plot CSVs")


def held_out_rows(path: Path, max_prompts: int) -> list[dict[str, Any]]:
    """The first `max_prompts` rows by id with a prompt: `prompt_ids` and `thinking` (the
    sample's thinking mode; None in tables written before modes were recorded)."""
    import pyarrow.parquet as pq

    if not path.is_file():
        raise SystemExit(f"evaluate: {path} not found: run `dvc repro generate_eval`")
    names = set(pq.read_schema(path).names)
    columns = ["id", "prompt_ids", *(["thinking"] if "thinking" in names else [])]
    rows = pq.read_table(path, columns=columns).to_pylist()
    rows.sort(key=lambda r: r["id"])
    kept = [{"thinking": None, **r} for r in rows if r["prompt_ids"]][:max_prompts]
    if not kept:
        raise SystemExit(f"evaluate: {path} has no prompts")
    return kept


def held_out_prompts(path: Path, max_prompts: int) -> list[list[int]]:
    """Prompt ids of the first `max_prompts` rows by id (the table is sorted by id)."""
    return [list(r["prompt_ids"]) for r in held_out_rows(path, max_prompts)]


def run(args: argparse.Namespace) -> int:
    import torch

    from draftline.core.continuation import greedy_continuations
    from draftline.core.target import load_model, load_tokenizer, special_token_id
    from draftline.drafter.build import Hyperparameters, build_drafter
    from draftline.drafter.evaluation import Sampling, evaluate_drafter, target_logits
    from draftline.drafter.export import load_drafter
    from draftline.drafter.extraction import pack_features

    p = params.load(args.params)
    profile = hardware.resolve_profile(p["hardware"])
    execution = hardware.Execution.of(profile)
    execution.set_threads()
    device = torch.device("cuda" if execution.on_gpu else "cpu")
    model_cfg, ev = p["model"], p["evaluate"]
    if not (Path(args.drafter) / "config.json").is_file():
        raise SystemExit(f"evaluate: no drafter in {args.drafter}: run `dvc repro train`")

    held_out = held_out_rows(Path(args.eval), int(ev["max_prompts"]))
    prompts = [list(r["prompt_ids"]) for r in held_out]
    target = load_model(model_cfg, device=str(device), dtype=execution.precision)
    eot = special_token_id(load_tokenizer(model_cfg), str(model_cfg["end_of_turn_token"]))
    batch = execution.local_batch_size
    continuations = greedy_continuations(target, prompts, int(ev["max_new_tokens"]), eot, batch)
    sequences = [(pr + c, len(pr)) for pr, c in zip(prompts, continuations, strict=True)]
    layer_ids = [int(i) for i in model_cfg["target_layer_ids"]]
    tokens_per_batch = execution.extract_tokens_per_batch
    feats, _ = pack_features(target, [s for s, _ in sequences], layer_ids, tokens_per_batch, device)
    features = list(feats.split([len(s) for s, _ in sequences]))  # bf16, as training sees them

    from draftline.drafter.dflash import TargetHead

    head = TargetHead.from_model(target)
    trained = load_drafter(args.drafter, head).to(device)
    untrained = build_drafter(model_cfg, Hyperparameters.from_params(p["drafter"]), head)
    untrained = untrained.to(device).eval()
    if untrained.config.block_size != trained.config.block_size:
        raise SystemExit(
            f"evaluate: {args.drafter} has block size {trained.config.block_size}, params say "
            f"{untrained.config.block_size}: retrain (dvc repro train)"
        )
    sampling = Sampling(
        float(ev.get("temperature") or 0.0),
        float(ev.get("top_p") or 1.0),
        int(ev.get("top_k") or -1),
    )
    logits = [target_logits(target, tokens, start) for tokens, start in sequences]
    reports = {
        name: evaluate_drafter(drafter, sequences, features, logits, sampling).summary()
        for name, drafter in (("trained", trained), ("untrained", untrained))
    }
    result = metrics(reports, continuations, profile)
    # A thinking mix (data.thinking_share): greedy tau of each mode, as each is served.
    modes = [r["thinking"] for r in held_out]
    if True in modes and False in modes:
        for mode, key in ((True, "tau_thinking"), (False, "tau_no_thinking")):
            picked = [i for i, m in enumerate(modes) if m is mode]
            subset = evaluate_drafter(
                trained, [sequences[i] for i in picked], [features[i] for i in picked]
            )
            result[key] = subset.tau
    run_log.write(args, "evaluate", result, RESULT_KEYS)
    write_plots(Path(args.plots), reports)
    print(
        f"evaluate: tau {result['tau']:.3f} (untrained {result['tau_untrained']:.3f}, "
        f"x{result['tau_ratio']:.2f}), at temperature {sampling.temperature:g} "
        f"{result['tau_sampled']:.3f} (untrained {result['tau_sampled_untrained']:.3f}) on "
        f"{len(prompts)} prompts, block size {trained.config.block_size}"
    )
    return 0


def metrics(
    reports: dict[str, dict[str, Any]], continuations: list[list[int]], profile: dict[str, Any]
) -> dict[str, Any]:
    tau, base = reports["trained"]["tau"], reports["untrained"]["tau"]
    return {
        "tau": tau,
        "tau_untrained": base,
        "tau_ratio": tau / base if base else 0.0,
        "tau_sampled": reports["trained"]["tau_sampled"],
        "tau_sampled_untrained": reports["untrained"]["tau_sampled"],
        "num_prompts": len(continuations),
        "continuation_tokens_mean": sum(map(len, continuations)) / max(1, len(continuations)),
        "tau_per_cycle": reports["trained"]["tau_per_cycle"],
        **reports,
        **hardware.describe(profile),
    }


def write_plots(folder: Path, reports: dict[str, dict[str, Any]]) -> None:
    """acceptance.csv (position, trained, untrained) and tau_histogram.csv (committed, ...)."""
    names = list(reports)
    for file, key, x in (
        ("acceptance.csv", "acceptance_rate", "position"),
        ("tau_histogram.csv", "commit_histogram", "committed"),
    ):
        buf = io.StringIO()
        out = csv.writer(buf, lineterminator="\n")
        out.writerow([x, *names])
        for k in reports[names[0]][key]:
            out.writerow([k, *(reports[n][key][k] for n in names)])
        write_text(folder / file, buf.getvalue())
