"""Benchmark: how full generation keeps the engine, old rounds against the continuous schedule.

The project's own scheduler (`draftline.generation.schedule.Scheduler`, and `stream_shards`,
which picks the shards a generate stage works on) drives a simulated engine with virtual time,
so a run of days takes seconds and nothing but the schedule differs between the two figures:

- the engine has `--slots` decode slots; a request holds one from its start to its end, for
  `--prefill-s` per prompt token plus `--decode-s` per output token; requests beyond the slots
  wait in its queue, higher priority first (the SGLang client's order);
- conversations (`--conversations` per shard, `--shards` shards) have 1 to `--max-turns`
  assistant turns (geometric, mean `--mean-turns`); every answer's length is log-normal with
  mean `--mean-tokens`, capped at `--max-tokens`; the first prompt is log-normal (mean
  `--prompt-tokens`, at most 2,048) and each later turn's prompt grows by the earlier answer as
  history keeps it (`--history-share` of it: Qwen templates drop earlier reasoning) and a user
  message of about 100 tokens; all drawn from `--seed`, and an answer's length is a function of
  its request, so the order results arrive in changes nothing;
- the shards run as `dvc repro` runs the generate stages, one after another on the same engine:
  `rounds` is what generate did before (turn k of every conversation of the shard, wait for all,
  then turn k+1, shard after shard); `continuous` is what it does now, each stage streaming its
  shard and the next `--work-ahead-shards` shards (the GPU profiles' `work_ahead_shards`); a
  stage whose shard was finished by an earlier stage's work-ahead only writes its table. With
  `--no-work-ahead` the continuous schedule is also run with each stage on its own shard.

Slot utilisation is busy slot-time over slots x simulated wall time; the ideal wall time is the
work (prefill + decode, slot-seconds) over the slots. Goal: continuous >= 0.95 at 2,048 slots
over 8 shards of 14,000 conversations (a few minutes on 2 cores; `--json PATH` writes the
figures). The last line is `utilisation continuous=<x.xxx> rounds=<y.yyy>`.

    python benchmarks/generation_schedule.py [--slots 2048] [--shards 8] [--conversations 14000]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from draftline.generation.engines.base import Request, Result
from draftline.generation.schedule import Scheduler, stream_shards

USER_TOKENS = 100  # mean tokens of a user message after the first


class Tokens:
    """Token ids the simulation never looks at: only their number counts."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


@dataclass
class Conversation:
    """One simulated conversation: a `Work` for the scheduler."""

    order: tuple[int, int]
    group: int
    id: str
    outputs: list[int]  # answer tokens of each turn
    prompts: list[int]  # prompt tokens of each turn
    done: int = 0

    def remaining_turns(self) -> int:
        return len(self.outputs) - self.done

    def next_request(self) -> Request:
        k = self.done
        return Request(f"{self.id}#{k}", Tokens(self.prompts[k]))  # type: ignore[arg-type]


@dataclass
class Shard:
    index: int
    conversations: list[Conversation]

    def remaining(self) -> int:
        return sum(c.remaining_turns() for c in self.conversations)


def lognormal_mu(mean: float, sigma: float, cap: float) -> float:
    """mu of a log-normal with `sigma` whose mean, capped at `cap`, is `mean`."""

    def capped_mean(mu: float) -> float:
        z = (math.log(cap) - mu - sigma**2) / sigma
        body = math.exp(mu + sigma**2 / 2) * 0.5 * (1 + math.erf(z / math.sqrt(2)))
        tail = cap * 0.5 * math.erfc(((math.log(cap) - mu) / sigma) / math.sqrt(2))
        return body + tail

    low, high = 0.0, math.log(cap)
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if capped_mean(mid) < mean else (low, mid)
    return (low + high) / 2


def workload(args: argparse.Namespace) -> list[Shard]:
    rng = np.random.default_rng(args.seed)
    out_mu = lognormal_mu(args.mean_tokens, args.sigma, args.max_tokens)
    prompt_mu = lognormal_mu(args.prompt_tokens, args.sigma, 2048)
    shards = []
    for s in range(args.shards):
        n = args.conversations
        turns = np.minimum(rng.geometric(1 / args.mean_turns, n), args.max_turns)
        total = int(turns.sum())
        answers = np.minimum(rng.lognormal(out_mu, args.sigma, total), args.max_tokens)
        answers = np.maximum(answers.round(), 1).astype(np.int64)
        users = rng.poisson(USER_TOKENS, total)
        firsts = np.minimum(rng.lognormal(prompt_mu, args.sigma, n), 2048).round().astype(int)
        conversations = []
        at = 0
        for i in range(n):
            t = int(turns[i])
            outs = answers[at : at + t].tolist()
            grow = (answers[at : at + t - 1] * args.history_share).astype(np.int64)
            grow = grow + users[at + 1 : at + t]
            prompts = [int(firsts[i]), *(int(firsts[i]) + np.cumsum(grow)).tolist()]
            at += t
            conversations.append(Conversation((s, i), s, f"s{s}c{i}", outs, prompts))
        shards.append(Shard(s, conversations))
    return shards


class SimulatedEngine:
    """`--slots` decode slots in virtual time; an answer's length is its request's (the
    workload's), whenever it is asked."""

    name = "simulated"

    def __init__(self, slots: int, decode_s: float, prefill_s: float, answers: dict[str, int]):
        self.max_in_flight = slots
        self.decode_s, self.prefill_s = decode_s, prefill_s
        self.answers = answers
        self.now = 0.0
        self.busy_s = 0.0  # slot-seconds of work done (prefill + decode)
        self.prefill_tokens = self.output_tokens = 0
        self._queue: list[tuple[int, int, Request]] = []
        self._running: list[tuple[float, int, str, int]] = []
        self._seq = 0

    def identity(self) -> str:
        return self.name

    def submit(self, requests: Sequence[Request]) -> None:
        for r in requests:
            self._seq += 1
            heapq.heappush(self._queue, (-r.priority, self._seq, r))
        self._start()

    def results(self) -> list[Result]:
        if not self._running:
            return []
        self.now = self._running[0][0]
        done = []
        while self._running and self._running[0][0] <= self.now:
            _, _, rid, n = heapq.heappop(self._running)
            done.append(Result(rid, Tokens(n), "stop"))  # type: ignore[arg-type]
        self._start()
        return done

    def generate(self, requests, on_result):  # pragma: no cover - the Engine protocol's
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _start(self) -> None:
        while self._queue and len(self._running) < self.max_in_flight:
            _, seq, r = heapq.heappop(self._queue)
            n = self.answers[r.id]
            work = len(r.prompt_ids) * self.prefill_s + n * self.decode_s
            self.busy_s += work
            self.prefill_tokens += len(r.prompt_ids)
            self.output_tokens += n
            heapq.heappush(self._running, (self.now + work, seq, r.id, n))


@dataclass
class Figures:
    schedule: str
    work_ahead_shards: int
    turns: int = 0
    output_tokens: int = 0
    prefill_tokens: int = 0
    wall_s: float = 0.0
    ideal_s: float = 0.0
    utilisation: float = 0.0
    mean_submitted: float = 0.0  # requests submitted and not back (rounds: queued ones too)
    peak_submitted: int = 0
    streams: list[list[int]] = field(default_factory=list)  # the shards each stage streamed
    cpu_s: float = 0.0


def simulate(args: argparse.Namespace, schedule: str, work_ahead: int) -> Figures:
    began = time.process_time()
    shards = workload(args)
    answers = {
        f"{c.id}#{k}": n for s in shards for c in s.conversations for k, n in enumerate(c.outputs)
    }
    engine = SimulatedEngine(args.slots, args.decode_s, args.prefill_s, answers)
    figures = Figures(schedule, work_ahead)
    in_flight_s = 0.0

    def on_result(work: Conversation, result: Result) -> None:  # the stage journals it here
        expected = f"{work.id}#{work.done}"
        if result.id != expected or len(result.completion_ids) != work.outputs[work.done]:
            raise AssertionError(f"{result.id}: not the turn or answer asked ({expected})")
        work.done += 1
        figures.turns += 1

    ids = [s.index for s in shards]
    for own in ids:  # dvc repro: generate@0, generate@1, ... on the same engine
        if not shards[own].remaining():
            continue  # finished by an earlier stage's work-ahead: the stage writes its table
        stream = stream_shards(own, ids, work_ahead, lambda s: shards[s].remaining() > 0)
        figures.streams.append(stream)
        scheduler = Scheduler(engine, on_result, schedule=schedule, clock=lambda: engine.now)
        scheduler.run(c for s in stream for c in shards[s].conversations)
        in_flight_s += scheduler.in_flight_s
        figures.peak_submitted = max(figures.peak_submitted, scheduler.peak_in_flight)
    assert all(not s.remaining() for s in shards), "a turn was never generated"
    assert figures.turns == len(answers), "a turn was generated twice"
    figures.output_tokens, figures.prefill_tokens = engine.output_tokens, engine.prefill_tokens
    figures.wall_s = engine.now
    figures.ideal_s = engine.busy_s / args.slots
    figures.utilisation = figures.ideal_s / figures.wall_s if figures.wall_s else 0.0
    figures.mean_submitted = in_flight_s / figures.wall_s if figures.wall_s else 0.0
    figures.cpu_s = time.process_time() - began
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--slots", type=int, default=2048, help="decode slots (requests at once)")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--conversations", type=int, default=14000, help="per shard")
    p.add_argument("--work-ahead-shards", type=int, default=7, help="continuous: shards ahead")
    p.add_argument("--mean-turns", type=float, default=3.0)
    p.add_argument("--max-turns", type=int, default=30)
    p.add_argument("--mean-tokens", type=float, default=2300.0, help="mean answer tokens")
    p.add_argument("--max-tokens", type=int, default=8192, help="answer cap (max_new_tokens)")
    p.add_argument("--sigma", type=float, default=0.8, help="log-normal sigma of lengths")
    p.add_argument("--prompt-tokens", type=float, default=500.0, help="mean first prompt")
    p.add_argument("--history-share", type=float, default=0.25, help="answer kept in history")
    # B200-like at 2,048 slots: ~22,500 output tok/s over the node (2048 / 0.09 s), prefill
    # ~6x cheaper per token in slot-time (a 27B forward at ~40% MFU over 8 GPUs).
    p.add_argument("--decode-s", type=float, default=0.09, help="seconds per output token")
    p.add_argument("--prefill-s", type=float, default=0.015, help="seconds per prompt token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-work-ahead", action="store_true", help="also continuous, no work-ahead")
    p.add_argument("--json", type=Path, help="write the figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = [("rounds", 0), ("continuous", args.work_ahead_shards)]
    if args.no_work_ahead:
        runs.insert(1, ("continuous", 0))
    print(
        f"{args.slots:,} slots, {args.shards} shards x {args.conversations:,} conversations, "
        f"turns 1-{args.max_turns} mean {args.mean_turns:g}, answers mean {args.mean_tokens:,.0f} "
        f"tokens (cap {args.max_tokens:,}), decode {args.decode_s:g} s/token, prefill "
        f"{args.prefill_s:g} s/prompt token, seed {args.seed}"
    )
    results = []
    for schedule, ahead in runs:
        f = simulate(args, schedule, ahead)
        results.append(f)
        label = schedule if schedule == "rounds" else f"{schedule}, work-ahead {ahead}"
        print(
            f"{label:>26}: {f.turns:,} turns, {f.output_tokens:,} output + {f.prefill_tokens:,} "
            f"prompt tokens; wall {f.wall_s / 3600:,.1f} h vs ideal {f.ideal_s / 3600:,.1f} h "
            f"(x{f.wall_s / f.ideal_s:.2f}); utilisation {f.utilisation:.3f}; "
            f"{len(f.streams)} streams; {f.cpu_s:.1f} CPU s"
        )
    by = {(f.schedule, f.work_ahead_shards): f for f in results}
    continuous, rounds = by[("continuous", args.work_ahead_shards)], by[("rounds", 0)]
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        report = {"args": settings, "runs": [f.__dict__ for f in results]}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"utilisation continuous={continuous.utilisation:.3f} rounds={rounds.utilisation:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
