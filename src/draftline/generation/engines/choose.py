"""The engine a hardware profile asks for, with the run's sampling.

`local`: transformers in this process. `sglang`: a client of the SGLang servers at
$DRAFTLINE_SGLANG_ENDPOINTS (comma-separated URLs), else `generate.endpoints`, else the profile's
own server; when none answers, `generate.autostart: true` starts it (`draftline serve start`),
otherwise generation stops and names the command to run.
"""

from __future__ import annotations

from typing import Any

from draftline.generation.engines.base import Engine, Sampling


def sampling_from(gen: dict[str, Any]) -> Sampling:
    return Sampling(
        max_new_tokens=int(gen["max_new_tokens"]),
        temperature=float(gen.get("temperature", 0.0)),
        top_p=float(gen.get("top_p", 1.0)),
        top_k=int(gen.get("top_k", -1)),
        seed=int(gen.get("seed", 0)),
    )


def make_engine(
    p: dict[str, Any],
    profile: dict[str, Any],
    sampling: Sampling,
    tokenizer: Any,
    end_of_turn: int,
) -> Engine:
    kind = profile.get("engine", "local")
    if kind == "local":
        from draftline.generation.engines.local import LocalEngine

        return LocalEngine.from_config(p["model"], sampling, tokenizer, end_of_turn, profile)
    if kind == "sglang":
        return make_sglang_engine(p, profile, sampling, end_of_turn)
    raise SystemExit(f"hardware.engine={kind!r} is not an engine: use local or sglang")


def make_sglang_engine(
    p: dict[str, Any], profile: dict[str, Any], sampling: Sampling, end_of_turn: int
) -> Engine:
    from draftline.generation import sglang_server
    from draftline.generation.engines.sglang import (
        ClientSettings,
        SGLangEngine,
        reachable,
        resolve_endpoints,
    )

    gen = p.get("generate") or {}
    sg = sglang_server.sglang_settings(profile)
    endpoints = resolve_endpoints(
        gen.get("endpoints"), str(sg.get("host") or "127.0.0.1"), int(sg.get("port") or 30000)
    )
    if not reachable(endpoints):
        own = sglang_server.server_url(profile)
        if gen.get("autostart") and endpoints == [own]:
            print(f"no SGLang server at {own}: starting one (generate.autostart)")
            try:
                sglang_server.start(
                    profile, p["model"], timeout_s=float(gen.get("serve_timeout_s", 1800))
                )
            except sglang_server.ServeError as exc:
                raise SystemExit(f"generate: autostart failed: {exc}") from exc
        else:
            raise SystemExit(
                f"generate: no SGLang server answers /health at {', '.join(endpoints)}. Start one "
                f"with `draftline serve start` (hardware={profile.get('name')}), or set "
                "generate.autostart=true, or point $DRAFTLINE_SGLANG_ENDPOINTS at running servers"
            )
    settings = ClientSettings(
        endpoints=tuple(endpoints),
        max_in_flight=int(sg.get("max_in_flight") or 256),
        request_timeout_s=float(gen.get("request_timeout_s", 3600)),
        max_retries=int(gen.get("max_retries", 5)),
        backoff_base_s=float(gen.get("backoff_base_s", 0.5)),
        backoff_max_s=float(gen.get("backoff_max_s", 30)),
    )
    serving = sglang_server.serving_identity(p["model"])
    return SGLangEngine(settings, sampling, end_of_turn, serving)
