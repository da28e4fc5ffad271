"""The online quality guard of `generate` (draftline.generation.guard).

Unit tests feed the guard rows built with the library's own completion statistics
(`draftline.core.loss_mask.completion_stats`, `draftline.quality.checks.completion_hash`) under the
project's real thresholds (conf/quality/default.yaml). The end-to-end test runs a generate stage in
a subprocess against the SGLang stand-in (tests/helpers/sglang_standin.py, a real HTTP server in
its own process speaking SGLang's `/generate` and `/health`; SGLang itself needs a GPU) answering
empty completions, and checks that the shard stops early, says why, and keeps what it journaled.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from helpers.generate_helpers import (
    QUALITY,
    StandIn,
    build_random_target,
    make_workdir,
    run_generate,
    sglang_hardware,
)

from draftline.core.loss_mask import SpecialIds, completion_stats
from draftline.generation.engines.base import Result
from draftline.generation.guard import Guard, GuardAbort
from draftline.generation.journal import Journal
from draftline.quality.checks import completion_hash

REPO = Path(__file__).resolve().parents[2]
DEFAULT_QUALITY = yaml.safe_load((REPO / "conf/quality/default.yaml").read_text(encoding="utf-8"))
SPECIAL = SpecialIds(end_of_turn=2, think_start=3, think_end=4)
MAX_NEW = 2048
JOURNAL = Path(".draftline/journal/generate/shard-0.jsonl")


def row(
    i: int,
    completion: list[int],
    finish: str = "stop",
    error: str | None = None,
    think_open: bool = False,
) -> dict:
    """The scalar columns `generate` writes for one sample, computed by the library.
    think_open: the prompt opened the think block (Qwen3.6's template)."""
    stats = completion_stats(completion, SPECIAL, think_open=think_open)
    return {
        "id": f"s{i:06d}",
        "num_completion_tokens": len(completion),
        "finish_reason": finish,
        "error": error,
        "has_think_block": stats.has_think_block,
        "think_tokens": stats.think_tokens,
        "answer_tokens": stats.answer_tokens,
        "loss_mask_sum": stats.loss_mask_sum,
        "completion_hash": completion_hash(completion),
    }


def tokens(i: int, n: int) -> list[int]:
    digest = hashlib.sha256(str(i).encode()).digest()
    return [10 + (digest[k % 32] + k * 7) % 1000 for k in range(n)]


def healthy(i: int, thinking: bool = True, think_open: bool = False) -> dict:
    """A varied, well-formed completion: think block (when on), answer, end of turn. With
    think_open the prompt holds the `<think>`, so the completion starts with the reasoning."""
    think, answer = tokens(i, 40 + i * 37 % 600), tokens(i + 1, 20 + i * 13 % 200)
    opening = [] if think_open else [3]
    body = [*opening, *think, 4, *answer] if thinking else answer
    return row(i, [*body, 2], think_open=think_open and thinking)


def empty(i: int, think_open: bool = False) -> dict:
    """The seed's failure: `OK.<|im_end|>`, two tokens then end of turn, no think block."""
    return row(i, [10 + i % 3, 11, 2], think_open=think_open)


def truncated(i: int, think_open: bool = False) -> dict:
    """Cut at max_new_tokens inside a think block that never closes."""
    opening = [] if think_open else [3]
    return row(i, [*opening, *tokens(i, MAX_NEW - len(opening))], "length", think_open=think_open)


def feed(guard: Guard, rows: Any) -> int:
    """Observe rows until the guard aborts; the number observed (all of them if it never did)."""
    n = 0
    for r in rows:
        n += 1
        guard.observe(r)
    return n


def make_guard(
    thinking: bool = True, quality: dict | None = None, think_in_prompt: bool = False
) -> Guard:
    return Guard(
        quality or DEFAULT_QUALITY,
        thinking=thinking,
        max_new_tokens=MAX_NEW,
        think_in_prompt=think_in_prompt,
    )


def abort_of(guard: Guard, rows: Any) -> tuple[int, str]:
    seen = 0

    def counted():
        nonlocal seen
        for r in rows:
            seen += 1
            yield r

    with pytest.raises(GuardAbort) as info:
        feed(guard, counted())
    return seen, str(info.value)


@pytest.mark.parametrize("thinking", [True, False])
def test_healthy_data_is_never_aborted(thinking):
    guard = make_guard(thinking)
    assert feed(guard, (healthy(i, thinking) for i in range(3000))) == 3000
    assert guard.seen == 3000 and len(guard.window) == guard.window.maxlen


def test_a_few_bad_samples_below_the_limits_do_not_abort():
    """2% truncated and 2% empty: under max_truncated_share=0.05 and the supervised limits."""

    def mixed(i: int) -> dict:
        if i % 50 == 7:
            return truncated(i)
        if i % 50 == 31:
            return empty(i)
        return healthy(i)

    assert feed(make_guard(), (mixed(i) for i in range(2000))) == 2000


def test_empty_responses_abort_within_the_first_samples_naming_the_cause():
    guard = make_guard(thinking=True)
    seen, message = abort_of(guard, (empty(i) for i in range(100_000)))
    assert DEFAULT_QUALITY["guard"]["min_samples"] <= seen <= 100  # not after 100,000
    assert f"the last {seen} finished samples (of {seen})" in message
    assert "think_block_share" in message and "supervised_tokens_min" in message
    assert "Likely cause: thinking is on but responses carry no <think>" in message
    assert "thinking is disabled" in message and "wrong template" in message
    assert "kept in the journal" in message


def test_empty_responses_without_thinking_blame_the_template():
    seen, message = abort_of(make_guard(thinking=False), (empty(i) for i in range(100_000)))
    assert seen <= 100
    assert "think_block_share" not in message  # no think check when thinking is off
    assert "responses are (near-)empty" in message and "chat template is wrong" in message
    assert "or thinking is disabled" in message


def test_truncated_responses_abort_naming_max_new_tokens():
    seen, message = abort_of(make_guard(), (truncated(i) for i in range(100_000)))
    assert seen <= 100
    assert "truncated_share" in message
    assert f"100% of responses hit max_new_tokens={MAX_NEW}" in message
    assert "inside an unclosed <think>" in message and "max_new_tokens is too small" in message


def test_failing_requests_blame_the_server():
    def failed(i: int) -> dict:
        return row(i, [], finish="error", error="HTTP 500") if i % 4 else healthy(i)

    _, message = abort_of(make_guard(), (failed(i) for i in range(10_000)))
    assert "error_share" in message and "engine or server is broken" in message


def test_rolling_window_catches_a_degradation_after_a_healthy_start():
    """A long healthy start does not dilute a later failure: the guard judges the last window."""
    window = DEFAULT_QUALITY["guard"]["window"]

    def degrading(i: int) -> dict:
        return healthy(i) if i < 5000 else empty(i)

    seen, message = abort_of(make_guard(), (degrading(i) for i in range(100_000)))
    assert 5000 < seen <= 5000 + window  # within one window of the change
    assert f"(of {seen})" in message and "Likely cause" in message


def test_guard_needs_min_samples_before_judging():
    quality = {**DEFAULT_QUALITY, "guard": {"min_samples": 200, "window": 400}}
    guard = make_guard(quality=quality)
    assert feed(guard, (empty(i) for i in range(199))) == 199  # too few to judge yet
    with pytest.raises(GuardAbort):
        feed(guard, (empty(i) for i in range(199, 260)))


# End to end: a generate stage through the SGLang stand-in.


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_random_target(tmp_path_factory.mktemp("target"))


def resumable(path: Path) -> tuple[dict[str, Result], int]:
    """What a rerun would resume from the journal (read by the library), and its record lines."""
    lines = path.read_bytes().splitlines()
    identity = json.loads(lines[0])["identity"]
    journal = Journal(path, identity)
    try:
        return journal.open(), len(lines) - 1
    finally:
        journal.close()


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("empty", "thinking is disabled somewhere"),
        ("truncated", "max_new_tokens is too small"),
    ],
)
def test_shard_through_the_standin_aborts_early_and_keeps_its_journal(
    tmp_path, model_dir, mode, cause
):
    n = 600
    server = StandIn(tmp_path, "--mode", mode)
    ids = make_workdir(tmp_path, model_dir, n=n, hardware=sglang_hardware(server.port, 8))
    with server:
        proc = run_generate(tmp_path, "--shard", "0")
        asked = server.sample_ids()
        turns_asked = {rid.rsplit("-", 1)[0] for rid in server.rids()}  # <id>#<turn>
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "generate shard-0 stopped: generation guard" in out
    assert f"Likely cause: {'' if mode == 'empty' else '100% of responses hit'}" in out
    assert cause in out
    # Early: the guard judged its first window of turns, far from the whole shard (a
    # conversation's next turn goes in as its last one is back: fewer conversations than turns).
    min_samples = QUALITY["guard"]["min_samples"]
    assert min_samples <= len(turns_asked) < n / 3
    # Nothing half-written in place; the journal keeps every sample that finished.
    assert not (tmp_path / "data/generated/train/shard-0.parquet").exists()
    assert not (tmp_path / "logs/runs/generate/shard-0.json").exists()
    journaled, lines = resumable(tmp_path / JOURNAL)
    assert len(journaled) == lines >= min_samples  # one record per finished sample
    conversations = {key.rpartition("#")[0] for key in journaled}  # keys are <id>#<turn>
    assert conversations <= set(ids) and conversations <= set(asked)
    expected_reason = "stop" if mode == "empty" else "length"
    assert {r.finish_reason for r in journaled.values()} == {expected_reason}


def test_turns_cut_by_a_full_context_abort_naming_the_context_length():
    def cut(i: int) -> dict:
        return {**truncated(i), "finish_reason": "context"}

    seen, message = abort_of(make_guard(), (cut(i) for i in range(400)))
    assert seen <= 128 and "truncated_share" in message
    assert "cut by a full context" in message and "model.serving.context_length" in message


def test_conversations_that_fill_the_context_are_capped_then_closed_and_counted(
    tmp_path, model_dir
):
    """No turn is refused for length: each asks for what its prompt leaves of the context
    (the stand-in refuses more with HTTP 400, as SGLang does), a turn cut there ends its
    conversation `context`, and validate's checks count those rows as cut short."""
    import pyarrow.parquet as pq

    from draftline.quality import checks

    context, max_new = 64 + 220, 200  # CONTEXT_RESERVE + room for ~2 turns of ~110 tokens
    server = StandIn(tmp_path, "--think-tokens", "100", "--context-length", str(context))
    make_workdir(
        tmp_path,
        model_dir,
        n=24,
        multi_turn=True,
        max_new_tokens=max_new,
        hardware=sglang_hardware(server.port, 8),
        generate={"guard": False},
    )
    params_path = tmp_path / "params.yaml"
    params = yaml.safe_load(params_path.read_text(encoding="utf-8"))
    params["model"]["serving"] = {"context_length": context}
    params_path.write_text(yaml.safe_dump(params), encoding="utf-8")
    with server:
        proc = run_generate(tmp_path, "--shard", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = pq.read_table(tmp_path / "data/generated/train/shard-0.parquet").to_pylist()
    assert not any(r["finish_reason"] == "error" for r in rows)  # nothing refused
    full = [r for r in rows if r["finish_reason"] == "context"]
    assert full and all(r["turns"] >= 2 for r in full)  # first turns fit; later ones fill it
    for r in full:
        assert r["num_prompt_tokens"] + r["num_completion_tokens"] <= context - 64
        assert json.loads(r["sampling"])["context_length"] == context  # recorded per row
    table = pd.DataFrame(rows)
    results = {c.name: c for c in checks.run_checks(table, DEFAULT_QUALITY, thinking=True)}
    share = sum(r["finish_reason"] in ("length", "context") for r in rows) / len(rows)
    assert results["truncated_share"].observed == pytest.approx(share) and share > 0
    assert results["conversation_complete"].observed < 1.0


# The same cases when the chat template opens <think> in the prompt (Qwen3.6): good replies pass,
# the seed's pathology and truncation inside the think block abort, each naming its cause.


def test_healthy_replies_after_an_opened_think_are_never_aborted():
    guard = make_guard(think_in_prompt=True)
    rows = (healthy(i, think_open=True) for i in range(2000))
    assert feed(guard, rows) == 2000


def test_empty_replies_after_an_opened_think_abort_naming_the_cause():
    guard = make_guard(think_in_prompt=True)
    seen, message = abort_of(guard, (empty(i, think_open=True) for i in range(100_000)))
    assert seen <= 100
    assert "think_block_share" in message and "supervised_tokens_min" in message
    assert "without closing the <think> block the prompt opened" in message
    assert "`OK.<|im_end|>`" in message


def test_truncation_inside_an_opened_think_aborts_naming_max_new_tokens():
    guard = make_guard(think_in_prompt=True)
    seen, message = abort_of(guard, (truncated(i, think_open=True) for i in range(100_000)))
    assert seen <= 100
    assert f"100% of responses hit max_new_tokens={MAX_NEW}" in message
    assert "inside an unclosed <think>" in message


def test_a_thinking_mix_is_judged_per_mode_and_blames_the_non_thinking_replies():
    """data.thinking_share: every other sample without thinking. Healthy replies in both modes
    pass; when only the non-thinking replies are empty, the guard says so."""

    def mixed(i: int, bad: bool = False) -> dict:
        if i % 2:
            return {**(empty(i) if bad else healthy(i, thinking=False)), "thinking": False}
        return {**healthy(i), "thinking": True}

    assert feed(make_guard(), (mixed(i) for i in range(400))) == 400
    n, message = abort_of(make_guard(), (mixed(i, bad=True) for i in range(400)))
    assert n <= 128
    assert "supervised_tokens_min_no_thinking" in message
    assert "generated with thinking off (data.thinking_share)" in message
