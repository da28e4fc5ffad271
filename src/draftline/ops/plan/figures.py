"""The figures a plan is made of, each with its source: data sizes and lengths (command-line
inputs, a run's measured statistics, or estimates) and each hardware profile's throughputs
(measured on that profile by a run, else by `draftline calibrate`, else its conf/ estimate scaled
to the target). Measured figures count only for the model, data and drafter they were measured
on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from draftline.ops import calibration
from draftline.runtime.params import identity as run_identity
from draftline.runtime.run_log import IDENTITY_KEYS, REPORTS_DIR, generation_rate, number_at

# bf16 features (docs/pipeline.md: feature_dtype bfloat16).
FEATURE_DTYPE_BYTES = 2
DAY_S = 86_400.0
TB = 1e12
STAGES = ("generate", "extract", "train_offline", "train_online")
STAGE_WORDS = {
    "generate": "generation",
    "extract": "feature extraction",
    "train_offline": "offline training",
    "train_online": "online training",
}


@dataclass(frozen=True)
class Figure:
    """A number, where it comes from, and its kind: `input` (a command-line flag), `measured`
    (stage metrics of a run), `estimate` (conf/), `derived` (computed from other figures) or
    `unknown`. `low`/`high` bound an estimate given as a range."""

    value: float | None
    source: str
    kind: str = "estimate"
    low: float | None = None
    high: float | None = None
    # The conf/ estimate a calibrated figure replaces (None: there was none), for the plan's
    # estimate-vs-measured table.
    estimate: float | None = None

    @property
    def measured(self) -> bool:
        return self.kind == "measured"


@dataclass(frozen=True)
class Inputs:
    """The data-size inputs every profile shares."""

    samples: Figure  # conversations generated (train + eval)
    train_samples: Figure  # conversations extracted and trained on
    prompt_tokens: Figure  # mean rendered prompt tokens per sample
    completion_tokens: Figure  # mean completion tokens per sample
    sequence_tokens: Figure  # mean training sequence: prompt + completion, capped at max_length
    bytes_per_token: Figure  # offline feature bytes per token
    max_length: int
    epochs: int
    block_size: int
    features: str  # extract.features: offline or online


def feature_bytes_per_token(model: dict[str, Any]) -> int:
    """K target layers x hidden size x 2 bytes (bf16): 51,200 B for Qwen3.6-27B."""
    return len(model["target_layer_ids"]) * int(model["hidden_size"]) * FEATURE_DTYPE_BYTES


def metrics_path(metrics: dict[str, Any], name: str) -> str:
    """Where a stage's metrics were read from, for the sources printed with each figure."""
    return (metrics.get("paths") or {}).get(name, f"{REPORTS_DIR.as_posix()}/{name}.json")


IDENTITY = IDENTITY_KEYS


def usable(metrics: dict[str, Any] | None, wanted: dict[str, Any]) -> bool:
    """Measured figures apply only to the target, data and drafter they were measured on; a
    file that does not record them (written by an older draftline) is not used."""
    return isinstance(metrics, dict) and all(metrics.get(k) == wanted[k] for k in IDENTITY)


def calibration_of(
    name: str | None, params: dict[str, Any], metrics: dict[str, Any]
) -> dict[str, Any] | None:
    """`draftline calibrate`'s record for profile `name` (any profile's, the newest, for None)
    when it was measured on this target, data and drafter. Only a plan from a run's results
    reads one (an estimate-only plan has no metrics), from logs/calibration/ of the working
    folder; `metrics["calibration"]`, {profile: record}, replaces the files (tests)."""
    if not metrics:
        return None
    records = metrics.get("calibration")
    if records is None and metrics.get("paths"):  # metrics read from a checkout's files
        paths = sorted(calibration.CALIBRATION_DIR.glob("*.json"))
        records = {p.stem: dict(calibration.read(p) or {}, path=p.as_posix()) for p in paths}
    wanted = run_identity(params)
    target_id = (params.get("model") or {}).get("target_id")
    found = [
        r
        for n, r in sorted((records or {}).items())
        if (name is None or n == name)
        and usable(r, wanted)
        and (not target_id or r.get("target_id") in (None, target_id))
    ]
    return max(found, key=lambda r: str(r.get("date"))) if found else None


def calibrated_figure(record: dict[str, Any] | None, key: str) -> tuple[float | None, str]:
    """A figure of a calibration record and its source text ((None, '') when it has none)."""
    if not record:
        return None, ""
    value = (record.get("figures") or {}).get(key)
    where = record.get("path") or f"{calibration.CALIBRATION_DIR.as_posix()}/<profile>.json"
    return value, f"measured by calibrate on {record.get('date')} ({where} figures.{key})"


def resolve_inputs(
    params: dict[str, Any],
    metrics: dict[str, Any],
    samples: int | None = None,
    completion_tokens: float | None = None,
    prompt_tokens: float | None = None,
) -> Inputs:
    """Data size and lengths: explicit arguments, else measured statistics, else estimates.

    `metrics` maps "curate", "validate", "extract", "train" to their parsed JSON and
    "generate" to {file name: parsed JSON}, and "paths" to {name: file read}; any may be missing.
    """
    model, data, drafter = params["model"], params.get("data") or {}, params["drafter"]
    estimate = data.get("estimate") or {}
    data_name = data.get("name", "?")
    wanted = run_identity(params)
    curate = metrics.get("curate") if usable(metrics.get("curate"), wanted) else None
    validate = metrics.get("validate") if usable(metrics.get("validate"), wanted) else None
    generated = [m for m in (metrics.get("generate") or {}).values() if usable(m, wanted)]
    run_profile = (params.get("hardware") or {}).get("name")
    calibrated = calibration_of(None if run_profile == "auto" else run_profile, params, metrics)
    gen_samples = sum(number_at(m, "samples") or 0 for m in generated)
    gen_tokens = sum(number_at(m, "output_tokens") or 0 for m in generated)
    gen_prompt = sum(number_at(m, "prompt_tokens") or 0 for m in generated)

    # Sample counts.
    kept = number_at(curate, "rows_kept", "kept")
    train = number_at(curate, "train_rows", "train")
    evals = number_at(curate, "eval_rows", "eval")
    if kept is None and train is not None and evals is not None:
        kept = train + evals
    if samples is not None:
        n = Figure(float(samples), "--samples", kind="input")
    elif kept is not None:
        n = Figure(kept, f"{metrics_path(metrics, 'curate')} rows_kept", kind="measured")
    elif estimate.get("samples"):
        n = Figure(float(estimate["samples"]), f"conf/data/{data_name}.yaml estimate.samples")
    else:
        raise SystemExit(
            f"no sample count for data={data_name}: pass --samples N, run the curate stage "
            f"(reports/curate.json), or set estimate.samples in conf/data/{data_name}.yaml"
        )
    eval_fraction = float(data.get("eval_fraction") or 0.0)
    if samples is None and train is not None:
        n_train = Figure(train, f"{metrics_path(metrics, 'curate')} train_rows", kind="measured")
    else:
        n_train = Figure(
            round(n.value * (1 - eval_fraction)),
            f"{n.source} x (1 - data.eval_fraction {eval_fraction:g})",
            kind=n.kind,
        )

    # Mean lengths.
    completion = _length(
        completion_tokens,
        "--completion-tokens",
        [
            (
                number_at(validate, "completion_tokens_mean", "completion_tokens.mean"),
                f"{metrics_path(metrics, 'validate')} completion_tokens_mean",
                "measured",
            ),
            (
                gen_tokens / gen_samples if gen_samples and gen_tokens else None,
                f"output_tokens / samples over {len(generated)} generate run logs",
                "measured",
            ),
            (*calibrated_figure(calibrated, "completion_tokens"), "measured"),
            (
                estimate.get("completion_tokens"),
                f"conf/data/{data_name}.yaml estimate.completion_tokens",
                "estimate",
            ),
        ],
        (
            model.get("max_new_tokens"),
            "upper bound: model.max_new_tokens (no estimate)",
            "estimate",
        ),
    )
    prompt = _length(
        prompt_tokens,
        "--prompt-tokens",
        [
            (
                number_at(validate, "prompt_tokens_mean", "prompt_tokens.mean"),
                f"{metrics_path(metrics, 'validate')} prompt_tokens_mean",
                "measured",
            ),
            (
                number_at(curate, "prompt_tokens.mean", "prompt_tokens_mean"),
                f"{metrics_path(metrics, 'curate')} prompt_tokens.mean",
                "measured",
            ),
            (
                gen_prompt / gen_samples if gen_samples and gen_prompt else None,
                f"prompt_tokens / samples over {len(generated)} generate run logs",
                "measured",
            ),
            (*calibrated_figure(calibrated, "prompt_tokens"), "measured"),
            (
                estimate.get("prompt_tokens"),
                f"conf/data/{data_name}.yaml estimate.prompt_tokens",
                "estimate",
            ),
        ],
        (
            data.get("max_prompt_tokens") or 0,
            "upper bound: data.max_prompt_tokens (no estimate)",
            "estimate",
        ),
    )
    if n.value <= 0 or completion.value <= 0:
        raise SystemExit(
            f"nothing to plan: {n.value:,.0f} samples x {completion.value:,.0f} completion tokens; "
            "pass --samples N and --completion-tokens T (both > 0)"
        )
    max_length = int((params.get("extract") or {}).get("max_length") or drafter["max_length"])
    whole = prompt.value + completion.value
    sequence = Figure(
        min(whole, max_length),
        f"prompt + completion ({whole:,.0f}), capped at extract.max_length {max_length:,}",
        kind="derived",
    )
    extract = metrics.get("extract") if usable(metrics.get("extract"), wanted) else None
    measured_bpt = number_at(extract, "bytes_per_token")
    if measured_bpt and (extract or {}).get("features", "offline") == "offline":
        bpt = Figure(
            measured_bpt, f"{metrics_path(metrics, 'extract')} bytes_per_token", kind="measured"
        )
    else:
        k, h = len(model["target_layer_ids"]), int(model["hidden_size"])
        bpt = Figure(float(feature_bytes_per_token(model)), f"K {k} x H {h:,} x 2 B (bf16)")
    return Inputs(
        samples=n,
        train_samples=n_train,
        prompt_tokens=prompt,
        completion_tokens=completion,
        sequence_tokens=sequence,
        bytes_per_token=bpt,
        max_length=max_length,
        epochs=int(drafter["epochs"]),
        block_size=int(drafter["block_size"]),
        features=str((params.get("extract") or {}).get("features", "offline")),
    )


def _length(
    explicit: float | None,
    flag: str,
    candidates: list[tuple[Any, str, str]],
    fallback: tuple[Any, str, str],
) -> Figure:
    if explicit is not None:
        return Figure(float(explicit), flag, kind="input")
    for value, source, kind in candidates:
        if isinstance(value, (int, float)) and value > 0:
            return Figure(float(value), source, kind=kind)
    return Figure(float(fallback[0] or 0), fallback[1], kind=fallback[2])


def _measured_on(metrics: dict[str, Any], default_profile: str | None) -> str | None:
    return metrics.get("hardware_profile") or default_profile


def profile_throughput(
    name: str,
    profile: dict[str, Any],
    params: dict[str, Any],
    metrics: dict[str, Any],
) -> dict[str, Figure]:
    """generate/extract/train tokens per second on one profile: measured there, else estimated.

    Profile estimates are for `throughput.model` (the reference target); for another target they
    are scaled by parameter count, a rough rule that the source says plainly.
    """
    model = params["model"]
    wanted = run_identity(params)
    run_profile = (params.get("hardware") or {}).get("name")
    run_profile = None if run_profile == "auto" else run_profile
    est = profile.get("throughput") or {}
    ref_name = est.get("model")
    ref_params = est.get("reference_parameters")
    scale, scale_note = 1.0, ""
    if ref_name and ref_name != model.get("name"):
        if ref_params and model.get("num_parameters"):
            scale = float(ref_params) / float(model["num_parameters"])
            scale_note = f", scaled x{scale:.3g} by parameters from {ref_name}"
        else:
            scale = float("nan")
    keys = {
        "generate": ("generate_tok_s", "source"),
        "extract": ("extract_tok_s", "extract_source"),
        "train": ("train_tok_s", "train_source"),
    }
    out: dict[str, Figure] = {}
    for stage, (key, source_key) in keys.items():
        value = est.get(key)
        where = f"conf/hardware/{name}.yaml throughput.{key}"
        why = est.get(source_key) or "no source given"
        if value is None or math.isnan(scale):
            out[stage] = Figure(None, f"{where}: none ({why})", kind="unknown")
            continue
        rng = est.get(f"{key}_range") or [None, None]
        out[stage] = Figure(
            float(value) * scale,
            f"{where}: {why}{scale_note}",
            low=None if rng[0] is None else float(rng[0]) * scale,
            high=None if rng[1] is None else float(rng[1]) * scale,
        )

    # Calibrated on this profile: before a run's own measurements, which replace it below.
    record = calibration_of(name, params, metrics)
    processes = int(profile.get("processes_per_node") or 1)
    for stage in ("generate", "extract", "train", "train_online"):
        value, source = calibrated_figure(record, f"{stage}_tok_s")
        if not value:
            continue
        part = "extract" if stage == "extract" else "train"
        world = int((record or {}).get("figures", {}).get(f"{part}_world_size") or 1)
        if stage != "generate" and processes > world:  # the served engine is the node's
            value *= processes / world
            source += f", x{processes / world:g}: {processes} processes, measured on {world}"
        previous = out.get(stage)
        out[stage] = Figure(
            value, source, kind="measured", estimate=previous.value if previous else None
        )

    generated = {
        f: m
        for f, m in (metrics.get("generate") or {}).items()
        if usable(m, wanted) and _measured_on(m, run_profile) == name
    }
    rate = generation_rate(list(generated.values()))
    if rate:
        files = sorted(generated)
        where = files[0] if len(files) == 1 else f"{len(files)} files: {files[0]} ... {files[-1]}"
        out["generate"] = Figure(rate, f"{where} (on {name})", kind="measured")
    for stage in ("extract", "train"):
        m = metrics.get(stage)
        if not usable(m, wanted) or _measured_on(m, run_profile) != name:
            continue
        tok_s = number_at(m, "tokens_per_s")
        if not tok_s:
            continue
        if stage == "train" and m.get("features") == "online":
            out["train_online"] = Figure(
                tok_s,
                f"{metrics_path(metrics, stage)} tokens_per_s (online, on {name})",
                kind="measured",
            )
        else:
            out[stage] = Figure(
                tok_s, f"{metrics_path(metrics, stage)} tokens_per_s (on {name})", kind="measured"
            )
    return out


def served_precision(model: dict[str, Any]) -> dict[str, str]:
    """The weight precision `draftline serve start` launches the target in: the model's
    `serving.quantization` (one source of truth for the servers and the plan)."""
    quantization = (model.get("serving") or {}).get("quantization")
    if quantization:
        return {"value": str(quantization), "source": "model.serving.quantization"}
    return {"value": "bf16", "source": "model.serving.quantization null: the checkpoint's bf16"}


def figure_precision(profile: dict[str, Any], served: str, kind: str) -> dict[str, Any]:
    """The weight precision a profile's generation figure is for (`throughput.
    generate_precision`), and whether it is the served one; a figure measured on a run of this
    target is taken as the run served it."""
    if kind == "measured":
        return {"value": served, "matches": True, "source": "measured on a run of this target"}
    value = (profile.get("throughput") or {}).get("generate_precision")
    return {
        "value": value,
        "matches": value == served if value else None,
        "source": "throughput.generate_precision" if value else "not stated by the profile",
    }


def precision_text(plan: dict[str, Any], profiles: list[dict[str, Any]]) -> str:
    """The weight precision a plan's generation time assumes (what `serve start` launches) and
    the one each profile's figure is for."""
    served = plan["model"]["served_precision"]
    said = {True: "as served", False: "not as served", None: "unstated"}
    figures = [(p["name"], p.get("generate_precision") or {}) for p in profiles]
    parts = ", ".join(f"{n} {g.get('value') or '?'} ({said[g.get('matches')]})" for n, g in figures)
    return (
        f"generation time assumes {served['value']} weights, as `draftline serve start` "
        f"launches them ({served['source']}); the figures are for: {parts}"
    )
