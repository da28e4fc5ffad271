"""Time, storage and cost of a run on each hardware profile, before spending them.

Pure arithmetic over dicts: composed params, hardware profiles and the stage metrics a run left
behind (read by the caller). Every figure carries its source, so a reader can tell a measured
throughput from an estimate and see which file or profile it came from.

Units: tokens per second, seconds, decimal terabytes (1e12 bytes), US dollars.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from draftline.core.target import model_ref
from draftline.generation import sglang_caps
from draftline.ops.plan import data_yield
from draftline.ops.plan.advice import advise
from draftline.ops.plan.figures import (
    DAY_S,
    IDENTITY,
    TB,
    Figure,
    Inputs,
    calibrated_figure,
    calibration_of,
    figure_precision,
    metrics_path,
    profile_throughput,
    resolve_inputs,
    served_precision,
    usable,
)
from draftline.ops.plan.figures import (
    STAGES as STAGES,  # re-exported: the plan's stages, in the order they run
)
from draftline.runtime.params import identity as run_identity
from draftline.runtime.run_log import number_at

SCHEMA = "draftline.plan/1"
# Online token packs: input_ids int32 + loss_mask uint8 per token (offsets are negligible).
TOKEN_PACK_BYTES_PER_TOKEN = 5
DEFAULT_STORAGE_BUDGET_TB = 20.0
DEFAULT_TIME_LIMIT_DAYS = 7.0
# Slot utilisation of the generation schedule, measured by benchmarks/generation_schedule.py:
# the project's scheduler driving a simulated engine of 2,048 slots over 8 shards of 14,000
# conversations (turns 1-30, mean 3; answers log-normal, mean 2,300 tokens, capped at 8,192;
# prefill 1/6 of a decode token), stages run one after another as `dvc repro` runs them.
# An estimated generate rate is the engine's when full: the plan divides by these.
SCHEDULE_BENCHMARK = (
    "benchmarks/generation_schedule.py, 2,048 slots, 8 x 14,000 conversations; rounds 0.211"
)
SCHEDULE_UTILISATION = {
    "work_ahead": (0.985, "continuous with work-ahead"),
    "alone": (0.476, "continuous, each shard alone"),
}


@dataclass(frozen=True)
class Generation:
    """What generation does per conversation, every profile alike."""

    turns: Figure  # assistant turns the target writes per conversation
    prefill_tokens: Figure  # prompt tokens prefilled per conversation, every turn's prompt
    output_tokens: float  # per conversation: turns x completion tokens


def generation_work(params: dict[str, Any], metrics: dict[str, Any], inputs: Inputs) -> Generation:
    """Turns and prefill per conversation: measured by the generate stages of this target, data
    and drafter, else from the data profile's estimate (a later turn's prompt holds the earlier
    turns' history, so prefill grows with the square of the turns)."""
    data = params.get("data") or {}
    estimate = data.get("estimate") or {}
    where = f"conf/data/{data.get('name', '?')}.yaml estimate"
    wanted = run_identity(params)
    logs = [m for m in (metrics.get("generate") or {}).values() if usable(m, wanted)]

    def measured(key: str) -> float | None:
        values = [(number_at(m, key), number_at(m, "samples")) for m in logs]
        if not values or not all(v is not None and n for v, n in values):
            return None
        return sum(v for v, _ in values) / sum(n for _, n in values)  # type: ignore[misc]

    last_only = str(data.get("regenerate_turns", "all")) == "last"
    run_profile = (params.get("hardware") or {}).get("name")
    record = calibration_of(None if run_profile == "auto" else run_profile, params, metrics)
    calibrated_turns, turns_source = calibrated_figure(record, "turns")
    if last_only:
        turns = Figure(1.0, "data.regenerate_turns: last (the final turn only)", kind="derived")
    elif (value := measured("turns")) is not None:
        where_measured = f"turns / samples over {len(logs)} generate run logs"
        turns = Figure(value, where_measured, kind="measured")
    elif calibrated_turns:
        turns = Figure(float(calibrated_turns), turns_source, kind="measured")
    elif estimate.get("turns"):
        turns = Figure(float(estimate["turns"]), f"{where}.turns")
    else:
        turns = Figure(1.0, f"one turn per conversation (no {where}.turns)")
    t, first = turns.value or 1.0, inputs.prompt_tokens.value or 0.0
    history = float(estimate.get("history_tokens") or 0.0)
    turn_prompt, turn_prompt_source = calibrated_figure(record, "turn_prompt_tokens")
    if (value := measured("turn_prompt_tokens")) is not None and not last_only:
        prefill = Figure(
            value,
            f"every turn's prompt / samples over {len(logs)} generate run logs",
            "measured",
        )
    elif turn_prompt and calibrated_turns and not last_only:
        prefill = Figure(
            t * float(turn_prompt), f"turns x mean turn prompt, {turn_prompt_source}", "measured"
        )
    elif last_only or t <= 1:
        prefill = Figure(first, "one prompt per conversation", kind="derived")
    else:
        # Turn k's prompt: the first one plus k earlier turns' history. Turns drawn geometric
        # with mean t (as the benchmark draws them): the mean of T(T-1)/2 is t(t-1).
        prefill = Figure(
            t * first + history * t * (t - 1),
            f"turns x prompt + {where}.history_tokens ({history:,.0f}) x turns(turns-1): each "
            "later turn's prompt holds the earlier turns",
            kind="derived",
        )
    return Generation(turns, prefill, t * (inputs.completion_tokens.value or 0.0))


def schedule_utilisation(profile: dict[str, Any]) -> Figure:
    """The measured utilisation of the schedule this profile generates with."""
    key = "work_ahead" if int(profile.get("work_ahead_shards") or 0) > 0 else "alone"
    value, what = SCHEDULE_UTILISATION[key]
    return Figure(value, f"{what}: {SCHEDULE_BENCHMARK}", kind="measured")


def _stage(tokens: float, rate: Figure, limit_days: float) -> dict[str, Any]:
    if not rate.value:
        return {
            "seconds": None,
            "days": None,
            "range_days": None,
            "over_limit": False,
            "source": rate.source,
        }
    seconds = tokens / rate.value
    range_days = None
    if rate.low and rate.high:
        range_days = [tokens / rate.high / DAY_S, tokens / rate.low / DAY_S]
    return {
        "seconds": seconds,
        "days": seconds / DAY_S,
        "range_days": range_days,
        "over_limit": seconds / DAY_S > limit_days,
        "source": rate.source,
    }


def _generate_stage(
    inputs: Inputs,
    gen: Generation,
    rates: dict[str, Figure],
    utilisation: Figure,
    limit_days: float,
) -> dict[str, Any]:
    """Generation, per turn: every turn's answer at the generate rate and every turn's prompt at
    the extract rate (prefill is a target forward), over the schedule's utilisation. A measured
    generate rate (output tokens over a run's wall time) has prefill and idle slots in it."""
    rate, prefill_rate = rates["generate"], rates["extract"]
    n = inputs.samples.value or 0.0
    output, prompts = n * gen.output_tokens, n * (gen.prefill_tokens.value or 0.0)
    figures: dict[str, Any] = {"output_tokens": output, "prefill_tokens": prompts}
    if not rate.value:
        return {**_stage(output, rate, limit_days), **figures, "utilisation": None}
    if rate.measured:
        info = _stage(output, rate, limit_days)
        info["source"] += " (measured: prefill and the schedule's idle slots included)"
        return {**info, **figures, "utilisation": None}
    prefill_s = prompts / prefill_rate.value if prefill_rate.value else 0.0
    u = utilisation.value or 1.0

    def seconds(tok_s: float) -> float:
        return (output / tok_s + prefill_s) / u

    total = seconds(rate.value)
    range_days = None
    if rate.low and rate.high:
        range_days = [seconds(rate.high) / DAY_S, seconds(rate.low) / DAY_S]
    return {
        "seconds": total,
        "days": total / DAY_S,
        "range_days": range_days,
        "over_limit": total / DAY_S > limit_days,
        "source": (
            f"{gen.turns.value:g} turns x {inputs.completion_tokens.value:,.0f} tokens at "
            f"{rate.value:,.0f} tok/s + {gen.prefill_tokens.value:,.0f} prompt tokens at the "
            f"extract rate (prefill), per conversation, / utilisation {u:.3f}"
            + ("" if prefill_rate.value else " (no extract rate: prefill left out)")
        ),
        **figures,
        "decode_s": output / rate.value,
        "prefill_s": prefill_s,
        "utilisation": _figure(utilisation),
    }


def _figure(f: Figure) -> dict[str, Any]:
    return {k: v for k, v in asdict(f).items() if v is not None or k == "value"}


def plan_profile(
    name: str,
    profile: dict[str, Any],
    params: dict[str, Any],
    inputs: Inputs,
    metrics: dict[str, Any],
    time_limit_days: float,
    gen: Generation | None = None,
    feature_tokens: float | None = None,
) -> dict[str, Any]:
    """Stage times, totals and costs of one profile. `feature_tokens`: the tokens of the run
    through the target's forward (`data_yield.run_tokens`), extracted once, trained each epoch;
    by default one sequence per conversation."""
    rates = profile_throughput(name, profile, params, metrics)
    gen = gen or generation_work(params, metrics, inputs)
    if feature_tokens is None:
        feature_tokens = inputs.train_samples.value * inputs.sequence_tokens.value
    train_tokens = inputs.epochs * feature_tokens
    online_rate = rates.get("train_online")
    if online_rate is None:
        # Online training runs the frozen target forward for every token it trains on.
        tr, ex = rates["train"], rates["extract"]
        value = 1 / (1 / tr.value + 1 / ex.value) if tr.value and ex.value else None
        online_rate = Figure(
            value,
            f"1 / (1/train + 1/extract): training plus the target forward "
            f"(train {tr.kind}, extract {ex.kind})",
            kind="derived" if value else "unknown",
        )
    stages = {
        "generate": _generate_stage(
            inputs, gen, rates, schedule_utilisation(profile), time_limit_days
        ),
        "extract": _stage(feature_tokens, rates["extract"], time_limit_days),
        "train_offline": _stage(train_tokens, rates["train"], time_limit_days),
        "train_online": _stage(train_tokens, online_rate, time_limit_days),
    }
    price = float(profile.get("price_per_hour") or 0.0)
    totals = {}
    for mode, parts in (
        ("offline", ("generate", "extract", "train_offline")),
        ("online", ("generate", "train_online")),
    ):
        secs = [stages[p]["seconds"] for p in parts]
        known = all(s is not None for s in secs)
        seconds = sum(secs) if known else None
        totals[mode] = {
            "seconds": seconds,
            "days": None if seconds is None else seconds / DAY_S,
            "cost_usd": None if seconds is None else seconds / 3600 * price,
            "missing": [p for p, s in zip(parts, secs, strict=True) if s is None],
        }
    served = served_precision(params["model"])["value"]
    return {
        "name": name,
        "price_per_hour": price,
        "generate_precision": figure_precision(profile, served, rates["generate"].kind),
        "throughput": {
            "generate_tok_s": _figure(rates["generate"]),
            "extract_tok_s": _figure(rates["extract"]),
            "train_tok_s": _figure(rates["train"]),
            "train_online_tok_s": _figure(online_rate),
        },
        "stages": stages,
        "total": totals,
        # What SGLang runs at once there (None off SGLang GPU profiles): the throughput figures
        # are for a full engine, and this is how full it gets.
        "running": sglang_caps.node_running(params["model"], profile),
    }


def build_plan(
    params: dict[str, Any],
    profiles: dict[str, dict[str, Any]],
    metrics: dict[str, Any] | None = None,
    *,
    samples: int | None = None,
    completion_tokens: float | None = None,
    prompt_tokens: float | None = None,
    storage_budget_tb: float = DEFAULT_STORAGE_BUDGET_TB,
    time_limit_days: float = DEFAULT_TIME_LIMIT_DAYS,
    memory: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The whole plan as a JSON-able dict (schema `draftline.plan/1`, see docs/pipeline.md).

    `memory` maps profile names to their memory per GPU (`drafter.memory_plan.profile_memory`).
    """
    metrics = metrics or {}
    memory = memory or {}
    inputs = resolve_inputs(params, metrics, samples, completion_tokens, prompt_tokens)
    gen = generation_work(params, metrics, inputs)
    layout = data_yield.configured_layout(params)
    yields = data_yield.layout_yields(params, metrics, inputs, gen.turns, gen.prefill_tokens)
    seq_tokens = data_yield.run_tokens(inputs, yields[layout])
    feature_bytes = seq_tokens * inputs.bytes_per_token.value
    storage = {
        "rows": layout,
        "sequences_per_sample": yields[layout].sequences.value,
        "feature_tokens": seq_tokens,
        "offline_features_bytes": feature_bytes,
        "offline_features_tb": feature_bytes / TB,
        "online_token_packs_bytes": seq_tokens * TOKEN_PACK_BYTES_PER_TOKEN,
        "budget_tb": storage_budget_tb,
        # Judged only when the plan trains offline: online features write token packs only.
        "over_budget": inputs.features == "offline" and feature_bytes / TB > storage_budget_tb,
    }
    planned = [
        plan_profile(name, prof, params, inputs, metrics, time_limit_days, gen, seq_tokens)
        for name, prof in profiles.items()
    ]
    # The same run under each layout: only extraction and training change.
    totals = {layout: {p["name"]: p["total"] for p in planned}}
    for name, y in yields.items():
        if name != layout:
            tokens = data_yield.run_tokens(inputs, y)
            totals[name] = {
                prof: plan_profile(
                    prof, spec, params, inputs, metrics, time_limit_days, gen, tokens
                )["total"]
                for prof, spec in profiles.items()
            }
    for p in planned:
        if p["name"] in memory:
            p["memory"] = memory[p["name"]]
    flags, recommendations = advise(storage, planned, inputs, time_limit_days, params)
    model = params["model"]
    return {
        "schema": SCHEMA,
        "model": {
            "name": model.get("name"),
            "ref": model_ref(model),
            "served_precision": served_precision(model),
            "num_parameters": model.get("num_parameters"),
            "target_layers": len(model["target_layer_ids"]),
            "hidden_size": model["hidden_size"],
        },
        "drafter": {"name": params["drafter"].get("name"), "epochs": inputs.epochs},
        "data": (params.get("data") or {}).get("name"),
        "features": inputs.features,
        "inputs": {
            "samples": _figure(inputs.samples),
            "train_samples": _figure(inputs.train_samples),
            "prompt_tokens": _figure(inputs.prompt_tokens),
            "completion_tokens": _figure(inputs.completion_tokens),
            "sequence_tokens": _figure(inputs.sequence_tokens),
            "bytes_per_token": _figure(inputs.bytes_per_token),
            "max_length": inputs.max_length,
        },
        "generation": {
            "turns": _figure(gen.turns),
            "prefill_tokens": _figure(gen.prefill_tokens),
            "output_tokens": gen.output_tokens,
        },
        "yield": data_yield.section(layout, yields, inputs, totals),
        "limits": {"storage_budget_tb": storage_budget_tb, "time_limit_days": time_limit_days},
        "storage": storage,
        "profiles": {p["name"]: p for p in planned},
        "flags": flags,
        "recommendations": recommendations,
        "notes": _other_run_notes(metrics, run_identity(params)),
    }


OLDER = (
    "it does not record the model, data and drafter it was measured on (an older draftline "
    "wrote it); rerun its stage"
)
OLDER_ALL = (
    "they do not record the model, data and drafter they were measured on (an older draftline "
    "wrote them); rerun their stages"
)


def _other_run_notes(metrics: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """One note per run that is not the planned one, naming its files (a run leaves a dozen)."""
    named = {
        metrics_path(metrics, k): metrics.get(k) for k in ("curate", "validate", "extract", "train")
    }
    named.update(metrics.get("generate") or {})
    planned = " ".join(f"{k}={wanted[k]}" for k in IDENTITY)
    runs: dict[str, list[str]] = {}
    for name, m in named.items():
        if not isinstance(m, dict) or usable(m, wanted):
            continue
        if not any(m.get(k) for k in IDENTITY):
            why = OLDER
        else:
            recorded = " ".join(f"{k}={m.get(k) or '?'}" for k in IDENTITY)
            why = f"measured on {recorded}, not {planned}"
        runs.setdefault(why, []).append(name)
    notes = []
    for why, files in runs.items():
        if len(files) == 1:
            notes.append(f"ignored {files[0]}: {why}")
        else:
            why = OLDER_ALL if why == OLDER else why
            notes.append(f"ignored {len(files)} files ({', '.join(files)}): {why}")
    return notes
