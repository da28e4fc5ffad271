"""Which DVC remote a push goes to, where its credentials come from, and whether it answers.

Credentials are looked for where dvc-s3 looks (`.dvc/config.local`, the environment, an AWS
profile, then botocore's other sources such as an instance role). Only the *source* is ever
reported, never a key. Missing credentials raise `RemoteError` with the commands that fix it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIX_CREDENTIALS = (
    "give DVC credentials for remote '{name}' in one of these ways (never in .dvc/config):\n"
    "  export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...      # environment\n"
    "  export AWS_PROFILE=my-profile                                # a profile in ~/.aws/\n"
    "  dvc remote modify --local {name} profile my-profile\n"
    "  dvc remote modify --local {name} access_key_id ...           # kept in .dvc/config.local\n"
    "  dvc remote modify --local {name} secret_access_key ...\n"
    "or push to the local trial remote instead: --remote local"
)


class RemoteError(RuntimeError):
    """A remote that cannot be used as configured; the message names the fix."""


@dataclass(frozen=True)
class RemoteInfo:
    name: str
    url: str
    kind: str  # "s3", "local" or another DVC scheme
    endpoint: str | None = None
    region: str | None = None
    profile: str | None = None

    def describe(self) -> str:
        parts = [f"{self.name} ({self.url})"]
        if self.endpoint:
            parts.append(f"endpoint {redact_url(self.endpoint)}")
        if self.region:
            parts.append(f"region {self.region}")
        if self.profile:
            parts.append(f"profile {self.profile}")
        return ", ".join(parts)


def redact_url(url: str) -> str:
    """`scheme://user:pass@host/...` -> `scheme://***@host/...`."""
    from draftline.ops.redaction import redact_urls

    return redact_urls(url)


def _dvc_config(root: Path) -> Any:
    from dvc.config import Config

    return Config(dvc_dir=str(root / ".dvc"))


def describe_remote(root: str | Path, name: str | None = None) -> RemoteInfo:
    """The remote `name` (default: DVC's default remote), merged over all config levels."""
    config = _dvc_config(Path(root))
    remotes = config.get("remote", {})
    chosen = name or config.get("core", {}).get("remote")
    if not chosen:
        raise RemoteError(
            "no DVC remote chosen: set one with `dvc remote default s3` or pass --remote NAME"
        )
    if chosen not in remotes:
        known = ", ".join(sorted(remotes)) or "none"
        raise RemoteError(
            f"DVC remote '{chosen}' is not configured (known: {known}); "
            f"add it with `dvc remote add {chosen} URL` or pass --remote NAME"
        )
    section = remotes[chosen]
    url = str(section["url"])
    scheme = url.split("://", 1)[0] if "://" in url else "local"
    if scheme != "s3":
        return RemoteInfo(name=chosen, url=url, kind=scheme)
    env = os.environ
    return RemoteInfo(
        name=chosen,
        url=url,
        kind=scheme,
        endpoint=section.get("endpointurl")
        or env.get("AWS_ENDPOINT_URL_S3")
        or env.get("AWS_ENDPOINT_URL"),
        region=section.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        profile=section.get("profile") or env.get("AWS_PROFILE"),
    )


def config_secrets(root: str | Path) -> list[str]:
    """Values of every DVC remote's credential options (`.dvc/config.local`, the user's and
    the system's config) and its URLs (their user info and queries are secrets): a log may
    echo them, the salvage notes must not."""
    from draftline.ops.redaction import is_secret_name

    try:
        remotes = _dvc_config(Path(root)).get("remote", {})
    except Exception:  # an unreadable config holds nothing DVC could use either
        return []
    return sorted(
        {
            str(value)
            for section in remotes.values()
            for option, value in section.items()
            if is_secret_name(option) or "://" in str(value)
        },
        key=len,
        reverse=True,
    )


def credential_source(root: str | Path, info: RemoteInfo) -> str:
    """Where the credentials for `info` come from, in words; `RemoteError` when there are none.

    Non-S3 remotes need none here (a local folder; other schemes are left to DVC).
    """
    if info.kind != "s3":
        return "none needed" if info.kind == "local" else f"left to DVC ({info.kind})"
    config = _dvc_config(Path(root))
    committed = config.load_one("repo").get("remote", {}).get(info.name, {})
    if "secret_access_key" in committed or "access_key_id" in committed:
        raise RemoteError(
            f"credentials for remote '{info.name}' are in the committed .dvc/config: remove them "
            f"and keep them in .dvc/config.local (`dvc remote modify --local {info.name} "
            "access_key_id ...`), then rotate the key"
        )
    section = config.get("remote", {}).get(info.name, {})
    if section.get("access_key_id") and section.get("secret_access_key"):
        return "DVC config (.dvc/config.local or user config)"
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return "environment (AWS_ACCESS_KEY_ID)"
    return _botocore_source(info, section)


def _botocore_source(info: RemoteInfo, section: dict[str, Any]) -> str:
    import botocore.exceptions
    import botocore.session

    session = botocore.session.Session(profile=info.profile)
    if section.get("credentialpath"):
        session.set_config_variable("credentials_file", section["credentialpath"])
    if section.get("configpath"):
        session.set_config_variable("config_file", section["configpath"])
    try:
        creds = session.get_credentials()
    except botocore.exceptions.ProfileNotFound:
        raise RemoteError(
            f"AWS profile '{info.profile}' (remote '{info.name}') is not in ~/.aws/credentials "
            f"or ~/.aws/config: create it with `aws configure --profile {info.profile}`, or "
            + FIX_CREDENTIALS.format(name=info.name)
        ) from None
    except botocore.exceptions.BotoCoreError as exc:
        raise RemoteError(
            f"AWS credentials for remote '{info.name}' could not be loaded "
            f"({type(exc).__name__}); " + FIX_CREDENTIALS.format(name=info.name)
        ) from None
    if creds is None:
        raise RemoteError(
            f"no AWS credentials found for remote '{info.name}' ({info.url}): "
            + FIX_CREDENTIALS.format(name=info.name)
        )
    method = getattr(creds, "method", "botocore")
    return f"AWS profile '{info.profile}' ({method})" if info.profile else f"botocore ({method})"


def check_reachable(root: str | Path, info: RemoteInfo) -> None:
    """List the remote's root once; `RemoteError` naming the endpoint when that fails."""
    from dvc.repo import Repo

    try:
        with Repo(str(root)) as repo:
            remote = repo.cloud.get_remote(info.name)
            remote.fs.exists(remote.path)
            if info.kind == "local":
                Path(remote.path).mkdir(parents=True, exist_ok=True)
    except Exception as exc:  # any failure here means "cannot push now"
        where = redact_url(info.endpoint) if info.endpoint else info.url
        raise RemoteError(
            f"remote '{info.name}' is unreachable at {where}: {type(exc).__name__}: "
            f"{redact_url(str(exc))[:300]}; check the network, the endpoint "
            f"(`dvc remote modify --local {info.name} endpointurl URL`) and the bucket name"
        ) from None
