"""Check this node before running the pipeline: Python, key packages, git/DVC state, params
(stale or not), the model path (its JSON files whole) and data sources params.yaml names,
credentials for the DVC remote, GPUs and the hardware profile `auto` would pick, the profile's
GPU count against this node's, SGLang importable by the Python that will run it
(`$DRAFTLINE_SGLANG_PYTHON`), the hybrid-layer kernels on a GPU profile, free disk. Exits 1 when
something must be fixed; warnings (yellow) do not stop the pipeline.

The remote: the pipeline itself runs without one, but `draftline salvage` before a node shuts
down needs it, and a node is the wrong place to find that out. So credentials for an s3 default
remote are checked for real (one signed HEAD on the bucket): missing, refused (401/403), an
unknown bucket or an endpoint that does not answer must be fixed; with no remote, or a non-s3
one, doctor only warns or says none are needed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from draftline.core import target
from draftline.ops import remote
from draftline.runtime import hardware, params

PACKAGES = [
    "dvc",
    "dvc-s3",
    "hydra-core",
    "torch",
    "transformers",
    "great-expectations",
    "pyarrow",
    "safetensors",
    "dvclive",
]
OPTIONAL = ["sglang", "sglang-router"]
MIN_FREE_GB = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config-dir", default="conf", help="the Hydra tree params.yaml was composed from (conf)"
    )


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def checks(config_dir: str = "conf") -> list[tuple[str, bool, str]]:
    """(what, ok, detail) rows; optional parts are reported but never fail."""
    rows: list[tuple[str, bool, str]] = []
    py_ok = sys.version_info >= (3, 10)
    rows.append(("python", py_ok, sys.version.split()[0] + ("" if py_ok else ": need >= 3.10")))
    for name in PACKAGES:
        ver = _version(name)
        rows.append((name, ver is not None, ver or f"missing: pip install -e . ({name})"))
    for name in OPTIONAL:
        ver = _version(name)
        rows.append(
            (
                name,
                True,
                ver
                or "not installed here (only needed on GPU nodes: pip install -e '.[sglang]', "
                "or SGLang in its own environment named by $DRAFTLINE_SGLANG_PYTHON)",
            )
        )
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rows.append(
        ("git", git.returncode == 0, git.stdout.strip() or "not a git checkout with commits")
    )
    rows.append(
        (
            "dvc repo",
            Path(".dvc").is_dir(),
            "ok" if Path(".dvc").is_dir() else "no .dvc/: run in the repository root",
        )
    )
    params_row, run_params = _params_row(config_dir)
    rows.append(params_row)
    if run_params and {"model", "data"} <= run_params.keys():
        rows.append(_model_row(run_params.get("model") or {}))
        rows.append(_data_row(run_params.get("data") or {}))
    rows.append(_remote_row(Path(".")))
    gpus = hardware.detect_gpus()
    chosen = hardware.match_profile(gpus, hardware.load_profiles(config_dir))
    profile = _profile(run_params, config_dir)
    rows.extend(_hybrid_rows(run_params, profile))
    rows.extend(_host_cache_rows(run_params))
    gpu_text = ", ".join(f"{g.name} ({g.memory_mib} MiB)" for g in gpus) or "none"
    rows.append(("gpus", True, f"{len(gpus)}: {gpu_text}"))
    rows.append(("hardware=auto picks", True, chosen))
    rows.extend(_gpu_count_rows(profile, gpus, chosen))
    rows.extend(_engine_rows(profile))
    rows.extend(_engine_argv_rows(run_params))
    rows.extend(_calibration_rows(run_params))
    free_gb = shutil.disk_usage(".").free / 1e9
    rows.append(
        (
            "free disk",
            free_gb >= MIN_FREE_GB,
            f"{free_gb:.1f} GB" + ("" if free_gb >= MIN_FREE_GB else f" (< {MIN_FREE_GB} GB)"),
        )
    )
    return rows


def _calibration_rows(run_params: dict[str, Any] | None) -> list[tuple[str, bool, str]]:
    """A warning per `draftline calibrate` result measured on another target, data, drafter,
    features or package versions than this node has now (`draftline plan` would mislead)."""
    from draftline.ops import calibration

    if not run_params or "model" not in run_params:
        return []
    rows = []
    for path in sorted(calibration.CALIBRATION_DIR.glob("*.json")):
        record = calibration.read(path)
        reasons = calibration.stale_reasons(record, run_params) if record else ["unreadable"]
        if reasons:
            rows.append((
                "calibration", True,
                f"warning: {path} is stale ({'; '.join(reasons)}): rerun `draftline calibrate`",
            ))  # fmt: skip
    return rows


def _profile(run_params: dict[str, Any] | None, config_dir: str) -> dict[str, Any] | None:
    """The hardware profile the stages would run on here (`auto` resolved on this node)."""
    profile = (run_params or {}).get("hardware")
    return hardware.resolve_profile(profile, config_dir) if profile else None


def _gpu_count_rows(
    profile: dict[str, Any] | None, gpus: list[hardware.GPUInfo], chosen: str
) -> list[tuple[str, bool, str]]:
    """The profile's GPUs against this node's: a b200x8 plan on a node without 8 B200s fails."""
    profile = profile or {}
    gpu = profile.get("gpu")
    if not gpu:
        return []
    name, count = str(gpu.get("name")), int(gpu.get("count") or 1)
    matching = [g for g in gpus if name.lower() in g.name.lower()]
    what = f"hardware={profile.get('name')} GPUs"
    if len(matching) >= count:
        return [(what, True, f"{len(matching)} x {name} (the profile needs {count})")]
    return [
        (
            what,
            False,
            f"the profile needs {count} x {name}, this node has {len(matching)} (of "
            f"{len(gpus)} GPUs): compose the profile of this node (`draftline compose "
            f"hardware={chosen} ...`, or hardware=auto), or run on the node the profile names",
        )
    ]


def _engine_rows(profile: dict[str, Any] | None) -> list[tuple[str, bool, str]]:
    """SGLang importable by the Python that will run it (`$DRAFTLINE_SGLANG_PYTHON`, else this
    one), for a profile that generates with it: checked here, not in the server's log."""
    if not profile or profile.get("engine") != "sglang" or not profile.get("sglang"):
        return []
    from draftline.generation import sglang_server

    if message := sglang_server.missing_engine(profile):
        return [("sglang environment", False, message)]
    python = sglang_server.engine_python()
    return [("sglang environment", True, f"{python} imports SGLang")]


def _hybrid_rows(
    run_params: dict[str, Any] | None, profile: dict[str, Any] | None = None
) -> list[tuple[str, bool, str]]:
    """A hybrid target (Gated DeltaNet layers) without the fast kernels runs a slow torch
    fallback: a warning on a GPU profile (extract and online training run the target here), a
    note on a CPU one (which has no use for GPU kernels)."""
    model = (run_params or {}).get("model") or {}
    if not model.get("hybrid"):
        return []
    from draftline.core.target import hybrid_kernels_missing

    missing = hybrid_kernels_missing()
    if not missing:
        return [("hybrid layers", True, "fast kernels installed")]
    gpu = (profile or {}).get("device") == "cuda"
    detail = (
        f"{', '.join(missing)} missing: the hybrid layers of {model.get('name')} run on "
        "the slow torch fallback; "
        + ("pip install -e '.[hybrid]'" if gpu else "on GPU nodes pip install -e '.[hybrid]'")
    )
    return [("hybrid layers", True, f"warning: {detail}" if gpu else detail)]


def _host_cache_rows(run_params: dict[str, Any] | None) -> list[tuple[str, bool, str]]:
    """The hierarchical cache's pinned host pool each SGLang engine of this node would get
    (`draftline.generation.host_cache`), a figure, never a failure; and the requests each
    engine runs at once as SGLang sizes them (`sglang_caps`), a failure only when the
    profile leaves it no memory to run any."""
    profile_cfg = (run_params or {}).get("hardware") or {}
    try:
        profile = hardware.resolve_profile(profile_cfg)
    except (SystemExit, Exception):  # an unresolvable profile is the params row's to report
        return []
    sg = profile.get("sglang") or {}
    if not sg:
        return []
    from draftline.generation import host_cache, sglang_caps

    rows = [(f"host cache ({profile.get('name')})", True, host_cache.describe(sg))]
    model = (run_params or {}).get("model")
    running = sglang_caps.node_running(model, profile) if model else None
    if running:
        rows.append((f"running requests ({profile.get('name')})", "error" not in running,
                     sglang_caps.describe_running(running)))  # fmt: skip
    return rows


def _engine_argv_rows(run_params: dict[str, Any] | None) -> list[tuple[str, bool, str]]:
    """The command line `serve start` would launch, through the installed engine's own parser:
    a flag it rejects is named here, before anything is launched. Without the engine installed
    (a CPU node, or another environment not named yet) it says how to get it; no failure."""
    from draftline.generation import engine_argv, sglang_server, vllm_server

    hw = (run_params or {}).get("hardware") or {}
    if not run_params or not (hw.get("sglang") or hw.get("vllm")):
        return []
    profile = hardware.resolve_profile(hw)
    kind = "vllm" if profile.get("engine") == "vllm" else "sglang"
    what = f"{kind} command line"
    try:
        cpu_vllm = kind == "vllm" and profile.get("device") == "cpu"
        python = engine_argv.engine_python(kind, "vllm" if cpu_vllm else None)
    except engine_argv.NotInstalled as err:
        return [(what, True, f"warning: not checked: {err}")]
    server = vllm_server if kind == "vllm" else sglang_server
    try:
        command = server.server_command(profile, run_params["model"], python=python)
        [result] = engine_argv.check_commands(python, [command])
    except (sglang_server.ServeError, RuntimeError, OSError, ValueError) as err:
        return [(what, False, f"could not check it with {python}: {err}")]
    if not result["ok"]:
        return [(what, False, f"{result['module']} rejects it: {result['error']}")]
    return [(what, True, f"{result['module']} ({python}) accepts the `serve start` command")]


def _params_row(config_dir: str) -> tuple[tuple[str, bool, str], dict[str, Any] | None]:
    """The params.yaml row, and the params the stages would read (stale or not)."""
    from hydra.errors import HydraException

    path = Path("params.yaml")
    if not path.exists():
        return ("params.yaml", False, "missing: run `draftline compose [overrides]`"), None
    try:
        run_params = params.load(path)
    except SystemExit as err:
        return ("params.yaml", False, str(err)), None
    try:
        current, used, _ = params.is_current(path, config_dir)
    except HydraException as err:
        why = f"its overrides no longer compose: {params.hydra_message(str(err))}"
        return ("params.yaml", False, why), run_params
    command = shlex.join(["draftline", "compose", *used])
    if not current:
        why = (
            f"stale: not conf/ composed by `{command}`; run that (or "
            "`draftline compose --check` to see the difference)"
        )
        return ("params.yaml", False, why), run_params
    names = {k: (run_params.get(k) or {}).get("name") for k in ("model", "data", "hardware")}
    return ("params.yaml", True, " ".join(f"{k}={v}" for k, v in names.items())), run_params


def _model_row(model: dict[str, Any]) -> tuple[str, bool, str]:
    if message := target.missing_model(model):
        return ("model path", False, message)
    path = str(model["path"])
    if target.is_local(path):
        return ("model path", True, path)
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(path, "config.json", revision=model.get("revision"))
    if isinstance(cached, str):
        return ("model path", True, f"{target.model_ref(model)} (in the Hugging Face cache)")
    return (
        "model path",
        True,
        f"warning: {target.model_ref(model)} is not in the Hugging Face cache: it downloads on "
        f"first use (needs the network; `{_hub_cli()} download {path}` to fetch it now)",
    )


def _hub_cli() -> str:
    """The hub's command line as installed: `hf` (huggingface-hub >= 0.34; 1.x ships no
    `huggingface-cli`), else the older `huggingface-cli`."""
    return (
        "huggingface-cli"
        if shutil.which("hf") is None and shutil.which("huggingface-cli")
        else "hf"
    )


def _data_row(data: dict[str, Any]) -> tuple[str, bool, str]:
    """Every data.sources entry must be a file or a folder with files in it."""
    sources = [Path(str(s)) for s in data.get("sources") or []]
    missing = [
        str(s)
        for s in sources
        if not (s.is_file() or (s.is_dir() and any(f.is_file() for f in s.rglob("*"))))
    ]
    if not sources or missing:
        return (
            "data sources",
            False,
            f"{', '.join(missing) or 'none'} missing or empty: put the conversations there "
            "(JSONL, JSON or Parquet, plain or .gz) or `draftline compose "
            f"data={data.get('name')} 'data.sources=[/path/to/conversations]'`",
        )
    return ("data sources", True, ", ".join(map(str, sources)))


def _remote_row(root: Path) -> tuple[str, bool, str]:
    try:
        info = remote.describe_remote(root)
    except remote.RemoteError as err:
        return ("remote credentials", True, f"warning: {err} (needed by `draftline salvage`)")
    try:
        source = remote.credential_source(root, info)
        answer = remote.check_access(root, info)  # present is not accepted: ask the remote
    except remote.RemoteError as err:
        trial = "\nor, for a trial without S3: dvc remote default --local local"
        return ("remote credentials", False, f"{err}{trial}")
    return ("remote credentials", True, f"{info.name} ({info.url}): {source}; {answer}")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    rows = checks(args.config_dir)
    table = Table(title="draftline doctor")
    for col in ("check", "status", "detail"):
        table.add_column(col)
    for what, ok, detail in rows:
        status = "[red]FIX[/]" if not ok else "[green]ok[/]"
        if ok and detail.startswith("warning: "):
            status, detail = "[yellow]warn[/]", detail.removeprefix("warning: ")
        table.add_row(what, status, escape(detail))
    Console().print(table)
    return 0 if all(ok for _, ok, _ in rows) else 1
