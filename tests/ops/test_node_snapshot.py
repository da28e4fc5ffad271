"""The node snapshot: every field present, secrets and URL user info never in it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from draftline.ops import node_snapshot

SECRET = "hf_SuperSecretTokenValue123"
PASSWORD = "pw-Kx93-very-private"


GH_PAT = "ghp_Rk2Lm9Qx7Wz4Tn8Vb3Jc6Hd1Fs5Gp0Ya7Ue"
WEBHOOK = "https://hooks.slack.com/services/T0SALVAGE/B0SALVAGE/Wh00kS3cretPathValue42"
API_URL = "https://metrics.example/ingest?project=draftline&api_key=mk-4471-private-key"


def test_redact_env_records_only_the_allow_list() -> None:
    env = {
        "HF_TOKEN": SECRET,
        "GH_PAT": GH_PAT,
        "DB_PASS": PASSWORD,
        "NOTIFY_URL": WEBHOOK,
        "METRICS_URL": API_URL,
        "PROXY": f"http://alice:{PASSWORD}@proxy.example:3128",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "NCCL_SOCKET_IFNAME": "eth0",
        "SGLANG_API_KEY": "sk-local-sglang",
        "MASTER_PORT": "29500",
        "TOKENIZERS_PARALLELISM": "false",
        "PATH": "/usr/local/bin:/usr/bin",
        "HOME": "/home/u",
    }
    assert node_snapshot.redact_env(env) == {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "MASTER_PORT": "29500",
        "NCCL_SOCKET_IFNAME": "eth0",
        "PATH": "/usr/local/bin:/usr/bin",
        "SGLANG_API_KEY": "***",
        "TOKENIZERS_PARALLELISM": "false",
    }
    # Secret by name (GH_PAT, DB_PASS) or by value (a webhook, an api_key URL, a token):
    # every such value is scrubbed from free text; plain values are not.
    secrets = node_snapshot.secret_values(env)
    for value in (SECRET, GH_PAT, PASSWORD, WEBHOOK, API_URL, env["PROXY"], "sk-local-sglang"):
        assert value in secrets
    for value in ("0,1,2,3", "eth0", "29500", "/home/u", env["PATH"]):
        assert value not in secrets


def test_redact_text_scrubs_values_and_urls() -> None:
    text = f"cmd --token {SECRET} --url https://bob:{PASSWORD}@git.example/repo.git done"
    out = node_snapshot.redact_text(text, [SECRET])
    assert out == "cmd --token *** --url https://***@git.example/repo.git done"


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        (f"POST {WEBHOOK} 200", "POST https://hooks.slack.com/*** 200"),
        (
            "POST https://discord.com/api/webhooks/1234/AbCdEf-secret 204",
            "POST https://discord.com/api/webhooks/*** 204",
        ),
        (
            f"GET {API_URL} 200",
            "GET https://metrics.example/ingest?project=draftline&api_key=*** 200",
        ),
        (
            "GET https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F&X-Amz-Signature=9f8e7d&n=1",
            "GET https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&n=1",
        ),
        ("blob?sv=2024&sig=AbC%2Bdef&se=1", "blob?sv=2024&sig=***&se=1"),
        (
            "aws_secret_access_key = Tq9vR2mXw7LkP4sZ8nB1cF6hJ3dG5yU0aEiOQe/x",
            "aws_secret_access_key = ***",
        ),
        ("found Tq9vR2mXw7LkP4sZ8nB1cF6hJ3dG5yU0aEiOQe/x in ~/.aws", "found *** in ~/.aws"),
        ("key id AKIAIOSFODNN7EXAMPLE", "key id ***"),
        (f"clone with {GH_PAT}", "clone with ***"),
        ('{"password": "hunter2-x"}', '{"password": "***"}'),
        ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30", "Authorization: Bearer ***"),
        # What is no secret stays readable: counts, hex digests, paths, plain URLs.
        (
            "step 10 loss=1.25 max_new_tokens=2048 supervised_tokens=123456",
            "step 10 loss=1.25 max_new_tokens=2048 supervised_tokens=123456",
        ),
        (
            "rev 3f2a1b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a md5 0123456789abcdef0123456789abcdef",
            "rev 3f2a1b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a md5 0123456789abcdef0123456789abcdef",
        ),
        ("GET https://hf.co/api/models?limit=5", "GET https://hf.co/api/models?limit=5"),
        (
            "credentials: environment (AWS_ACCESS_KEY_ID)",
            "credentials: environment (AWS_ACCESS_KEY_ID)",
        ),
        ("aws_session_token=FwoGZXIvYXdzEBY", "aws_session_token=***"),
    ],
)
def test_redact_text_scrubs_secret_shapes(text: str, redacted: str) -> None:
    assert node_snapshot.redact_text(text, []) == redacted


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
    assert "HF_TOKEN" not in snap["environment"] and "PATH" in snap["environment"]

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
