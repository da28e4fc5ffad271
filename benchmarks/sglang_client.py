"""Benchmark: the SGLang client (draftline.generation.engines.sglang) against a stand-in
answering at once.

SGLang needs a GPU, so the server is the stand-in of the tests (tests/helpers/sglang_standin.py:
SGLang's native `/generate` and `/health`), run as separate processes with no delay, so that the
client's own cost is what is measured: requests/s it sustains with `--in-flight` requests open, and
the CPU seconds of the client process (user + system, all its threads) per 1,000 output tokens. The
client runs in this process and the stand-ins in theirs; on a machine with at least 2 cores the
client is pinned to one core and the stand-ins to the others (`--no-pin` to leave them free).

Two workloads: `short` answers (~20 tokens; the request rate is what counts) and `long` answers
(`--long-tokens`, default 2,500, the seed run's average per sample: the tokens are what counts).
Each timed run is one `generate` call, as a shard stage makes it: connection setup included.

    python benchmarks/sglang_client.py [--requests 20000] [--in-flight 1000] [--servers 1]
        [--prompt-tokens 300] [--long-tokens 2500] [--long-requests 5000] [--target 500]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from draftline.generation import server_process
from draftline.generation.engines.base import Request, Result, Sampling
from draftline.generation.engines.sglang import ClientSettings, SGLangEngine

REPO = Path(__file__).resolve().parents[1]
STANDIN = REPO / "tests" / "helpers" / "sglang_standin.py"
END_OF_TURN = 2
THINK_START, THINK_END = 3, 4


@dataclass
class Figures:
    workload: str
    requests: int
    completed: int
    errors: int
    output_tokens: int
    wall_s: float
    client_cpu_s: float
    server_cpu_s: float

    @property
    def req_s(self) -> float:
        return self.completed / self.wall_s

    @property
    def cpu_per_1k_tokens(self) -> float:
        return self.client_cpu_s / self.output_tokens * 1000

    @property
    def cpu_bound_req_s(self) -> float:
        """Requests/s the client's CPU cost allows on one core of its own."""
        return self.requests / self.client_cpu_s

    @property
    def cpu_ms_per_request(self) -> float:
        return self.client_cpu_s / self.requests * 1000


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str


def start_standins(n: int, think_tokens: int, cores: set[int] | None) -> list[Server]:
    servers = []
    for _ in range(n):
        port = free_port()
        args = [
            sys.executable,
            str(STANDIN),
            "--port",
            str(port),
            "--think-start",
            str(THINK_START),
            "--think-end",
            str(THINK_END),
            "--vocab-low",
            "10",
            "--vocab-high",
            "30000",
            "--think-tokens",
            str(think_tokens),
        ]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        if cores:
            os.sched_setaffinity(proc.pid, cores)
        servers.append(Server(proc, f"http://127.0.0.1:{port}"))
    for server in servers:
        wait_healthy(server.url)
    return servers


def wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not server_process.healthy(url, timeout_s=1.0):
        if time.monotonic() > deadline:
            raise SystemExit(f"stand-in at {url} did not come up")
        time.sleep(0.05)


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def requests_for(n: int, prompt_tokens: int, offset: int = 0) -> list[Request]:
    return [
        Request(
            f"b{offset + i:08d}",
            [1, *((offset + i + k) % 29000 + 10 for k in range(prompt_tokens))],
        )
        for i in range(n)
    ]


def run_once(
    workload: str,
    servers: list[Server],
    requests: list[Request],
    in_flight: int,
    max_new_tokens: int,
) -> Figures:
    settings = ClientSettings(
        endpoints=tuple(s.url for s in servers),
        max_in_flight=in_flight,
        request_timeout_s=120,
        max_retries=3,
        backoff_base_s=0.05,
        backoff_max_s=1.0,
    )
    engine = SGLangEngine(settings, Sampling(max_new_tokens=max_new_tokens), END_OF_TURN)
    results: list[Result] = []
    server_cpu = [process_cpu_s(s.proc.pid) for s in servers]
    cpu0, t0 = self_cpu_s(), time.perf_counter()
    engine.generate(requests, results.append)
    wall, cpu = time.perf_counter() - t0, self_cpu_s() - cpu0
    server_cpu_s = sum(
        process_cpu_s(s.proc.pid) - c for s, c in zip(servers, server_cpu, strict=True)
    )
    errors = sum(r.finish_reason == "error" for r in results)
    return Figures(
        workload=workload,
        requests=len(requests),
        completed=len(results) - errors,
        errors=errors,
        output_tokens=sum(len(r.completion_ids) for r in results),
        wall_s=wall,
        client_cpu_s=cpu,
        server_cpu_s=server_cpu_s,
    )


def bench(
    workload: str,
    args: argparse.Namespace,
    n: int,
    think_tokens: int,
    server_cores: set[int] | None,
) -> Figures:
    servers = start_standins(args.servers, think_tokens, server_cores)
    try:
        max_new = think_tokens + 64
        run_once(
            workload,
            servers,
            requests_for(min(n, 2000), args.prompt_tokens, 10**7),
            args.in_flight,
            max_new,
        )  # warm-up: imports, first connections
        runs = [
            run_once(
                workload,
                servers,
                requests_for(n, args.prompt_tokens, r * n),
                args.in_flight,
                max_new,
            )
            for r in range(args.repeats)
        ]
    finally:
        for server in servers:
            server.proc.kill()
            server.proc.wait()
    return max(runs, key=lambda f: f.req_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000, help="short-answer requests a run")
    parser.add_argument("--long-requests", type=int, default=5_000, help="long-answer requests")
    parser.add_argument("--long-tokens", type=int, default=2_500, help="think tokens, long answers")
    parser.add_argument("--in-flight", type=int, default=1_000)
    parser.add_argument("--servers", type=int, default=1, help="stand-in processes (endpoints)")
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs each; best reported")
    parser.add_argument("--target", type=float, default=500.0, help="requests/s to sustain")
    parser.add_argument("--no-pin", action="store_true", help="do not pin client and stand-ins")
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    client_cores = server_cores = None
    if len(cores) >= 2 and not args.no_pin:
        client_cores, server_cores = {cores[0]}, set(cores[1:])
        os.sched_setaffinity(0, client_cores)
    placement = (
        f"client on core {cores[0]}, stand-ins on {sorted(server_cores)}"
        if server_cores
        else f"unpinned on {len(cores)} core(s)"
    )
    print(
        f"{os.cpu_count()} CPUs, {len(cores)} usable; {placement}; python {sys.version.split()[0]}"
    )
    print(
        f"{args.in_flight} in flight, {args.servers} stand-in process(es), "
        f"{args.prompt_tokens}-token prompts, best of {args.repeats} timed runs after a warm-up\n"
    )
    figures = [
        bench("short", args, args.requests, 0, server_cores),
        bench(
            f"long ({args.long_tokens})", args, args.long_requests, args.long_tokens, server_cores
        ),
    ]
    load = os.getloadavg()[0]
    header = (
        f"{'workload':<14}{'requests':>9}{'errors':>7}{'out tokens':>12}{'wall s':>8}"
        f"{'req/s':>8}{'out tok/s':>11}{'client CPU s':>13}{'CPU ms/req':>11}"
        f"{'CPU s/1k tok':>13}{'CPU-bound req/s':>16}{'server CPU s':>13}"
    )
    print(header)
    print("-" * len(header))
    for f in figures:
        print(
            f"{f.workload:<14}{f.requests:>9}{f.errors:>7}{f.output_tokens:>12,}{f.wall_s:>8.2f}"
            f"{f.req_s:>8,.0f}{f.output_tokens / f.wall_s:>11,.0f}{f.client_cpu_s:>13.2f}"
            f"{f.cpu_ms_per_request:>11.3f}{f.cpu_per_1k_tokens:>13.4f}"
            f"{f.cpu_bound_req_s:>16,.0f}{f.server_cpu_s:>13.2f}"
        )
    print(
        "\nreq/s: answered requests per wall second, connection setup included. CPU: user +"
        " system of the\nclient process. CPU-bound req/s: requests per client CPU second, the"
        " rate one free core\nwould sustain. Load average at the end: "
        f"{load:.1f} (other programs on the machine slow the wall figures)."
    )
    short, long = figures
    verdict = "meets" if short.req_s >= args.target and not short.errors else "BELOW"
    print(
        f"\nshort answers: {short.req_s:,.0f} requests/s with {args.in_flight} in flight "
        f"({verdict} the {args.target:g} requests/s target; CPU-bound "
        f"{short.cpu_bound_req_s:,.0f}/s), client CPU {short.cpu_ms_per_request:.3f} ms a "
        f"request = {short.cpu_per_1k_tokens:.4f} s per 1,000 output tokens;\n"
        f"{args.long_tokens}-token answers: {long.req_s:,.0f} requests/s, "
        f"{long.output_tokens / long.wall_s:,.0f} output tok/s, client CPU "
        f"{long.cpu_per_1k_tokens:.4f} s per 1,000 output tokens"
    )
    return 0 if verdict == "meets" else 1


if __name__ == "__main__":
    raise SystemExit(main())
