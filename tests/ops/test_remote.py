"""The project's DVC remotes and cache settings, credential sources, and clear errors.

Credential lookups run for real (DVC's config loader, botocore's resolver) in an isolated HOME;
reachability runs against moto's S3 server on 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.s3_server import ACCESS_KEY_ID, SECRET_ACCESS_KEY, S3Server

from draftline.ops import remote


@pytest.fixture
def repo(tmp_path: Path, repo_root: Path, isolated_home: Path) -> Path:
    """A DVC repository with the project's .dvc/config, no AWS settings from this machine."""
    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    # What `dvc init` makes, without paying for a dvc process per test.
    (root / ".dvc").mkdir()
    (root / ".dvc" / ".gitignore").write_text("/config.local\n/tmp\n/cache\n")
    shutil.copy(repo_root / ".dvc" / "config", root / ".dvc" / "config")
    return root


def dvc_local(root: Path, *args: str) -> None:
    subprocess.run(["dvc", "remote", "modify", "--local", *args], cwd=root, check=True)


def test_project_config_has_s3_default_local_trial_remote_cache_links_and_hydra(
    repo_root: Path,
) -> None:
    from dvc.config import Config

    conf = Config.validate(Config.load_file(str(repo_root / ".dvc" / "config")))
    assert conf["core"]["remote"] == "s3"
    assert conf["remote"]["s3"]["url"] == "s3://train-dflash-qwen36-27b/dvc"
    assert "local" in conf["remote"]
    # No second full copy of large outputs: links first, copy only as the last resort.
    assert conf["cache"]["type"] == ["reflink", "hardlink", "symlink", "copy"]
    assert conf["hydra"] == {"enabled": True, "config_dir": "conf", "config_name": "config"}
    # Nothing secret is committed.
    for section in conf["remote"].values():
        assert not {"access_key_id", "secret_access_key", "session_token"} & set(section)


def test_default_remote_is_s3_and_endpoint_region_profile_are_configurable(repo: Path) -> None:
    info = remote.describe_remote(repo)
    assert (info.name, info.kind, info.url) == ("s3", "s3", "s3://train-dflash-qwen36-27b/dvc")
    dvc_local(repo, "s3", "url", "s3://other-bucket/x")
    dvc_local(repo, "s3", "endpointurl", "https://s3.example.test")
    dvc_local(repo, "s3", "region", "eu-north-1")
    dvc_local(repo, "s3", "profile", "trainer")
    info = remote.describe_remote(repo)
    assert info.url == "s3://other-bucket/x"
    assert (info.endpoint, info.region, info.profile) == (
        "https://s3.example.test",
        "eu-north-1",
        "trainer",
    )
    local = remote.describe_remote(repo, "local")
    assert local.kind == "local" and Path(local.url).name == "draftline-dvc-remote"
    assert remote.credential_source(repo, local) == "none needed"


def test_missing_credentials_error_names_the_fix(repo: Path) -> None:
    info = remote.describe_remote(repo)
    with pytest.raises(remote.RemoteError) as err:
        remote.credential_source(repo, info)
    text = str(err.value)
    assert "no AWS credentials found for remote 's3'" in text
    assert "AWS_ACCESS_KEY_ID" in text and "AWS_PROFILE" in text
    assert "dvc remote modify --local s3 access_key_id" in text
    assert "--remote local" in text


def test_credentials_from_environment(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
    source = remote.credential_source(repo, remote.describe_remote(repo))
    assert source.startswith("environment")
    assert SECRET_ACCESS_KEY not in source and ACCESS_KEY_ID not in source


def test_credentials_from_config_local(repo: Path) -> None:
    dvc_local(repo, "s3", "access_key_id", ACCESS_KEY_ID)
    dvc_local(repo, "s3", "secret_access_key", SECRET_ACCESS_KEY)
    source = remote.credential_source(repo, remote.describe_remote(repo))
    assert source.startswith("DVC config")
    assert "secret_access_key" in (repo / ".dvc" / "config.local").read_text()
    assert "secret_access_key" not in (repo / ".dvc" / "config").read_text()


def test_credentials_from_aws_profile(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    aws = Path(os.environ["HOME"]) / ".aws"
    aws.mkdir()
    (aws / "credentials").write_text(
        f"[trainer]\naws_access_key_id = {ACCESS_KEY_ID}\n"
        f"aws_secret_access_key = {SECRET_ACCESS_KEY}\n"
    )
    dvc_local(repo, "s3", "profile", "trainer")
    source = remote.credential_source(repo, remote.describe_remote(repo))
    assert source == "AWS profile 'trainer' (shared-credentials-file)"
    monkeypatch.setenv("AWS_PROFILE", "nobody")
    dvc_local(repo, "s3", "profile", "nobody")
    with pytest.raises(remote.RemoteError, match="profile 'nobody'.*aws configure --profile"):
        remote.credential_source(repo, remote.describe_remote(repo))


def test_credentials_in_committed_config_are_refused(repo: Path) -> None:
    subprocess.run(
        ["dvc", "remote", "modify", "s3", "secret_access_key", SECRET_ACCESS_KEY],
        cwd=repo,
        check=True,
    )
    with pytest.raises(remote.RemoteError, match="committed .dvc/config.*config.local"):
        remote.credential_source(repo, remote.describe_remote(repo))


def test_access_is_checked_for_real_and_the_cause_named(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One signed HEAD on the bucket: accepted; refused (moto enforcing IAM auth, where these
    keys belong to no user: 403); an unknown bucket (404); an endpoint that is gone."""
    from moto.core.authorization import enable_iam_authentication

    server = S3Server()
    server.start()
    try:
        server.create_bucket("reach-bucket")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
        dvc_local(repo, "s3", "url", "s3://reach-bucket/dvc")
        dvc_local(repo, "s3", "endpointurl", server.endpoint)
        info = remote.describe_remote(repo)
        assert remote.check_access(repo, info) == (
            f"bucket 'reach-bucket' at {server.endpoint} accepts the credentials"
        )
        with enable_iam_authentication(), pytest.raises(remote.RemoteError) as refused:
            remote.check_access(repo, info)
        first = str(refused.value).splitlines()[0]
        assert first.startswith(
            f"remote 's3': {server.endpoint} refused the credentials for bucket 'reach-bucket' "
            "(HTTP 403): they are wrong, expired or lack access to the bucket"
        )
        assert "dvc remote modify --local s3 access_key_id" in str(refused.value)
        assert SECRET_ACCESS_KEY not in str(refused.value)
        dvc_local(repo, "s3", "url", "s3://no-such-bucket/dvc")
        with pytest.raises(remote.RemoteError, match=r"bucket 'no-such-bucket' does not exist"):
            remote.check_access(repo, remote.describe_remote(repo))
    finally:
        server.stop()
    with pytest.raises(remote.RemoteError, match=r"unreachable at http://127\.0\.0\.1:\d+"):
        remote.check_access(repo, info)


def test_unknown_remote_names_the_known_ones(repo: Path) -> None:
    with pytest.raises(remote.RemoteError, match=r"'nas' is not configured \(known: local, s3\)"):
        remote.describe_remote(repo, "nas")
