"""A snapshot of this node -- hardware, drivers, software versions, git state -- secrets redacted.

Written into the salvage notes so that a later node can rebuild the same stack. Every field is
best effort: a missing tool gives `null` plus the reason, never an exception.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

REDACTED = "***"
# Names whose values are secrets. PAT, PW and SIG only as whole words: PATH and SIGNAL are not.
SECRET_NAME = re.compile(
    r"KEY|SECRET|TOKEN|PASS|CREDENTIAL|AUTH|COOKIE|SESSION|WEBHOOK|PRIVATE|SIGNATURE|DSN"
    r"|(?:^|_)(?:PAT|PW|SIG)(?:_|$)",
    re.IGNORECASE,
)
# The environment variables the notes record: how the node runs (devices, threads, paths, the
# distributed layout, library switches, the AWS region and profile names). Any other variable
# is left out whatever its name: a name (GH_PAT, DB_PASS, ALERTS_URL) cannot tell a secret.
ENV_ALLOWED = frozenset(
    {
        "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX",
        "CONDA_DEFAULT_ENV", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HOME",
        "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_ENABLE_HF_TRANSFER", "MASTER_ADDR",
        "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
        "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "LANG", "LC_ALL", "TZ",
        "HYDRA_FULL_ERROR",
    }
)  # fmt: skip
ENV_ALLOWED_PREFIXES = (
    "CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "TORCHELASTIC_", "SLURM_", "SGLANG_", "DRAFTLINE_",
)  # fmt: skip
_STOP = "\\s\"'<>"  # characters that end a URL in free text
URL_USERINFO = re.compile(rf"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@{_STOP}]+)@")
# Shapes of secrets in free text; group 1 (what names the secret) is kept, the rest redacted:
# `?api_key=`/`&sig=` query values, a webhook's path, `secret_access_key = ...`, `Bearer ...`,
# GitHub/GitLab/Slack/Hugging Face/OpenAI tokens, AWS key ids and 40-character AWS secret keys.
SECRET_PATTERNS = (
    re.compile(
        rf"(?i)([?&;][\w.-]*(?:key|token|secret|sig|signature|password|passwd|pwd|auth"
        rf"|credential|session)[\w.-]*=)[^&#{_STOP}]+"
    ),
    re.compile(
        rf"(?i)(https?://(?:[^/{_STOP}]*hook[^/{_STOP}]*/"
        rf"|[^/{_STOP}]+/(?:[^{_STOP}]*/)?(?:webhooks?|hooks)/))[^{_STOP}]+"
    ),
    re.compile(  # a value with no letter is no secret: `max_new_tokens=2048` stays
        r"(?i)(\b[\w.-]*(?:secret|token|password|passwd|api[_-]?key|access[_-]?key"
        r"|private[_-]?key|credential)(?:[_-]?(?:id|key|value))?[\"']?\s*[:=]\s*[\"']?)"
        r"(?=[^\s\"',;&]*[a-df-z])[^\s\"',;&]{6,}"
    ),
    re.compile(r"(?i)(\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(
        r"()\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{22,}|glpat-[\w-]{20,}"
        r"|xox[abposr]-[\w-]{10,}|hf_[A-Za-z0-9]{30,}|sk-[\w-]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16})\b"
    ),
    re.compile(  # mixed case and a digit or slash: not a hex digest, not a word
        r"()(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+]*[A-Z])(?=[A-Za-z0-9/+]*[a-z])"
        r"(?=[A-Za-z0-9/+]*[0-9/+])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"
    ),
)
# A value that looks random (a token) whatever its variable is named.
TOKEN_VALUE = re.compile(r"(?=.*[A-Z])(?=.*[a-z])(?=.*\d)[A-Za-z0-9+/=_.-]{20,}")
# Values shorter than this are not scrubbed from free text (they would match everywhere).
MIN_SECRET_LEN = 6


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def is_allowed_env(name: str) -> bool:
    """Named in `ENV_ALLOWED` (TOKENIZERS_PARALLELISM too), or under an allowed prefix and
    named for no secret (SGLANG_API_KEY is one)."""
    if name in ENV_ALLOWED:
        return True
    return name.startswith(ENV_ALLOWED_PREFIXES) and not is_secret_name(name)


def redact_urls(text: str) -> str:
    """Drop the user info of every URL: `https://user:pw@host` -> `https://***@host`."""
    return URL_USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text)


def redact_patterns(text: str) -> str:
    """Scrub URL user info and every secret shape of `SECRET_PATTERNS` from free text."""
    text = redact_urls(text)
    for pattern in SECRET_PATTERNS:
        text = pattern.sub(lambda m: m[1] + REDACTED, text)
    return text


def looks_secret(name: str, value: str) -> bool:
    """A secret by its name, or by its value: a credential-bearing URL or a random token."""
    if is_allowed_env(name):
        return False
    return (
        is_secret_name(name)
        or redact_patterns(value) != value
        or bool(TOKEN_VALUE.fullmatch(value))
    )


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """Values of secret-looking variables, longest first, for scrubbing free text."""
    env = os.environ if env is None else env
    values = {v for k, v in env.items() if len(v) >= MIN_SECRET_LEN and looks_secret(k, v)}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """Scrub known secret values, URL user info and secret shapes from free text."""
    for value in secret_values() if secrets is None else secrets:
        text = text.replace(value, REDACTED)
    return redact_patterns(text)


def redact_data(data: Any, secrets: Iterable[str] | None = None) -> Any:
    """`redact_text` on every string of a JSON-like structure (keys included)."""
    secrets = secret_values() if secrets is None else list(secrets)
    if isinstance(data, str):
        return redact_text(data, secrets)
    if isinstance(data, dict):
        return {redact_text(str(k), secrets): redact_data(v, secrets) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_data(v, secrets) for v in data]
    return data


def redact_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allow-listed variables (`ENV_ALLOWED`), values scrubbed; a secret-named one
    under an allowed prefix (SGLANG_API_KEY) only says that it is set."""
    env = dict(os.environ if env is None else env)
    secrets = secret_values(env)
    return {
        name: redact_text(value, secrets) if is_allowed_env(name) else REDACTED
        for name, value in sorted(env.items())
        if is_allowed_env(name) or name.startswith(ENV_ALLOWED_PREFIXES)
    }


def _run(cmd: list[str], cwd: Path | None = None, timeout: float = 20) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        done = subprocess.run(
            cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None


def gpu_info() -> dict[str, Any]:
    query = _run(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,driver_version,pci.bus_id",
            "--format=csv,noheader,nounits",
        ]
    )
    if query is None:
        return {"gpus": [], "driver": None, "cuda_driver": None, "note": "nvidia-smi not available"}
    gpus = []
    driver = None
    for line in query.splitlines():
        index, name, mem, driver, bus = (part.strip() for part in line.split(","))
        gpus.append({"index": int(index), "name": name, "memory_mib": int(float(mem)), "bus": bus})
    header = _run(["nvidia-smi"]) or ""
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return {"gpus": gpus, "driver": driver, "cuda_driver": cuda.group(1) if cuda else None}


def cuda_toolkit() -> str | None:
    out = _run(["nvcc", "--version"])
    found = re.search(r"release ([\d.]+)", out or "")
    return found.group(1) if found else None


def cpu_info() -> dict[str, Any]:
    model = platform.processor() or None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"model": model, "logical_cores": os.cpu_count(), "machine": platform.machine()}


def memory_info() -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    return {"total_bytes": vm.total, "available_bytes": vm.available}


def disk_info() -> list[dict[str, Any]]:
    import psutil

    disks = []
    for part in psutil.disk_partitions(all=False):
        try:
            usage = psutil.disk_usage(part.mountpoint)
        except OSError:
            continue
        disks.append(
            {
                "device": part.device,
                "mountpoint": part.mountpoint,
                "fstype": part.fstype,
                "total_bytes": usage.total,
                "free_bytes": usage.free,
            }
        )
    return disks


def package_versions() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[name.lower()] = dist.version
    return dict(sorted(found.items()))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_info() -> dict[str, Any]:
    """torch's version and build CUDA, read from its files: importing torch takes seconds."""
    version = _version("torch")
    info: dict[str, Any] = {"version": version, "cuda": None}
    spec = importlib.util.find_spec("torch")
    if version is None or spec is None or not spec.submodule_search_locations:
        return info
    version_py = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    if version_py.exists():
        found = re.search(r"^cuda[^=]*=\s*['\"]([^'\"]+)['\"]", version_py.read_text(), re.M)
        info["cuda"] = found.group(1) if found else None
    return info


def sglang_info() -> dict[str, Any]:
    """SGLang may live in its own environment: report this one's and any launcher on PATH."""
    return {
        "version": _version("sglang"),
        "router": _version("sglang-router"),
        "on_path": shutil.which("sglang"),
    }


def git_info(root: Path) -> dict[str, Any]:
    revision = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if revision is None:
        return {"revision": None, "note": "not a git repository or no commit yet"}
    status = _run(["git", "status", "--porcelain"], cwd=root) or ""
    remotes = _run(["git", "remote", "-v"], cwd=root) or ""
    return {
        "revision": revision,
        "branch": _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=root),
        "dirty": bool(status),
        "changes": status.splitlines(),
        "remotes": sorted({redact_urls(line) for line in remotes.splitlines()}),
    }


def take_snapshot(root: str | Path = ".") -> dict[str, Any]:
    """Everything a later node needs to know about this one; secrets redacted."""
    root = Path(root)
    gpu = gpu_info()
    return {
        "host": socket.gethostname(),
        "time_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "gpu": gpu,
        "cuda_toolkit": cuda_toolkit(),
        "cpu": cpu_info(),
        "memory": memory_info(),
        "disks": disk_info(),
        "torch": torch_info(),
        "sglang": sglang_info(),
        "git": git_info(root),
        "packages": package_versions(),
        "environment": redact_env(),
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def to_markdown(snap: Mapping[str, Any]) -> str:
    """A short human summary; the full snapshot goes next to it as JSON."""
    gpu = snap["gpu"]
    gpus = (
        "\n".join(f"- GPU {g['index']}: {g['name']}, {g['memory_mib']} MiB" for g in gpu["gpus"])
        or "- none visible"
    )
    disks = "\n".join(
        f"- {d['mountpoint']} ({d['fstype']}): {_gib(d['free_bytes'])} free of "
        f"{_gib(d['total_bytes'])}"
        for d in snap["disks"]
    )
    git = snap["git"]
    torch = snap["torch"]
    return (
        f"## Node {snap['host']} at {snap['time_utc']}\n\n"
        f"- OS: {snap['os']}\n"
        f"- CPU: {snap['cpu']['model']} ({snap['cpu']['logical_cores']} logical cores)\n"
        f"- RAM: {_gib(snap['memory']['total_bytes'])}\n"
        f"- NVIDIA driver: {gpu.get('driver')}, CUDA (driver): {gpu.get('cuda_driver')}, "
        f"CUDA toolkit: {snap['cuda_toolkit']}\n"
        f"- Python {snap['python']}, torch {torch.get('version')} (CUDA {torch.get('cuda')}), "
        f"SGLang {snap['sglang'].get('version')}\n"
        f"- git: {git.get('revision')} on {git.get('branch')}"
        f"{' (dirty)' if git.get('dirty') else ''}\n\n"
        f"### GPUs\n\n{gpus}\n\n### Disks\n\n{disks}\n"
    )
