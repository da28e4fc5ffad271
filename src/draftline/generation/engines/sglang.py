"""The SGLang engine: an async client of SGLang's native `POST /generate` with token ids.

Request (one sample each): `{"input_ids": [...], "sampling_params": {...}, "rid": "..."}`.
Response: `{"output_ids": [...], "text": ..., "meta_info": {"finish_reason": {"type": "stop",
"matched": <id>} | {"type": "length", "length": n} | {"type": "abort", "message": ...},
"prompt_tokens", "completion_tokens", ...}}`. Readiness is `GET /health`. An abort, and a stop
SGLang wrote at a NaN step (`"matched": "NaN happened"`), become `error` results.

Requests are submitted while answers arrive (`submit`, `results`: the client's event loop runs
in a thread of its own); at most `max_in_flight` are open at once (spread over the endpoints,
least busy first), the rest wait in the client's queue, higher priority first, so the engines'
schedulers stay full. Connection errors, timeouts, 429 and 5xx are
retried with exponential backoff and jitter, on another endpoint when there is one; an endpoint
that refused a connection is left out of the choice for `backoff_max_s` (a dead node would
otherwise look least busy and draw every request). A sample that still fails becomes an `error`
result. When no endpoint answers `/health` any more the
run stops with `EngineUnavailable` (finished samples are already journaled).
"""

from __future__ import annotations

import asyncio
import heapq
import os
import queue
import random
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from draftline.core.loss_mask import cut_at_stop
from draftline.generation.engines.base import (
    EngineUnavailable,
    OnResult,
    Request,
    Result,
    Sampling,
    count_or_none,
    generate_all,
    stop_ids,
)

ENDPOINTS_ENV = "DRAFTLINE_SGLANG_ENDPOINTS"
# `finish_reason.matched` of a turn SGLang stopped at a NaN step (0.5.23, schedule_batch.py).
NAN_STOP = "NaN happened"


@dataclass(frozen=True)
class ClientSettings:
    endpoints: tuple[str, ...]
    max_in_flight: int = 256
    request_timeout_s: float = 3600.0
    max_retries: int = 5
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    health_timeout_s: float = 5.0
    # Send each request's `priority` (SGLang schedules by it, higher first, when started with
    # `--enable-priority-scheduling`, as `serve start` does; without it 0.5.23 ignores the field
    # unless `--abort-on-priority-when-disabled`, and servers before priorities reject it).
    priorities: bool = False


def in_flight_for(caps: Sequence[int], figure: int) -> int:
    """How many requests to keep open over engines that run at most `caps` each: every
    engine's cap plus a small queue (max(4, cap / 8)) so a finished request is replaced at once,
    never more than the profile's `figure`. Beyond that they would only wait in SGLang's queue,
    where the client's priorities no longer order them."""
    return min(figure, sum(cap + max(4, cap // 8) for cap in caps))


def resolve_endpoints(
    configured: Sequence[str] | str | None, host: str, port: int, env: str = ENDPOINTS_ENV
) -> list[str]:
    """Endpoints from $DRAFTLINE_SGLANG_ENDPOINTS (the engine's variable `env`), else
    `generate.endpoints`, else the profile's own server (`http://host:port`). Several URLs
    (comma-separated in the variable) spread the load; one URL may be a single server or a
    router in front of many."""
    raw: Sequence[str] | str | None = os.environ.get(env) or configured
    if isinstance(raw, str):
        raw = [u for u in raw.split(",") if u.strip()]
    urls = [u.strip().rstrip("/") for u in (raw or [])]
    if not urls:
        urls = [f"http://{host}:{port}"]
    return [u if "://" in u else f"http://{u}" for u in urls]


def sampling_params(sampling: Sampling, end_of_turn: int, eos: int | None = None) -> dict[str, Any]:
    """SGLang `sampling_params` for our sampling: stop at the end-of-turn token or the model's
    EOS (`stop_ids`: SGLang stops on the model's EOS anyway, and `ignore_eos` would switch off
    `stop_token_ids` too), the stop token kept in `output_ids` (`no_stop_trim`)."""
    return {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop_token_ids": stop_ids(end_of_turn, eos),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }


def parse_response(
    sample_id: str, body: dict[str, Any], end_of_turn: int, eos: int | None = None
) -> Result:
    """A Result from one `/generate` answer; ids kept exactly as returned, cut after the first
    stop token (end of turn or EOS)."""
    meta = body.get("meta_info") or {}
    result = _finished(sample_id, body, meta, stop_ids(end_of_turn, eos))
    result.prompt_tokens = count_or_none(meta.get("prompt_tokens"))
    result.cached_tokens = count_or_none(meta.get("cached_tokens"))
    return result


def _finished(
    sample_id: str, body: dict[str, Any], meta: dict[str, Any], stops: list[int]
) -> Result:
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort" or "output_ids" not in body:
        message = reason.get("message") if isinstance(reason, dict) else None
        return Result(id=sample_id, error=f"server aborted the request: {message or body}")
    if kind == "stop" and isinstance(reason, dict) and reason.get("matched") == NAN_STOP:
        # SGLang ends a request whose step sampled no valid token (NaN logits) with a stop
        # token written in its place: not an answer of the model.
        return Result(id=sample_id, error=f"the server hit NaN and stopped the turn: {reason}")
    ids, stopped = cut_at_stop(body["output_ids"], stops)
    if not stopped and kind == "stop" and isinstance(reason, dict):
        # Versions that trim the matched stop token from output_ids still name it in `matched`.
        if reason.get("matched") in stops:
            ids, stopped = [*ids, int(reason["matched"])], True
        else:
            return Result(id=sample_id, completion_ids=ids, finish_reason="stop")
    if stopped:
        return Result(id=sample_id, completion_ids=ids, finish_reason="stop")
    if kind == "length":
        return Result(id=sample_id, completion_ids=ids, finish_reason="length")
    return Result(id=sample_id, completion_ids=ids, error=f"unexpected finish_reason {reason!r}")


class _Retryable(Exception):
    def __init__(self, message: str, connection: bool, retry_after: float | None = None):
        super().__init__(message)
        self.connection = connection
        self.retry_after = retry_after


class SGLangEngine:
    """The HTTP client: SGLang's `/generate`. Another server's protocol (the vLLM engine)
    overrides `route`, `_payload` and `_parse` and keeps the scheduling, retries and health."""

    name = "sglang"
    label = "SGLang"  # the server, in messages
    route = "/generate"

    def __init__(
        self,
        settings: ClientSettings,
        sampling: Sampling,
        end_of_turn: int,
        serving: str = "",
        eos: int | None = None,
    ) -> None:
        if not settings.endpoints:
            raise ValueError(f"no {self.label} endpoint given")
        self.settings = settings
        self.sampling = sampling
        self.params = sampling_params(sampling, end_of_turn, eos)
        self.end_of_turn = end_of_turn
        self.eos = eos
        self.in_flight = dict.fromkeys(settings.endpoints, 0)
        self.down_until = dict.fromkeys(settings.endpoints, 0.0)  # monotonic seconds
        self.requests_sent = 0
        self.retries = 0
        self._rng = random.Random()
        # In every request id: a resumed run asks the same turns again, and SGLang refuses an
        # id still running from an earlier run (HTTP 400 "Duplicate request ID").
        self.run_tag = secrets.token_hex(4)
        self.serving = serving  # what the servers compute (the model's `serving` block)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._outstanding = 0  # submitted, result not yet handed out
        self._failure: BaseException | None = None
        self._seq = 0
        # Owned by the loop's thread once started (`_start`).
        self._done: queue.Queue[Result | BaseException] = queue.Queue()
        self._waiting: list[tuple[int, int, Request]] = []
        self._running = 0
        self._stopped = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: Any = None

    def identity(self) -> str:
        """Recorded with every sample: a change of served precision or speculative settings
        is another engine, so a resumed shard never mixes the two."""
        return f"sglang:{self.serving}" if self.serving else "sglang"

    @property
    def max_in_flight(self) -> int:
        return self.settings.max_in_flight

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests (higher priority first); at most `max_in_flight` are open at once."""
        if not requests:
            return
        loop = self._start()
        self._outstanding += len(requests)
        loop.call_soon_threadsafe(self._enqueue, list(requests))

    def results(self) -> list[Result]:
        """Results as they finish; `EngineUnavailable` (once every result that arrived before
        it is handed out) when no endpoint answers any more."""
        if self._failure is not None:
            raise self._failure
        if not self._outstanding:
            return []
        items = [self._next_item()]
        while not self._done.empty():
            items.append(self._done.get_nowait())
        self._outstanding -= len(items)
        finished = [item for item in items if isinstance(item, Result)]
        failure = next((item for item in items if isinstance(item, BaseException)), None)
        if failure is not None:
            self._failure = failure
            if not finished:
                raise failure
        return finished

    def generate(self, requests: Sequence[Request], on_result: OnResult) -> None:
        try:
            generate_all(self, requests, on_result)
        finally:  # done, or on_result raised (guard abort): nothing stays open
            self.close()

    def close(self) -> None:
        """Drop the requests still open (their connections close, so the servers abort them)
        and stop the client's event loop."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
        self._loop = self._thread = None
        self._outstanding = 0
        self._failure = None

    # The client's event loop runs in a thread of its own, so requests are sent and answers
    # read while the caller journals results and builds the next prompts.

    def _start(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name=f"{self.name}-client")
            thread.daemon = True  # a killed stage never waits for it
            thread.start()
            self._loop, self._thread = loop, thread
            self._done = queue.Queue()
            self._waiting = []
            self._running = 0
            self._stopped = False
            self._tasks = set()
            self._session = asyncio.run_coroutine_threadsafe(self._open(), loop).result()
        return self._loop

    def _next_item(self) -> Result | BaseException:
        while True:  # a timeout, so Ctrl-C reaches the waiting thread
            try:
                return self._done.get(timeout=1.0)
            except queue.Empty:
                continue

    async def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout_s)
        return aiohttp.ClientSession(connector=connector, timeout=timeout)

    def _enqueue(self, requests: list[Request]) -> None:
        for request in requests:
            self._seq += 1
            heapq.heappush(self._waiting, (-request.priority, self._seq, request))
        self._fill()

    def _fill(self) -> None:
        assert self._loop is not None
        while self._waiting and self._running < self.settings.max_in_flight and not self._stopped:
            request = heapq.heappop(self._waiting)[2]
            self._running += 1
            task = self._loop.create_task(self._serve(request))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, request: Request) -> None:
        try:
            item: Result | BaseException = await self._one(self._session, request)
        except Exception as exc:  # EngineUnavailable or a bug: nothing new starts
            self._stopped = True
            item = exc
        finally:
            self._running -= 1
        self._done.put(item)
        self._fill()

    async def _shutdown(self) -> None:
        self._stopped = True
        self._waiting.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._session.close()

    def _pick(self, avoid: str | None) -> str:
        now = time.monotonic()
        up = [e for e in self.in_flight if self.down_until[e] <= now] or list(self.in_flight)
        choices = [e for e in up if e != avoid] or up
        return min(choices, key=lambda e: (self.in_flight[e], self._rng.random()))

    async def _one(self, session: aiohttp.ClientSession, request: Request) -> Result:
        s = self.settings
        failed: str | None = None
        last: _Retryable | None = None
        for attempt in range(s.max_retries + 1):
            endpoint = self._pick(avoid=failed)
            payload = self._payload(request, attempt)
            self.in_flight[endpoint] += 1
            self.requests_sent += 1
            try:
                return await self._post(session, endpoint, request.id, payload)
            except _Retryable as exc:
                last, failed = exc, endpoint
                if exc.connection:
                    self.down_until[endpoint] = time.monotonic() + s.backoff_max_s
            finally:
                self.in_flight[endpoint] -= 1
            if attempt < s.max_retries:
                self.retries += 1
                await asyncio.sleep(self._backoff(attempt, last.retry_after))
        assert last is not None
        if last.connection and not await self._any_healthy(session):
            raise EngineUnavailable(
                f"no {self.label} endpoint answers any more ({', '.join(self.in_flight)}): {last}. "
                "Finished samples are journaled; check `draftline serve status` and the server "
                "log under logs/serve/, then rerun the stage to resume."
            )
        return Result(id=request.id, error=f"failed after {s.max_retries + 1} attempts: {last}")

    def request_key(self, request: Request, attempt: int) -> str:
        """The server's id of one try: `<turn id>-<attempt>@<run tag>`, unique per try and
        per run (the sampling seed depends on the turn id only)."""
        return f"{request.id}-{attempt}@{self.run_tag}"

    def _payload(self, request: Request, attempt: int) -> bytes:
        """The body of one request (one sample): the turn's own cap when the context leaves
        less than `max_new_tokens`, and a seed of its own when sampling (the same on every
        retry; SGLang uses it only with `--enable-deterministic-inference`)."""
        params = self.params
        if request.max_new_tokens is not None or self.sampling.temperature > 0:
            params = {**params}
            if request.max_new_tokens is not None:
                params["max_new_tokens"] = request.max_new_tokens
            if self.sampling.temperature > 0:
                params["sampling_seed"] = self.sampling.request_seed(request.id)
        body: dict[str, Any] = {
            "input_ids": request.prompt_ids,
            "sampling_params": params,
            "rid": self.request_key(request, attempt),
        }
        if self.settings.priorities:
            body["priority"] = request.priority
        return orjson.dumps(body)

    def _parse(self, sample_id: str, body: dict[str, Any]) -> Result:
        """The Result of one 200 answer (already a JSON object)."""
        return parse_response(sample_id, body, self.end_of_turn, self.eos)

    async def _post(
        self, session: aiohttp.ClientSession, endpoint: str, sample_id: str, payload: bytes
    ) -> Result:
        try:
            async with session.post(
                f"{endpoint}{self.route}",
                data=payload,
                headers={"Content-Type": "application/json"},
            ) as resp:
                raw = await resp.read()
                if resp.status == 200:
                    body = orjson.loads(raw)
                    if isinstance(body, list) and body:  # a batch answer; we send one sample
                        body = body[0]
                    if not isinstance(body, dict):
                        raise _Retryable(
                            f"malformed answer from {endpoint}: {raw[:300]!r}", connection=False
                        )
                    return self._parse(sample_id, body)
                detail = raw[:300].decode("utf-8", "replace")
                if resp.status == 429 or resp.status >= 500:
                    raise _Retryable(
                        f"HTTP {resp.status} from {endpoint}: {detail}",
                        connection=False,
                        retry_after=_retry_after(resp.headers.get("Retry-After")),
                    )
                return Result(id=sample_id, error=f"HTTP {resp.status} from {endpoint}: {detail}")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise _Retryable(f"{type(exc).__name__} on {endpoint}: {exc}", connection=True) from exc
        except asyncio.TimeoutError as exc:
            raise _Retryable(
                f"no answer from {endpoint} within {self.settings.request_timeout_s:g}s",
                connection=False,
            ) from exc
        except orjson.JSONDecodeError as exc:
            raise _Retryable(f"malformed answer from {endpoint}: {exc}", connection=False) from exc
        except aiohttp.ClientError as exc:  # e.g. a garbled status line: a sample, not the run
            raise _Retryable(
                f"{type(exc).__name__} from {endpoint}: {exc}", connection=False
            ) from exc

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        s = self.settings
        delay = min(s.backoff_max_s, s.backoff_base_s * 2**attempt)
        delay = delay * (0.5 + self._rng.random() / 2)  # jitter: retries of a burst spread out
        if retry_after is not None:
            delay = max(delay, min(retry_after, s.backoff_max_s))
        return delay

    async def _any_healthy(self, session: aiohttp.ClientSession) -> bool:
        checks = [health(session, e, self.settings.health_timeout_s) for e in self.in_flight]
        return any(await asyncio.gather(*checks))


async def health(session: aiohttp.ClientSession, endpoint: str, timeout_s: float) -> bool:
    try:
        async with session.get(
            f"{endpoint}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def reachable(endpoints: Sequence[str], timeout_s: float = 5.0) -> list[str]:
    """The endpoints among `endpoints` whose `/health` answers 200 now."""

    async def check() -> list[str]:
        async with aiohttp.ClientSession() as session:
            ok = await asyncio.gather(*(health(session, e, timeout_s) for e in endpoints))
        return [e for e, good in zip(endpoints, ok, strict=True) if good]

    return asyncio.run(check())


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None
