"""What may leave this node: environment values by allow-list, and free text scrubbed of every
secret the node knows, the parts of secrets included.

A deny-list of names and patterns always misses the next secret, so the decision goes the other
way round. The snapshot keeps the value of a variable only when its name is known safe
(`is_safe_name`: CUDA, NCCL, OMP, torch, SGLang, DVC and the project's own settings that are
not credentials), with any URL user info, query and token-like path segment taken out of it
(`sanitize_value`); any other variable is recorded by name only. Text that is copied off the
node (logs into the salvage notes, findings printed or committed) goes through `redact_text`,
which knows

- the value of every variable that is not known safe or harmless (`HOME`, `USER`, ...), with
  no minimum length when the name looks secret (PASS, PWD, CRED, SECRET, TOKEN, KEY, AUTH,
  DSN, ...): a 5-character password is still a password;
- the parts of every value, of safe variables too: URL user names and passwords, query values,
  the path segments of webhook-like URLs and token-like path segments, the `user:pass` of a
  curl `-u`/`--user` flag, `password=...` pairs of a DSN; each also percent-encoded and
  JSON-escaped, as logs print them;
- the shapes of secrets whatever their source (`SECRET_PATTERNS`): tokens of known services,
  `Authorization`/`Cookie` header values of any scheme, `pass=`/`pw:` values however short,
  `?api_key=` (and `#access_token=`) values, webhook paths, random-looking strings.

A variable not known safe is a secret when its value is long enough (`MIN_UNNAMED_LEN`) and not
a number, a path or a common setting word (`PLAIN_VALUES`): a lowercase word is no proof of
innocence. A short value (under `MIN_FREE_LEN` characters) or a lowercase word is scrubbed only
where it stands alone, not inside a longer word, so that a 4-character password does not eat
every word containing it.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***"
# Names whose values are secrets. PAT, PW and SIG only as whole words: PATH and SIGNAL are not.
SECRET_NAME = re.compile(
    r"KEY|SECRET|TOKEN|PASS|PWD|CRED|AUTH|COOKIE|SESSION|WEBHOOK|PRIVATE|SIGNATURE|DSN"
    r"|(?:^|_)(?:PAT|PW|SIG)(?:_|$)",
    re.IGNORECASE,
)
# Variables whose values the snapshot records (scrubbed of URL secrets): how the node runs.
SAFE_NAMES = frozenset(
    {
        "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX",
        "CONDA_DEFAULT_ENV", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
        "TOKENIZERS_PARALLELISM", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
        "HF_HUB_ENABLE_HF_TRANSFER", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
        "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "AWS_REGION", "AWS_DEFAULT_REGION",
        "AWS_PROFILE", "LANG", "LC_ALL", "TZ", "HYDRA_FULL_ERROR",
    }
)  # fmt: skip
SAFE_PREFIXES = (
    "CUDA_", "NCCL_", "OMP_", "MKL_", "KMP_", "TORCH_", "PYTORCH_", "TORCHINDUCTOR_",
    "TORCHELASTIC_", "SLURM_", "SGLANG_", "DVC_", "DRAFTLINE_",
)  # fmt: skip
# Not recorded, but their values are no secret (and are everywhere in logs).
HARMLESS_NAMES = frozenset(
    {"HOME", "USER", "LOGNAME", "SHELL", "TERM", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_"}
)
MIN_FREE_LEN = 6  # shorter values are scrubbed only as whole words
MIN_UNNAMED_LEN = 6  # a value whose name says nothing, shorter than this, is no secret
# Setting words an innocently named variable holds (`AWS_RETRY_MODE=standard`): no secret.
PLAIN_VALUES = frozenset(
    {
        "true", "false", "yes", "no", "none", "null", "auto", "always", "never", "enabled",
        "disabled", "default", "standard", "legacy", "adaptive", "interactive",
        "noninteractive", "production", "development", "staging", "debug", "info", "warning",
        "error", "critical", "python", "python3", "bash", "linux", "vscode", "xterm",
    }
)  # fmt: skip

_STOP = "\\s\"'<>"  # characters that end a URL in free text
# A scheme starts after no scheme character and is short: a long run of letters is read once.
_SCHEME = r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{0,30}://"
URL = re.compile(rf"{_SCHEME}[^{_STOP},]+")  # a comma separates lists of URLs
URL_USERINFO = re.compile(rf"(?P<scheme>{_SCHEME})(?P<userinfo>[^/@{_STOP}]+)@")
USER_FLAG = re.compile(r"(?:^|\s)(?:-u|--user|--proxy-user)(?:\s+|=)['\"]?([^\s:'\"]+):([^\s'\"]+)")
SECRET_PAIR = re.compile(  # `password=...` in a DSN or an option string; never a path
    r"(?i)\b[\w.-]*(?:password|passwd|pwd|pass|secret|token|key|auth|cred)\w*\s*=\s*"
    r"['\"]?([^\s'\",;&/][^\s'\",;&]*)"
)
# A JSON key naming its string value a secret (`hf_token`, `authorization`, `db_password`,
# `auth_header`, `authToken`): the value goes whole, whatever its shape. Ends with the word, or
# with a word that says where it is held: `tokenizer` and `token_count` are no secrets.
SECRET_KEY = re.compile(
    r"(?i)(?:^|[_.-])(?:authorization|auth|cookie|password|passwd|pwd|pass|secret|token"
    r"|api[_-]?key|access[_-]?key|private[_-]?key|credentials?|cred)"
    r"(?:[_.-](?:header|value|string|str))?$"
)
SECRET_QUERY_KEY = re.compile(
    r"(?i)key|token|secret|sig|signature|password|passwd|pwd|pass|auth|cred|session"
)
# Shapes of secrets in free text; group 1 (what names the secret) is kept, the rest redacted:
# `?api_key=`/`&sig=` query values, a webhook's path, `secret_access_key = ...`, `Bearer ...`,
# curl's `-u user:pass`, GitHub/GitLab/Slack/Hugging Face/OpenAI tokens, JWTs, AWS key ids and
# 40-character AWS secret keys.
SECRET_PATTERNS = (
    re.compile(
        rf"(?i)([?&;#][\w.-]*(?:key|token|secret|sig|signature|password|passwd|pwd|auth"
        rf"|cred|session)[\w.-]*=)[^&#{_STOP}]+"
    ),
    re.compile(
        rf"(?i)(https?://(?:[^/{_STOP}]*hook[^/{_STOP}]*/"
        rf"|[^/{_STOP}]+/(?:[^{_STOP}]*/)?(?:webhooks?|hooks)/))[^{_STOP}]+"
    ),
    re.compile(  # a value with no letter is no secret: `max_new_tokens=2048` stays
        r"(?i)(\b[\w.-]*(?:secret|token|password|passwd|pwd|api[_-]?key|access[_-]?key"
        r"|private[_-]?key|cred(?:ential)?)(?:[_-]?(?:id|key|value))?[\"']?\s*[:=]\s*[\"']?)"
        r"(?=[^\s\"',;&]*[a-df-z])[^\s\"',;&]{4,}"
    ),
    # An `Authorization:` header of any scheme (Token, ApiKey, Negotiate, AWS4-HMAC-SHA256,
    # none): the scheme stays, the rest of the value goes; `Cookie:` values whole.
    re.compile(
        r"(?i)(\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?(?:[A-Za-z][\w-]*\s+)?)"
        r"[^\r\n\"']+"
    ),
    re.compile(r"(?i)(\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{8,}"),
    # An `Authorization` value copied without its header (`"auth_header": "Token 9f8e..."`):
    # the scheme and a long credential of letters and digits (`token embeddings` stays).
    re.compile(
        r"(?i)(\b(?:token|apikey|api-key|digest|negotiate|hmac)\s+)"
        r"(?=[A-Za-z0-9._~+/=-]*\d)(?=[A-Za-z0-9._~+/=-]*[A-Za-z])[A-Za-z0-9._~+/=-]{16,}"
    ),
    re.compile(r"(?i)(\b(?:set-)?cookie[\"']?\s*:\s*[\"']?)[^\r\n\"']+"),
    # `pass=Qx7pL`, `pw: Hq3z`: a password is short, so no minimum but 3 characters.
    re.compile(r"(?i)(\b(?:pass|passphrase|pw|pin)[\"']?\s*[:=]\s*[\"']?)[^\s\"',;&]{3,}"),
    re.compile(r"((?:^|\s)(?:-u|--user|--proxy-user)(?:\s+|=)['\"]?[^\s:'\"]+:)[^\s'\"]+"),
    re.compile(r"(?i)((?:^|\s)--password(?:\s+|=))\S+"),
    re.compile(
        r"()\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{22,}|glpat-[\w-]{20,}"
        r"|xox[abposr]-[\w-]{10,}|hf_[A-Za-z0-9]{30,}|sk-[\w-]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}"
        r"|eyJ[\w-]{8,}\.[\w-]{4,}\.[\w-]*)\b"
    ),
    re.compile(  # mixed case and a digit or slash: not a hex digest, not a word
        r"()(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+]*[A-Z])(?=[A-Za-z0-9/+]*[a-z])"
        r"(?=[A-Za-z0-9/+]*[0-9/+])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"
    ),
)
# A value that looks random (a token) whatever its variable is named.
TOKEN_VALUE = re.compile(r"(?=.*[A-Z])(?=.*[a-z])(?=.*\d)[A-Za-z0-9+/=_.-]{20,}")
RANDOM_RUN = re.compile(r"(?<![A-Za-z0-9])[A-Za-z0-9]{20,}(?![A-Za-z0-9])")


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def is_safe_name(name: str) -> bool:
    """Named in `SAFE_NAMES`, or under a safe prefix and named for no secret (SGLANG_API_KEY
    and DVC_STUDIO_TOKEN are secrets)."""
    if name in SAFE_NAMES:
        return True
    return name.startswith(SAFE_PREFIXES) and not is_secret_name(name)


def _token_like(segment: str, webhook: bool = False) -> bool:
    """A path segment that may be a credential: long and of mixed characters; in a webhook's
    URL (whose path is the credential) any segment with a digit or a capital, or a long one."""
    classes = sum(any(test(c) for c in segment) for test in (str.isdigit, str.isupper, str.islower))
    if webhook:
        return len(segment) >= 6 and (classes >= 2 or len(segment) >= 16)
    return len(segment) >= 16 and classes >= 2


def _webhook_like(url: urllib.parse.SplitResult) -> bool:
    return "hook" in (url.hostname or "") or bool(re.search(r"/(?:web)?hooks?/", url.path))


def url_parts(text: str) -> set[str]:
    """The secret parts of every URL in `text`: user info, query values, token-like path
    segments (every longer segment of a webhook-like URL)."""
    found: set[str] = set()
    for match in URL.finditer(text):
        try:
            url = urllib.parse.urlsplit(match.group(0))
            password = url.password
        except ValueError:
            continue
        if "@" in url.netloc:
            userinfo = url.netloc.rsplit("@", 1)[0]
            found |= {userinfo, urllib.parse.unquote(userinfo)}
        if password:  # a user name is no secret, and scrubbing `app` would eat every `app`
            found |= {password, urllib.parse.unquote(password)}
        for key, value in urllib.parse.parse_qsl(url.query, keep_blank_values=False):
            if SECRET_QUERY_KEY.search(key) or _token_like(value):
                found.add(value)
        hook = _webhook_like(url)
        found |= {s for s in url.path.split("/") if _token_like(s, hook)}
    return found


def value_parts(value: str) -> set[str]:
    """Secrets inside one value: URL parts, a curl `-u user:pass`, `password=...` pairs."""
    found = url_parts(value)
    for match in USER_FLAG.finditer(value):
        found |= {match[2], f"{match[1]}:{match[2]}"}
    for match in SECRET_PAIR.finditer(value):
        found.add(match[1])
    return {p for p in found if p}


def sanitize_value(value: str) -> str:
    """`value` without URL user info, queries or token-like path segments, curl `-u`
    passwords or `password=...` values: what a safe variable may show."""

    def clean_url(match: re.Match[str]) -> str:
        try:
            url = urllib.parse.urlsplit(match.group(0))
            netloc = url.netloc.rsplit("@", 1)[-1]
        except ValueError:
            return REDACTED
        hook = _webhook_like(url)
        path = "/".join(REDACTED if _token_like(s, hook) else s for s in url.path.split("/"))
        query = f"?{REDACTED}" if url.query else ""
        return urllib.parse.urlunsplit((url.scheme, netloc, path, "", "")) + query

    return redact_patterns(URL.sub(clean_url, value))


def looks_secret(name: str, value: str) -> bool:
    """Whether the whole value of `name` is a secret to scrub from free text."""
    if is_safe_name(name) or name in HARMLESS_NAMES or not value.strip():
        return False
    if is_secret_name(name):
        return True
    # Numbers, addresses and setting words (`standard`); any other word may be a secret.
    if (
        len(value) < MIN_UNNAMED_LEN
        or re.fullmatch(r"[\d\s.,:;/_+=-]*", value)
        or value.lower() in PLAIN_VALUES
    ):
        return False
    # A list of paths (`/opt/x:/usr/lib`) names places, not secrets.
    return not all(p.startswith(("/", "~")) for p in value.split(os.pathsep) if p)


def _variants(secret: str) -> set[str]:
    """The forms a log may print a secret in: as is, percent-encoded, JSON-escaped."""
    return {
        secret,
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote(secret),
        urllib.parse.unquote(secret),
        json.dumps(secret)[1:-1],
    }


def secret_values(env: Mapping[str, str] | None = None, extra: Iterable[str] = ()) -> list[str]:
    """Every secret value this environment holds and the parts of every value, each in the
    forms logs print it, longest first (scrubbing a longer one first leaves no tail)."""
    env = os.environ if env is None else env
    found: set[str] = set()
    for name, value in env.items():
        if looks_secret(name, value):
            found.add(value)
        found |= value_parts(value)
    for value in extra:  # credentials whole; a URL (a remote's) by its secret parts only
        found |= value_parts(value) | ({value} if "://" not in value else set())
    variants = {v for s in found if s.strip() for v in _variants(s)}
    return sorted(variants, key=lambda s: (-len(s), s))


def redact_urls(text: str) -> str:
    """Drop the user info of every URL: `https://user:pw@host` -> `https://***@host`."""
    return URL_USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)


def _random_run(match: re.Match[str]) -> str:
    """A run of 20+ letters and digits that switches between classes like a random string."""
    run = match.group(0)
    classes = ["d" if c.isdigit() else "u" if c.isupper() else "l" for c in run]
    switches = sum(a != b for a, b in zip(classes, classes[1:], strict=False))
    mixed = all(classes.count(k) >= 2 for k in "dul")
    return REDACTED if mixed and switches * 3 >= len(run) else run


def redact_patterns(text: str) -> str:
    """Scrub URL user info and every secret shape of `SECRET_PATTERNS` from free text."""
    text = redact_urls(text)
    for pattern in SECRET_PATTERNS:
        text = pattern.sub(lambda m: m[1] + REDACTED, text)
    return RANDOM_RUN.sub(_random_run, text)


def redact_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """Scrub known secret values (and their parts), URL user info and secret shapes."""
    for value in secret_values() if secrets is None else secrets:
        if len(value) >= MIN_FREE_LEN and not (value.isalpha() and value.islower()):
            text = text.replace(value, REDACTED)
        elif value in text:
            text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])", REDACTED, text)
    return redact_patterns(text)


def holds_secret(text: str) -> bool:
    """Whether `text` has the shape of a secret (`redact_patterns` would change it): for what
    leaves the node unredacted, commit messages and ref names."""
    return redact_patterns(text) != text


def secret_key(key: str) -> bool:
    """Whether a JSON key names its value a secret (`SECRET_KEY`; camelCase keys too)."""
    return bool(SECRET_KEY.search(re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)))


def redact_data(data: Any, secrets: Iterable[str] | None = None) -> Any:
    """`redact_text` on every string of a JSON-like structure (keys included)."""
    secrets = secret_values() if secrets is None else list(secrets)
    if isinstance(data, str):
        return redact_text(data, secrets)
    if isinstance(data, dict):
        return {
            redact_text(str(k), secrets): REDACTED
            if isinstance(v, str) and v and secret_key(str(k))
            else redact_data(v, secrets)
            for k, v in data.items()
        }
    if isinstance(data, (list, tuple)):
        return [redact_data(v, secrets) for v in data]
    return data


def redact_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The snapshot's view of the environment: `values` of the safe variables (sanitized and
    scrubbed), and `names_only` of every other variable."""
    env = dict(os.environ if env is None else env)
    secrets = secret_values(env)
    values = {
        name: redact_text(sanitize_value(value), secrets)
        for name, value in sorted(env.items())
        if is_safe_name(name)
    }
    return {"values": values, "names_only": sorted(n for n in env if not is_safe_name(n))}
