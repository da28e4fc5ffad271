"""How long one generation request may take, from the profile's own figures.

A request's answer takes up to `max_new_tokens` at the decode rate one request gets when the
node keeps N requests open: the profile's output tok/s (the low end of its range when it gives
one) divided by N. The client's N is what it really keeps: the engines' running caps plus a
short queue as the servers report them (the 27B on b200x8: 8 x (46 + 5) = 408, so an
8,192-token answer at 15,000 / 408 = 37 tok/s takes ~220 s), at most `max_in_flight`. The
client's timeout is `SAFETY` times that (at least `FLOOR_S`), or `generate.request_timeout_s`
when set. The router in front of DP engines is started before any cap is known: it takes the
profile's `max_in_flight` (the most the client ever keeps, so the longest client timeout: b200x8
15,000 / 4,096 = 3.7 tok/s, ~2,240 s an answer) plus `ROUTER_MARGIN_S`, so the client, which
retries on its own, always gives up first and no answer is cut by the router while the client
still waits for it.
"""

from __future__ import annotations

import math
from typing import Any

# Prefill of long histories, queueing behind other turns and a slower-than-profiled node.
SAFETY = 2.0
# The client's timeout never goes below this (CPU profiles, tiny targets, unknown figures).
FLOOR_S = 600.0
DEFAULT_S = 3600.0  # a profile without a throughput figure or in-flight count
ROUTER_MARGIN_S = 300


def per_request_tok_s(profile: dict[str, Any], in_flight: int | None = None) -> float | None:
    """Output tok/s of one request when the node keeps `in_flight` requests open (by default
    the profile's `max_in_flight`, the most the client ever keeps), or None when unknown."""
    throughput = profile.get("throughput") or {}
    server = profile.get("sglang") or profile.get("vllm") or {}
    low = (throughput.get("generate_tok_s_range") or [None])[0]
    tok_s = low or throughput.get("generate_tok_s")
    in_flight = in_flight or server.get("max_in_flight")
    if not tok_s or not in_flight:
        return None
    return float(tok_s) / int(in_flight)


def client_timeout_s(
    profile: dict[str, Any],
    max_new_tokens: int,
    configured: float | None = None,
    in_flight: int | None = None,
) -> float:
    """The client's per-request timeout: `generate.request_timeout_s` when set, else derived
    from the requests it really keeps open (`in_flight`: the engines' running caps plus a
    short queue, read from the servers; never more than `max_in_flight`, so never above the
    router's, which is derived from that)."""
    if configured:
        return float(configured)
    rate = per_request_tok_s(profile, in_flight)
    if rate is None:
        return DEFAULT_S
    return float(max(FLOOR_S, math.ceil(SAFETY * max_new_tokens / rate / 60) * 60))


def router_timeout_s(
    profile: dict[str, Any], max_new_tokens: int, configured: float | None = None
) -> int:
    """`--router-request-timeout-secs`: above the client's for the same answers (`configured`:
    `generate.request_timeout_s`, as the client gets it)."""
    client = client_timeout_s(profile, max_new_tokens, configured)
    return math.ceil(client) + ROUTER_MARGIN_S
