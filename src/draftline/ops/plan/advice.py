"""What a plan flags and recommends: storage over budget, stages over the time limit, stages
out of memory, each with the concrete change that fixes it (an override, a subset, a length).

Only the feature mode the plan trains with is judged for storage, and no recommendation is a
value the params already hold: a plan never tells the user to set what is set.
"""

from __future__ import annotations

import math
from typing import Any

from draftline.ops.plan.figures import DAY_S, STAGE_WORDS, STAGES, TB, Inputs


def advise(
    storage: dict[str, Any],
    planned: list[dict[str, Any]],
    inputs: Inputs,
    limit: float,
    params: dict[str, Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The plan's flags and its recommendations, less those the params already hold."""
    flags = _flags(storage, planned, inputs, limit) + _memory_flags(planned)
    recs = _recommendations(storage, planned, inputs, limit) + _memory_recommendations(planned)
    return flags, [r for r in recs if not is_set(params, r.get("override"))]


def is_set(params: dict[str, Any], override: str | None) -> bool:
    """Whether `key=value` is what the params already hold (compared as YAML would write it)."""
    if not override or "=" not in override:
        return False
    key, _, wanted = override.partition("=")
    node: Any = params
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    shown = str(node).lower() if isinstance(node, bool) else str(node)
    return shown == wanted


def _flags(
    storage: dict[str, Any], planned: list[dict[str, Any]], inputs: Inputs, limit: float
) -> list[dict[str, Any]]:
    flags = []
    if storage["over_budget"]:
        flags.append(
            {
                "kind": "storage",
                "profile": None,
                "stage": "extract",
                "message": (
                    f"offline features need {storage['offline_features_tb']:,.1f} TB "
                    f"({inputs.train_samples.value:,.0f} samples x "
                    f"{_per_sample(storage, inputs):,.0f} tokens ({storage['rows']} rows) x "
                    f"{inputs.bytes_per_token.value:,.0f} B), over the "
                    f"{storage['budget_tb']:g} TB budget"
                ),
            }
        )
    for p in planned:
        for stage in STAGES:
            info = p["stages"][stage]
            if info["over_limit"]:
                flags.append(
                    {
                        "kind": "time",
                        "profile": p["name"],
                        "stage": stage,
                        "message": (
                            f"{p['name']}: {STAGE_WORDS[stage]} takes {info['days']:,.1f} days, "
                            f"over the {limit:g}-day limit"
                        ),
                    }
                )
    return flags


def _recommendations(
    storage: dict[str, Any], planned: list[dict[str, Any]], inputs: Inputs, limit: float
) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    budget_bytes = storage["budget_tb"] * TB
    bpt = inputs.bytes_per_token.value
    per_sample = _per_sample(storage, inputs)
    sequences = storage.get("sequences_per_sample") or 1.0
    if storage["over_budget"]:
        times = [
            f"{p['name']} {p['stages']['train_online']['days']:,.1f} d online vs "
            f"{p['stages']['extract']['days'] + p['stages']['train_offline']['days']:,.1f} d "
            "extract + offline"
            for p in planned
            if all(p["stages"][k]["days"] is not None for k in STAGES[1:])
        ]
        recs.append(
            {
                "kind": "online_features",
                "override": "extract.features=online",
                "storage_bytes": storage["online_token_packs_bytes"],
                "message": (
                    "use online features (extract.features=online): token packs only, "
                    f"{storage['online_token_packs_bytes'] / 1e9:,.1f} GB instead of "
                    f"{storage['offline_features_tb']:,.1f} TB; the target runs during training"
                    + (f" ({'; '.join(times)})" if times else "")
                ),
            }
        )
        fit_samples = math.floor(budget_bytes / (per_sample * bpt))
        share = fit_samples / inputs.train_samples.value
        recs.append(
            {
                "kind": "subset",
                "samples": fit_samples,
                "share": share,
                "message": (
                    f"train offline on a subset: {fit_samples:,} samples ({share:.1%} of "
                    f"{inputs.train_samples.value:,.0f}) fit {storage['budget_tb']:g} TB at "
                    f"{per_sample:,.0f} tokens each"
                ),
            }
        )
        # Every sequence of a sample (one per turn with `turn` rows) cut to the same length.
        fit_length = math.floor(budget_bytes / (inputs.train_samples.value * sequences * bpt))
        mean_sequence = per_sample / sequences
        kept = fit_length / mean_sequence
        # The prompt comes first: what is left of the budgeted length is supervised completion.
        supervised = max(0, fit_length - round(inputs.prompt_tokens.value))
        usable = supervised >= 2 * inputs.block_size  # shorter sequences are dropped in training
        recs.append(
            {
                "kind": "max_length",
                "override": f"extract.max_length={fit_length}",
                "max_length": fit_length,
                "kept_share": kept,
                "completion_tokens_kept": supervised,
                "usable": usable,
                "message": (
                    f"shorter max length: extract.max_length={fit_length:,} fits "
                    f"{storage['budget_tb']:g} TB with all samples, but keeps only {kept:.0%} "
                    f"of a mean {mean_sequence:,.0f}-token sequence "
                    f"(~{supervised:,} completion tokens after the prompt)"
                    + (
                        ""
                        if usable
                        else f": too short, training drops sequences under "
                        f"2 x block_size = {2 * inputs.block_size} supervised tokens"
                    )
                ),
            }
        )
    by_name = {p["name"]: p for p in planned}
    for p in planned:
        gen = p["stages"]["generate"]
        if gen["over_limit"]:
            faster = [
                f"{q['name']} ({q['stages']['generate']['days']:,.1f} d)"
                for q in planned
                if q["stages"]["generate"]["days"] is not None
                and q["stages"]["generate"]["days"] <= limit
            ]
            rate = by_name[p["name"]]["throughput"]["generate_tok_s"]["value"]
            fit = math.floor(limit * DAY_S / (gen["seconds"] / inputs.samples.value))
            recs.append(
                {
                    "kind": "generate_time",
                    "profile": p["name"],
                    "samples": fit,
                    "message": (
                        f"{p['name']}: generation fits {limit:g} days for {fit:,} samples "
                        f"({fit / inputs.samples.value:.0%}) at {rate:,.0f} tok/s"
                        + (f"; or generate on {', '.join(faster)}" if faster else "")
                    ),
                }
            )
        for stage in ("train_offline", "train_online"):
            info = p["stages"][stage]
            if info["over_limit"]:
                per_epoch = info["days"] / inputs.epochs
                epochs = math.floor(limit / per_epoch)
                recs.append(
                    {
                        "kind": "train_time",
                        "profile": p["name"],
                        "stage": stage,
                        "epochs": epochs,
                        "message": (
                            f"{p['name']}: {STAGE_WORDS[stage]} is {per_epoch:,.1f} days "
                            "per epoch; "
                            f"{epochs} of {inputs.epochs} epochs fit {limit:g} days "
                            "(drafter.epochs), or train on a subset"
                        ),
                    }
                )
    return recs


def _per_sample(storage: dict[str, Any], inputs: Inputs) -> float:
    """Tokens through the target's forward per conversation, under the planned row layout."""
    return storage["feature_tokens"] / (inputs.train_samples.value or 1.0)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _memory_flags(planned: list[dict[str, Any]]) -> list[dict[str, Any]]:
    flags = []
    for p in planned:
        mem = p.get("memory") or {}
        for stage, info in (mem.get("stages") or {}).items():
            if not info["fits"]:
                flags.append(
                    {
                        "kind": "memory",
                        "profile": p["name"],
                        "stage": stage,
                        "message": (
                            f"{p['name']}: {STAGE_WORDS[stage]} needs {_gib(info['peak_bytes'])} "
                            f"per GPU, over the {_gib(mem['usable_bytes'])} usable of "
                            f"{_gib(mem['device_bytes'])} (out of memory)"
                        ),
                    }
                )
    return flags


def _memory_recommendations(planned: list[dict[str, Any]]) -> list[dict[str, Any]]:
    recs = []
    for p in planned:
        for stage, info in ((p.get("memory") or {}).get("stages") or {}).items():
            if info["fits"]:
                continue
            fix = info.get("fix")
            if fix:
                message = (
                    f"{p['name']}: {STAGE_WORDS[stage]} fits with {fix['override']} "
                    f"({_gib(fix['peak_bytes'])} per GPU)"
                    + (f": {fix['why']}" if fix.get("why") else "")
                )
            else:
                message = (
                    f"{p['name']}: no smaller batch makes {STAGE_WORDS[stage]} fit: train on "
                    "bigger GPUs, or shorten drafter.max_length / drafter.max_anchors "
                    "(which changes what is trained)"
                )
            recs.append(
                {
                    "kind": "memory",
                    "profile": p["name"],
                    "stage": stage,
                    "override": fix["override"] if fix else None,
                    "message": message,
                }
            )
    return recs
