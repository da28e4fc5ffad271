"""Eval sets: benchmark prompt files in the formats users have, and source names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftline.data.eval_sets import benchmark_files, benchmark_messages, source_names


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    ("row", "prompt"),
    [
        ({"question": "2+2?", "answer": "#### 4"}, "2+2?"),  # gsm8k
        ({"problem": "Solve x.", "solution": "x", "level": 3}, "Solve x."),  # math500
        ({"task_id": "HumanEval/0", "prompt": "def f():\n"}, "def f():"),  # humaneval
        ({"question_id": 81, "turns": ["Write a poem.", "Shorter."]}, "Write a poem."),  # mt-bench
        ({"messages": [{"role": "user", "content": "Hi"}]}, "Hi"),
    ],
)
def test_each_benchmark_format_gives_its_prompt(tmp_path, row, prompt):
    path = write_jsonl(tmp_path / "set.jsonl", [row])
    assert benchmark_messages(path, 10) == [[{"role": "user", "content": prompt}]]


def test_rows_are_taken_in_file_order_up_to_the_limit_and_bad_rows_are_skipped(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(
        '{"question": "a"}\nnot json\n{"other": 1}\n{"question": "b"}\n{"question": "c"}\n'
    )
    assert [m[0]["content"] for m in benchmark_messages(path, 2)] == ["a", "b"]


def test_a_file_without_a_usable_prompt_names_the_fields(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"text": "x"}])
    with pytest.raises(SystemExit, match="question, problem, instruction or turns"):
        benchmark_messages(path, 5)


def test_benchmark_files_are_named_by_stem_and_other_files_ignored(tmp_path):
    assert benchmark_files(tmp_path / "absent") == {}
    write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "a"}])
    write_jsonl(tmp_path / "mt_bench.jsonl.gz.txt", [])  # not an input format
    (tmp_path / "README.md").write_text("notes")
    assert benchmark_files(tmp_path) == {"gsm8k": tmp_path / "gsm8k.jsonl"}
    write_jsonl(tmp_path / "gsm8k.json", [])
    with pytest.raises(SystemExit, match="gsm8k"):
        benchmark_files(tmp_path)


def test_source_names_are_stems_unless_two_share_one():
    assert source_names(["data/a/chat.jsonl", "data/b/code.parquet"]) == ["chat", "code"]
    assert source_names(["x/set.jsonl", "y/set.jsonl"]) == ["x/set.jsonl", "y/set.jsonl"]
