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


def check_access(root: str | Path, info: RemoteInfo) -> str:
    """One authenticated request to the remote (a HEAD on the bucket, signed with the
    credentials DVC would use); what it answered, or `RemoteError` naming the cause:
    credentials refused (401/403), no such bucket (404), or an endpoint that does not answer.
    A local remote needs no request; other schemes are left to DVC."""
    if info.kind == "local":
        folder = Path(info.url)
        folder = folder if folder.is_absolute() else Path(root) / ".dvc" / folder
        if folder.is_dir():
            return f"folder {folder.resolve()} is there"
        return f"folder {folder.resolve()} is made by the first push"
    if info.kind != "s3":
        return f"not checked ({info.kind}: left to DVC)"
    import botocore.exceptions

    bucket = info.url.removeprefix("s3://").split("/", 1)[0]
    where = redact_url(info.endpoint) if info.endpoint else "AWS S3"
    try:
        _s3_client(root, info).head_bucket(Bucket=bucket)
    except botocore.exceptions.ClientError as exc:
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        code = str(exc.response.get("Error", {}).get("Code") or "")
        code = "" if code == str(status) else f" {code}"  # a HEAD has no body: no named code
        if status in (401, 403):
            raise RemoteError(
                f"remote '{info.name}': {where} refused the credentials for bucket '{bucket}' "
                f"(HTTP {status}{code}): they are wrong, expired or lack access to the bucket; "
                + FIX_CREDENTIALS.format(name=info.name)
            ) from None
        if status == 404:
            raise RemoteError(
                f"remote '{info.name}': bucket '{bucket}' does not exist at {where} (HTTP 404): "
                f"fix the URL (`dvc remote modify --local {info.name} url s3://BUCKET/dvc`) or "
                "create the bucket"
            ) from None
        if status == 301:
            raise RemoteError(
                f"remote '{info.name}': bucket '{bucket}' is in another region (HTTP 301): "
                f"`dvc remote modify --local {info.name} region REGION`"
            ) from None
        raise RemoteError(
            f"remote '{info.name}': {where} answered HTTP {status}{code} for bucket '{bucket}'"
        ) from None
    except botocore.exceptions.BotoCoreError as exc:
        raise RemoteError(
            f"remote '{info.name}' is unreachable at {where} ({type(exc).__name__}): check the "
            f"network and the endpoint (`dvc remote modify --local {info.name} endpointurl URL`)"
        ) from None
    return f"bucket '{bucket}' at {where} accepts the credentials"


def _s3_client(root: str | Path, info: RemoteInfo) -> Any:
    """A botocore S3 client with DVC's view of this remote (endpoint, region, profile,
    credentials of .dvc/config.local) that fails fast: one attempt, short timeouts."""
    import botocore.config
    import botocore.session

    section = _dvc_config(Path(root)).get("remote", {}).get(info.name, {})
    session = botocore.session.Session(profile=info.profile)
    if section.get("credentialpath"):
        session.set_config_variable("credentials_file", section["credentialpath"])
    keys = {}
    if section.get("access_key_id") and section.get("secret_access_key"):
        keys = {
            "aws_access_key_id": section["access_key_id"],
            "aws_secret_access_key": section["secret_access_key"],
            "aws_session_token": section.get("session_token"),
        }
    config = botocore.config.Config(
        connect_timeout=10, read_timeout=20, retries={"max_attempts": 1, "mode": "standard"}
    )
    return session.create_client(
        "s3",
        endpoint_url=info.endpoint,
        region_name=info.region or "us-east-1",
        config=config,
        **keys,
    )
