"""Run SGLang 0.5.23's own startup resolution on server command lines, with a GPU node's device
facts (executed by the engines' Python: tests/engines/test_sglang_startup.py feeds it JSON on
stdin and reads one JSON object back).

Input: `{"cases": [case, ...]}`, each case
`{"name", "argv": [python, "-m", launcher, *args], "device": {"gpu_name", "capability": [maj,
min], "memory_mib", "count", "host_ram_bytes"}, "model_dirs": {hub id: local folder},
"weights": {"target_bytes", "draft_bytes"}}`. Output: `{"results": [...]}`, per case `ok`,
`error` (the exception SGLang raised, as one line), `resolved` (what SGLang resolved) and
`memory` (what its memory configurator sized), and `stubs` (the stand-ins SGLang called).

What runs, unchanged, from the installed wheel:
- the launcher's parsing: `sglang.launch_server` (`prepare_server_args`) or, for
  `sglang_router.launch_server`, its parser (ServerArgs + RouterArgs) and what its
  `launch_server_process` does to the arguments of each DP engine (dp_size 1, its own port
  and base GPU); every DP engine resolves the same arguments, so engine 0 stands for all;
- `ServerArgs.resolve_once()` (`arg_groups/pipeline.py` `run_resolution_pipeline`: the
  overrides, attention, kv-cache, hicache, mamba, serving and speculative hooks), reading the
  target's and the drafter's config.json from local folders;
- `publish(..., role="scheduler")`, then the target runner's memory sizing before CUDA graph
  capture (`mem_cache/kv_cache_configurator.py`): `KVCacheConfigurator._resolve_memory_pool_
  config` (`_profile_available_bytes`, `_handle_max_mamba_cache`, `config_from_budget` through
  `pool_configurator.py`, `resolve_max_num_reqs`), with its inputs built by the model
  runner's own helpers (`ModelConfig.from_server_args`, `resolve_layer_indices`,
  `resolve_spec_aux_hidden_state_config`, `kv_cache_dtype.configure_kv_cache_dtype`,
  `is_post_capture_kv_active`). Pools are not allocated; the post-capture KV resize (after
  CUDA graph capture, from then-free memory) is not run: it can grow the KV pool, not the
  mamba state pool that caps hybrid models' running requests;
- the host-memory check of the hierarchical cache's host pool (`mem_cache/pool_host/base.py`
  `host_memory_budget_bytes`) against the `--hicache-size` pool.

Stand-ins (what needs a GPU, its driver, or the node's own packages), each named:
- `torch.cuda.is_available`, `is_initialized`, `device_count`, `current_device`,
  `get_device_capability`, `get_device_name`, `get_device_properties`, `mem_get_info` and
  `torch.version.cuda` ("13.0"): the CUDA driver's answers for the profile's GPU. NVML
  (`utils/common.py` `_get_device_sm_via_nvml`) is not installed here, so SGLang falls back to
  `torch.cuda.get_device_capability` as it does on a node without pynvml.
- `utils.common.get_nvgpu_memory_capacity`: nvidia-smi's total memory (the profile's MiB).
- `utils.common.is_flashinfer_available`: the flashinfer package SGLang requires on a GPU node
  (not installed here), as found there (and CUDA).
- `psutil.virtual_memory` and `mem_cache.host_memory._cgroup_memory_headroom`: the node's
  RAM (the profile's), not this machine's nor its container limit.
- The loaded weights: `mem_get_info` reports the GPU free before loading, then free minus
  `weights.target_bytes + weights.draft_bytes` (the checkpoint's weights at the served
  precision, draftline.generation.sglang_caps.served_weight_bytes) when the configurator
  measures, as after `load_model` of the target and the draft worker. Nothing else is resident
  (the CUDA context and NCCL buffers of a real node take a little more).
- `get_parallel().world_group`: a process group without peers (one engine, tp 1), whose CPU
  group `get_available_gpu_memory` receives and does not use for one process.
- The model object the configurator receives: an empty object (no weights are built; the
  configurator reads only layer-range attributes it defaults without one).
- torchvision: PyPI's build links CUDA and does not import here. `sglang.srt.configs` imports
  `torchvision.transforms` for image preprocessing; a module whose every attribute raises when
  called stands in, installed after transformers has found torchvision absent.
Model configs are not downloaded: a hub id on the command line is replaced by the local folder
`model_dirs` names for it (the test writes the checkpoint's config.json there, from the model
profile's `config:` block).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import logging
import pkgutil
import sys
import traceback
import types
from collections import Counter
from typing import Any

GIB = 1 << 30
STUBS: Counter[str] = Counter()


class _Unusable:
    """A torchvision attribute: usable as a name, raises when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Unusable:
        return _Unusable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is not installed here")


class _TorchvisionStandin(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self.__name__}.{attr}")


def _install_torchvision_standin() -> None:
    import transformers.utils.import_utils  # noqa: F401  (decides torchvision is absent first)

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    modules = {n: _TorchvisionStandin(n) for n in names}
    modules["torchvision"].transforms = modules["torchvision.transforms"]
    modules["torchvision.transforms"].functional = modules["torchvision.transforms.functional"]
    sys.modules.update(modules)


def _import_sglang() -> None:
    """Everything resolution imports lazily, imported now, while torch still says there is no
    GPU: with the device stand-ins in place, module-level `if is_cuda(): import <kernel>` lines
    would reach for CUDA kernels this machine has not got."""
    import sglang.srt.arg_groups as arg_groups

    for name in (
        "sglang.srt.server_args",
        "sglang.srt.arg_groups.pipeline",
        "sglang.srt.kernel_plugins.nvidia.binding",
        "sglang.srt.kernel_plugins.amd.binding",
        "sglang.srt.mem_cache.kv_cache_configurator",
        "sglang.srt.model_executor.pool_configurator",
        "sglang.srt.model_executor.model_runner_components.layer_setup",
        "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state",
        "sglang.srt.model_executor.model_runner_components.kv_pool_runtime",
        "sglang.srt.mem_cache.kv_cache_dtype",
        "sglang.srt.speculative.spec_info",
        "sglang.srt.mem_cache.pool_host.base",
        "sglang.srt.speculative.dflash_utils",
        "sglang_router.launch_server",
    ):
        importlib.import_module(name)
    for module in pkgutil.iter_modules(arg_groups.__path__):
        importlib.import_module(f"sglang.srt.arg_groups.{module.name}")


class Device:
    """One GPU node's facts, answered where SGLang asks the driver, nvidia-smi or psutil."""

    def __init__(self, facts: dict[str, Any]) -> None:
        self.name = f"NVIDIA {facts['gpu_name']}"
        self.capability = tuple(int(c) for c in facts["capability"])
        self.total = int(facts["memory_mib"]) * (1 << 20)
        self.count = int(facts["count"])
        self.ram = int(facts["host_ram_bytes"])
        self.resident = 0  # bytes the loaded weights take

    def install(self) -> None:
        import psutil
        import sglang.srt.mem_cache.host_memory as host_memory
        import sglang.srt.utils.common as common
        import torch

        def stub(name: str, answer: Any) -> Any:
            def called(*_args: Any, **_kwargs: Any) -> Any:
                STUBS[name] += 1
                return answer() if callable(answer) else answer

            return called

        cuda = torch.cuda
        cuda.is_available = stub("torch.cuda.is_available", True)
        cuda.is_initialized = stub("torch.cuda.is_initialized", False)
        cuda.device_count = stub("torch.cuda.device_count", self.count)
        cuda.current_device = stub("torch.cuda.current_device", 0)
        cuda.get_device_capability = stub("torch.cuda.get_device_capability", self.capability)
        cuda.get_device_name = stub("torch.cuda.get_device_name", self.name)
        cuda.get_device_properties = stub(
            "torch.cuda.get_device_properties",
            types.SimpleNamespace(
                name=self.name,
                major=self.capability[0],
                minor=self.capability[1],
                total_memory=self.total,
                is_integrated=False,
            ),
        )
        cuda.mem_get_info = stub(
            "torch.cuda.mem_get_info", lambda: (self.total - self.resident, self.total)
        )
        cuda.empty_cache = stub("torch.cuda.empty_cache", None)
        torch.version.cuda = "13.0"
        common.get_nvgpu_memory_capacity = stub(
            "utils.common.get_nvgpu_memory_capacity", float(self.total >> 20)
        )
        common.is_flashinfer_available = stub("utils.common.is_flashinfer_available", True)
        memory = types.SimpleNamespace(total=self.ram, available=self.ram)
        psutil.virtual_memory = stub("psutil.virtual_memory", memory)
        host_memory._cgroup_memory_headroom = stub("host_memory._cgroup_memory_headroom", None)
        # The platform probes are lru_cache'd: forget what an earlier case's device answered.
        for value in vars(common).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


def _local_paths(args: list[str], model_dirs: dict[str, str]) -> list[str]:
    """The command line with each hub id of a model replaced by its local folder."""
    out = list(args)
    for i, word in enumerate(out[:-1]):
        if word in ("--model-path", "--speculative-draft-model-path") and out[i + 1] in model_dirs:
            out[i + 1] = model_dirs[out[i + 1]]
    return out


def engine_args(module: str, args: list[str]) -> Any:
    """The ServerArgs one engine resolves, parsed as the launcher parses them."""
    if module == "sglang.launch_server":
        from sglang.srt.server_args import prepare_server_args

        return prepare_server_args(args)
    if module != "sglang_router.launch_server":
        raise ValueError(f"not an SGLang launcher: {module}")
    import argparse

    from sglang.srt.server_args import ServerArgs
    from sglang_router.launch_router import RouterArgs

    # sglang_router/launch_server.py main(): the same parser, then launch_server_process.
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    parser.add_argument("--router-dp-worker-base-port", type=int, default=31000)
    server_args = ServerArgs.from_cli_args(parser.parse_args(args))
    engine = copy.deepcopy(server_args)
    engine.port = 31000
    engine.base_gpu_id = 0
    engine.dp_size = 1
    return engine


RESOLVED = (
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "page_size",
    "disable_radix_cache",
    "enable_hierarchical_cache",
    "hicache_size",
    "enable_deterministic_inference",
    "mamba_radix_cache_strategy",
    "disable_overlap_schedule",
    "quantization",
    "kv_cache_dtype",
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
    "speculative_draft_model_quantization",
    "max_running_requests",
    "mem_fraction_static",
    "chunked_prefill_size",
    "context_length",
    "mamba_full_memory_ratio",
    "max_mamba_cache_size",
)


def _resolved(server_args: Any) -> dict[str, Any]:
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    return {k: _plain(getattr(view, k, None)) for k in RESOLVED}


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def size_memory(server_args: Any, device: Device, weights: dict[str, int]) -> dict[str, Any]:
    """The target runner's KV and mamba pool sizing, as `ModelRunner.alloc_memory_pool` does
    it before allocating (its inputs built by the runner's own helpers)."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.mem_cache import kv_cache_configurator as kvc_module
    from sglang.srt.mem_cache import kv_cache_dtype
    from sglang.srt.model_executor.model_runner_components.kv_pool_runtime import (
        is_post_capture_kv_active,
    )
    from sglang.srt.model_executor.model_runner_components.layer_setup import (
        resolve_layer_indices,
    )
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.runtime_context import (
        SpawnRanks,
        get_model,
        get_parallel,
        get_schedule,
        get_spec,
        publish,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.utils.common import get_available_gpu_memory

    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    model_config = ModelConfig.from_server_args(server_args)
    spec = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
    model = types.SimpleNamespace()  # stand-in: no weights are built
    pre_model_load_gb = get_available_gpu_memory("cuda", 0)
    device.resident = int(weights["target_bytes"]) + int(weights.get("draft_bytes") or 0)
    _, dtype = kv_cache_dtype.configure_kv_cache_dtype(
        server_args_kv_cache_dtype=get_model().kv_cache_dtype,
        model=model,
        model_dtype=model_config.dtype,
        is_draft_worker=False,
        is_dflash=spec.is_dflash_family(),
        speculative_draft_attention_backend=None,
        speculative_draft_kv_cache_dtype=get_spec().speculative_draft_kv_cache_dtype,
    )
    configurator = kvc_module.KVCacheConfigurator(
        device="cuda",
        gpu_id=0,
        attn_dp_size=get_parallel().attn_dp_size,
        pp_size=1,
        pp_group=None,
        model=model,
        model_config=model_config,
        server_args=server_args,
        kv_cache_dtype=dtype,
        kv_cache_dtype_str=get_model().kv_cache_dtype,
        model_dtype=model_config.dtype,
        page_size=get_schedule().page_size,
        sliding_window_size=None,
        spec_algorithm=spec,
        is_draft_worker=False,
        post_capture_kv_active=is_post_capture_kv_active(
            server_args=server_args,
            is_draft_worker=False,
            spec_algorithm=spec,
            token_to_kv_pool_allocator=None,
        ),
        spec_aux_config=resolve_spec_aux_hidden_state_config(
            server_args=server_args,
            model_config=model_config,
            spec_algorithm=spec,
            is_draft_worker=False,
        ),
        is_hybrid_swa=model_config.is_hybrid_swa,
        is_hybrid_swa_compress=model_config.is_hybrid_swa_compress,
        use_mla_backend=model_config.attention_arch == AttentionArch.MLA,
        layer_info=resolve_layer_indices(
            model=model, model_config=model_config, is_draft_worker=False
        ),
        forward_stream=None,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        memory_pool_config=None,
    )
    world = types.SimpleNamespace(cpu_group=None, world_size=1)  # stand-in: no peers
    with get_parallel().override(world_group=world):
        config = configurator._resolve_memory_pool_config(pre_model_load_gb)
    mamba = configurator.mambaish_config
    draft_quantization = None
    if not spec.is_none():  # the draft worker's own config, as it builds it
        draft = ModelConfig.from_server_args(
            server_args, model_path=get_spec().speculative_draft_model_path, is_draft_model=True
        )
        draft_quantization = _plain(draft.quantization)
    return {
        "draft_quantization": draft_quantization,
        "mamba_full_memory_ratio": get_schedule().mamba_full_memory_ratio,
        "pre_model_load_gib": pre_model_load_gb,
        "max_running_requests": int(config.max_running_requests),
        "max_total_num_tokens": int(config.max_total_num_tokens),
        "max_mamba_cache_size": get_schedule().max_mamba_cache_size,
        "mamba_slots_per_request": (
            configurator._calculate_mamba_ratio() if mamba is not None else None
        ),
        "mamba_bytes_per_slot": (
            mamba.mamba2_cache_params.mamba_cache_per_req if mamba is not None else None
        ),
        "post_capture_kv_active": configurator.post_capture_kv_active,
        "context_len": model_config.context_len,
    }


def host_cache(server_args: Any, device: Device) -> dict[str, Any] | None:
    """The host pool's RAM check (pool_host/base.py `_allocate_host_buffer`) for a fixed
    `--hicache-size` (GB per engine): what it books against what the node leaves it."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_bytes

    view = resolved_view(server_args)
    if not view.enable_hierarchical_cache or not view.hicache_size:
        return None
    requested = int(view.hicache_size * 1e9)
    available = host_memory_budget_bytes(requested)
    return {"requested_bytes": requested, "available_bytes": int(available)}


def check(case: dict[str, Any]) -> dict[str, Any]:
    """Resolve one command line on one device; never raises."""
    STUBS.clear()
    device = Device(case["device"])
    device.install()
    argv = [str(a) for a in case["argv"]]
    out: dict[str, Any] = {"ok": False, "error": None, "resolved": None, "memory": None}
    stage = "parse"
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(log):
            server_args = engine_args(argv[2], _local_paths(argv[3:], case.get("model_dirs", {})))
            stage = "resolve"
            server_args.resolve_once()
            out["resolved"] = _resolved(server_args)
            stage = "memory"
            out["memory"] = size_memory(server_args, device, case["weights"])
            stage = "host cache"
            out["host_cache"] = host_cache(server_args, device)
        out["ok"] = True
    except SystemExit as exc:  # argparse
        lines = [ln for ln in log.getvalue().splitlines() if "error:" in ln]
        out["error"] = f"{stage}: " + (lines[-1] if lines else f"exit {exc.code}")
    except Exception as exc:
        detail = traceback.format_exception_only(type(exc), exc)[-1].strip()
        out["error"] = f"{stage}: {detail}"
    finally:
        logging.getLogger().removeHandler(handler)
    out["capped_log"] = [ln for ln in log.getvalue().splitlines() if "is capped to" in ln]
    out["stubs"] = dict(STUBS)
    return out


def main() -> int:
    payload = json.load(sys.stdin)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        _install_torchvision_standin()
        _import_sglang()
    results = [check(case) for case in payload["cases"]]
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
