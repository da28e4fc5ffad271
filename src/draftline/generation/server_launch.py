"""What starting an inference server takes that is the same for every engine: the profile's
section for it, the address it binds and is reached at, the Python that runs it, the flags
both engines spell alike, its environment, the model as served (another speculative decoding,
the identity recorded with every sample) and the start itself (`server_process.launch`).

`sglang_server` and `vllm_server` each describe their engine as a `ServerKind` and build the
rest of the command line themselves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftline.core import target
from draftline.generation import server_process
from draftline.generation.server_process import ServeError, ServerState, display, reach_url


@dataclass(frozen=True)
class ServerKind:
    """One engine's servers: `kind` names the profile's section, pid file and log."""

    kind: str
    default_port: int
    python_env: str  # the variable naming the Python that runs the engine
    without_section: str  # what refusing a profile without the section goes on to say

    def settings(self, profile: dict[str, Any]) -> dict[str, Any]:
        """The profile's section for this engine; ServeError when it has none."""
        section = profile.get(self.kind)
        if not section:
            raise ServeError(
                f"{display(self.kind)} is not for hardware profile {profile.get('name')!r}: it "
                f"has no {self.kind} section (engine {profile.get('engine')!r})"
                + self.without_section
            )
        return section

    def bind_host(self, profile: dict[str, Any], host: str | None = None) -> str:
        return str(host or self.settings(profile).get("host") or "127.0.0.1")

    def bind_port(self, profile: dict[str, Any], port: int | None = None) -> int:
        return int(port or self.settings(profile).get("port") or self.default_port)

    def server_url(
        self, profile: dict[str, Any], host: str | None = None, port: int | None = None
    ) -> str:
        """Where clients on this node reach the server (loopback when it binds every address)."""
        return reach_url(self.bind_host(profile, host), self.bind_port(profile, port))

    def state_path(self, port: int, root: Path = Path(".")) -> Path:
        """The pid file of this engine's server on `port`."""
        return server_process.state_path(port, root, self.kind)

    def engine_python(self, python: str | None = None) -> str:
        """The Python that runs the engine: `python`, else the one `python_env` names, else
        this one."""
        return python or os.environ.get(self.python_env) or sys.executable

    def address_flags(
        self, profile: dict[str, Any], host: str | None = None, port: int | None = None
    ) -> list[str]:
        bound, on = self.bind_host(profile, host), self.bind_port(profile, port)
        return ["--host", bound, "--port", str(on)]

    def server_env(
        self, profile: dict[str, Any], model: dict[str, Any], base: dict[str, Any] | None = None
    ) -> dict[str, str]:
        """The server's environment beyond this process's: `base` (the engine's own), then the
        node's (`<kind>.env`), then the model's (`serving.env`)."""
        env = {**(base or {}), **(self.settings(profile).get("env") or {})}
        env.update((model.get("serving") or {}).get("env") or {})
        return {str(k): str(v) for k, v in env.items()}

    def start(
        self,
        profile: dict[str, Any],
        command: list[str],
        env: dict[str, str],
        *,
        host: str | None = None,
        port: int | None = None,
        timeout_s: float = 1800.0,
        root: Path = Path("."),
        ready: Callable[[Path], str | None] | None = None,
        limits: Callable[[Path], list[dict[str, Any]]] | None = None,
    ) -> ServerState:
        """Launch `command` as this profile's server and wait until it is ready
        (`server_process.launch`: `/health`, then `ready`; `limits` recorded once it is)."""
        return server_process.launch(
            self.kind,
            command,
            env,
            port=self.bind_port(profile, port),
            url=self.server_url(profile, host, port),
            profile=profile.get("name"),
            timeout_s=timeout_s,
            root=root,
            ready=ready,
            limits=limits,
        )


def modules_missing(python: str, modules: list[str]) -> list[str]:
    """Which of `modules` the interpreter `python` cannot import (all of them when it does not
    run)."""
    if python == sys.executable:
        return [m for m in modules if importlib.util.find_spec(m) is None]
    probe = (
        "import importlib.util as u, sys; "
        "print(' '.join(m for m in sys.argv[1:] if not u.find_spec(m)))"
    )
    try:
        out = subprocess.run(
            [python, "-c", probe, *modules], capture_output=True, text=True, timeout=60
        )
    except OSError:
        return modules  # no such interpreter
    return out.stdout.split() if out.returncode == 0 else modules


def checkpoint_flags(model: dict[str, Any], *lead: str) -> list[str]:
    """The served weights (`target.served_checkpoint`): `lead` (how the engine names them),
    the path, and its revision when one is pinned."""
    served = target.served_checkpoint(model)
    flags = [*lead, served["path"]]
    if served["revision"]:
        flags += ["--revision", str(served["revision"])]
    return flags


def precision_flags(model: dict[str, Any]) -> list[str]:
    """The served weights' quantization and the KV cache's dtype, as both engines spell them.
    A served checkpoint carries its quantization in its config.json: no flag then."""
    serving = model.get("serving") or {}
    flags = []
    if serving.get("quantization") and not serving.get("checkpoint"):
        flags += ["--quantization", str(serving["quantization"])]
    if serving.get("kv_cache_dtype") and serving["kv_cache_dtype"] != "auto":
        flags += ["--kv-cache-dtype", str(serving["kv_cache_dtype"])]
    return flags


def extra_flags(settings: dict[str, Any]) -> list[str]:
    """The profile's own flags for the engine (`extra_args`), last on the command line."""
    return [str(a) for a in settings.get("extra_args") or []]


def with_speculation(
    model: dict[str, Any], drafter: str | Path | None = None, off: bool = False
) -> dict[str, Any]:
    """The model served with another speculative decoding: the exported DFlash drafter at
    `drafter` (DFLASH, drafting its block size), or none at all (`off`: the baseline a
    speed-up is measured against). Without either, the model's own (`serving.speculative`)."""
    if drafter is None and not off:
        return model
    speculative = None
    if drafter is not None:
        config = Path(drafter) / "config.json"
        if not config.is_file():
            raise ServeError(f"no exported drafter in {drafter}: run `dvc repro train` first")
        block = json.loads(config.read_text(encoding="utf-8"))["block_size"]
        speculative = {
            "algorithm": "DFLASH",
            "draft_model_path": str(drafter),
            "num_draft_tokens": int(block),
        }
    return {**model, "serving": {**(model.get("serving") or {}), "speculative": speculative}}


def serving_identity(model: dict[str, Any]) -> str:
    """What the server computes, as recorded with every generated sample (sorted JSON); a
    served checkpoint as the weights it names (`target.served_weights_id`)."""
    serving = dict(model.get("serving") or {})
    if serving.get("checkpoint"):
        serving["checkpoint"] = target.served_weights_id(model)
    return json.dumps(serving, sort_keys=True, separators=(",", ":"))
