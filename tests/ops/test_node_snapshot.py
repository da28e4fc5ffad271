"""The node snapshot: every field present, secrets and URL user info never in it (the
redaction itself: test_redaction.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from draftline.ops import node_snapshot

SECRET = "hf_SuperSecretTokenValue123"
PASSWORD = "pw-Kx93-very-private"


@pytest.fixture
def git_repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)

    git("init", "-q", "-b", "main")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (root / "a.txt").write_text("a\n")
    git("add", "a.txt")
    git("commit", "-qm", "a")
    git("remote", "add", "origin", f"https://deploy:{PASSWORD}@git.example/draftline.git")
    return root


def test_snapshot_fields_git_state_and_no_secrets(
    git_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setenv("HTTPS_PROXY", f"http://carol:{PASSWORD}@proxy.example:8080")
    snap = node_snapshot.take_snapshot(git_repo)

    for key in (
        "host",
        "time_utc",
        "os",
        "python",
        "gpu",
        "cuda_toolkit",
        "cpu",
        "memory",
        "disks",
        "torch",
        "sglang",
        "git",
        "packages",
        "environment",
    ):
        assert key in snap
    assert snap["cpu"]["logical_cores"] >= 1
    assert snap["memory"]["total_bytes"] > 0
    assert any(d["total_bytes"] > 0 for d in snap["disks"])
    assert snap["packages"]["dvc"] and snap["packages"]["torch"]
    assert snap["torch"]["version"] == snap["packages"]["torch"]
    assert "version" in snap["sglang"]  # None here: SGLang lives on GPU nodes
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=git_repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert snap["git"]["revision"] == head and snap["git"]["dirty"] is False
    environment = snap["environment"]
    assert "PATH" in environment["values"] and "HF_TOKEN" not in environment["values"]
    assert {"HF_TOKEN", "HTTPS_PROXY"} <= set(environment["names_only"])

    (git_repo / "a.txt").write_text("changed\n")
    dirty = node_snapshot.take_snapshot(git_repo)
    assert dirty["git"]["dirty"] is True and " M a.txt" in dirty["git"]["changes"]

    text = json.dumps(snap) + node_snapshot.to_markdown(snap)
    assert SECRET not in text and PASSWORD not in text
    assert "https://***@git.example/draftline.git" in " ".join(snap["git"]["remotes"])


def test_gpu_fields_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi needs a GPU: this stand-in prints what nvidia-smi prints for the same
    queries on a 4x RTX PRO 6000 node (CSV rows, then the banner with the CUDA version)."""
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    rows = "\n".join(
        f"{i}, NVIDIA RTX PRO 6000 Blackwell Server Edition, 97887, 580.95.05, 00000000:0{i}:00.0"
        for i in range(4)
    )
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ -n "$1" ]; then printf "%s\\n" "{rows}"; exit 0; fi\n'
        'echo "| NVIDIA-SMI 580.95.05   Driver Version: 580.95.05   CUDA Version: 13.0 |"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{__import__('os').environ['PATH']}")
    info = node_snapshot.gpu_info()
    assert [g["memory_mib"] for g in info["gpus"]] == [97887] * 4
    assert info["gpus"][0]["name"] == "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    assert (info["driver"], info["cuda_driver"]) == ("580.95.05", "13.0")


def test_no_gpu_tool_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    info = node_snapshot.gpu_info()
    assert info["gpus"] == [] and "not available" in info["note"]
