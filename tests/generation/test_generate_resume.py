"""Resume after `kill -9`: the shard completes with exactly its curated ids, none twice, none
lost, and samples finished before the kill are not generated again.

The SGLang runs use the stand-in server (tests/helpers/sglang_standin.py, SGLang's `/generate`
protocol) in its own process; its request log counts what was generated after the restart.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from helpers.generate_helpers import (
    StandIn,
    build_random_target,
    make_workdir,
    run_generate,
    sglang_hardware,
)

from draftline.generation.engines.base import Result
from draftline.generation.journal import Journal

JOURNAL = Path(".draftline/journal/generate/shard-0.jsonl")
ROOT = Path(__file__).resolve().parents[2]
# The local engine on one thread, two prompts a batch: many batches, so a kill lands mid-shard.
LOCAL_CPU = {
    "name": "cpu",
    "engine": "local",
    "device": "cpu",
    "precision": "fp32",
    "num_threads": 1,
    "local": {"batch_size": 2},
    "sglang": None,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_random_target(tmp_path_factory.mktemp("target"))


def journal_ids(path: Path) -> list[str]:
    """Keys (`<conversation id>#<turn>`) of the turns the journal holds as finished."""
    ids = []
    for line in path.read_bytes().splitlines(keepends=True):
        if line.endswith(b"\n"):
            obj = json.loads(line)
            if "id" in obj and obj["finish_reason"] != "error":
                ids.append(obj["id"])
    return ids


def turn_keys(table: list[dict]) -> set[str]:
    return {f"{r['id']}#{k}" for r in table for k in range(r["turns"])}


def start_and_kill(cwd: Path, at_records: int, timeout: float = 180) -> list[str]:
    """Run the stage in a subprocess and SIGKILL it once the journal holds `at_records`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "draftline", "generate", "--no-progress", "--shard", "0"],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    journal = cwd / JOURNAL
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists() and len(journal_ids(journal)) >= at_records:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"stage ended before the kill: {proc.stdout.read().decode()}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (cwd / "data/generated/train/shard-0.parquet").exists()
    return journal_ids(journal)


def test_kill_9_mid_shard_then_resume_on_sglang(tmp_path, model_dir):
    server = StandIn(tmp_path, "--delay", "0.03")
    ids = make_workdir(
        tmp_path, model_dir, n=240, hardware=sglang_hardware(server.port, 4), max_new_tokens=64
    )
    with server:
        done_before = start_and_kill(tmp_path, random.Random().randint(10, 200))
        assert len(done_before) == len(set(done_before)) >= 10
        # A torn last line, as if the process died inside a write.
        with open(tmp_path / JOURNAL, "ab") as f:
            f.write(b'{"id": "' + ids[-1].encode() + b'", "completion_ids": [3, 1')
        asked_before = len(server.rids())
        proc = run_generate(tmp_path, "--shard", "0")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        asked_after = {r.rsplit("-", 1)[0] for r in server.rids()[asked_before:]}
    table = pq.read_table(tmp_path / "data/generated/train/shard-0.parquet").to_pylist()
    assert [r["id"] for r in table] == ids  # exactly the curated ids, once each, sorted
    assert not asked_after & set(done_before)  # finished turns were not generated again
    assert asked_after | set(done_before) == turn_keys(table)
    assert max(r["turns"] for r in table) == 2  # the conversations with an earlier answer
    assert all(r["finish_reason"] == "stop" and r["completion_ids"][-1] == 2 for r in table)
    metrics = json.loads((tmp_path / "logs/runs/generate/shard-0.json").read_text())
    assert metrics["generated_turns"] == len(asked_after)
    assert metrics["resumed_samples"] + metrics["generated_samples"] == len(ids)
    assert not (tmp_path / JOURNAL).exists()  # removed once the output is in place


def test_kill_9_mid_shard_then_resume_on_the_local_engine(tmp_path, model_dir):
    ids = make_workdir(
        tmp_path, model_dir, n=60, hardware=LOCAL_CPU, max_new_tokens=40, generate={"guard": False}
    )
    done_before = start_and_kill(tmp_path, random.Random().randint(2, 30))
    proc = run_generate(tmp_path, "--shard", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = pq.read_table(tmp_path / "data/generated/train/shard-0.parquet").to_pylist()
    assert [r["id"] for r in table] == ids
    metrics = json.loads((tmp_path / "logs/runs/generate/shard-0.json").read_text())
    assert metrics["generated_turns"] == len(turn_keys(table) - set(done_before))
    assert metrics["resumed_samples"] + metrics["generated_samples"] == len(ids)
    # The run it measured, for `draftline plan`.
    assert (metrics["model"], metrics["data"], metrics["drafter"]) == (
        str(model_dir),
        "sample",
        "dflash_tiny",
    )


def test_journal_keeps_the_latest_record_and_cuts_a_torn_line(tmp_path):
    path = tmp_path / "j.jsonl"
    ident = {"model": "m", "sampling": {"max_new_tokens": 4}}
    j = Journal(path, ident)
    assert j.open() == {}
    j.append([Result("a", [1, 2], "stop"), Result("b", [], "error", "boom")], wall_s=1.5)
    j.append([Result("b", [3], "length")], wall_s=2.5)
    j.close()
    with open(path, "ab") as f:
        f.write(b'{"id": "c", "compl')  # died mid-write
    j = Journal(path, ident)
    records = j.open()
    assert {k: (v.completion_ids, v.finish_reason) for k, v in records.items()} == {
        "a": ([1, 2], "stop"),
        "b": ([3], "length"),
    }
    assert j.wall_s == 2.5
    j.append([Result("c", [9], "stop")])
    j.close()
    assert set(Journal(path, ident).open()) == {"a", "b", "c"}  # no line glued to the torn one


def test_journal_of_another_sampling_is_set_aside(tmp_path):
    path = tmp_path / "j.jsonl"
    j = Journal(path, {"sampling": {"temperature": 0.0}})
    j.open()
    j.append([Result("a", [1], "stop")])
    j.close()
    j = Journal(path, {"sampling": {"temperature": 0.7}})
    assert j.open() == {}
    assert j.discarded is not None and j.discarded.exists()
    j.close()


def test_journal_of_another_chat_template_is_set_aside(tmp_path):
    """Fixing a broken template (same model, kwargs and sampling) must not resume its samples."""
    from draftline.generation.engines.base import Sampling
    from draftline.generation.shards import Identity

    sampling = Sampling(temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=8, seed=0)
    before, after = (
        Identity("m", {"enable_thinking": True}, sampling, chat_template_sha256=h).as_dict()
        for h in ("a" * 64, "b" * 64)
    )
    path = tmp_path / "j.jsonl"
    j = Journal(path, before)
    j.open()
    j.append([Result("a", [1], "stop")])
    j.close()
    assert Journal(path, before).open() == {"a": Result("a", [1], "stop")}
    j = Journal(path, after)
    assert j.open() == {}
    assert j.discarded is not None and j.discarded.exists()
    j.close()


def test_errors_below_the_threshold_are_kept_as_rows_and_retried_on_rerun(tmp_path, model_dir):
    server = StandIn(tmp_path, "--delay", "0.4")
    ids = make_workdir(
        tmp_path,
        model_dir,
        n=30,
        hardware=sglang_hardware(server.port, 8),
        max_new_tokens=64,
        generate={
            "request_timeout_s": 0.2,
            "max_retries": 0,
            "guard": False,
            "max_error_share": 0.2,
        },
    )
    with server:
        proc = run_generate(tmp_path, "--shard", "0")
    # Every request timed out: far above max_error_share, so the shard fails and says why.
    assert proc.returncode == 1
    assert "max_error_share" in proc.stdout and "within 0.2s" in proc.stdout
    assert not (tmp_path / "data/generated/train/shard-0.parquet").exists()
    # The failures are journaled as errors and are generated again by the next run.
    asked_before = len(server.rids())
    with StandIn(tmp_path, port=server.port) as again:  # same port: appends to the same log
        proc = run_generate(tmp_path, "--shard", "0")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert sorted(set(again.sample_ids()[asked_before:])) == ids
    table = pq.read_table(tmp_path / "data/generated/train/shard-0.parquet").to_pylist()
    assert [r["id"] for r in table] == ids and {r["finish_reason"] for r in table} == {"stop"}


def test_an_endpoint_dying_mid_shard_leaves_the_shard_whole(tmp_path, model_dir):
    """Two endpoints in DRAFTLINE_SGLANG_ENDPOINTS; one dies mid-shard. The stage goes on with
    the other and the shard holds every curated id exactly once, with no error row."""
    alive = StandIn(tmp_path, "--delay", "0.02")
    dies = StandIn(tmp_path, "--delay", "0.02", "--die-after", "30")
    ids = make_workdir(
        tmp_path, model_dir, n=160, hardware=sglang_hardware(alive.port, 8), max_new_tokens=64
    )
    with alive, dies:
        endpoints = f"{alive.url},{dies.url}"
        proc = run_generate(tmp_path, "--shard", "0", env={"DRAFTLINE_SGLANG_ENDPOINTS": endpoints})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert dies.proc.wait(5) != 0  # it did die, mid-shard
        served_by_dying = set(dies.sample_ids())
    assert 20 <= len(served_by_dying) < len(ids)
    table = pq.read_table(tmp_path / "data/generated/train/shard-0.parquet").to_pylist()
    assert [r["id"] for r in table] == ids  # exactly the curated ids, once each, sorted
    assert all(r["finish_reason"] == "stop" and r["completion_ids"][-1] == 2 for r in table)


def test_a_thinking_share_renders_each_prompt_in_its_own_mode(tmp_path, model_dir):
    """data.thinking_share=0.5: the ids `thinking_mode` leaves out are rendered with
    enable_thinking=false by the target's own template (its pre-filled empty think block), the
    rest as the model's kwargs say; each row records its mode."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from draftline.core import target

    with StandIn(tmp_path) as server:
        ids = make_workdir(tmp_path, model_dir, n=40, hardware=sglang_hardware(server.port, 4),
                           generate={"guard": False})  # fmt: skip
        params = yaml.safe_load((tmp_path / "params.yaml").read_text())
        params["data"]["thinking_share"] = 0.5
        params["data"]["regenerate_turns"] = "last"  # the dataset's history: prompts as curated
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        done = run_generate(tmp_path, "--shard", "0")
        assert done.returncode == 0, done.stdout + done.stderr
    rows = pq.read_table(tmp_path / "data/generated/train/shard-0.parquet").to_pylist()
    assert sorted(r["id"] for r in rows) == sorted(ids)
    modes = {r["id"]: r["thinking"] for r in rows}
    assert modes == {i: target.thinking_mode(i, 0.5) for i in ids}
    assert 10 < sum(modes.values()) < 30
    curated = {
        r["id"]: r["messages"]
        for r in pq.read_table(tmp_path / "data/curated/train/shard-0.parquet").to_pylist()
    }
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for row in rows:
        messages = [{"role": m["role"], "content": m["content"]} for m in curated[row["id"]]]
        kwargs = {"enable_thinking": row["thinking"]}
        assert row["prompt_ids"] == target.prompt_ids(tokenizer, messages, kwargs), row["id"]


def bundled_multi_turn_conversations(count: int) -> list[list[dict]]:
    """The first `count` conversations of the bundled prompt set with three assistant turns or
    more for the target to write."""
    from draftline.core.turn_prompts import regenerated_turns
    from draftline.data.conversations import normalise
    from draftline.data.input_files import Rejection, read_rows

    found = []
    for row in read_rows(ROOT / "data/sample/conversations.jsonl"):
        if row.error:  # the bundled set's deliberately malformed rows
            continue
        messages = normalise(row.value)
        if not isinstance(messages, Rejection) and len(regenerated_turns(messages)) >= 3:
            found.append(messages)
    return found[:count]


def test_a_bundled_multi_turn_conversation_resumes_mid_conversation_to_the_same_sequence(
    tmp_path,
):
    """Embedded default (the tiny target, local engine, the bundled set's multi-turn
    conversations): kill -9 once every first turn and some later ones are journaled, resume, and
    the table is identical to an uninterrupted run's. Each row is one sequence whose loss mask
    covers every assistant turn the target wrote."""
    from transformers import AutoTokenizer

    from draftline.core.loss_mask import loss_mask

    model_dir = ROOT / "models/tiny-target"
    conversations = bundled_multi_turn_conversations(8)
    assert len(conversations) == 8
    tables = []
    for name, kill in (("uninterrupted", False), ("killed", True)):
        work = tmp_path / name
        work.mkdir()
        ids = make_workdir(work, model_dir, hardware=LOCAL_CPU, max_new_tokens=128,
                           messages=conversations, generate={"guard": False})  # fmt: skip
        if kill:  # every conversation has a first turn; some have their second: mid-way
            done_before = start_and_kill(work, len(ids) + 2)
            assert {k.rpartition("#")[0] for k in done_before} == set(ids)
            assert any(k.endswith("#1") for k in done_before)
        proc = run_generate(work, "--shard", "0")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        tables.append(pq.read_table(work / "data/generated/train/shard-0.parquet"))
        if kill:
            metrics = json.loads((work / "logs/runs/generate/shard-0.json").read_text())
            assert metrics["generated_turns"] == sum(tables[-1]["turns"].to_pylist()) - len(
                done_before
            )
    assert tables[0].equals(tables[1])

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = tables[0].to_pylist()
    assert all(r["turn_finish_reasons"] == ["stop"] * r["turns"] for r in rows)
    for row in rows:
        spans = row["history_spans"]
        assert len(spans) == row["turns"] - 1 >= 2  # every earlier answer is in the sequence
        mask = loss_mask(row["num_prompt_tokens"], row["completion_ids"], spans)
        sequence = row["prompt_ids"] + row["completion_ids"]
        supervised = [tok.decode(sequence[s:e]) for s, e in spans]
        assert all(text.endswith("<|im_end|>") for text in supervised)
        assert sum(mask) == sum(e - s for s, e in spans) + len(row["completion_ids"])
        # Nothing but the target's answers is supervised: no user turn, no role header.
        assert all("<|im_start|>" not in text for text in supervised)
