"""The values a composed configuration may hold: a bad one fails in one line naming the fix.

`config_schema` knows which keys exist; this module knows what each user-settable value may be
(type, range, choices) and how values relate (`data.shard_ids` follows `data.num_shards`, kv
heads divide heads). `problems` runs at `draftline compose` and again when a stage reads
params.yaml, since `dvc exp run -S key=value` composes without us. Keys missing from a
composition are not checked (tests and partial files hold only what they need).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hydra.errors import ConfigCompositionException


class BadValueError(ConfigCompositionException):
    """A value no stage can run with (one line naming the value and the fix)."""


@dataclass(frozen=True)
class Rule:
    """What one value may be: `kind` "int", "number", "bool", "str" or "list", with optional
    bounds (`low_open`: strictly above `low`, `high_open`: strictly below `high`), choices,
    whether null is allowed, and why a bound is where it is (`reason`, said with the rule)."""

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    null: bool = False
    reason: str = ""

    def problem(self, value: Any) -> str | None:
        """Why `value` does not fit (a phrase after "must be"), or None."""
        if value is None:
            return None if self.null else f"set ({self.describe()})"
        if not self._has_kind(value):
            return self.describe()
        if self.choices and value not in self.choices:
            return self.describe()
        if self.kind in ("int", "number"):
            too_low = self.low is not None and (
                value <= self.low if self.low_open else value < self.low
            )
            too_high = self.high is not None and (
                value >= self.high if self.high_open else value > self.high
            )
            if too_low or too_high:
                return self.describe()
        return None

    def _has_kind(self, value: Any) -> bool:
        if isinstance(value, bool):
            return self.kind == "bool"
        return {
            "int": isinstance(value, int),
            "number": isinstance(value, (int, float)),
            "bool": False,
            "str": isinstance(value, str),
            "list": isinstance(value, list),
        }[self.kind]

    def describe(self) -> str:
        if self.choices:
            text = "one of " + ", ".join(self.choices)
        else:
            text = {"int": "an integer", "number": "a number", "bool": "true or false"}.get(
                self.kind, f"a {self.kind}"
            )
            closed = not (self.low_open or self.high_open)
            if self.low is not None and self.high is not None and closed:
                text += f" from {_num(self.low)} to {_num(self.high)}"
            elif self.low is not None:
                text += f" {'>' if self.low_open else '>='} {_num(self.low)}"
                if self.high is not None:
                    text += f" and {'<' if self.high_open else '<='} {_num(self.high)}"
        text += " or null" if self.null else ""
        return f"{text} ({self.reason})" if self.reason else text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def count(low: int = 1, null: bool = False) -> Rule:
    return Rule("int", low=low, null=null)


def positive(null: bool = False) -> Rule:
    return Rule("number", low=0, low_open=True, null=null)


def at_least(low: float, null: bool = False) -> Rule:
    return Rule("number", low=low, null=null)


def share(null: bool = False) -> Rule:
    return Rule("number", low=0, high=1, null=null)


def choice(*options: str, null: bool = False) -> Rule:
    return Rule("str", choices=options, null=null)


FLAG = Rule("bool")
SEED = Rule("int", null=True)
TOP_P = Rule("number", low=0, high=1, low_open=True)
# Sampling's top-k: 0 or -1 (the engines' "off") or a positive count.
TOP_K = Rule("int", low=-1)

# Each shard adds four stages to dvc.yaml (generate, validate_shard, extract, train_shard), and
# DVC slows with the stage count: `dvc status` on a repository with no outputs yet took 11 s
# at 1024 shards and 104 s at 4096.
MAX_SHARDS = 1024

RULES: dict[str, Rule] = {
    "data.num_shards": Rule(
        "int",
        low=1,
        high=MAX_SHARDS,
        reason="each shard is four DVC stages, and `dvc status` takes minutes past a few "
        "thousand stages",
    ),
    "data.shard_ids": Rule("list"),
    "data.shard_chain": Rule("list"),
    "data.sources": Rule("list"),
    "data.eval_fraction": Rule(
        "number", low=0, high=1, high_open=True, reason="1 leaves no rows to train on"
    ),
    "data.thinking_share": share(),
    "data.regenerate_turns": choice("all", "last"),
    "data.max_prompt_tokens": count(),
    "data.max_reject_rate": share(),
    "data.estimate.samples": count(0),
    "data.estimate.prompt_tokens": at_least(0),
    "data.estimate.completion_tokens": at_least(0),
    "data.estimate.turns": positive(),
    "data.estimate.history_tokens": at_least(0),
    # Before generate.* and evaluate.*, which read several of these: a stage (which sees only
    # resolved values) names the key the user set.
    "model.max_new_tokens": count(),
    "model.features": choice("offline", "online"),
    "model.num_hidden_layers": count(),
    "model.hidden_size": count(),
    "model.vocab_size": count(),
    "model.target_layer_ids": Rule("list"),
    "model.serving.context_length": count(null=True),
    "model.serving.deterministic_inference": FLAG,
    # A served checkpoint other than model.path (`_served_checkpoint` checks the pair).
    "model.serving.checkpoint.path": Rule("str"),
    "model.serving.checkpoint.revision": Rule("str", null=True),
    "model.sampling.temperature": at_least(0),
    "model.sampling.top_p": TOP_P,
    "model.sampling.top_k": TOP_K,
    "generate.max_new_tokens": count(),
    "generate.temperature": at_least(0),
    "generate.top_p": TOP_P,
    "generate.top_k": TOP_K,
    "generate.seed": SEED,
    "generate.max_error_share": share(),
    # null: derived from max_new_tokens and the profile's decode rate (generation.timeouts).
    "generate.request_timeout_s": positive(null=True),
    "generate.max_retries": count(0),
    "generate.backoff_base_s": at_least(0),
    "generate.backoff_max_s": at_least(0),
    "generate.guard": FLAG,
    "generate.endpoints": Rule("list"),
    "generate.autostart": FLAG,
    "generate.serve_timeout_s": positive(),
    "extract.features": choice("offline", "online"),
    "extract.max_length": count(),
    "extract.pack_tokens": count(),
    "extract.rows": choice("turn", "conversation"),
    "evaluate.max_new_tokens": count(),
    "evaluate.max_prompts": count(),
    "evaluate.temperature": at_least(0),
    "evaluate.top_p": TOP_P,
    "evaluate.top_k": TOP_K,
    "drafter.num_hidden_layers": count(),
    "drafter.num_attention_heads": count(null=True),  # null: the target's
    "drafter.num_key_value_heads": count(null=True),  # null: the target's
    "drafter.head_dim": count(null=True),  # null: the target's
    "drafter.intermediate_size": count(null=True),  # null: the target's
    "drafter.sliding_window": count(null=True),
    "drafter.block_size": count(2),
    "drafter.gamma": positive(),
    "drafter.max_anchors": count(),
    "drafter.max_length": count(),
    "drafter.global_batch_size": count(),
    "drafter.lr": positive(),
    "drafter.weight_decay": at_least(0),
    "drafter.warmup_ratio": share(),
    "drafter.epochs": positive(),
    "drafter.grad_clip": positive(),
    "drafter.seed": Rule("int"),
    "hardware.engine": choice("local", "sglang", "vllm", null=True),
    "hardware.device": choice("cpu", "cuda", null=True),
    "hardware.precision": choice("fp32", "bf16", null=True),
    "hardware.processes_per_node": count(),
    # null in conf/hardware/auto.yaml: the detected profile's value.
    "hardware.micro_batch_size": count(null=True),
    "hardware.sharding": choice("ddp", "fsdp"),
    "hardware.activation_checkpointing": Rule("bool", null=True),
    "hardware.local.batch_size": count(),
    "hardware.extract_tokens_per_batch": count(null=True),
    "hardware.num_threads": count(null=True),
    "hardware.work_ahead_shards": count(0, null=True),
    "hardware.gpu.count": count(),
    "hardware.price_per_hour": at_least(0, null=True),
    "hardware.sglang.dp_size": count(),
    "hardware.sglang.tp_size": count(),
    "hardware.sglang.mem_fraction_static": Rule("number", low=0, high=1, low_open=True),
    "hardware.sglang.context_length": count(null=True),
    "hardware.sglang.max_running_requests": count(null=True),
    "hardware.sglang.max_in_flight": count(),
    "hardware.sglang.host_cache_gb_per_engine": positive(null=True),
    "hardware.sglang.host_cache_share_of_ram": Rule("number", low=0, high=1, low_open=True),
    "hardware.sglang.port": Rule("int", low=1, high=65535),
    "hardware.vllm.port": Rule("int", low=1, high=65535),
    "hardware.vllm.max_model_len": count(null=True),  # null: model.serving.context_length
    "hardware.vllm.max_num_seqs": count(),
    "hardware.vllm.tp_size": count(),
    "hardware.vllm.dp_size": count(),
    "hardware.vllm.gpu_memory_utilization": Rule("number", low=0, high=1, low_open=True),
    "hardware.vllm.max_in_flight": count(),
    "hardware.vllm.kv_cache_gib": positive(null=True),  # null: not a CPU build
    "quality.max_error_share": share(),
    "quality.min_supervised_tokens": count(0),
    "quality.min_share_supervised": share(),
    "quality.no_thinking_min_supervised_tokens": count(0, null=True),
    "quality.max_mode_share": share(),
    "quality.min_unique_completion_share": share(),
    "quality.max_truncated_share": share(),
    "quality.min_think_block_share": share(),
    "quality.min_answer_share": share(),
    "quality.min_complete_conversation_share": share(),
    "quality.min_yield": share(),
    "quality.guard.min_samples": count(),
    "quality.guard.window": count(),
}


def _get(data: dict[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def fix(path: str, example: str = "VALUE") -> str:
    return f"set it with `draftline compose {path}={example}` (or `dvc exp run -S {path}=...`)"


# A value conf/ copies from another key, e.g. `temperature: ${model.sampling.temperature}`.
PLAIN_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")


def set_as(raw: dict[str, Any]) -> dict[str, str]:
    """For each checked key that `raw` (a composition before interpolation) copies from another,
    the key a user sets to change it: generate.temperature -> model.sampling.temperature."""
    out = {}
    for path in RULES:
        source = path
        for _ in range(8):  # follows a chain of copies; a cycle cannot compose anyway
            present, value = _get(raw, source)
            match = PLAIN_INTERPOLATION.fullmatch(value) if isinstance(value, str) else None
            if not present or match is None:
                break
            source = match.group(1)
        if source != path:
            out[path] = source
    return out


def problems(data: dict[str, Any], sources: Mapping[str, str] | None = None) -> list[str]:
    """One line per bad value of `data` (a composition or params.yaml), naming value and fix:
    the key in `sources` (`set_as`) a value was copied from, when it has one."""
    sources = sources or {}
    out = []
    for path, rule in RULES.items():
        present, value = _get(data, path)
        if not present or (why := rule.problem(value)) is None:
            continue
        key = sources.get(path, path)
        if key != path and RULES.get(key) == rule and _get(data, key)[0]:
            continue  # the key it was copied from has the same rule, which names it
        shown = "null" if value is None else repr(value)
        copied = f" (copied to {path})" if key != path else ""
        out.append(f"{key}={shown} must be {why}{copied}; {fix(key)}")
    return out + _sources(data) + _relations(data) + _served_checkpoint(data)


def _sources(data: dict[str, Any]) -> list[str]:
    present, sources = _get(data, "data.sources")
    if present and sources == []:
        return [
            "data.sources=[] names no input: list the files or folders of conversations to "
            "curate, e.g. `draftline compose 'data.sources=[data/my-set]'` (or `dvc exp run "
            "-S 'data.sources=[data/my-set]'`)"
        ]
    return []


def _served_checkpoint(data: dict[str, Any]) -> list[str]:
    """`model.serving.checkpoint`: absent, null, or a mapping naming the checkpoint's path."""
    present, checkpoint = _get(data, "model.serving.checkpoint")
    if not present or checkpoint is None:
        return []
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("path"), str):
        unknown = sorted(set(checkpoint) - {"path", "revision"})
        if not unknown:
            return []
        return [
            f"model.serving.checkpoint has unknown key(s) {', '.join(unknown)}: it takes path "
            "and revision only"
        ]
    return [
        f"model.serving.checkpoint={checkpoint!r} must name the served weights: `draftline "
        "compose '+model.serving.checkpoint={path: Qwen/Qwen3.6-27B-FP8, revision: <commit>}'`"
    ]


def _relations(data: dict[str, Any]) -> list[str]:
    out = []
    has_shards, n = _get(data, "data.num_shards")
    has_ids, ids = _get(data, "data.shard_ids")
    if has_shards and has_ids and isinstance(n, int) and n >= 1 and ids != list(range(n)):
        listed = ",".join(map(str, range(n)))
        out.append(
            f"data.shard_ids must be [0..{n - 1}] for data.num_shards={n}; run `draftline "
            f"compose data.num_shards={n}` or pass -S 'data.shard_ids=[{listed}]' to dvc exp run"
        )
    has_chain, chain = _get(data, "data.shard_chain")
    if has_shards and has_chain and isinstance(n, int) and n >= 1:
        from draftline.runtime.resolvers import chain_links

        if chain != chain_links(n):
            out.append(
                f"data.shard_chain must list shards 0..{n - 1} for data.num_shards={n}, each "
                f"after the one before; run `draftline compose data.num_shards={n}`"
            )
    _, heads = _get(data, "drafter.num_attention_heads")
    _, kv = _get(data, "drafter.num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv >= 1 and heads % kv:
        out.append(
            f"drafter.num_attention_heads={heads} must be a multiple of "
            f"drafter.num_key_value_heads={kv}; {fix('drafter.num_key_value_heads')}"
        )
    _, quantiles = _get(data, "quality.completion_length_quantiles")
    if (
        isinstance(quantiles, dict)
        and isinstance(quantiles.get("quantiles"), list)
        and len(quantiles["quantiles"]) != len(quantiles.get("ranges") or [])
    ):
        out.append(
            "quality.completion_length_quantiles: quantiles and ranges must have the same "
            "length (one [low, high] range per quantile); edit conf/quality/*.yaml"
        )
    return out
