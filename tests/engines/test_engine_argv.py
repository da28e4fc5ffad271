"""Every server command line `draftline serve start --dry-run` prints, for every model profile x
GPU hardware profile x mode (the model's own speculation, the exported DFlash drafter, none) and
the vLLM profile (no speculation, the drafter), goes through the launcher's own parsing code of
the pinned engines: `sglang.launch_server` (`prepare_server_args`), `sglang_router.launch_server`
(its `main()`, strict parser of ServerArgs + RouterArgs, then both `from_cli_args`), and
`vllm serve` (`vllm.entrypoints.cli.main`, `validate_parsed_serve_args`, then
`AsyncEngineArgs.from_cli_args`) and, for vLLM's CPU build, `vllm.entrypoints.openai.api_server`
(the same parser and checks through its own entry). The checker is the one `draftline doctor` runs
(src/draftline/generation/engine_argv_check.py); see its docstring for where each launcher is
stopped. Not run: SGLang's `resolve_once` and vLLM's `create_engine_config`, which load the
target's config from the hub and probe the GPU."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from engine_helpers import REPO, run_in_engines

from draftline import cli
from draftline.generation import engine_argv_check
from draftline.runtime import params

pytestmark = pytest.mark.engines

MODELS = sorted(p.stem for p in (REPO / "conf/model").glob("*.yaml"))
GPU_PROFILES = ("pro6000x4", "b200x8")
CHECKER = Path(engine_argv_check.__file__)


def dry_run(
    tmp: Path, model: str, hardware: str, *mode: str, overrides: tuple[str, ...] = ()
) -> list[str]:
    """The command `draftline serve start --dry-run` prints, without its environment."""
    path = tmp / f"{model}-{hardware}{''.join(overrides)}.yaml"
    if not path.exists():
        composed = params.compose(
            [f"model={model}", f"hardware={hardware}", *overrides], REPO / "conf"
        )
        path.write_text(params.to_yaml(composed), encoding="utf-8")
    out = _capture(["serve", "start", "--dry-run", "--params", str(path), *mode])
    words = shlex.split(out.strip())
    while words and "=" in words[0] and not words[0].startswith("-"):
        words.pop(0)
    return words


def _capture(argv: list[str]) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(argv) == 0
    return buf.getvalue()


@pytest.fixture(scope="module")
def commands(tmp_path_factory, exported_drafter) -> dict[str, list[str]]:
    tmp = tmp_path_factory.mktemp("argv")
    drafter = ["--drafter", str(exported_drafter)]
    out = {}
    for model in MODELS:
        for hardware in GPU_PROFILES:
            out[f"{model} {hardware} own"] = dry_run(tmp, model, hardware)
            out[f"{model} {hardware} dflash"] = dry_run(tmp, model, hardware, *drafter)
            out[f"{model} {hardware} none"] = dry_run(tmp, model, hardware, "--no-speculation")
        out[f"{model} vllm_cpu none"] = dry_run(tmp, model, "vllm_cpu", "--no-speculation")
        out[f"{model} vllm_cpu dflash"] = dry_run(tmp, model, "vllm_cpu", *drafter)
        # vLLM on a GPU node (vllm 0.34.0) launches through `vllm serve` instead.
        cuda = ("hardware.device=cuda",)
        out[f"{model} vllm_gpu dflash"] = dry_run(
            tmp, model, "vllm_cpu", *drafter, overrides=cuda
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
    target in FP8, the bf16 drafter is served `unquant`, a value its parsers accept."""
    for hardware in GPU_PROFILES:
        name = f"qwen3_6_27b {hardware} dflash"
        words = commands[name]
        assert words[words.index("--quantization") + 1] == "fp8"
        assert words[words.index("--speculative-draft-model-quantization") + 1] == "unquant"
        assert verdicts[name]["ok"], verdicts[name]
