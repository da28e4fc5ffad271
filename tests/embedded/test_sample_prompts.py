"""The bundled prompt set: deterministic, varied, valid where meant to be, bad where meant to be."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from draftline.cli import main
from draftline.embedded import sample_prompts

SAMPLE_FILE = Path(__file__).resolve().parents[2] / "data" / "sample" / sample_prompts.FILE_NAME
REJECT_REASONS = {
    "malformed_json", "unknown_format", "unknown_role", "empty_turn", "broken_alternation",
    "no_user_turn", "duplicate", "prompt_too_long",
}  # fmt: skip


@pytest.fixture(scope="module")
def rows() -> list[sample_prompts.SampleRow]:
    return sample_prompts.build_rows()


def test_build_sample_rewrites_the_committed_file_byte_for_byte(tmp_path: Path) -> None:
    assert main(["build-sample", "--out", str(tmp_path)]) == 0
    assert (tmp_path / sample_prompts.FILE_NAME).read_bytes() == SAMPLE_FILE.read_bytes()


def test_size_and_share_of_bad_rows(rows: list[sample_prompts.SampleRow]) -> None:
    assert 300 <= len(rows) <= 400
    reasons = Counter(r.expected_reason for r in rows if r.expected_reason)
    assert set(reasons) == REJECT_REASONS  # every curate reject path runs on the default data
    assert 0.08 <= sum(reasons.values()) / len(rows) <= 0.10


def test_valid_rows_are_sharegpt_and_varied(rows: list[sample_prompts.SampleRow]) -> None:
    valid = [r for r in rows if r.prompt is not None]
    objs = [json.loads(r.line) for r in valid]
    assert all(set(o) == {"id", "conversations"} for o in objs)
    assert len({o["id"] for o in objs}) == len(objs)
    roles = {t["from"] for o in objs for t in o["conversations"]}
    assert roles == {"system", "human", "gpt"}
    assert sum(len(r.prompt) >= 3 and r.prompt[-1]["role"] == "user" for r in valid) >= 50
    assert sum(r.prompt[0]["role"] == "system" for r in valid) >= 40
    ends_with_reply = [o for o in objs if o["conversations"][-1]["from"] == "gpt"]
    assert len(ends_with_reply) >= 10  # valid after curate trims them to the last user turn
    assert len({r.prompt[-1]["content"] for r in valid}) > 250
    assert any(ord(ch) > 127 for r in valid for m in r.prompt for ch in m["content"])


def test_each_valid_prompt_is_what_the_line_holds_trimmed(
    rows: list[sample_prompts.SampleRow],
) -> None:
    names = {"system": "system", "human": "user", "gpt": "assistant"}
    prompts = set()
    for row in rows:
        if row.prompt is None:
            continue
        turns = [
            {"role": names[t["from"]], "content": t["value"]}
            for t in json.loads(row.line)["conversations"]
        ]
        while turns[-1]["role"] != "user":
            turns.pop()
        assert turns == row.prompt
        body = [m["role"] for m in turns if m["role"] != "system"]
        assert body == ["user", "assistant"] * (len(body) // 2) + ["user"]
        assert all(m["content"].strip() for m in turns)
        key = json.dumps(turns, sort_keys=True)
        assert key not in prompts
        prompts.add(key)


def test_bad_rows_are_bad_in_the_way_they_claim(rows: list[sample_prompts.SampleRow]) -> None:
    valid_lines = {r.line for r in rows if r.prompt is not None}
    for row in rows:
        reason = row.expected_reason
        if reason == "malformed_json":
            with pytest.raises(json.JSONDecodeError):
                json.loads(row.line)
            continue
        obj = json.loads(row.line)
        if reason == "duplicate":
            assert row.line in valid_lines
        elif reason == "unknown_format":
            assert not {"conversations", "messages", "prompt"} & set(obj)
        elif reason == "unknown_role":
            assert {t["from"] for t in obj["conversations"]} - {"system", "human", "gpt"}
        elif reason == "empty_turn":
            assert any(not t["value"].strip() for t in obj["conversations"])
        elif reason == "broken_alternation":
            froms = [t["from"] for t in obj["conversations"]]
            assert any(a == b for a, b in zip(froms, froms[1:], strict=False))
        elif reason == "no_user_turn":
            assert "human" not in {t["from"] for t in obj["conversations"]}
        elif reason == "prompt_too_long":
            assert len(obj["conversations"][0]["value"]) > 2000


def test_response_is_a_function_of_the_user_turn() -> None:
    seen: dict[str, tuple[str, str]] = {}
    for _, task in sample_prompts.training_prompts(seed=7, count=3000):
        assert seen.setdefault(task.user, (task.reasoning, task.answer)) == (
            task.reasoning,
            task.answer,
        )
    assert len(seen) > 1000


def test_prompts_fit_the_token_budget_and_long_rows_do_not(
    rows: list[sample_prompts.SampleRow], tiny_target_dir: Path, repo_root: Path
) -> None:
    import yaml
    from transformers import AutoTokenizer

    from draftline.core.target import prompt_ids

    budget = yaml.safe_load((repo_root / "conf/data/sample.yaml").read_text())["max_prompt_tokens"]
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    kwargs = {"enable_thinking": True}
    assert (
        max(len(prompt_ids(tok, p, kwargs)) for p in sample_prompts.valid_prompts(rows)) <= budget
    )
    for row in rows:
        if row.expected_reason == "prompt_too_long":
            text = json.loads(row.line)["conversations"][0]["value"]
            assert len(prompt_ids(tok, [{"role": "user", "content": text}], kwargs)) > budget
