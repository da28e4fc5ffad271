"""A pre-quantized checkpoint as what the servers load (`model.serving.checkpoint`, e.g.
Qwen/Qwen3.6-27B-FP8): `serve start` passes it as the model to SGLang and vLLM, without
`--quantization` (its config carries it), the drafter still unquantized; training and
extraction keep model.path; the serving identity, which keys the journals, names the served
weights; the committed configuration (no checkpoint) keeps its identity.

`draftline serve start --dry-run` runs for real; an unpinned hub id resolves through a Hugging
Face cache laid out as the hub client writes it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from draftline import cli
from draftline.core import target
from draftline.generation import server_launch
from draftline.runtime import params
from draftline.runtime.config_values import BadValueError

REPO = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FP8 = f"+model.serving.checkpoint={{path:Qwen/Qwen3.6-27B-FP8,revision:{COMMIT}}}"


def dry_run(tmp: Path, capsys, overrides: list[str], *mode: str) -> list[str]:
    composed = params.compose(["model=qwen3_6_27b", *overrides], REPO / "conf")
    path = tmp / "params.yaml"
    path.write_text(params.to_yaml(composed), encoding="utf-8")
    assert cli.main(["serve", "start", "--dry-run", "--params", str(path), *mode]) == 0
    words = shlex.split(capsys.readouterr().out.strip())
    return [w for w in words if not ("=" in w and not w.startswith("-"))]  # no environment


def value(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


@pytest.fixture
def drafter(tmp_path) -> Path:
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"block_size": 16}), encoding="utf-8")
    return folder


def test_sglang_serves_the_checkpoint_without_a_quantization_flag(tmp_path, capsys, drafter):
    plain = dry_run(tmp_path, capsys, ["hardware=b200x8"])
    assert value(plain, "--model-path") == "Qwen/Qwen3.6-27B"
    assert value(plain, "--revision") == "main"
    assert value(plain, "--quantization") == "fp8"  # online FP8 of the bf16 target
    served = dry_run(tmp_path, capsys, ["hardware=b200x8", FP8])
    assert value(served, "--model-path") == "Qwen/Qwen3.6-27B-FP8"
    assert value(served, "--revision") == COMMIT and "--quantization" not in served
    # The rest of what is served is the model's, as without a checkpoint.
    assert value(served, "--speculative-algorithm") == "NEXTN"
    with_drafter = dry_run(tmp_path, capsys, ["hardware=b200x8", FP8], "--drafter", str(drafter))
    assert value(with_drafter, "--speculative-algorithm") == "DFLASH"
    assert value(with_drafter, "--speculative-draft-model-quantization") == "unquant"


def test_vllm_serves_the_checkpoint_too(tmp_path, capsys, drafter):
    plain = dry_run(tmp_path, capsys, ["hardware=vllm_b200x8"])
    assert plain[plain.index("serve") + 1] == "Qwen/Qwen3.6-27B" and "--quantization" in plain
    served = dry_run(tmp_path, capsys, ["hardware=vllm_b200x8", FP8], "--drafter", str(drafter))
    assert served[served.index("serve") + 1] == "Qwen/Qwen3.6-27B-FP8"
    assert value(served, "--revision") == COMMIT and "--quantization" not in served
    spec = json.loads(value(served, "--speculative-config"))
    assert spec == {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15}


def test_training_keeps_the_target_and_the_identity_names_the_served_weights():
    model = params.compose(["model=qwen3_6_27b", FP8], REPO / "conf")["model"]
    assert (model["path"], model["revision"]) == ("Qwen/Qwen3.6-27B", "main")  # what trains
    assert target.served_checkpoint(model) == {"path": "Qwen/Qwen3.6-27B-FP8", "revision": COMMIT}
    identity = json.loads(server_launch.serving_identity(model))
    assert identity["checkpoint"] == f"hub:Qwen/Qwen3.6-27B-FP8@{COMMIT}"
    assert {k: v for k, v in identity.items() if k != "checkpoint"} == {
        k: v for k, v in model["serving"].items() if k != "checkpoint"
    }
    other = {**model, "serving": {**model["serving"], "checkpoint": {"path": "Qwen/Qwen3.6-27B"}}}
    assert server_launch.serving_identity(other) != server_launch.serving_identity(model)


def test_the_committed_configuration_keeps_its_identity():
    """No checkpoint in params.yaml: the identity is the serving block's JSON, as before."""
    model = params.load(REPO / "params.yaml")["model"]
    assert "checkpoint" not in (model.get("serving") or {})
    assert server_launch.serving_identity(model) == json.dumps(
        model.get("serving") or {}, sort_keys=True, separators=(",", ":")
    )


def test_an_unpinned_checkpoint_is_keyed_on_its_cached_commit_or_resumes_nothing(
    tmp_path, monkeypatch, capsys
):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model = {"path": "Qwen/Qwen3.6-27B", "serving": {"checkpoint": {"path": "org/fp8"}}}
    first, second = (json.loads(server_launch.serving_identity(model)) for _ in range(2))
    assert first["checkpoint"].startswith("unidentified:") and first != second
    assert "Pin its revision to a commit" in capsys.readouterr().out
    refs = tmp_path / "hub/models--org--fp8/refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("f" * 40)
    resolved = json.loads(server_launch.serving_identity(model))
    assert resolved["checkpoint"] == f"hub:org/fp8@{'f' * 40}"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+model.serving.checkpoint=Qwen/Qwen3.6-27B-FP8", "must name the served weights"),
        ("+model.serving.checkpoint={path:a/b,revison:x}", "unknown key(s) revison"),
        ("+model.serving.checkpoint={path:1,revision:x}", "checkpoint.path=1 must be a str"),
    ],
)
def test_a_bad_checkpoint_fails_at_compose_in_one_line(override, message):
    with pytest.raises(BadValueError) as info:
        params.compose(["model=qwen3_6_27b", override], REPO / "conf")
    assert message in str(info.value) and "\n" not in str(info.value).strip()
