"""`draftline serve start --dry-run` on compositions of the production target (Qwen3.6-27B on
b200x8) with the overrides a run may set: the launched command must start and serve what the
run asks for."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from draftline import cli
from draftline.runtime import params

REPO = Path(__file__).resolve().parents[2]
BASE = ["hardware=b200x8", "model=qwen3_6_27b", "data=sharegpt", "drafter=dflash_b16"]


def dry_run(
    tmp: Path, capsys: pytest.CaptureFixture[str], *overrides: str, serve: tuple[str, ...] = ()
) -> tuple[list[str], str]:
    """The printed command line (flags only, no environment) and what went to stderr."""
    path = tmp / "params.yaml"
    composed = params.compose([*BASE, *overrides], REPO / "conf")
    path.write_text(params.to_yaml(composed), encoding="utf-8")
    capsys.readouterr()
    assert cli.main(["serve", "start", "--dry-run", "--params", str(path), *serve]) == 0
    out = capsys.readouterr()
    return shlex.split(out.out.strip()), out.err


def flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def test_the_router_waits_longer_than_an_overridden_client_timeout(tmp_path, capsys):
    words, _ = dry_run(tmp_path, capsys, "generate.request_timeout_s=20000")
    assert int(flag(words, "--router-request-timeout-secs")) > 20000
    # A longer answer raises the derived client timeout, and the router's with it.
    words, _ = dry_run(tmp_path, capsys, "generate.max_new_tokens=32768")
    default, _ = dry_run(tmp_path, capsys)
    longer = int(flag(words, "--router-request-timeout-secs"))
    assert longer > int(flag(default, "--router-request-timeout-secs"))


def test_deterministic_inference_runs_triton_attention_and_keeps_the_caches(tmp_path, capsys):
    """The backend SGLang 0.5.23 runs deterministically with the radix cache (left to itself
    it starts neither GPU profile: tests/engines/test_sglang_startup.py runs its resolution)."""
    words, err = dry_run(tmp_path, capsys, "model.serving.deterministic_inference=true")
    assert "--enable-deterministic-inference" in words
    assert flag(words, "--attention-backend") == "triton"
    assert "--enable-hierarchical-cache" in words and "--hicache-size" in words
    assert len(err.strip().splitlines()) == 1
    assert "triton attention" in err and "caches kept" in err
    words, err = dry_run(tmp_path, capsys)  # off: the GPU's own backend, no line
    assert "--attention-backend" not in words and err == ""
    chosen = ("model.serving.deterministic_inference=true",
              "hardware.sglang.extra_args=[--attention-backend,fa3]")  # fmt: skip
    words, err = dry_run(tmp_path, capsys, *chosen)  # the user's backend, not a second one
    assert words.count("--attention-backend") == 1 and flag(words, "--attention-backend") == "fa3"
    assert "sglang.extra_args" in err


def test_a_served_drafter_stays_unquantized_under_an_fp8_target(tmp_path, capsys):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"block_size": 16}), encoding="utf-8")
    words, _ = dry_run(tmp_path, capsys, serve=("--drafter", str(drafter)))
    assert flag(words, "--quantization") == "fp8"
    assert flag(words, "--speculative-algorithm") == "DFLASH"
    assert flag(words, "--speculative-draft-model-quantization") == "unquant"
    # The target's own MTP head is part of the quantized checkpoint; a bf16 target needs nothing.
    own, _ = dry_run(tmp_path, capsys)
    assert "--speculative-draft-model-quantization" not in own
    bf16, _ = dry_run(
        tmp_path, capsys, "model.serving.quantization=null", serve=("--drafter", str(drafter))
    )
    assert "--quantization" not in bf16 and "--speculative-draft-model-quantization" not in bf16
