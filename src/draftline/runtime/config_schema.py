"""The keys a composed configuration may hold: a typo in a conf/ file or an override fails.

Hydra merges whatever a group file holds, so `num_hiden_layers` in a user's conf/model/*.yaml
would reach params.yaml unnoticed and every stage would read the default instead. `check`
compares the composition with `SCHEMA` and fails on the first unknown key with one line,
`unknown key X; did you mean Y`. A key added with `+key=value` (or `++`) on the command line
is taken as meant. Subtrees marked `OPEN` hold free-form keys (chat template kwargs, server
environment, the target's Hugging Face config). A new key in conf/ goes here as well: that
is what makes a misspelled one stand out. A `+key` that is one slip from a known key
(`+generate.max_new_token=64`) fails too, naming the key it meant: `+` is for new keys.
"""

from __future__ import annotations

import difflib
from typing import Any

from hydra.errors import ConfigCompositionException

OPEN = "*"  # any key below
Schema = dict[str, Any]

# The drafter's attention/MLP shape and its layers' layout: set in `drafter` (conf/drafter/), or
# in `model.dflash` as the target's public drafters have them; unset, derived from the target
# (`drafter.build.Hyperparameters`).
DRAFTER_SHAPE_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
DRAFTER_LAYOUT_KEYS = ("layer_types", "sliding_window", "sliding_causal")

SCHEMA: Schema = {
    "model": {
        "name": None,
        "path": None,
        "revision": None,
        "target_id": None,
        "architecture": None,
        "hybrid": None,
        "layer_types_pattern": None,
        "num_hidden_layers": None,
        "hidden_size": None,
        "vocab_size": None,
        "num_parameters": None,
        "mtp": None,
        "target_layer_ids": None,
        "mask_token": None,
        "mask_token_id": None,
        "end_of_turn_token": None,
        "end_of_turn_token_id": None,
        "eos_token_id": None,
        "think_token_ids": None,
        "think_in_prompt": None,
        "chat_template_kwargs": OPEN,
        "sampling": {"temperature": None, "top_p": None, "top_k": None},
        "max_new_tokens": None,
        "features": None,
        "dflash": dict.fromkeys((*DRAFTER_SHAPE_KEYS, *DRAFTER_LAYOUT_KEYS)),
        "serving": {
            "quantization": None,
            "kv_cache_dtype": None,
            "context_length": None,
            "deterministic_inference": None,
            # The served weights when they are not model.path (a pre-quantized checkpoint).
            "checkpoint": {"path": None, "revision": None},
            "speculative": OPEN,
            "env": OPEN,
        },
        "config": OPEN,
    },
    "data": {
        "name": None,
        "sources": None,
        "eval_fraction": None,
        "num_shards": None,
        "shard_ids": None,
        "shard_chain": None,
        "thinking_share": None,
        "regenerate_turns": None,
        "max_prompt_tokens": None,
        "max_reject_rate": None,
        "split_seed": None,
        "estimate": {
            "samples": None,
            "prompt_tokens": None,
            "completion_tokens": None,
            "turns": None,
            "history_tokens": None,
        },
    },
    "drafter": {
        "name": None,
        "num_hidden_layers": None,
        **dict.fromkeys((*DRAFTER_SHAPE_KEYS, *DRAFTER_LAYOUT_KEYS)),
        "block_size": None,
        "gamma": None,
        "max_anchors": None,
        "max_length": None,
        "global_batch_size": None,
        "lr": None,
        "weight_decay": None,
        "warmup_ratio": None,
        "epochs": None,
        "grad_clip": None,
        "seed": None,
        # DFlash2 profiles (conf/drafter/dflash2_*.yaml): the family, its layout, its selector.
        "family": None,
        "conv_kernel_size": None,
        "conv_group_size": None,
        "selector_rank": None,
        "selector_top_k": None,
        "selector_loss": None,
        "selector_alpha": None,
        "selector_warmup_ratio": None,
        "selector_ramp_ratio": None,
        "selector_stop_gradient": None,
    },
    "hardware": {
        "name": None,
        "detect": None,
        "gpu": {"name": None, "count": None, "memory_mib": None},
        "engine": None,
        "device": None,
        "precision": None,
        "processes_per_node": None,
        "micro_batch_size": None,
        "sharding": None,
        "activation_checkpointing": None,
        "local": {"batch_size": None},
        "extract_tokens_per_batch": None,
        "num_threads": None,
        "work_ahead_shards": None,
        "sglang": {
            "dp_size": None,
            "tp_size": None,
            "mem_fraction_static": None,
            "context_length": None,
            "max_running_requests": None,
            "max_in_flight": None,
            "hierarchical_cache": None,
            "host_cache_gb_per_engine": None,
            "host_cache_share_of_ram": None,
            "host": None,
            "port": None,
            "extra_args": None,
            "env": OPEN,
        },
        "vllm": {
            "host": None,
            "port": None,
            "dtype": None,
            "max_model_len": None,
            "max_num_seqs": None,
            "tp_size": None,
            "dp_size": None,
            "gpu_memory_utilization": None,
            "enforce_eager": None,
            "seed": None,
            "kv_cache_gib": None,
            "max_in_flight": None,
            "extra_args": None,
            "env": OPEN,
        },
        "throughput": {
            "generate_tok_s": None,
            "generate_tok_s_range": None,
            "generate_precision": None,
            "source": None,
            "model": None,
            "reference_parameters": None,
            "extract_tok_s": None,
            "extract_source": None,
            "train_tok_s": None,
            "train_source": None,
        },
        "price_per_hour": None,
    },
    "quality": {
        "name": None,
        "max_error_share": None,
        "min_supervised_tokens": None,
        "min_share_supervised": None,
        "no_thinking_min_supervised_tokens": None,
        "max_mode_share": None,
        "min_unique_completion_share": None,
        "max_truncated_share": None,
        "min_think_block_share": None,
        "min_answer_share": None,
        "min_complete_conversation_share": None,
        "min_yield": None,
        "completion_length_quantiles": {"quantiles": None, "ranges": None},
        "no_thinking_completion_length_quantiles": None,
        "guard": {"min_samples": None, "window": None},
    },
    "generate": {
        "max_new_tokens": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "seed": None,
        "max_error_share": None,
        "request_timeout_s": None,
        "max_retries": None,
        "backoff_base_s": None,
        "backoff_max_s": None,
        "guard": None,
        "endpoints": None,
        "autostart": None,
        "serve_timeout_s": None,
    },
    "extract": {"features": None, "max_length": None, "pack_tokens": None, "rows": None},
    "evaluate": {
        "max_new_tokens": None,
        "max_prompts": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    },
}


class UnknownKeyError(ConfigCompositionException):
    """A key no part of the pipeline reads: almost always a typo."""


def _paths(schema: Schema, prefix: str = "") -> list[str]:
    out = []
    for key, sub in schema.items():
        path = f"{prefix}{key}"
        out.append(path)
        if isinstance(sub, dict):
            out += _paths(sub, path + ".")
    return out


def _unknown(path: str, siblings: list[str]) -> UnknownKeyError:
    head, _, last = path.rpartition(".")
    close = difflib.get_close_matches(last, siblings, n=1, cutoff=0.6)
    if not close:  # a key put in the wrong section: look everywhere
        close = difflib.get_close_matches(path, _paths(SCHEMA), n=1, cutoff=0.6)
    elif head:
        close = [f"{head}.{close[0]}"]
    if close:
        return UnknownKeyError(f"unknown key {path}; did you mean {close[0]}?")
    return UnknownKeyError(
        f"unknown key {path}; no part of the pipeline reads it (to add it on purpose: "
        f"+{path}=VALUE on the command line, or the key in draftline/runtime/config_schema.py)"
    )


def _lookup(path: str) -> Schema | str | None:
    """The schema below `path`: a dict, OPEN, None for a leaf; KeyError when unknown."""
    node: Any = SCHEMA
    walked: list[str] = []
    for part in path.split("."):
        if node == OPEN:
            return OPEN
        if not isinstance(node, dict) or part not in node:
            raise _unknown(".".join([*walked, part]), list(node) if isinstance(node, dict) else [])
        walked.append(part)
        node = node[part]
    return node


def added_keys(overrides: list[str]) -> set[str]:
    """Keys the command line adds on purpose (`+key=...`, `++key=...`)."""
    return {o.lstrip("+").split("=", 1)[0] for o in overrides if o.startswith("+")}


def check_overrides(overrides: list[str]) -> None:
    """Every `key=value` override names a known key (before Hydra suggests appending it)."""
    for override in overrides:
        key = override.split("=", 1)[0]
        if override.startswith(("+", "~")) or "=" not in override or "/" in key or "@" in key:
            continue  # added on purpose, deleted, or a defaults-list choice
        if key.startswith("hydra.") or key in SCHEMA:
            continue
        _lookup(key)


def close_key(path: str) -> str | None:
    """The known key `path` is one slip away from (same section, nearly the same name)."""
    head, _, last = path.rpartition(".")
    try:
        node = _lookup(head) if head else SCHEMA
    except UnknownKeyError:
        return None
    if not isinstance(node, dict):
        return None
    close = difflib.get_close_matches(last, list(node), n=1, cutoff=0.85)
    return f"{head}.{close[0]}" if close and head else (close[0] if close else None)


def unknown_keys(data: dict[str, Any]) -> list[str]:
    """Every key of `data` the schema does not know (below OPEN subtrees anything goes)."""
    out: list[str] = []

    def walk(node: Any, schema: Any, prefix: str) -> None:
        if schema == OPEN or not isinstance(node, dict) or not isinstance(schema, dict):
            return
        for key, value in node.items():
            if key not in schema:
                out.append(f"{prefix}{key}")
            else:
                walk(value, schema[key], f"{prefix}{key}.")

    walk(data, SCHEMA, "")
    return out


def check(data: dict[str, Any], overrides: list[str] | None = None) -> None:
    """Fail on the first key of `data` the schema does not know (see the module docstring)."""
    added = added_keys(list(overrides or []))
    for path in sorted(added):
        if (meant := close_key(path)) and meant != path:
            raise UnknownKeyError(
                f"+{path} adds a key no stage reads; did you mean {meant}? "
                f"(`{meant}=...` without + sets it)"
            )

    def walk(node: Any, schema: Any, prefix: str) -> None:
        if schema == OPEN or not isinstance(node, dict):
            return
        for key, value in node.items():
            path = f"{prefix}{key}"
            if path in added:
                continue
            if not isinstance(schema, dict) or key not in schema:
                raise _unknown(path, list(schema) if isinstance(schema, dict) else [])
            walk(value, schema[key], path + ".")

    walk(data, SCHEMA, "")
