"""The curate library on small synthetic inputs written in tmp_path, with the real tiny target
tokenizer (models/tiny-target): every input format and container, normalisation, ids, dedupe,
every reject reason, byte-identical results whatever the chunks and workers, stable splits, the
fast rendering/counting paths against the chat template and the tokenizer themselves, and tool
turns and calls (kept, stored and read back; refused by a template that cannot render them, the
tiny target's; rendered by one that can, models/tiny-qwen36's). The stage is tested in
tests/stages/test_curate.py."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.curate_helpers import (
    BUDGET,
    THINKING,
    mixed_input,
    msg,
    rejected_rows,
    write_rows,
)

from draftline.core.target import load_tokenizer, prompt_ids, render_prompt
from draftline.data import curation
from draftline.data.byte_level_counter import ByteLevelTokenCounter
from draftline.data.conversations import (
    REASONS,
    messages_from_records,
    messages_to_records,
    normalise,
)
from draftline.data.curation import CurateSettings, conversation_id, curate
from draftline.data.input_files import BrokenInputFiles, Rejection, read_rows
from draftline.data.prompt_tokens import PromptTokenCounter


@pytest.fixture(scope="session")
def tokenizer(tiny_target_dir: Path) -> Any:
    return load_tokenizer({"path": str(tiny_target_dir)})


@pytest.fixture(scope="session")
def counter(tokenizer: Any) -> PromptTokenCounter:
    return _default_counter()


def settings(**overrides: Any) -> CurateSettings:
    values: dict[str, Any] = {
        "max_prompt_tokens": BUDGET,
        "eval_fraction": 0.2,
        "num_shards": 3,
        "split_seed": "test",
        "workers": 0,
    }
    return CurateSettings(**{**values, **overrides})


def run(sources: list[Path], out: Path, **overrides: Any) -> curation.CurateResult:
    counter = overrides.pop("counter", None) or _default_counter()
    return curate([str(s) for s in sources], out, counter, settings(**overrides), progress=False)


_COUNTER: list[PromptTokenCounter] = []


def _default_counter() -> PromptTokenCounter:
    if not _COUNTER:
        path = Path(__file__).resolve().parents[2] / "models" / "tiny-target"
        _COUNTER.append(PromptTokenCounter(load_tokenizer({"path": str(path)}), THINKING, BUDGET))
    return _COUNTER[0]


def kept_rows(out: Path) -> list[dict[str, Any]]:
    """Kept rows, their messages read back as the generation stage reads them."""
    tables = [pq.read_table(p) for p in sorted((out / "train").glob("*.parquet"))]
    tables.append(pq.read_table(out / "eval.parquet"))
    rows = [row for t in tables for row in t.to_pylist()]
    for row in rows:
        row["messages"] = messages_from_records(row["messages"])
    return rows


def call(name: str, arguments: Any, **extra: Any) -> dict[str, Any]:
    """An OpenAI-style tool call."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **extra}


def calling(*calls: dict[str, Any], content: str = "") -> dict[str, Any]:
    """An assistant message that calls tools."""
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


# A conversation with a tool call and its result, normalised: the tiny target cannot render it.
TOOL_CONVERSATION = [
    msg("user", "Weather in Paris?"),
    calling(call("get_weather", {"city": "Paris"})),
    msg("tool", "sunny, 21C"),
]


# One conversation per style, with what it normalises to.
EXPECTED = [
    [msg("system", "Be brief."), msg("user", "Hi there"), msg("assistant", "Hello!"),
     msg("user", "What is 2+2?")],
    [msg("user", "Translate 'chat' to English.")],
    [msg("system", "You are terse."), msg("user", "Name a colour.")],
]  # fmt: skip


def style_rows(style: str) -> list[dict[str, Any]]:
    """EXPECTED written in one input style, with whitespace, odd role names and a reply after
    the last user turn (dropped)."""
    if style == "sharegpt":
        return [
            {
                "id": "a",
                "conversations": [
                    {"from": "system", "value": " Be brief. "},
                    {"from": "human", "value": "Hi there\n"},
                    {"from": "gpt", "value": "Hello!"},
                    {"from": "Human", "value": "What is 2+2?"},
                    {"from": "gpt", "value": "4"},
                ],
            },
            {"id": "b",
             "conversations": [{"from": "USER", "value": "Translate 'chat' to English."}]},
            {"id": "c", "system": "You are terse.", "conversations": [
                {"from": "human", "value": "Name a colour."},
                {"from": "chatgpt", "value": "Red."}]},
        ]  # fmt: skip
    if style == "openai":
        return [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                 {"type": "text", "text": "there"}]},
                    {"role": "assistant", "content": " Hello! "},
                    {"role": "user", "content": "What is 2+2?"},
                ]
            },
            {"messages": [{"role": "user", "content": "Translate 'chat' to English."},
                          {"role": "assistant", "content": None}]},
            {"messages": [{"role": "system", "content": "You are terse."},
                          {"role": "User", "content": "Name a colour."},
                          {"role": "model", "content": "Red."}]},
        ]  # fmt: skip
    # {prompt} rows: a single user turn, optional system.
    return [
        {"prompt": "Translate 'chat' to English."},
        {"prompt": "  Name a colour.  ", "system": "You are terse."},
    ]


def style_expected(style: str) -> list[list[dict[str, str]]]:
    return EXPECTED[1:] if style == "prompt" else EXPECTED


# ---------------------------------------------------------------------------------------------
# Formats, normalisation, ids.


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("container", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize("style", ["sharegpt", "openai", "prompt"])
def test_every_format_from_a_file_and_from_a_folder(tmp_path, style, container, gz):
    rows = style_rows(style)
    if container == "parquet" and style == "openai":
        # A Parquet column has one type: text parts there, plain strings nowhere.
        for row in rows:
            for m in row["messages"]:
                if not isinstance(m["content"], list):
                    m["content"] = [{"type": "text", "text": m["content"] or ""}]
    path = write_rows(tmp_path / "in" / "sub" / f"rows.{container}", rows, gz)
    expected = sorted(style_expected(style), key=conversation_id)
    for name, source in (("file", path), ("folder", tmp_path / "in")):
        out = tmp_path / f"out-{name}"
        result = run([source], out)
        rows = sorted(kept_rows(out), key=lambda r: r["id"])
        assert [r["messages"] for r in rows] == expected, name
        assert [r["id"] for r in rows] == [conversation_id(m) for m in expected]
        assert all(r["source"] == path.as_posix() for r in rows)
        assert all(r["num_turns"] == len(r["messages"]) for r in rows)
        assert result.rows_read == len(expected) and result.rows_rejected == 0
        assert rejected_rows(out) == []


def test_folder_skips_other_files_and_reads_in_sorted_order(tmp_path):
    write_rows(tmp_path / "in" / "b.jsonl", [{"prompt": "second file"}])
    write_rows(tmp_path / "in" / "a" / "x.json", [{"prompt": "first file"}])
    (tmp_path / "in" / "notes.txt").write_text("not rows")
    result = run([tmp_path / "in"], tmp_path / "out")
    assert result.files == 2
    assert result.files_skipped == [(tmp_path / "in" / "notes.txt").as_posix()]
    # A missing source, or a named file of another type, is a configuration error.
    with pytest.raises(SystemExit, match="does not exist"):
        run([tmp_path / "missing"], tmp_path / "out2")
    with pytest.raises(SystemExit, match="not a .jsonl"):
        run([tmp_path / "in" / "notes.txt"], tmp_path / "out3")


def test_role_names_normalise():
    aliases = {
        "user": ["user", "human", "Human", " USER "],
        "assistant": ["assistant", "gpt", "chatgpt", "bard", "model", "bing", "claude", "AI",
                      "bot", "GPT"],
    }  # fmt: skip
    for role, names in aliases.items():
        for name in names:
            turns = [{"from": "human", "value": "q"}, {"from": name, "value": "a"}]
            turns.append({"from": "human", "value": "q2"})
            if role == "user":
                turns = [{"from": name, "value": "q"}]
            got = normalise({"conversations": turns})
            assert isinstance(got, list), (name, got)
            assert got[0] == msg("user", "q") and (role == "user" or got[1]["role"] == role)
    # Either key pair works in either format: datasets mix them.
    mixed = {"conversations": [{"role": "user", "content": "q"}]}
    assert normalise(mixed) == [msg("user", "q")]
    mixed = {"messages": [{"from": "human", "value": "q"}]}
    assert normalise(mixed) == [msg("user", "q")]
    # A Parquet file of mixed rows has null columns: a null key counts as absent.
    assert normalise({"conversations": None, "messages": [msg("user", "q")]}) == [msg("user", "q")]


def test_keeps_the_prefix_that_ends_in_the_last_user_turn():
    row = {
        "system": "Sys.",
        "conversations": [
            {"from": "human", "value": "one"},
            {"from": "gpt", "value": "<think>\nhm\n</think>\n\nuno"},
            {"from": "human", "value": "two"},
            {"from": "gpt", "value": "dos"},
            {"from": "gpt", "value": ""},  # after the last user turn: dropped, not an empty turn
        ],
    }
    assert normalise(row) == [
        msg("system", "Sys."),
        msg("user", "one"),
        msg("assistant", "<think>\nhm\n</think>\n\nuno"),
        msg("user", "two"),
    ]
    # An empty system prompt says nothing and is dropped; a system turn in the messages counts.
    assert normalise({"system": "  ", "prompt": "p"}) == [msg("user", "p")]
    assert normalise({"messages": [msg("system", ""), msg("user", "p")]}) == [msg("user", "p")]


def test_id_is_the_hash_of_the_normalised_messages(tmp_path):
    messages = [msg("system", "Système ✓"), msg("user", "Hi 中文"), msg("assistant", "Yo"),
                msg("user", "Bye")]  # fmt: skip
    canonical = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert conversation_id(messages) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    # The same conversation in another style, with other whitespace, is the same row.
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "Système ✓\n"},
            {"from": "human", "value": " Hi 中文"},
            {"from": "gpt", "value": "Yo"},
            {"from": "human", "value": "Bye"},
        ]
    }
    openai = {"messages": [*messages, msg("assistant", "a reply, dropped")]}  # fmt: skip
    a = write_rows(tmp_path / "in" / "a.jsonl", [sharegpt])
    write_rows(tmp_path / "in" / "b.parquet", [openai])
    result = run([tmp_path / "in"], tmp_path / "out")
    [kept] = kept_rows(tmp_path / "out")
    assert kept["id"] == conversation_id(messages) and kept["source"] == a.as_posix()
    [dup] = rejected_rows(tmp_path / "out")
    assert dup["reason"] == "duplicate"
    assert dup["detail"] == f"id {kept['id']}, first at {a.as_posix()}:1"
    assert result.rows_kept == 1 and result.rejected == {"duplicate": 1}


def test_ids_of_conversations_without_tools_are_pinned():
    # Ids computed before tool turns were accepted: the committed curated data depends on them.
    plain = {"messages": [msg("user", "What is 2+2?"), msg("assistant", "4"),
                          msg("user", "And 3+3?")]}  # fmt: skip
    prompt = {"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi"}]}
    for row, pinned in ((plain, "559b6262581524f6"), (prompt, "158ab9a5f9ffbe1e")):
        messages = normalise(row)
        assert isinstance(messages, list) and conversation_id(messages) == pinned
        # Role and content only, in memory and as read back from the table.
        assert all(set(m) == {"role", "content"} for m in messages)
        assert messages_from_records(messages_to_records(messages)) == messages


def test_dedupe_keeps_the_first_occurrence_across_chunks_and_files(tmp_path):
    rows = [{"prompt": f"question {i % 7}"} for i in range(30)]
    first = write_rows(tmp_path / "in" / "1.jsonl", rows)
    write_rows(tmp_path / "in" / "2.json", rows[:5])
    result = run([tmp_path / "in"], tmp_path / "out", chunk_rows=4)
    kept = kept_rows(tmp_path / "out")
    assert len(kept) == 7 and {r["source"] for r in kept} == {first.as_posix()}
    rejected = rejected_rows(tmp_path / "out")
    assert result.rejected == {"duplicate": 28} and len(rejected) == 28
    # Each duplicate names the line of its first occurrence.
    for row in rejected:
        index = json.loads(row["raw"])["prompt"].split()[-1]
        assert row["detail"].endswith(f"first at {first.as_posix()}:{int(index) + 1}")


# ---------------------------------------------------------------------------------------------
# Rejections.


def bad_rows_by_reason() -> dict[str, list[str]]:
    """JSONL lines that each fail for one reason, for every reason curation defines."""
    long_words = " ".join(["word"] * 300)  # ~300 tokens: just over the budget, counted exactly
    return {
        "malformed_json": ['{"conversations": [{"from": "human", "value": "unterminated',
                           "{'single': 'quotes'}", "\xff\xfe not utf-8 text"],
        "unknown_format": ["[1, 2, 3]", '"a string"', '{"text": "no known key"}',
                           '{"conversations": "not a list"}',
                           '{"messages": [{"role": "user", "content": {"x": 1}}]}',
                           '{"prompt": "p", "system": 7}'],
        "unknown_role": ['{"conversations": [{"from": "narrator", "value": "Once"}]}',
                         '{"messages": [{"role": null, "content": "x"}]}'],
        "empty_turn": ['{"conversations": [{"from": "human", "value": "   "}]}',
                       '{"messages": [{"role": "user", "content": "q"}, '
                       '{"role": "assistant", "content": ""}, {"role": "user", "content": "q"}]}'],
        "broken_alternation": ['{"messages": [{"role": "user", "content": "a"}, '
                               '{"role": "user", "content": "b"}]}',
                               '{"messages": [{"role": "user", "content": "a"}, '
                               '{"role": "system", "content": "late"}, '
                               '{"role": "user", "content": "b"}]}'],
        "no_user_turn": ['{"conversations": [{"from": "gpt", "value": "unprompted"}]}',
                         '{"system": "only a system prompt", "messages": []}'],
        "duplicate": ['{"prompt": "a good row"}'],
        "template_rejects": [json.dumps({"messages": TOOL_CONVERSATION})],
        "prompt_too_long": [json.dumps({"prompt": long_words}),
                            json.dumps({"prompt": " ".join(["far"] * 5000)})],
    }  # fmt: skip


def test_every_reject_reason_is_recorded_per_row(tmp_path):
    bad = bad_rows_by_reason()
    assert set(bad) == set(REASONS), "a reject reason without a test row"
    lines = ['{"prompt": "a good row"}', '{"prompt": "another good row"}']
    expected: list[tuple[int, str]] = []
    for reason, rows in bad.items():
        for row in rows:
            lines.append(row)
            expected.append((len(lines), reason))
    path = tmp_path / "rows.jsonl"
    # "\xff\xfe" is written as those two bytes: a line that is not UTF-8.
    path.write_bytes(b"".join(line.encode("latin-1" if "\xff" in line else "utf-8") + b"\n"
                              for line in lines))  # fmt: skip

    result = run([path], tmp_path / "out", chunk_rows=5)
    rejected = rejected_rows(tmp_path / "out")
    assert [(r["line"], r["reason"]) for r in rejected] == expected
    assert all(r["source"] == path.as_posix() and r["detail"] for r in rejected)
    raw_lines = path.read_bytes().split(b"\n")
    for row in rejected:
        assert row["raw"] == raw_lines[row["line"] - 1].decode("utf-8", errors="replace")
    assert result.rows_read == len(lines) and result.rows_kept == 2
    assert result.metrics()["rejected_by_reason"] == {r: len(bad[r]) for r in REASONS}
    details = {r["reason"]: r["detail"] for r in reversed(rejected)}  # the first of each
    assert details["unknown_role"] == "turn 0: role 'narrator'"
    assert details["template_rejects"] == "unknown role tool: use system, user or assistant"
    too_long = [r["detail"] for r in rejected if r["reason"] == "prompt_too_long"]
    prompt = json.loads(bad["prompt_too_long"][0])["prompt"]
    n = len(prompt_ids(_default_counter().tokenizer, [msg("user", prompt)], THINKING))
    assert too_long[0] == f"{n} tokens > data.max_prompt_tokens={BUDGET}"
    assert too_long[1].startswith("at least ")  # counted on a prefix only
    assert int(too_long[1].split()[2]) > BUDGET
    # One example per reason (its first row), for the failure message.
    assert set(result.examples) == set(REASONS)
    first_line = {reason: line for line, reason in reversed(expected)}
    assert {r: e["line"] for r, e in result.examples.items()} == first_line


def test_a_file_that_cannot_be_read_whole_fails_naming_it(tmp_path):
    """A cut gzip stream (40 rows, cut short), a corrupt Parquet row group, a JSON document
    that ends early, garbage behind a gzip header and an empty file each fail curate by name,
    with the rows read before the break and the fix; none is counted as one rejected row."""
    folder = tmp_path / "in"
    good = [{"prompt": f"good {i}"} for i in range(40)]
    whole = gzip.compress("".join(json.dumps(r) + "\n" for r in good).encode(), mtime=0)
    folder.mkdir()
    (folder / "cut.jsonl.gz").write_bytes(whole[: len(whole) * 2 // 3])
    (folder / "garbage.parquet").write_bytes(b"PAR1 this is not parquet")
    (folder / "broken.json").write_text('[{"prompt": "a"}, {"prompt": ')
    (folder / "garbage.json.gz").write_bytes(b"\x1f\x8b not really gzip")
    (folder / "empty.jsonl").write_text("\n  \n")
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(good), sink, row_group_size=10)
    data = bytearray(sink.getvalue().to_pybytes())
    page = pq.ParquetFile(pa.BufferReader(bytes(data))).metadata.row_group(2).column(0)
    start = page.data_page_offset  # row group 2 of 4 rots: the first 20 rows read well
    data[start : start + page.total_compressed_size] = b"\xff" * page.total_compressed_size
    (folder / "rot.parquet").write_bytes(bytes(data))
    write_rows(folder / "ok.jsonl", ["", '{"prompt": "after blank lines"}', "\x00\x01"])
    with pytest.raises(BrokenInputFiles) as err:
        run([folder], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    lines = str(err.value).splitlines()
    assert lines[0] == "6 input files are cut short, corrupt or empty:"
    by_file = {Path(line.split(":")[0].strip()).name: line for line in lines[1:]}
    assert set(by_file) == {
        "broken.json", "cut.jsonl.gz", "empty.jsonl", "garbage.json.gz", "garbage.parquet",
        "rot.parquet",
    }  # fmt: skip
    cut = by_file["cut.jsonl.gz"]
    rows_before = int(cut.split("cut short or corrupt after ")[1].split()[0])
    assert 0 < rows_before < 40
    assert "Compressed file ended before the end-of-stream marker" in cut
    assert f"`gzip -t {folder / 'cut.jsonl.gz'}` tests it" in cut
    assert cut.endswith("or take it out of data.sources")
    rot = by_file["rot.parquet"]
    assert "cut short or corrupt after 20 rows, 20 of its 40 rows lost: unreadable from" in rot
    assert (
        "after 0 rows" in by_file["broken.json"]
        and "not one JSON document" in by_file["broken.json"]
    )
    assert "empty (no rows)" in by_file["empty.jsonl"]
    # A line that does not parse is still one rejected row: it is one row.
    ok = run([folder / "ok.jsonl"], tmp_path / "ok")
    assert (ok.rows_read, ok.rows_rejected) == (2, 1)


def test_an_empty_source_fails_with_a_clear_error(tmp_path):
    (tmp_path / "none").mkdir()
    with pytest.raises(SystemExit, match=r"data.sources: .*none holds no input files: put"):
        run([tmp_path / "none"], tmp_path / "out")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(SystemExit, match=r"holds no input files \(1 other files in it\)"):
        run([tmp_path / "other"], tmp_path / "out")
    write_rows(tmp_path / "empty.json", [])
    with pytest.raises(BrokenInputFiles, match=r"empty.json: empty \(no rows\): put conv"):
        run([tmp_path / "empty.json"], tmp_path / "out")


def test_raw_text_of_rejected_rows_from_every_container(tmp_path):
    row = {"conversations": [{"from": "narrator", "value": "x"}]}
    for container in ("jsonl", "json", "parquet"):
        write_rows(tmp_path / "in" / f"r.{container}", [row])
    run([tmp_path / "in"], tmp_path / "out")
    rejected = rejected_rows(tmp_path / "out")
    assert [r["reason"] for r in rejected] == ["unknown_role"] * 3
    assert all(json.loads(r["raw"]) == row for r in rejected)
    # read_rows (row by row) gives the same raw text as curate's batches.
    for path in sorted((tmp_path / "in").iterdir()):
        [raw_row] = read_rows(path)
        assert json.loads(raw_row.raw_text()) == row


# ---------------------------------------------------------------------------------------------
# Tool turns and tool calls.


@pytest.fixture(scope="module")
def qwen36_counter() -> PromptTokenCounter:
    """models/tiny-qwen36: its template renders `tool` turns (and ignores tool calls)."""
    path = Path(__file__).resolve().parents[2] / "models" / "tiny-qwen36"
    return PromptTokenCounter(load_tokenizer({"path": str(path)}), THINKING, BUDGET)


def weather_rows() -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """Tool conversations as OpenAI and ShareGPT rows, with what each normalises to."""
    openai = {"messages": [
        msg("system", "You can call tools."),
        msg("user", "Weather in Paris and Rome?"),
        {"role": "assistant", "content": None, "tool_calls": [
            call("get_weather", '{"city": "Paris"}', id="call_1"),
            call("get_weather", {"city": "Rome", "units": ["C", 1, None]}, id="call_2")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain, 15C"},
        msg("assistant", "Paris is sunny, Rome is wet."),
        msg("user", "And tomorrow in Paris?"),
        {"role": "assistant", "content": " Let me check. ", "tool_calls": [
            call("forecast", '{"city": "Paris", "days": 1}')]},
        {"role": "tool", "content": "clouds"},
        msg("assistant", "Cloudy."),  # after the last tool turn: regenerated, dropped
    ]}  # fmt: skip
    openai_expected = [
        msg("system", "You can call tools."),
        msg("user", "Weather in Paris and Rome?"),
        calling(call("get_weather", {"city": "Paris"}, id="call_1"),
                call("get_weather", {"city": "Rome", "units": ["C", 1, None]}, id="call_2")),
        msg("tool", "sunny, 21C"),
        msg("tool", "rain, 15C"),
        msg("assistant", "Paris is sunny, Rome is wet."),
        msg("user", "And tomorrow in Paris?"),
        calling(call("forecast", {"city": "Paris", "days": 1}), content="Let me check."),
        msg("tool", "clouds"),
    ]  # fmt: skip
    # ShareGPT-style (LLaMA-Factory): a call turn's value is the call as JSON (here arguments as
    # text holding an object); tool results are `observation` (or `function`, `ipython`).
    sharegpt = {"conversations": [
        {"from": "human", "value": "Convert 3 km."},
        {"from": "function_call",
         "value": json.dumps({"name": "convert", "arguments": '{"km": 3, "to": "mi"}'})},
        {"from": "observation", "value": "1.86"},
        {"from": "gpt", "value": "About 1.86 miles."},
        {"from": "human", "value": "And 5 km, in both units?"},
        {"from": "function_call", "value": json.dumps(
            [{"name": "convert", "arguments": {"km": 5, "to": "mi"}},
             {"name": "convert", "arguments": {"km": 5, "to": "ft"}}])},
        {"from": "function", "value": "3.11"},
        {"from": "ipython", "value": "16404"},
    ]}  # fmt: skip
    sharegpt_expected = [
        msg("user", "Convert 3 km."),
        calling(call("convert", {"km": 3, "to": "mi"})),
        msg("tool", "1.86"),
        msg("assistant", "About 1.86 miles."),
        msg("user", "And 5 km, in both units?"),
        calling(call("convert", {"km": 5, "to": "mi"}), call("convert", {"km": 5, "to": "ft"})),
        msg("tool", "3.11"),
        msg("tool", "16404"),
    ]  # fmt: skip
    return [openai, sharegpt], [openai_expected, sharegpt_expected]


def test_tool_turns_and_calls_normalise():
    rows, expected = weather_rows()
    assert [normalise(r) for r in rows] == expected
    # Arguments given as text holding an object are the object, so the same call in either
    # style, with the same result, is the same conversation (one id, deduplicated).
    text_args = normalise({"messages": [msg("user", "q"), calling(call("f", '{"a": 1}')),
                                        msg("tool", "r")]})  # fmt: skip
    flat = normalise({"conversations": [{"from": "human", "value": "q"},
                                        {"from": "function_call",
                                         "value": '{"name": "f", "arguments": {"a": 1}}'},
                                        {"from": "observation", "value": "r"}]})  # fmt: skip
    assert text_args == flat == [msg("user", "q"), calling(call("f", {"a": 1})), msg("tool", "r")]
    # Text that is not an object stays text; absent arguments are none.
    got = normalise({"messages": [msg("user", "q"), calling(call("run", "print(1)")),
                                  msg("tool", "1"), calling(call("now", None)),
                                  msg("tool", "noon")]})  # fmt: skip
    assert isinstance(got, list)
    assert [m["tool_calls"][0]["function"]["arguments"] for m in got[1::2]] == ["print(1)", {}]
    # The tool_calls key is there only where there are calls (Parquet gives null or [] keys).
    got = normalise({"messages": [{**msg("user", "q"), "tool_calls": None},
                                  {**msg("assistant", "a"), "tool_calls": []},
                                  msg("user", "q2")]})  # fmt: skip
    assert got == [msg("user", "q"), msg("assistant", "a"), msg("user", "q2")]


def test_tool_turn_order_empty_turns_and_bad_calls_are_rejected():
    user, answer, result = msg("user", "q"), msg("assistant", "a"), msg("tool", "r")
    calls = calling(call("f", {}))

    def reason(*turns: dict[str, Any]) -> tuple[str, str] | None:
        got = normalise({"messages": list(turns)})
        return (got.reason, got.detail) if isinstance(got, Rejection) else None

    # A tool result answers a call (or follows another result); the assistant answers a user or
    # a tool; the user speaks first and after the assistant only.
    assert reason(user, calls, result, result, answer, user, calls, user) is None
    assert reason(user, result) == (
        "broken_alternation",
        "turn 1 is tool, expected assistant (roles: user,tool)",
    )
    assert reason(user, answer, result) == (
        "broken_alternation",
        "turn 2 is tool, expected user (roles: user,assistant,tool)",
    )
    assert reason(user, calls, answer, result) == (
        "broken_alternation",
        "turn 2 is assistant, expected user or tool (roles: user,assistant,assistant,tool)",
    )
    assert reason(user, calls, result, user) == (
        "broken_alternation",
        "turn 3 is user, expected assistant or tool (roles: user,assistant,tool,user)",
    )
    assert reason(msg("system", "s"), result, user) == (
        "broken_alternation",
        "turn 1 is tool, expected user (roles: system,tool,user)",
    )
    assert reason(result) == ("no_user_turn", "1 turns, none from the user")
    # Empty: a tool result never, an assistant turn only when it calls tools.
    assert reason(user, calls, msg("tool", " ")) == ("empty_turn", "turn 2 (tool) is empty")
    assert reason(user, msg("assistant", ""), user) == ("empty_turn", "turn 1 (assistant) is empty")
    # Calls that are not function calls with a name and object or text arguments.
    bad_calls = [
        ({**user, "tool_calls": [call("f", {})]}, "turn 1: tool_calls on a user turn"),
        (calling({"type": "retrieval"}), "turn 1: tool call 0: type 'retrieval', not 'function'"),
        (calling(call("", {})), "turn 1: tool call 0: name ''"),
        (calling(call("f", [1, 2])), "turn 1: tool call 0: arguments are a JSON array"),
        (calling(call("f", {}), "not a call"), "turn 1: tool call 1: a JSON string, not an object"),
        ({**answer, "tool_calls": "f()"}, "turn 1: tool call 0: a JSON string, not an object"),
    ]
    for turn, detail in bad_calls:
        assert reason(user, turn, result) == ("unknown_format", detail)
    sharegpt = {"conversations": [{"from": "human", "value": "q"},
                                  {"from": "function_call", "value": "f(1)"}]}  # fmt: skip
    assert normalise(sharegpt) == Rejection(
        "unknown_format", "turn 1 (function_call): tool call 0: a JSON string, not an object"
    )


@pytest.mark.parametrize("container", ["jsonl", "parquet"])
def test_tool_conversations_are_kept_and_read_back(tmp_path, qwen36_counter, container):
    rows, expected = weather_rows()
    rows.append({"prompt": "no tools"})
    expected.append([msg("user", "no tools")])
    if container == "jsonl":
        write_rows(tmp_path / "in" / "rows.jsonl", rows)
    else:
        # A Parquet column has one type: arguments all text, each style in a file of its own.
        arguments = json.dumps({"city": "Rome", "units": ["C", 1, None]})
        rows[0]["messages"][2]["tool_calls"][1]["function"]["arguments"] = arguments
        write_rows(tmp_path / "in" / "openai.parquet", rows[:1])
        write_rows(tmp_path / "in" / "sharegpt.parquet", rows[1:])
    result = run([tmp_path / "in"], tmp_path / "out", counter=qwen36_counter)
    assert result.rows_rejected == 0, rejected_rows(tmp_path / "out")
    kept = sorted(kept_rows(tmp_path / "out"), key=lambda r: r["id"])
    assert [r["messages"] for r in kept] == sorted(expected, key=conversation_id)
    assert [r["id"] for r in kept] == sorted(conversation_id(m) for m in expected)
    tokenizer = qwen36_counter.tokenizer
    for row in kept:
        assert row["num_turns"] == len(row["messages"])
        assert row["num_prompt_tokens"] == len(prompt_ids(tokenizer, row["messages"], THINKING))
    # The table holds the calls as canonical JSON text, and null where a message has none.
    table = pq.read_table(tmp_path / "out" / "eval.parquet").to_pylist()
    table += [r for p in (tmp_path / "out" / "train").glob("*.parquet")
              for r in pq.read_table(p).to_pylist()]  # fmt: skip
    stored = {r["id"]: r["messages"] for r in table}
    first = stored[conversation_id(expected[0])]
    assert [i for i, m in enumerate(first) if m["tool_calls"] is not None] == [2, 7]
    assert first[7]["tool_calls"] == (
        '[{"function":{"arguments":{"city":"Paris","days":1},"name":"forecast"},"type":"function"}]'
    )
    # The rendered prompt shows the tool results, ending in the generation prompt.
    prompt = render_prompt(tokenizer, expected[1], THINKING)
    assert "<tool_response>\n3.11\n</tool_response>\n<tool_response>\n16404" in prompt


@pytest.mark.parametrize("fast", [True, False], ids=["formatter", "jinja"])
def test_template_rejects_what_it_cannot_render_and_keeps_the_rest(tmp_path, tokenizer, fast):
    # The tiny target's template raises on a tool turn: that row is refused, its neighbours in
    # the same file and chunk (rendered in one batch with it) are kept.
    counter = PromptTokenCounter(tokenizer, THINKING, BUDGET, fast=fast)
    assert (counter.formatter is not None) == fast
    rows: list[Any] = [{"prompt": f"plain {i}"} for i in range(4)]
    rows.insert(2, {"messages": TOOL_CONVERSATION})
    # Calls without tool turns render (this template ignores calls): kept.
    calls_only = [msg("user", "q"), calling(call("f", {"a": 1})), msg("user", "never mind")]
    rows.append({"messages": calls_only})
    path = write_rows(tmp_path / "rows.jsonl", rows)
    result = run([path], tmp_path / "out", counter=counter)
    [rejected] = rejected_rows(tmp_path / "out")
    assert (rejected["line"], rejected["reason"]) == (3, "template_rejects")
    assert rejected["detail"] == "unknown role tool: use system, user or assistant"
    assert result.rejected == {"template_rejects": 1}
    kept = {r["id"]: r for r in kept_rows(tmp_path / "out")}
    expected = [[msg("user", f"plain {i}")] for i in range(4)] + [calls_only]
    assert set(kept) == {conversation_id(m) for m in expected}
    row = kept[conversation_id(calls_only)]
    assert row["messages"] == calls_only
    assert row["num_prompt_tokens"] == len(prompt_ids(tokenizer, calls_only, THINKING))


# ---------------------------------------------------------------------------------------------
# Determinism: chunks, workers, added rows.


def test_chunk_size_and_worker_processes_do_not_change_a_byte(tmp_path):
    mixed_input(tmp_path / "in", good=80, bad=6)
    write_rows(tmp_path / "in" / "d.jsonl", ['{"prompt": "Question 1"}'] * 3)  # duplicates
    # Refused by the template, which a worker loads only then (the fast formatter needs none).
    write_rows(tmp_path / "in" / "e.jsonl", [{"messages": TOOL_CONVERSATION}])
    outs = {
        "inline": run([tmp_path / "in"], tmp_path / "inline"),
        "small-chunks": run([tmp_path / "in"], tmp_path / "small-chunks", chunk_rows=7),
        "two-workers": run([tmp_path / "in"], tmp_path / "two-workers", chunk_rows=16, workers=2),
    }
    assert outs["two-workers"].workers == 2
    metrics = {name: r.metrics() for name, r in outs.items()}
    assert metrics["inline"] == metrics["small-chunks"] == metrics["two-workers"]
    assert metrics["inline"]["rejected_by_reason"]["duplicate"] > 0
    assert metrics["inline"]["rejected_by_reason"]["template_rejects"] == 1
    files = sorted(p.relative_to(tmp_path / "inline") for p in (tmp_path / "inline").rglob("*.*"))
    for name in ("small-chunks", "two-workers"):
        for f in files:
            assert (tmp_path / name / f).read_bytes() == (tmp_path / "inline" / f).read_bytes()


def test_split_and_shard_do_not_move_when_rows_are_added(tmp_path):
    first = [{"prompt": f"original prompt {i}"} for i in range(200)]
    write_rows(tmp_path / "v1" / "rows.jsonl", first)
    run([tmp_path / "v1"], tmp_path / "out1")
    before = {r["id"]: (r["split"], r["shard"]) for r in kept_rows(tmp_path / "out1")}
    # New rows before, between and after the old ones, and a new file that sorts first.
    added = [{"prompt": f"new prompt {i}"} for i in range(300)]
    mixed = added[:100] + first[:100] + added[100:200] + first[100:] + added[200:250]
    write_rows(tmp_path / "v2" / "rows.jsonl", mixed)
    write_rows(tmp_path / "v2" / "0-first.parquet", added[250:])
    run([tmp_path / "v2"], tmp_path / "out2", chunk_rows=64)
    after = {r["id"]: (r["split"], r["shard"]) for r in kept_rows(tmp_path / "out2")}
    assert len(after) == 500
    assert {i: after[i] for i in before} == before
    splits = [s for s, _ in after.values()]
    assert 50 < splits.count("eval") < 150  # eval_fraction 0.2 of 500
    assert {k for s, k in after.values() if s == "train"} == {0, 1, 2}
    # The file a row lands in is its shard's.
    for shard in range(3):
        table = pq.read_table(tmp_path / "out2" / "train" / f"shard-{shard}.parquet")
        assert all(after[i] == ("train", shard) for i in table.column("id").to_pylist())


def test_raising_eval_fraction_only_moves_rows_from_train_to_eval():
    ids = [conversation_id([msg("user", f"q{i}")]) for i in range(500)]
    low = {i: curation.assign_split(i, 0.1, 4, "s") for i in ids}
    high = {i: curation.assign_split(i, 0.3, 4, "s") for i in ids}
    assert all(high[i] == ("eval", -1) for i in ids if low[i][0] == "eval")
    assert all(high[i] in (low[i], ("eval", -1)) for i in ids)
    assert sum(s == "eval" for s, _ in high.values()) > sum(s == "eval" for s, _ in low.values())


# ---------------------------------------------------------------------------------------------
# The fast paths equal the slow ones.


def varied_conversations(seed: int, n: int) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    alphabet = ["word", "Word", "a", "7", "2024", " ", " ", " ", "  ", "   ", "\n", "\n\n",
                "\n\n ", " \n", "\t", "\r\n", ".", ",", "'s", "'ll", "don't", "!?", "(x)", "é",
                "Système", "中文字符", "日本語", "한국어", "🙂", "👍🏽", "\xa0", "\u3000", "\u2009",
                "<think>", "</think>", "<|im_end|>", "<|im_start|>user", "<tool_response>",
                "ünïcödé", "½", "٣", "\x1c", "-", "_", "http://x.io/a?b=1"]  # fmt: skip

    def text(k: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, k))).strip() or "x"

    conversations = []
    for _ in range(n):
        messages = [msg("system", text(12))] if rng.random() < 0.4 else []
        turns = rng.choice([1, 1, 3, 5, 7])
        for t in range(turns):
            if t % 2 == 0:
                messages.append(msg("user", text(60)))
            else:
                think = f"<think>\n{text(20)}\n</think>\n\n" if rng.random() < 0.6 else ""
                messages.append(msg("assistant", think + text(40)))
        conversations.append(messages)
    return conversations


@pytest.mark.parametrize(
    "seed, kwargs", [(1, {"enable_thinking": True}), (2, {"enable_thinking": False}), (3, {})]
)
def test_fast_path_equals_the_chat_template_and_the_tokenizer(tokenizer, seed, kwargs):
    fast = PromptTokenCounter(tokenizer, kwargs, BUDGET, prefix_chars_per_token=2)
    slow = PromptTokenCounter(tokenizer, kwargs, BUDGET, prefix_chars_per_token=2, fast=False)
    assert fast.formatter is not None and fast.fast_counter is not None
    assert slow.formatter is None and slow.fast_counter is None
    conversations = varied_conversations(seed, n=400)
    rendered = fast.render(conversations)
    assert rendered == slow.render(conversations)
    assert rendered == [render_prompt(tokenizer, c, kwargs) for c in conversations]
    history = [m["content"] for c in conversations for m in c if m["role"] == "assistant"]
    assert any(h.startswith("<think>") for h in history)
    counts = fast.count(conversations)
    assert counts == slow.count(conversations)
    exact = [len(prompt_ids(tokenizer, c, kwargs)) for c in conversations]
    for (n, is_exact), true in zip(counts, exact, strict=True):
        assert n == true if is_exact else BUDGET < n <= true
    assert any(not e for _, e in counts) and any(n <= BUDGET for n, _ in counts)


def test_fast_counter_counts_every_text_exactly(counter):
    rng = random.Random(3)
    alphabet = [" ", " ", "  ", "\n", "\t", "\r", "\x0b", "\x0c", "a", "bc", "Z", "9", "'", "'s",
                ".", "é", "中", "🙂", "\xa0", "\u2028", "\x1c", "\x85", "<|im_end|>", "<think>",
                "\x00"]  # fmt: skip
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(3000)]
    expected = [len(e) for e in counter.backend.encode_batch(texts, add_special_tokens=False)]
    assert counter.lengths(texts) == expected
    # A text holding the hold character is left to the tokenizer, still exact.
    assert counter.fast_counter is not None and counter.fast_counter.count("a\x00b") is None


def test_fast_paths_are_used_only_where_they_are_known_to_be_exact(tiny_target_dir, tokenizer):
    from tokenizers import Tokenizer, normalizers
    from transformers import AutoTokenizer

    # The tiny target's template and tokenizer are the checked kind: curate runs fast on them.
    assert PromptTokenCounter(tokenizer, THINKING, BUDGET).formatter is not None
    # Another template (here Qwen3's rule that a <tool_response> turn is not a query), or a
    # template argument the formatter does not know, falls back to jinja.
    other = AutoTokenizer.from_pretrained(str(tiny_target_dir))
    other.chat_template = tokenizer.get_chat_template().replace(
        "message.role == 'user' -%}",
        "message.role == 'user' and not message.content.startswith('<tool_response>') -%}",
    )
    assert other.chat_template != tokenizer.get_chat_template()
    assert PromptTokenCounter(other, THINKING, BUDGET).formatter is None
    assert PromptTokenCounter(tokenizer, {**THINKING, "tools": None}, BUDGET).formatter is None
    # A tokenizer with a normalizer is not one the fast counter models.
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    assert ByteLevelTokenCounter.verified(backend) is not None
    backend.normalizer = normalizers.NFC()
    assert ByteLevelTokenCounter.verified(backend) is None


def test_counts_survive_the_trip_to_a_worker_process(counter):
    import pickle

    copy = pickle.loads(pickle.dumps(counter))
    assert copy.tokenizer is None  # the fast formatter needs no transformers in the worker
    conversations = varied_conversations(seed=5, n=50)
    assert copy.count(conversations) == counter.count(conversations)
    assert copy.tokenizer is None
    # A conversation with tools goes to the template, loaded in the worker on first need.
    conversations.insert(3, TOOL_CONVERSATION)
    counts = copy.count(conversations)
    assert counts == counter.count(conversations) and copy.tokenizer is not None
    assert counts[3] == Rejection(
        "template_rejects", "unknown role tool: use system, user or assistant"
    )


@pytest.fixture(scope="module")
def whitespace_bpe() -> Any:
    """A byte-level BPE trained on text full of whitespace runs, so that its merges span them
    ("ĠĠĠ", "ĊĠĠ"): counts then show any misplaced pre-token boundary, which the tiny target's
    vocabulary (no such merges) would hide."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(7)
    words = ["def", "return", "if", "x", "value", "it's", "we'll", "42", "(", "):", "=", "+"]
    corpus = []
    for _ in range(3000):
        lines = []
        for _ in range(rng.randint(1, 6)):
            indent = " " * rng.choice([0, 1, 2, 3, 4, 8]) + "\t" * rng.choice([0, 0, 1])
            spaces = [" ", " ", "  ", "   "]
            lines.append(indent + "".join(rng.choice(words) + rng.choice(spaces) for _ in range(5)))
        corpus.append(rng.choice(["\n", "\n\n", " \n", "\n \n", "\r\n"]).join(lines))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=[AddedToken(t, normalized=False) for t in ("<|im_start|>", "<|im_end|>")],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    vocab = tok.get_vocab()
    assert {"ĠĠ", "ĠĠĠ", "ĠĊĠ", "ĠĠĊĠĠ"} <= set(vocab)  # " " is Ġ, "\n" is Ċ
    return tok


def test_fast_counter_is_exact_where_merges_span_whitespace(whitespace_bpe):
    counter = ByteLevelTokenCounter.verified(whitespace_bpe)
    assert counter is not None
    rng = random.Random(11)
    alphabet = [" ", " ", "  ", "   ", "    ", "\n", "\n ", " \n", "\n\n", "\t", " \t", "\r\n",
                "def", "x", "it's", "'ll", "42", "(", "):", "é", "中", "\xa0", "\u3000",
                "<|im_start|>", "<|im_end|>"]  # fmt: skip
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25))) for _ in range(4000)]
    expected = [len(e) for e in whitespace_bpe.encode_batch(texts, add_special_tokens=False)]
    assert [counter.count(t) for t in texts] == expected
