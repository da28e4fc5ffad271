"""Every server command line `draftline serve start --dry-run` prints, for every model profile x
GPU hardware profile x mode (the model's own speculation, the exported DFlash drafter, none),
the vLLM GPU profile (the same modes and an exported DFlash2 drafter), the vLLM CPU profile (no
speculation, the drafter) and a pre-quantized served checkpoint, goes through the launcher's own
parsing code of
the pinned engines: `sglang.launch_server` (`prepare_server_args`), `sglang_router.launch_server`
(its `main()`, strict parser of ServerArgs + RouterArgs, then both `from_cli_args`), and
`vllm serve` (`vllm.entrypoints.cli.main`, `validate_parsed_serve_args`, then
`AsyncEngineArgs.from_cli_args`) and, for vLLM's CPU build, `vllm.entrypoints.openai.api_server`
(the same parser and checks through its own entry). The checker is the one `draftline doctor` runs
(src/draftline/generation/engine_argv_check.py); see its docstring for where each launcher is
stopped. Not run: SGLang's `resolve_once` and vLLM's `create_engine_config`, which load the
target's config from the hub and probe the GPU."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from helpers.engine_helpers import REPO, dry_run, export_tiny_drafter, run_in_engines

from draftline.generation import engine_argv_check

pytestmark = pytest.mark.engines

MODELS = sorted(p.stem for p in (REPO / "conf/model").glob("*.yaml"))
GPU_PROFILES = ("pro6000x4", "b200x8", "vllm_b200x8")
CHECKPOINT = "+model.serving.checkpoint={path:Qwen/Qwen3.6-27B-FP8,revision:main}"
CHECKER = Path(engine_argv_check.__file__)


@pytest.fixture(scope="module")
def exported_drafter2(tmp_path_factory) -> Path:
    """A DFlash2 drafter exported by draftline's own export (random weights)."""
    from draftline.drafter.dflash2 import DFlash2Layout

    layout = DFlash2Layout(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                           selector_top_k=6)  # fmt: skip
    return export_tiny_drafter(tmp_path_factory.mktemp("engines2") / "drafter2", dflash2=layout)


@pytest.fixture(scope="module")
def commands(tmp_path_factory, exported_drafter, exported_drafter2) -> dict[str, list[str]]:
    tmp = tmp_path_factory.mktemp("argv")
    drafter = ["--drafter", str(exported_drafter)]
    out = {}
    for model in MODELS:
        for hardware in GPU_PROFILES:
            out[f"{model} {hardware} own"] = dry_run(tmp, model, hardware)
            out[f"{model} {hardware} dflash"] = dry_run(tmp, model, hardware, *drafter)
            out[f"{model} {hardware} none"] = dry_run(tmp, model, hardware, "--no-speculation")
        # vLLM on a GPU node (vllm 0.34.0, `vllm serve`) serves DFlash2 too (Model Runner V2).
        out[f"{model} vllm_b200x8 dflash2"] = dry_run(
            tmp, model, "vllm_b200x8", "--drafter", str(exported_drafter2)
        )  # fmt: skip
        out[f"{model} vllm_cpu none"] = dry_run(tmp, model, "vllm_cpu", "--no-speculation")
        out[f"{model} vllm_cpu dflash"] = dry_run(tmp, model, "vllm_cpu", *drafter)
    # The FP8 checkpoint as what is served, through both engines.
    for hardware in ("b200x8", "vllm_b200x8"):
        for mode, flags in (("own", ()), ("dflash", drafter)):
            out[f"qwen3_6_27b {hardware} {mode} fp8 checkpoint"] = dry_run(
                tmp, "qwen3_6_27b", hardware, *flags, overrides=(CHECKPOINT,)
            )  # fmt: skip
    return out


REMOVED = ["--mamba-scheduler-strategy", "extra_buffer"]  # removed in SGLang 0.5.23


@pytest.fixture(scope="module")
def verdicts(engine_python, commands, tmp_path_factory) -> dict[str, dict]:
    """Every command line, and the ones the checks below add, through the engines' parsers
    in one subprocess (its imports take most of the time)."""
    # One engine per node (dp_size 1: no profile here has it, a node's own may): our code
    # launches `sglang.launch_server` itself, without the router's flags.
    single = dry_run(
        tmp_path_factory.mktemp("single"), "qwen3_6_27b", "pro6000x4",
        overrides=("hardware.sglang.dp_size=1",),
    )  # fmt: skip
    extra = {
        "single engine": single,
        "router, removed flag": commands["qwen3_6_27b b200x8 own"] + REMOVED,
        "single, removed flag": single + REMOVED,
        "vllm, unknown flag": commands["tiny vllm_cpu none"] + ["--no-such-flag"],
    }
    every = {**commands, **extra}
    names = list(every)
    results = run_in_engines(engine_python, CHECKER, [every[n] for n in names])
    return {n: {**r, "command": every[n]} for n, r in zip(names, results, strict=True)}


def test_every_command_line_passes_the_engines_own_parsers(commands, verdicts):
    failed = {
        n: f"{verdicts[n]['module']}: {verdicts[n]['error']}\n  {shlex.join(commands[n])}"
        for n in commands
        if not verdicts[n]["ok"]
    }
    assert not failed, "\n".join(f"{n}: {why}" for n, why in failed.items())
    modules = {verdicts[n]["module"] for n in commands}
    assert modules == {
        "sglang_router.launch_server",
        "vllm.entrypoints.cli.main",
        "vllm.entrypoints.openai.api_server",
    }


def test_single_engine_sglang_launcher_parses_too(verdicts):
    assert verdicts["single engine"]["ok"], verdicts["single engine"]
    assert verdicts["single engine"]["module"] == "sglang.launch_server"


def test_a_removed_or_unknown_flag_is_named(verdicts):
    """The check can fail: the flag SGLang 0.5.23 removed, and one vLLM never had."""
    for name in ("router, removed flag", "single, removed flag"):
        assert not verdicts[name]["ok"]
        assert "unrecognized arguments: --mamba-scheduler-strategy" in verdicts[name]["error"]
    assert not verdicts["vllm, unknown flag"]["ok"]
    assert "--no-such-flag" in verdicts["vllm, unknown flag"]["error"]


def test_the_drafter_of_an_fp8_target_is_served_as_trained(commands, verdicts):
    """SGLang quantizes a draft model as it does the target unless told otherwise: with the
    target in FP8, the bf16 drafter is served `unquant`, a value its parsers accept; beside a
    pre-quantized checkpoint too. (vLLM leaves a draft unquantized unless told otherwise.)"""
    for name in ("qwen3_6_27b pro6000x4 dflash", "qwen3_6_27b b200x8 dflash"):
        words = commands[name]
        assert words[words.index("--quantization") + 1] == "fp8"
        assert words[words.index("--speculative-draft-model-quantization") + 1] == "unquant"
        assert verdicts[name]["ok"], verdicts[name]
    words = commands["qwen3_6_27b b200x8 dflash fp8 checkpoint"]
    assert words[words.index("--speculative-draft-model-quantization") + 1] == "unquant"


def test_a_served_checkpoint_replaces_the_model_and_its_quantization_flag(commands, verdicts):
    for hardware in ("b200x8", "vllm_b200x8"):
        for mode in ("own", "dflash"):
            name = f"qwen3_6_27b {hardware} {mode} fp8 checkpoint"
            words = commands[name]
            assert "Qwen/Qwen3.6-27B-FP8" in words and "Qwen/Qwen3.6-27B" not in words
            assert "--quantization" not in words
            assert verdicts[name]["ok"], verdicts[name]


def test_the_vllm_gpu_profile_serves_mtp_dflash_and_dflash2(commands, verdicts):
    """`vllm serve` with 8 data-parallel engines; the target's MTP head as vLLM's `mtp`, and
    both drafter families as its `dflash` method (vLLM picks DFlash2's model from the export's
    `architectures`)."""
    own = commands["qwen3_6_27b vllm_b200x8 own"]
    assert own[2:4] == ["vllm.entrypoints.cli.main", "serve"]
    assert own[own.index("--data-parallel-size") + 1] == "8" and "--enforce-eager" not in own
    assert json.loads(own[own.index("--speculative-config") + 1]) == {
        "method": "mtp", "num_speculative_tokens": 3,
    }  # fmt: skip
    for family, architecture in (("dflash", "DFlashDraftModel"), ("dflash2", "DFlash2DraftModel")):
        name = f"qwen3_6_27b vllm_b200x8 {family}"
        spec = json.loads(commands[name][commands[name].index("--speculative-config") + 1])
        assert spec["method"] == "dflash" and verdicts[name]["ok"], verdicts[name]
        config = json.loads((Path(spec["model"]) / "config.json").read_text(encoding="utf-8"))
        assert config["architectures"] == [architecture]
