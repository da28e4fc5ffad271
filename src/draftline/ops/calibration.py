"""Calibration: the generate, extract and train figures of this node, measured in minutes on a
sample of the curated data, for `draftline plan` to use instead of conf/ estimates.

Each part runs the code its stage runs: generation through the engine `draftline generate`
builds (`make_engine`), with the production scheduler and its in-flight cap, every turn of a
sample of curated conversations, until its time is spent; extraction and training through
`ops.calibration_parts` on the target and drafter params.yaml names, over the sequences the
generation part produced (prompt + completion of each turn, capped at extract.max_length).

Nothing is written but the result, `logs/calibration/<profile>.json` (git-ignored, outside every
DVC output and journal): the generated turns stay in memory and are dropped, so a kill leaves
nothing a later run or salvage would pick up. The result is keyed by what decides its figures
(target id, data, drafter, features, profile, engine and package versions); `stale_reasons`
says why one no longer applies.
"""

from __future__ import annotations

import importlib.metadata
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path
from typing import Any

from draftline.runtime.params import identity as run_identity

CALIBRATION_DIR = Path("logs/calibration")
CURATED_TRAIN = Path("data/curated/train")
SCHEMA = "draftline.calibration/1"
PARTS = ("generate", "extract", "train")
# Share of the time budget per part: generation is the long stage and the slowest to settle.
SHARES = {"generate": 0.5, "extract": 0.25, "train": 0.25}
VERSIONED = ("draftline", "torch", "transformers", "sglang", "vllm")

Say = Callable[[str], None]


class PartSkipped(Exception):
    """A part cannot run here; the message says why in one line."""


def calibration_path(profile: str, folder: Path = CALIBRATION_DIR) -> Path:
    return folder / f"{profile}.json"


def split_budget(minutes: float, parts: Sequence[str]) -> dict[str, float]:
    """Seconds per part: `SHARES` of the budget, over the parts asked for."""
    total = sum(SHARES[p] for p in parts)
    return {p: minutes * 60.0 * SHARES[p] / total for p in parts}


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def key_of(p: dict[str, Any], profile: dict[str, Any], engine: str | None) -> dict[str, Any]:
    """What decides a calibration's figures: a change to any of them makes it stale."""
    drafter = p.get("drafter") or {}
    return {
        **run_identity(p),
        "target_id": (p.get("model") or {}).get("target_id"),
        "drafter_family": drafter.get("family") or "dflash",
        "block_size": drafter.get("block_size"),
        "max_anchors": drafter.get("max_anchors"),
        "features": str((p.get("extract") or {}).get("features", "offline")),
        "hardware_profile": profile.get("name"),
        "engine": engine,
        "versions": versions(),
        "date": date.today().isoformat(),
    }


def read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None


def stale_reasons(record: dict[str, Any], p: dict[str, Any]) -> list[str]:
    """Why a calibration no longer describes params.yaml on this node: another target, data,
    drafter or features, or other package versions than it was measured with."""
    now = key_of(p, {}, None)
    reasons = [
        f"{k} {record.get(k)!r} -> {now[k]!r}"
        for k in ("model", "target_id", "data", "drafter", "drafter_family", "features")
        if record.get(k) != now[k]
    ]
    was = record.get("versions") or {}
    reasons += [
        f"{name} {was.get(name)} -> {now['versions'].get(name)}"
        for name in sorted(set(was) | set(now["versions"]))
        if was.get(name) != now["versions"].get(name)
    ]
    return reasons


def distribution(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    return {
        "mean": round(statistics.fmean(ordered), 2),
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
        "max": float(ordered[-1]),
        "count": len(ordered),
    }


class TimeBar:
    """A progress bar over a part's time budget: elapsed seconds, its ETA, and a rate."""

    def __init__(self, what: str, budget_s: float, enabled: bool) -> None:
        from tqdm import tqdm

        self.began = time.monotonic()
        self.budget_s = budget_s
        self.tokens = 0
        self.bar = tqdm(
            total=round(budget_s),
            desc=f"calibrate {what}",
            unit="s",
            disable=not enabled,
            mininterval=1.0,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s "
            "[ETA {remaining}{postfix}]",
        )

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        elapsed = time.monotonic() - self.began
        self.bar.n = min(self.bar.total, round(elapsed))
        self.bar.set_postfix_str(f"{self.tokens / max(elapsed, 1e-9):,.0f} tok/s", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


# ---------------------------------------------------------------------------------------------
# generate


class _Sampled:
    """A sampled conversation as the scheduler's `Work`, with no turn asked after `deadline`
    (the turns in flight then still finish)."""

    __slots__ = ("conversation", "order", "group", "failed", "_tokenizer", "_special", "_end")

    def __init__(self, conversation: Any, tokenizer: Any, special: Any, deadline: float) -> None:
        self.conversation = conversation
        self.order = (0, conversation.id)
        self.group = "calibrate"
        self.failed = False
        self._tokenizer, self._special, self._end = tokenizer, special, deadline

    def remaining_turns(self) -> int:
        if self.failed or time.monotonic() >= self._end:
            return 0
        return self.conversation.remaining_turns()

    def next_request(self) -> Any:
        from draftline.generation.engines.base import Result

        if time.monotonic() >= self._end:
            return None
        asked = self.conversation.next_request(self._tokenizer, self._special)
        if isinstance(asked, Result):  # its prompt cannot be built: left out of the sample
            self.failed = True
            return None
        return asked


class _Timed:
    """The engine, with the time and output tokens of each collection of results (the
    scheduler's `results()` calls), for a rate over whole batches."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.max_in_flight = engine.max_in_flight
        self.started = time.monotonic()
        self.collected: list[tuple[float, int]] = []  # (time, output tokens) per collection

    def submit(self, requests: Any) -> None:
        self.engine.submit(requests)

    def results(self) -> list[Any]:
        finished = self.engine.results()
        tokens = sum(len(r.completion_ids) for r in finished if r.finish_reason != "error")
        self.collected.append((time.monotonic(), tokens))
        return finished


def sample_conversations(
    p: dict[str, Any], identity: Any, count: int, folder: Path = CURATED_TRAIN
) -> list[Any]:
    """Up to `count` curated train conversations, drawn at random (seeded) over the shards."""
    import pyarrow.parquet as pq

    from draftline.core.turn_prompts import regenerated_turns
    from draftline.data.conversations import messages_from_records
    from draftline.generation.turns import Conversation

    shards = sorted(folder.glob("shard-*.parquet"))
    if not shards:
        raise PartSkipped(f"no curated shards under {folder}/: run `dvc repro curate` first")
    rows = [r for s in shards for r in pq.read_table(s, columns=["id", "messages"]).to_pylist()]
    rows = random.Random(0).sample(rows, min(count, len(rows)))
    conversations = []
    for r in rows:
        messages = messages_from_records(r["messages"])
        conversations.append(
            Conversation(
                r["id"],
                messages,
                regenerated_turns(messages, identity.regenerate_turns),
                identity.kwargs_for(r["id"]),
                sampling=identity.sampling,
            )
        )
    return conversations


def measure_generation(
    p: dict[str, Any], profile: dict[str, Any], budget_s: float, say: Say, progress: bool
) -> tuple[dict[str, Any], list[list[int]]]:
    """Generate turns of sampled conversations for `budget_s` seconds: the figures, and every
    generated turn's sequence (prompt + completion ids) for the extract and train parts."""
    from draftline.core import target
    from draftline.core.loss_mask import special_ids
    from draftline.generation.engines.choose import make_engine, sampling_from
    from draftline.generation.schedule import Scheduler
    from draftline.generation.table_record import Identity
    from draftline.generation.turns import turn_row

    model, gen, data = p["model"], p["generate"], p.get("data") or {}
    sampling = sampling_from(gen, model)
    tokenizer = target.load_tokenizer(model)
    special = special_ids(tokenizer, str(model.get("end_of_turn_token", "<|im_end|>")))
    identity = Identity(
        model=target.model_ref(model),
        template_kwargs=dict(model.get("chat_template_kwargs") or {}),
        sampling=sampling,
        thinking_share=float(data.get("thinking_share", 1.0)),
        regenerate_turns=str(data.get("regenerate_turns", "all")),
    )
    began = time.monotonic()
    engine = make_engine(p, profile, sampling, tokenizer, special.end_of_turn)
    setup_s = time.monotonic() - began
    say(f"generate: engine {engine.identity()} ready in {setup_s:.0f} s")
    try:
        # Enough conversations to keep the engine full for the whole budget.
        conversations = sample_conversations(p, identity, max(64, 8 * engine.max_in_flight))
        bar = TimeBar("generate", budget_s, progress)
        deadline = time.monotonic() + budget_s
        turns: list[dict[str, Any]] = []
        reasons: Counter[str] = Counter()
        sequences: list[list[int]] = []
        cache = PrefixCache()

        def on_result(work: _Sampled, result: Any) -> None:
            conversation = work.conversation
            k = len(conversation.results)
            result = conversation.take(result)
            reasons[result.finish_reason] += 1
            cache.add(result)
            if result.finish_reason == "error":
                work.failed = True
                return
            conversation.results.append(result)
            prompt = conversation.prompt(tokenizer, special, k).ids
            row = turn_row(prompt, result, special, conversation.thinking)
            turns.append({**row, "turn": k})
            sequences.append(prompt + row["completion_ids"])
            bar.add(row["num_completion_tokens"])

        timed = _Timed(engine)
        scheduler = Scheduler(
            timed,  # type: ignore[arg-type]
            on_result,  # type: ignore[arg-type]
            schedule=str(profile.get("generation_schedule") or "continuous"),
        )
        try:
            works = [_Sampled(c, tokenizer, special, deadline) for c in conversations]
            timed.started = time.monotonic()
            scheduler.run(works)
        finally:
            bar.close()
        figures = generation_figures(turns, timed, conversations)
        figures.update(
            {
                "engine": engine.identity(),
                "engine_setup_s": round(setup_s, 1),
                "budget_s": round(budget_s, 1),
                "running_cap": scheduler.limit,
                "mean_in_flight": round(scheduler.mean_in_flight(), 2),
                "peak_in_flight": scheduler.peak_in_flight,
                "finish_reasons": dict(reasons),
                "prefix_cache": cache.figures(),
                "sampled_conversations": len(conversations),
            }
        )
    finally:
        engine.close()
    return figures, sequences


class PrefixCache:
    """Prompt tokens the engine served from its prefix cache, over the turns that say (SGLang's
    `meta_info.cached_tokens`; vLLM's `usage.prompt_tokens_details` when it is started with
    `--enable-prompt-tokens-details`): a multi-turn conversation's later turns should find
    their history cached, and a low share means the engine evicts it between turns."""

    def __init__(self) -> None:
        self.turns = self.prompt_tokens = self.cached_tokens = 0

    def add(self, result: Any) -> None:
        if result.prompt_tokens is None or result.cached_tokens is None:
            return
        self.turns += 1
        self.prompt_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens

    def figures(self) -> dict[str, Any] | str:
        if not self.turns:
            return "not reported by this engine"
        return {
            "turns": self.turns,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_share": round(self.cached_tokens / max(1, self.prompt_tokens), 4),
        }


def generation_figures(
    turns: list[dict[str, Any]], timed: _Timed, conversations: list[Any]
) -> dict[str, Any]:
    """Steady-state output tok/s (the collections after the first: the first carries the
    engine's warm-up) and the lengths of the turns, their distributions."""
    if not turns:
        raise PartSkipped("no turn finished within the budget: give it more --minutes")
    collected = timed.collected
    if len(collected) >= 2 and collected[-1][0] > collected[0][0]:
        tokens = sum(n for _, n in collected[1:])
        rate = tokens / (collected[-1][0] - collected[0][0])
        warm = f"steady state: {len(collected) - 1} collections after the first"
    else:  # one collection only: from the first submission, warm-up included
        rate = collected[0][1] / (collected[0][0] - timed.started)
        warm = "one collection only: warm-up included"
    asked = [len(c.turns) for c in conversations]
    finished = [c for c in conversations if c.done()]
    return {
        "output_tok_s": round(rate, 2),
        "steady_state": warm,
        "turns_generated": len(turns),
        "output_tokens": sum(t["num_completion_tokens"] for t in turns),
        "completion_tokens": distribution([t["num_completion_tokens"] for t in turns]),
        "think_tokens": distribution([t["think_tokens"] for t in turns]),
        "answer_tokens": distribution([t["answer_tokens"] for t in turns]),
        "turn_prompt_tokens": distribution([t["num_prompt_tokens"] for t in turns]),
        "first_prompt_tokens": distribution(
            [t["num_prompt_tokens"] for t in turns if t["turn"] == 0]
        ),
        # The turns generate is asked for per conversation (the curated structure), and those
        # written where a conversation finished (a cut turn ends it early).
        "turns_per_conversation": distribution(asked),
        "turns_per_finished_conversation": distribution([len(c.results) for c in finished]),
    }


# ---------------------------------------------------------------------------------------------
# extract and train


def training_sequences(
    sequences: list[list[int]], p: dict[str, Any]
) -> tuple[list[list[int]], str]:
    """The generated turns capped at extract.max_length; without any, random tokens at the
    lengths the data profile estimates (said in the source)."""
    max_length = int((p.get("extract") or {}).get("max_length") or p["drafter"]["max_length"])
    if sequences:
        return [s[:max_length] for s in sequences], "the generated turns of this calibration"
    estimate = (p.get("data") or {}).get("estimate") or {}
    length = int(estimate.get("prompt_tokens", 0) + estimate.get("completion_tokens", 0))
    if length <= 0:
        raise PartSkipped("no generated turns and no data.estimate lengths to shape sequences")
    vocab = int(p["model"]["vocab_size"])
    gen = random.Random(1)
    rows = [[gen.randrange(vocab) for _ in range(min(length, max_length))] for _ in range(64)]
    return rows, f"random tokens at data.estimate's {length} tokens (generate did not run)"


def _device(profile: dict[str, Any]) -> tuple[Any, Any]:
    import torch

    from draftline.runtime import distributed, hardware

    execution = hardware.Execution.of(profile)
    if execution.on_gpu and not torch.cuda.is_available():
        raise PartSkipped(f"profile {execution.name} wants {execution.device}; no GPU visible")
    execution.set_threads()
    device = distributed.device(execution.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return execution, device


def measure_extraction(
    p: dict[str, Any], profile: dict[str, Any], sequences: list[list[int]], budget_s: float,
    progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """The target forward as extraction runs it, over the measured sequences."""
    from draftline.core.target import load_model
    from draftline.ops import calibration_parts as parts
    from draftline.runtime import distributed

    execution, device = _device(profile)
    rows, source = training_sequences(sequences, p)
    # As the stage does: each process extracts its share of the sequences with a whole target.
    rank, world = parts.join_world(device)
    rows = (rows * -(-world // len(rows)))[rank::world]  # a share of at least one each
    model = load_model(p["model"], device=str(device), dtype=execution.precision)
    layer_ids = [int(i) for i in p["model"]["target_layer_ids"]]
    bar = TimeBar("extract", budget_s, progress and rank == 0)
    try:
        result = parts.time_extraction(
            model, rows, layer_ids, execution.extract_tokens_per_batch, device,
            budget_s=budget_s, on_batch=bar.add,
        )  # fmt: skip
        result = node_extraction(result, world)
    finally:
        bar.close()
        distributed.close()
    peak, peak_source = parts.peak_flops(device)
    parts.add_mfu(result, peak, world)
    return {**result, "sequences_from": source, "peak_source": peak_source}


def node_extraction(result: dict[str, Any], world: int) -> dict[str, Any]:
    """One process's extraction figures as the node's: tokens summed over the processes, over
    the slowest one's seconds."""
    from draftline.runtime import distributed

    summed = ("sequences", "tokens", "padded_tokens", "flops")
    totals = distributed.all_sum([result[k] or 0 for k in summed])
    seconds = distributed.all_max(result["seconds"])
    node = {**result, **{k: int(v) for k, v in zip(summed, totals, strict=True)}}
    if result["flops"] is None:
        node["flops"] = None
    peak = result["peak_gpu_bytes"]
    return {
        **node,
        "seconds": seconds,
        "tokens_per_s": node["tokens"] / seconds,
        "peak_gpu_bytes_max": None if peak is None else int(distributed.all_max(peak)),
        "world_size": world,
    }


def measure_training(
    p: dict[str, Any], profile: dict[str, Any], sequences: list[list[int]], budget_s: float,
    progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """The training step as configured (features, family, block, anchors, layout, precision,
    micro-batch), on a micro-batch drawn across the measured lengths."""
    from draftline.core.target import load_model
    from draftline.drafter.build import Hyperparameters, drafter_config
    from draftline.drafter.dflash import TargetHead
    from draftline.drafter.sharding import Layout
    from draftline.ops import calibration_parts as parts
    from draftline.runtime import distributed

    execution, device = _device(profile)
    hp = Hyperparameters.from_params(p["drafter"])
    rows, source = training_sequences(sequences, p)
    rows = sorted((r for r in rows if len(r) > hp.block_size + 1), key=len)
    if not rows:
        raise PartSkipped(f"no sequence longer than the block ({hp.block_size} tokens)")
    micro = min(execution.micro_batch_size, len(rows))
    # Spread over the sorted lengths: a micro-batch of the distribution, not of its tail.
    lengths = [len(rows[round(i * (len(rows) - 1) / max(1, micro - 1))]) for i in range(micro)]
    model_cfg = p["model"]
    config = drafter_config(model_cfg, hp)
    model = load_model(model_cfg, device=str(device), dtype=execution.precision)
    head = TargetHead.from_model(model)
    head = TargetHead(head.embed_weight.clone(), head.lm_head_weight.clone())  # kept whole
    batch = parts.random_batch(config, lengths, hp.max_anchors, hp.gamma, hp.seed)
    features = str((p.get("extract") or {}).get("features", "offline"))
    bar = TimeBar("train", budget_s, progress)
    try:
        result = parts.time_training(
            model, config, head, batch, features=features, layout=Layout.of(profile),
            device=device, precision=execution.precision, budget_s=budget_s, warmup_steps=1,
            selector=hp.selector, lr=hp.lr, on_step=bar.add,
        )  # fmt: skip
    finally:
        bar.close()
        distributed.close()
    peak, peak_source = parts.peak_flops(device)
    parts.add_mfu(result, peak, result["world_size"])
    result["tokens_per_s"] = result["sequence_tokens_per_s"]
    return {**result, "micro_batch_lengths": lengths, "sequences_from": source,
            "peak_source": peak_source}  # fmt: skip


def plan_figures(parts: dict[str, Any]) -> dict[str, Any]:
    """The figures `draftline plan` reads, from the parts that ran."""
    gen, ext, tr = (parts.get(k) or {} for k in PARTS)
    figures: dict[str, Any] = {
        "generate_tok_s": gen.get("output_tok_s"),
        "extract_tok_s": ext.get("tokens_per_s"),
        "extract_world_size": ext.get("world_size"),
        "train_world_size": tr.get("world_size"),
        "completion_tokens": (gen.get("completion_tokens") or {}).get("mean"),
        "prompt_tokens": (gen.get("first_prompt_tokens") or {}).get("mean"),
        "turns": (gen.get("turns_per_conversation") or {}).get("mean"),
        "turn_prompt_tokens": (gen.get("turn_prompt_tokens") or {}).get("mean"),
    }
    key = "train_online_tok_s" if tr.get("features") == "online" else "train_tok_s"
    figures[key] = tr.get("tokens_per_s")
    return {k: v for k, v in figures.items() if v is not None}
