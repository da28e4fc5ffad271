"""Stage `evaluate`: offline acceptance length of the exported drafter, greedy (tau) and under
speculative sampling at the serving temperature (tau_sampled, `evaluate.temperature`, top_p,
top_k; formula in `draftline.drafter.evaluation`).

On the held-out prompts (`data/generated/eval.parquet`) the target writes its greedy
continuation, one target forward gives the features, and the chained walk scores the trained
drafter (`models/drafter/`) and, as the baseline, the same drafter untrained (same config,
random init seeded by `drafter.seed`). Metrics for `dvc exp show`; plots of the per-position
acceptance and of the commit-length histogram.

The held-out prompts are every generated turn of each conversation, later turns (long contexts)
as well as first ones, and reports/evaluate.json has tau per context-length bucket
(`tau_by_context_length`): acceptance can hold at short contexts and collapse at long ones, which
one tau over mostly short prompts hides.
"""

from __future__ import annotations

import argparse
import csv
import io
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftline.data.eval_sets import BENCHMARKS_DIR
from draftline.runtime import hardware, params, run_log
from draftline.runtime.atomic import write_text

if TYPE_CHECKING:
    from draftline.drafter.evaluation import TauReport

# The figures that compare drafters; per-position acceptance and the commit histogram are plots.
RESULT_KEYS = (
    "tau", "tau_untrained", "tau_ratio", "tau_sampled", "tau_sampled_untrained", "tau_thinking",
    "tau_no_thinking", "tau_source", "benchmarks", "tau_by_context_length", "tau_per_cycle",
    "num_prompts", "continuation_tokens_mean",
)  # fmt: skip
# What `dvc exp show` compares, in its column order (its first metric columns): tau greedy and
# sampled, then per thinking mode, input file and benchmark where the held-out data has several.
# The untrained drafter's tau, a fixed reference, is in reports/evaluate.json with the rest.
COMPARE_KEYS = (
    "tau", "tau_sampled", "tau_thinking", "tau_no_thinking", "tau_source", "benchmarks",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="composed parameters")
    parser.add_argument("--eval", default="data/generated/eval.parquet", help="held-out split")
    parser.add_argument(
        "--curated-eval", default="data/curated/eval.parquet", help="its sources, for tau_source"
    )
    parser.add_argument(
        "--benchmarks", default=str(BENCHMARKS_DIR), help="folder of benchmark prompt files"
    )
    parser.add_argument("--drafter", default="models/drafter", help="exported drafter")
    parser.add_argument(
        "--metrics", default="metrics/evaluate.json", help="metrics file (metrics/evaluate.json)"
    )
    run_log.add_arguments(parser, "evaluate")
    parser.add_argument("--plots", default="plots/evaluate", help="folder of plot CSVs")


def held_out_rows(
    path: Path, max_prompts: int, curated: Path | None = None
) -> list[dict[str, Any]]:
    """At most `max_prompts` eval prompts from the conversations in id order, each with `id`,
    `conversation` (its row's id), `prompt_ids`, `thinking` (the sample's thinking mode; None in
    tables written before modes were recorded) and `source` (its input file, from the `curated`
    eval table; None without it). One prompt per generated turn (`turn_prompt_ids`; id
    `<conversation id>#<k>` for turn k from 0, as generate keys turns), failed turns left out; a
    row without per-turn prompts (tables written before them) gives its `prompt_ids`, the prompt
    of its last turn."""
    import pyarrow.parquet as pq

    if not path.is_file():
        raise SystemExit(f"evaluate: {path} not found: run `dvc repro generate_eval`")
    names = set(pq.read_schema(path).names)
    optional = [c for c in ("thinking", "turn_prompt_ids", "turn_finish_reasons") if c in names]
    table = pq.read_table(path, columns=["id", "prompt_ids", *optional]).sort_by("id")
    # Whole conversations in id order, each with all its turns, until the cap: a conversation's
    # turns run from its shortest context to its longest, so the set keeps later turns (long
    # contexts) as the data has them, where first turns of more conversations would fill the cap
    # with short prompts. Rows become Python lists only as far as the cap needs.
    kept: list[dict[str, Any]] = []
    for i in range(table.num_rows):
        if len(kept) >= max_prompts:
            break
        kept.extend(turn_prompts(table.slice(i, 1).to_pylist()[0]))
    kept = kept[:max_prompts]
    if not kept:
        raise SystemExit(f"evaluate: {path} has no prompts")
    sources: dict[str, str] = {}
    if curated is not None and curated.is_file():
        curated_table = pq.read_table(curated, columns=["id", "source"]).to_pydict()
        sources = dict(zip(curated_table["id"], curated_table["source"], strict=True))
    return [{**r, "source": sources.get(r["conversation"])} for r in kept]


def turn_prompts(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The eval prompts of one conversation row, in turn order (see `held_out_rows`)."""
    common = {"conversation": row["id"], "thinking": row.get("thinking")}
    turns = row.get("turn_prompt_ids")
    if turns is None:
        prompt = row["prompt_ids"]
        return [{**common, "id": row["id"], "prompt_ids": prompt}] if prompt else []
    reasons = row.get("turn_finish_reasons") or []
    return [
        {**common, "id": f"{row['id']}#{k}", "prompt_ids": ids}
        for k, ids in enumerate(turns)
        if ids and (reasons[k] if k < len(reasons) else None) != "error"
    ]


def held_out_prompts(path: Path, max_prompts: int) -> list[list[int]]:
    """Prompt ids of evaluate's held-out prompts (`held_out_rows`)."""
    return [list(r["prompt_ids"]) for r in held_out_rows(path, max_prompts)]


def run(args: argparse.Namespace) -> int:
    import torch

    from draftline.core.target import load_model, load_tokenizer, prompt_ids, special_token_id
    from draftline.data.eval_sets import benchmark_files, benchmark_messages, source_names
    from draftline.drafter.build import Hyperparameters, build_drafter
    from draftline.drafter.dflash import TargetHead
    from draftline.drafter.evaluation import Sampling
    from draftline.drafter.export import load_drafter

    p = params.load(args.params)
    profile = hardware.resolve_profile(p["hardware"])
    execution = hardware.Execution.of(profile)
    execution.set_threads()
    device = torch.device("cuda" if execution.on_gpu else "cpu")
    model_cfg, ev = p["model"], p["evaluate"]
    if not (Path(args.drafter) / "config.json").is_file():
        raise SystemExit(f"evaluate: no drafter in {args.drafter}: run `dvc repro train`")

    max_prompts = int(ev["max_prompts"])
    held_out = held_out_rows(Path(args.eval), max_prompts, Path(args.curated_eval))
    benchmarks = benchmark_files(Path(args.benchmarks))
    target = load_model(model_cfg, device=str(device), dtype=execution.precision)
    tokenizer = load_tokenizer(model_cfg)
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
    scorer = Scorer(
        target,
        eot=special_token_id(tokenizer, str(model_cfg["end_of_turn_token"])),
        max_new_tokens=int(ev["max_new_tokens"]),
        layer_ids=[int(i) for i in model_cfg["target_layer_ids"]],
        execution=execution,
        device=device,
        sampling=sampling,
    )
    held = scorer.score([list(r["prompt_ids"]) for r in held_out], trained, untrained)
    reports = {name: report.summary() for name, report in held.reports.items()}
    result = metrics(reports, held.continuations, profile)
    # A thinking mix (data.thinking_share): tau of each mode, as each is served.
    modes = [r["thinking"] for r in held_out]
    if True in modes and False in modes:
        for mode, key in ((True, "tau_thinking"), (False, "tau_no_thinking")):
            picked = [i for i, m in enumerate(modes) if m is mode]
            result[key] = held.reports["trained"].subset(picked).tau
    # Short, medium and long prompts: tau of each.
    lengths = [len(r["prompt_ids"]) for r in held_out]
    result["tau_by_context_length"] = tau_by_context_length(held.reports["trained"], lengths)
    # Several input files: tau of each.
    sources = sorted({r["source"] for r in held_out if r["source"] is not None})
    if len(sources) > 1:
        names = dict(zip(sources, source_names(sources), strict=True))
        result["tau_source"] = {
            names[src]: held.reports["trained"]
            .subset([i for i, r in enumerate(held_out) if r["source"] == src])
            .tau
            for src in sources
        }
    # Benchmark prompt files (data/benchmarks/): greedy and sampled tau of each.
    kwargs = dict(model_cfg.get("chat_template_kwargs") or {})
    if benchmarks:
        result["benchmarks"] = {}
    for name, path in benchmarks.items():
        prompts = [
            prompt_ids(tokenizer, messages, kwargs)
            for messages in benchmark_messages(path, max_prompts)
        ]
        report = scorer.score(prompts, trained).reports["trained"]
        result["benchmarks"][name] = {
            "tau": report.tau,
            "tau_sampled": report.tau_sampled,
            "num_prompts": len(prompts),
        }
    run_log.write(args, "evaluate", result, RESULT_KEYS, COMPARE_KEYS)
    write_plots(Path(args.plots), reports)
    print(
        f"evaluate: tau {result['tau']:.3f} (untrained {result['tau_untrained']:.3f}, "
        f"x{result['tau_ratio']:.2f}), at temperature {sampling.temperature:g} "
        f"{result['tau_sampled']:.3f} (untrained {result['tau_sampled_untrained']:.3f}) on "
        f"{len(held_out)} prompts, block size {trained.config.block_size}"
        + "".join(f"; {name} {b['tau']:.3f}" for name, b in result.get("benchmarks", {}).items())
    )
    for line in bucket_lines(result["tau_by_context_length"]):
        print(f"evaluate: {line}")
    return 0


# Bucket names by how many buckets the prompts allow (`length_edges`).
BUCKET_NAMES = {1: ("all",), 2: ("short", "long"), 3: ("short", "medium", "long")}


def length_edges(lengths: Sequence[int]) -> list[int]:
    """Edges between context-length buckets, in prompt tokens: the terciles of the lengths
    (short < q1 <= medium < q2 <= long), by nearest rank, so the same prompts give the same
    edges. Under 6 prompts the median alone (2 buckets), under 4 none (1 bucket): a bucket's tau
    should not be one prompt's. An edge that would leave a bucket empty (tied lengths, fewer than
    3 distinct ones) is dropped, so there are fewer buckets."""
    ordered = sorted(lengths)
    n = len(ordered)
    buckets = max(1, min(3, n // 2))
    ranks = ((n * i + buckets // 2) // buckets for i in range(1, buckets))
    return sorted({ordered[r] for r in ranks} - {ordered[0]}) if n else []


def tau_by_context_length(report: TauReport, lengths: Sequence[int]) -> dict[str, Any]:
    """Tau of each context-length bucket (`length_edges`) of the prompts `report` scored, whose
    prompt lengths are `lengths`: its prompt count and lengths, tau, and tau_sampled where the
    report has it."""
    edges = length_edges(lengths)
    buckets: dict[str, Any] = {}
    for b, name in enumerate(BUCKET_NAMES[len(edges) + 1]):
        picked = [i for i, n in enumerate(lengths) if bisect_right(edges, n) == b]
        part = report.subset(picked)
        buckets[name] = {
            "num_prompts": len(picked),
            "min_prompt_tokens": min(lengths[i] for i in picked),
            "max_prompt_tokens": max(lengths[i] for i in picked),
            "tau": part.tau,
            **({"tau_sampled": part.tau_sampled} if part.tau_sampled is not None else {}),
        }
    return {"edges": edges, "buckets": buckets}


def bucket_lines(by_length: dict[str, Any]) -> list[str]:
    """One line per context-length bucket, for the stage's output."""
    lines = []
    for name, b in by_length["buckets"].items():
        sampled = f", sampled {b['tau_sampled']:.3f}" if "tau_sampled" in b else ""
        lines.append(
            f"tau at {name} context ({b['min_prompt_tokens']}-{b['max_prompt_tokens']} prompt "
            f"tokens, {b['num_prompts']} prompts) {b['tau']:.3f}{sampled}"
        )
    return lines


@dataclass
class Scored:
    reports: dict[str, Any]  # drafter name ("trained", "untrained") -> TauReport
    continuations: list[list[int]]


@dataclass
class Scorer:
    """Scores drafters on prompts: the target's greedy continuation, one target forward for
    the features (bf16, as training sees them) and the logits, then the chained walk."""

    target: Any
    eot: int
    max_new_tokens: int
    layer_ids: list[int]
    execution: Any
    device: Any
    sampling: Any

    def score(self, prompts: list[list[int]], trained: Any, untrained: Any = None) -> Scored:
        from draftline.core.continuation import greedy_continuations
        from draftline.drafter.evaluation import evaluate_drafter, target_logits
        from draftline.drafter.extraction import pack_features

        batch = self.execution.local_batch_size
        continuations = greedy_continuations(
            self.target, prompts, self.max_new_tokens, self.eot, batch
        )
        sequences = [(pr + c, len(pr)) for pr, c in zip(prompts, continuations, strict=True)]
        feats, _ = pack_features(
            self.target,
            [s for s, _ in sequences],
            self.layer_ids,
            self.execution.extract_tokens_per_batch,
            self.device,
        )
        features = list(feats.split([len(s) for s, _ in sequences]))
        logits = [target_logits(self.target, tokens, start) for tokens, start in sequences]
        drafters = {
            "trained": trained,
            **({"untrained": untrained} if untrained is not None else {}),
        }
        return Scored(
            {
                name: evaluate_drafter(drafter, sequences, features, logits, self.sampling)
                for name, drafter in drafters.items()
            },
            continuations,
        )


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
