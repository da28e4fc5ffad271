"""What each row layout (`extract.rows`, `draftline.core.training_rows`) gives training, per
conversation and per run: sequences, tokens through the target's forward, supervised tokens,
generated tokens and the yield (supervised / generated), and what a supervised token costs.

Per conversation, with t turns of c completion tokens and L = extract.max_length (a sequence
longer than L is cut from its prompt's start, its completion kept up to L - 1 tokens):

- `turn`: t sequences, each a mean turn prompt (the generation's prefill / t) and its
  completion: t x min(prompt + c, L) forward tokens, t x min(c, L - 1) supervised. Every turn's
  prompt goes through the target's forward again.
- `conversation`: one sequence, the last prompt (the first one plus t - 1 turns of history, as
  `build.generation_work` counts them) and its completion: min(prompt + c, L) forward tokens,
  min(c, L - 1) supervised plus the earlier answers the history shows, where the window keeps
  them.

A measured yield (the extract stage's report for this target, data and drafter) replaces the
estimated one for the layout it was measured with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftline.core.training_rows import ROW_LAYOUTS, check_layout
from draftline.ops.plan.figures import Figure, Inputs, metrics_path, usable
from draftline.runtime.params import identity as run_identity
from draftline.runtime.run_log import number_at


@dataclass(frozen=True)
class LayoutYield:
    """One layout's figures per conversation."""

    layout: str
    sequences: Figure  # training sequences
    forward_tokens: Figure  # tokens through the target's forward (extract, online training)
    supervised_tokens: Figure  # tokens the drafter is trained to predict
    generated_tokens: Figure  # tokens the target wrote, every turn, reasoning included
    share: Figure  # the yield: supervised / generated


def configured_layout(params: dict[str, Any]) -> str:
    return check_layout(str((params.get("extract") or {}).get("rows", "turn")))


def layout_yields(
    params: dict[str, Any],
    metrics: dict[str, Any],
    inputs: Inputs,
    turns: Figure,
    prefill_tokens: Figure,
) -> dict[str, LayoutYield]:
    """Both layouts' figures per conversation, from the generation's turns and prefill."""
    data = params.get("data") or {}
    history = float((data.get("estimate") or {}).get("history_tokens") or 0.0)
    t = turns.value or 1.0
    first, c = inputs.prompt_tokens.value or 0.0, inputs.completion_tokens.value or 0.0
    cap = inputs.max_length
    kept_c = min(c, cap - 1)
    generated = Figure(t * c, f"{t:.2f} turns x {c:,.0f} completion tokens", kind="derived")

    turn_prompt = (prefill_tokens.value or 0.0) / t
    turn = LayoutYield(
        "turn",
        Figure(t, f"one per turn ({turns.source})", kind=turns.kind),
        Figure(
            t * min(turn_prompt + c, cap),
            f"{t:.2f} turns x min(turn prompt {turn_prompt:,.0f} (prefill / turns) + "
            f"completion {c:,.0f}, max_length {cap:,}): each turn's prompt through the "
            "target's forward again",
            kind="derived",
        ),
        Figure(
            t * kept_c,
            f"{t:.2f} turns x min(completion {c:,.0f}, max_length - 1): every generated token once",
            kind="derived",
        ),
        generated,
        _share(t * kept_c, generated.value or 0.0),
    )

    earlier = history * max(t - 1, 0.0)
    last_prompt = first + earlier
    window = min(last_prompt + c, cap)
    # The history sits at the prompt's end: the window keeps it before the prompt's start.
    shown = min(earlier, window - kept_c)
    conversation = LayoutYield(
        "conversation",
        Figure(1.0, "one per conversation: the last turn", kind="derived"),
        Figure(
            window,
            f"min(last prompt {last_prompt:,.0f} (prompt + history_tokens {history:,.0f} x "
            f"(turns - 1)) + completion {c:,.0f}, max_length {cap:,})",
            kind="derived",
        ),
        Figure(
            kept_c + shown,
            f"min(completion {c:,.0f}, max_length - 1) + {shown:,.0f} tokens of earlier "
            f"answers in the window: an upper bound (history_tokens counts the user messages "
            "too); their reasoning is never trained on",
            kind="derived",
        ),
        generated,
        _share(kept_c + shown, generated.value or 0.0),
    )
    out = {"turn": turn, "conversation": conversation}
    measured = _measured_yield(params, metrics)
    if measured is not None:
        layout, share = measured
        g = generated.value or 0.0
        out[layout] = LayoutYield(
            layout,
            out[layout].sequences,
            out[layout].forward_tokens,
            Figure(
                (share.value or 0.0) * g,
                f"measured yield {share.value:.3f} x {g:,.0f} generated tokens",
                kind="derived",
            ),
            generated,
            share,
        )
    return out


def _share(supervised: float, generated: float) -> Figure:
    value = supervised / generated if generated else 1.0
    return Figure(value, "supervised / generated tokens", kind="derived")


def _measured_yield(params: dict[str, Any], metrics: dict[str, Any]) -> tuple[str, Figure] | None:
    """The yield the extract stage measured for this run, with the layout it extracted."""
    extract = metrics.get("extract")
    if not usable(extract, run_identity(params)) or extract.get("rows") not in ROW_LAYOUTS:
        return None
    value = number_at(extract, "yield")
    if value is None:
        return None
    where = f"{metrics_path(metrics, 'extract')} yield (rows: {extract['rows']})"
    return str(extract["rows"]), Figure(value, where, kind="measured")


def run_tokens(inputs: Inputs, layout: LayoutYield) -> float:
    """Tokens through the target's forward over the run: every conversation extracted."""
    return inputs.train_samples.value * (layout.forward_tokens.value or 0.0)


def _figure(f: Figure) -> dict[str, Any]:
    return {k: v for k, v in vars(f).items() if v is not None or k == "value"}


def section(
    configured: str,
    yields: dict[str, LayoutYield],
    inputs: Inputs,
    totals: dict[str, dict[str, dict[str, Any]]],
) -> dict[str, Any]:
    """The plan's `yield` section: per layout, the figures per conversation, the run's totals
    and, per profile and feature mode, the cost and the $ per million supervised tokens.

    `totals` maps each layout to {profile name: that profile's `total` under the layout}."""
    n = inputs.train_samples.value
    layouts = {}
    for name in ROW_LAYOUTS:
        y = yields[name]
        supervised = n * (y.supervised_tokens.value or 0.0)
        extract = run_tokens(inputs, y)
        costs = {
            profile: {
                mode: {
                    "cost_usd": t["cost_usd"],
                    "usd_per_m_supervised": None
                    if t["cost_usd"] is None or not supervised
                    else t["cost_usd"] / (supervised / 1e6),
                }
                for mode, t in total.items()
            }
            for profile, total in totals[name].items()
        }
        layouts[name] = {
            "per_conversation": {
                "sequences": _figure(y.sequences),
                "forward_tokens": _figure(y.forward_tokens),
                "supervised_tokens": _figure(y.supervised_tokens),
                "generated_tokens": _figure(y.generated_tokens),
                "yield": _figure(y.share),
            },
            "run": {
                "conversations": n,
                "sequences": n * (y.sequences.value or 0.0),
                "extract_tokens": extract,
                "train_tokens": inputs.epochs * extract,
                "supervised_tokens": supervised,
                "generated_tokens": n * (y.generated_tokens.value or 0.0),
            },
            "profiles": costs,
        }
    return {"configured": configured, "layouts": layouts}


def _tokens(n: float) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n / 1e6:,.2f} M"


def _usd(value: float | None) -> str:
    return "—" if value is None else f"${value:,.2f}"


def yield_table(plan: dict[str, Any], profiles: list[dict[str, Any]]) -> Any:
    """One row per layout (* the configured one): yield, supervised tokens of the run, tokens
    extracted and trained on, and $ per million supervised tokens on each profile, in the
    plan's feature mode."""
    from rich.table import Table

    section, mode = plan["yield"], plan["features"]
    table = Table(
        title=f"Data yield (* extract.rows; $/M supervised tokens, {mode} features)",
        title_justify="left",
    )
    table.add_column("rows", overflow="fold")
    for label in ("yield", "supervised", "extract", "train"):
        table.add_column(label, justify="right", no_wrap=True)
    for p in profiles:
        table.add_column(f"{p['name']}\n$/M", justify="right", no_wrap=True)
    for name, layout in section["layouts"].items():
        run = layout["run"]
        marked = f"{name} *" if name == section["configured"] else name
        table.add_row(
            marked,
            f"{layout['per_conversation']['yield']['value']:.2f}",
            _tokens(run["supervised_tokens"]),
            _tokens(run["extract_tokens"]),
            _tokens(run["train_tokens"]),
            *(_usd(layout["profiles"][p["name"]][mode]["usd_per_m_supervised"]) for p in profiles),
        )
    return table


def yield_sources(plan: dict[str, Any]) -> list[str]:
    """Where each layout's supervised tokens and yield come from, a line each."""
    lines = []
    for name, layout in plan["yield"]["layouts"].items():
        per = layout["per_conversation"]
        share = per["yield"]
        measured = f" (measured: {share['source']})" if share["kind"] == "measured" else ""
        lines.append(
            f"{name}: {per['supervised_tokens']['value']:,.0f} of "
            f"{per['generated_tokens']['value']:,.0f} tokens per conversation supervised"
            f"{measured}: {per['supervised_tokens']['source']}; "
            f"{per['forward_tokens']['value']:,.0f} forward: {per['forward_tokens']['source']}"
        )
    return lines
