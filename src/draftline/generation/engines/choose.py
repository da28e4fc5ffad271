"""The engine a hardware profile asks for, with the run's sampling.

`local`: transformers in this process. `sglang`: a client of the SGLang servers at
$DRAFTLINE_SGLANG_ENDPOINTS (comma-separated URLs), else `generate.endpoints`, else the profile's
own server; when none answers, `generate.autostart: true` starts it (`draftline serve start`),
otherwise generation stops and names the command to run. `vllm`: the same for a vLLM server
(`hardware.vllm`, $DRAFTLINE_VLLM_ENDPOINTS, `draftline serve start --hardware vllm_cpu`).
"""

from __future__ import annotations

from typing import Any

from draftline.generation.engines.base import Engine, Sampling


def sampling_from(gen: dict[str, Any], model: dict[str, Any] | None = None) -> Sampling:
    """The run's sampling; the context length is the served one (`model.serving.context_length`),
    which every engine then caps each turn to."""
    context = ((model or {}).get("serving") or {}).get("context_length")
    return Sampling(
        max_new_tokens=int(gen["max_new_tokens"]),
        temperature=float(gen.get("temperature", 0.0)),
        top_p=float(gen.get("top_p", 1.0)),
        top_k=int(gen.get("top_k", -1)),
        seed=int(gen.get("seed", 0)),
        context_length=int(context) if context else None,
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
    if kind == "vllm":
        return make_vllm_engine(p, profile, sampling, end_of_turn)
    raise SystemExit(f"hardware.engine={kind!r} is not an engine: use local, sglang or vllm")


def make_sglang_engine(
    p: dict[str, Any], profile: dict[str, Any], sampling: Sampling, end_of_turn: int
) -> Engine:
    return make_server_engine("sglang", p, profile, sampling, end_of_turn)


def make_vllm_engine(
    p: dict[str, Any], profile: dict[str, Any], sampling: Sampling, end_of_turn: int
) -> Engine:
    return make_server_engine("vllm", p, profile, sampling, end_of_turn)


def make_server_engine(
    kind: str, p: dict[str, Any], profile: dict[str, Any], sampling: Sampling, end_of_turn: int
) -> Engine:
    """A client of the `kind` servers (sglang or vllm) this profile names, started on demand."""
    from draftline.generation import server_launch, sglang_server, timeouts, vllm_server
    from draftline.generation.engines import sglang, vllm
    from draftline.generation.server_process import ServeError, display

    server = sglang_server if kind == "sglang" else vllm_server
    client = sglang if kind == "sglang" else vllm
    read_settings = sglang_server.sglang_settings if kind == "sglang" else vllm_server.vllm_settings
    settings = read_settings(profile)
    gen = p.get("generate") or {}
    endpoints = sglang.resolve_endpoints(
        gen.get("endpoints"),
        server.bind_host(profile),
        server.bind_port(profile),
        env=client.ENDPOINTS_ENV,
    )
    name = display(kind)
    if not sglang.reachable(endpoints):
        own = server.server_url(profile)
        if gen.get("autostart") and endpoints == [own]:
            print(f"no {name} server at {own}: starting one (generate.autostart)")
            try:
                timeout = float(gen.get("serve_timeout_s", 1800))
                options = {"generate": gen} if kind == "sglang" else {}
                server.start(profile, p["model"], timeout_s=timeout, **options)
            except ServeError as exc:
                raise SystemExit(f"generate: autostart failed: {exc}") from exc
        else:
            raise SystemExit(
                f"generate: no {name} server answers /health at {', '.join(endpoints)}. Start "
                f"one with `draftline serve start` (hardware={profile.get('name')}), or set "
                f"generate.autostart=true, or point ${client.ENDPOINTS_ENV} at running servers"
            )
    elif kind == "sglang" and endpoints == [server.server_url(profile)]:
        try:  # a router of this node answers /health before its engines have loaded
            sglang_server.wait_for_engines(profile, float(gen.get("serve_timeout_s", 1800)))
        except ServeError as exc:
            raise SystemExit(f"generate: {exc}") from exc
    in_flight = int(settings.get("max_in_flight") or 256)
    if kind == "sglang":
        # Caps are known for the node's own servers only (`serve start` records them).
        own = endpoints == [server.server_url(profile)]
        caps = sglang_server.recorded_limits(profile) if own else []
        in_flight = sglang_in_flight(caps, in_flight)
    client_settings = sglang.ClientSettings(
        endpoints=tuple(endpoints),
        max_in_flight=in_flight,
        # From max_new_tokens and one request's decode rate at the in-flight count it keeps
        # (`generation.timeouts`), unless generate.request_timeout_s is set.
        request_timeout_s=timeouts.client_timeout_s(
            profile, sampling.max_new_tokens, gen.get("request_timeout_s"), in_flight
        ),
        max_retries=int(gen.get("max_retries", 5)),
        backoff_base_s=float(gen.get("backoff_base_s", 0.5)),
        backoff_max_s=float(gen.get("backoff_max_s", 30)),
        # `serve start` asks SGLang to order its queue by them (sglang_server.PRIORITY_FLAGS).
        priorities=kind == "sglang",
    )
    engine = sglang.SGLangEngine if kind == "sglang" else vllm.VLLMEngine
    serving = server_launch.serving_identity(p["model"])
    return engine(client_settings, sampling, end_of_turn, serving, p["model"].get("eos_token_id"))


def sglang_in_flight(engines: list[dict[str, Any]], figure: int) -> int:
    """The SGLang client's in-flight count: from the running caps `serve start` recorded for
    the engines when every one is known (`sglang.in_flight_for`), else the profile's `figure`;
    one line says which."""
    from draftline.generation.engines.sglang import in_flight_for

    caps = [e.get("max_running_requests") for e in engines]
    if not caps or not all(isinstance(c, int) and c > 0 for c in caps):
        print(f"SGLang client: {figure} requests in flight (hardware.sglang.max_in_flight)")
        return figure
    size = in_flight_for(caps, figure)
    running = "/".join(map(str, sorted(set(caps))))
    print(
        f"SGLang client: {size} requests in flight, from the servers' caps ({len(caps)} engines "
        f"running at most {running} each, plus a short queue; hardware.sglang.max_in_flight "
        f"{figure})"
    )
    return size
