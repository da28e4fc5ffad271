"""Resume after `kill -9`: the shard completes with exactly its curated ids, none twice, none
lost, and samples finished before the kill are not generated again.

The SGLang runs use the stand-in server (tests/helpers/sglang_standin.py, SGLang's `/generate`
protocol) in its own process; its request log counts what was generated after the restart.
Killed runs are `draftline generate` subprocesses; the others run in this process.
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
    generate_here,
    make_workdir,
    sglang_hardware,
)

from draftline import cli
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


def journaled(cwd: Path, shards: int = 1) -> list[str]:
    """Finished turns in the journals of train shards 0..shards-1."""
    paths = [cwd / f".draftline/journal/generate/shard-{k}.jsonl" for k in range(shards)]
    return [key for path in paths if path.exists() for key in journal_ids(path)]


def start_and_kill(
    cwd: Path, at_records: int, timeout: float = 180, shard: int = 0, shards: int = 1
) -> list[str]:
    """Run stage `generate@shard` in a subprocess and SIGKILL it once the journals of shards
    0..shards-1 hold `at_records` finished turns; the turns they hold then."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "draftline", "generate", "--no-progress", "--shard", str(shard)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if len(journaled(cwd, shards)) >= at_records:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"stage ended before the kill: {proc.stdout.read().decode()}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (cwd / f"data/generated/train/shard-{shard}.parquet").exists()
    return journaled(cwd, shards)


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
        generate_here(tmp_path, "--shard", "0")
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
    # Kept until DVC records the table (no dvc.lock here): it rebuilds a table DVC deletes.
    assert sorted(journal_ids(tmp_path / JOURNAL)) == sorted(turn_keys(table))


def test_kill_9_mid_shard_then_resume_on_the_local_engine(tmp_path, model_dir):
    ids = make_workdir(
        tmp_path, model_dir, n=60, hardware=LOCAL_CPU, max_new_tokens=40, generate={"guard": False}
    )
    done_before = start_and_kill(tmp_path, random.Random().randint(2, 30))
    generate_here(tmp_path, "--shard", "0")
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


def tables(cwd: Path, shards: int) -> list[bytes]:
    return [(cwd / f"data/generated/train/shard-{k}.parquet").read_bytes() for k in range(shards)]


def reference_tables(cwd: Path, shards: int) -> list[bytes]:
    """generate@0, generate@1, ... run one after another, as `dvc repro` runs them (in this
    process: the reference needs no kill)."""
    for k in range(shards):
        generate_here(cwd, "--shard", str(k))
    return tables(cwd, shards)


def test_kill_9_while_working_ahead_loses_and_doubles_nothing(tmp_path, model_dir, capsys):
    """Three shards of 1-4-turn conversations on the SGLang stand-in. Stage 0 works ahead on
    shards 1 and 2 (`work_ahead_shards: 2`) and is killed at a random point; then stage 0 or 1
    runs and is killed again; then the stages run in dvc.yaml order. No finished turn is asked
    again, each journal holds each turn once, stages 1 and 2 find their turns journaled by
    stage 0, salvage counts them, and every table has the bytes of the old schedule's (rounds,
    each shard alone)."""
    from draftline.ops.salvage.node_checks import partial_journals

    alone, ahead = tmp_path / "alone", tmp_path / "ahead"
    alone.mkdir()
    ahead.mkdir()
    server = StandIn(tmp_path, "--delay", "0.005", "--delay-spread", "0.03")
    hardware = sglang_hardware(server.port, 6)
    shape = {"n": 40, "shards": 3, "multi_turn": True, "max_new_tokens": 64}
    make_workdir(alone, model_dir, hardware={**hardware, "generation_schedule": "rounds"}, **shape)
    make_workdir(ahead, model_dir, hardware={**hardware, "work_ahead_shards": 2}, **shape)
    rng = random.Random()
    with server:
        reference = reference_tables(alone, 3)
        turns = [sum(pq.read_table(alone / f"data/generated/train/shard-{k}.parquet")
                     .column("turns").to_pylist()) for k in range(3)]  # fmt: skip
        total = sum(turns)
        assert max(turns) < total - 20  # several shards' worth of turns

        done: list[str] = []
        for shard in (0, rng.choice([0, 1])):
            # Within what this stage's stream has left (its shard and those after it).
            left = sum(turns[shard:]) - len(journaled(ahead, 3)) + len(journaled(ahead, shard))
            at = len(journaled(ahead, 3)) + rng.randint(1, max(1, left // 2))
            asked = len(server.rids())
            done_now = start_and_kill(ahead, at, shard=shard, shards=3)
            asked_after = {r.rsplit("-", 1)[0] for r in server.rids()[asked:]}
            assert not asked_after & set(done)  # a finished turn is never asked again
            assert len(done_now) == len(set(done_now))  # no turn journaled twice
            assert set(done) <= set(done_now)  # and none lost
            done = done_now
        # Stage 0 finishes its stream: every turn of shards 0-2 is journaled. (The runs that
        # are not killed run in this process: no interpreter to start.)
        capsys.readouterr()
        generate_here(ahead, "--shard", "0")
        out = capsys.readouterr().out
        assert "worked ahead on shard-1" in out and "worked ahead on shard-2" in out
        assert sorted(journaled(ahead, 3)) == sorted(set(journaled(ahead, 3)))
        # Shard 0's journal stays too: no dvc.lock here records its table.
        assert len(journaled(ahead, 3)) == total
        unfinished = {f.what.split(":")[0]: f.what for f in partial_journals(ahead, set())}
        assert (
            f"unfinished shard generate@1: {turns[1]} finished turns"
            in unfinished["unfinished shard generate@1"]
        )
        # Stages 1 and 2 generate nothing: they write their tables from their journals.
        asked = len(server.rids())
        for shard in (1, 2):
            generate_here(ahead, "--shard", str(shard))
        assert len(server.rids()) == asked
    assert tables(ahead, 3) == reference
    assert len(journaled(ahead, 3)) == len(set(journaled(ahead, 3))) == total  # none added
    metrics = json.loads((ahead / "logs/runs/generate/shard-1.json").read_text())
    assert metrics["generated_turns"] == 0 and metrics["resumed_samples"] == 40


def test_kill_9_on_the_local_engine_while_working_ahead(tmp_path, model_dir):
    """The local engine, two shards, work-ahead on: killed mid-stream, stage 1 runs first (it
    resumes the turns stage 0 journaled for it), then stage 0; the tables equal those of the
    stages run alone in the old schedule."""
    alone, ahead = tmp_path / "alone", tmp_path / "ahead"
    alone.mkdir()
    ahead.mkdir()
    shape = {"n": 10, "shards": 2, "multi_turn": True, "max_new_tokens": 24,
             "generate": {"guard": False}}  # fmt: skip
    make_workdir(alone, model_dir, hardware={**LOCAL_CPU, "generation_schedule": "rounds"},
                 **shape)  # fmt: skip
    make_workdir(ahead, model_dir, hardware={**LOCAL_CPU, "work_ahead_shards": 1}, **shape)
    reference = reference_tables(alone, 2)
    done = start_and_kill(ahead, random.Random().randint(4, 16), shards=2)
    for shard in (1, 0):  # stage 1 first: its journal holds what stage 0 did ahead
        generate_here(ahead, "--shard", str(shard))
    table = pq.read_table(ahead / "data/generated/train/shard-1.parquet").to_pylist()
    metrics = json.loads((ahead / "logs/runs/generate/shard-1.json").read_text())
    assert metrics["generated_turns"] == len(turn_keys(table) - set(done))
    assert tables(ahead, 2) == reference


@pytest.mark.parametrize("target", ["tiny-target", "tiny-qwen36"])
def test_the_embedded_targets_write_the_old_schedules_bytes(tmp_path, target):
    """The embedded default's target and the Qwen3.6 twin (local engine, greedy), a shard of
    the bundled conversations (multi-turn ones among them) and one of made-up 1-4-turn ones:
    the continuous schedule, stage 0 working ahead on shard 1, writes the bytes of the old
    rounds schedule with each stage alone, and so do the journals they resume from."""
    from draftline.core.turn_prompts import regenerated_turns
    from draftline.data.conversations import normalise
    from draftline.data.input_files import read_rows

    bundled = [normalise(r.value) for r in read_rows(ROOT / "data/sample/conversations.jsonl")
               if not r.error][:40]  # fmt: skip
    bundled = [m for m in bundled if isinstance(m, list)]
    multi = [m for m in bundled if len(regenerated_turns(m)) > 1][:4]
    picked = multi + [m for m in bundled if m not in multi][:6]
    runs = {}
    for name, hardware in (
        ("rounds", {**LOCAL_CPU, "local": {"batch_size": 4}, "generation_schedule": "rounds"}),
        ("continuous", {**LOCAL_CPU, "local": {"batch_size": 4}, "work_ahead_shards": 1}),
    ):
        work = tmp_path / name
        work.mkdir()
        make_workdir(work, ROOT / "models" / target, hardware=hardware, n=6, shards=2,
                     multi_turn=True, messages=picked, max_new_tokens=48,
                     generate={"guard": False})  # fmt: skip
        generate_here(work, "--shard", "0")
        if name == "continuous":  # stage 0 worked ahead: shard 1's turns are journaled
            assert not (work / "data/generated/train/shard-1.parquet").exists()
            ahead = journal_ids(work / ".draftline/journal/generate/shard-1.jsonl")
        generate_here(work, "--shard", "1")
        runs[name] = tables(work, 2)
        if name == "continuous":
            metrics = json.loads((work / "logs/runs/generate/shard-1.json").read_text())
            assert metrics["generated_turns"] == 0 and metrics["resumed_samples"] == 6
    assert runs["continuous"] == runs["rounds"]
    rows = pq.read_table(tmp_path / "rounds/data/generated/train/shard-0.parquet").to_pylist()
    assert max(r["turns"] for r in rows) > 1
    shard_1 = pq.read_table(tmp_path / "rounds/data/generated/train/shard-1.parquet")
    assert sorted(ahead) == sorted(turn_keys(shard_1.to_pylist()))  # every turn, once


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
    from draftline.generation.table_record import Identity

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


def test_errors_below_the_threshold_are_kept_as_rows_and_retried_on_rerun(
    tmp_path, model_dir, monkeypatch, capsys
):
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
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    with server:
        status = cli.main(["generate", "--no-progress", "--shard", "0"])
    # Every request timed out: far above max_error_share, so the shard fails and says why.
    out = capsys.readouterr().out
    assert status == 1
    assert "max_error_share" in out and "within 0.2s" in out
    assert not (tmp_path / "data/generated/train/shard-0.parquet").exists()
    # The failures are journaled as errors and are generated again by the next run.
    asked_before = len(server.rids())
    with StandIn(tmp_path, port=server.port) as again:  # same port: appends to the same log
        generate_here(tmp_path, "--shard", "0")
        assert sorted(set(again.sample_ids()[asked_before:])) == ids
    table = pq.read_table(tmp_path / "data/generated/train/shard-0.parquet").to_pylist()
    assert [r["id"] for r in table] == ids and {r["finish_reason"] for r in table} == {"stop"}


def test_an_endpoint_dying_mid_shard_leaves_the_shard_whole(tmp_path, model_dir, monkeypatch):
    """Two endpoints in DRAFTLINE_SGLANG_ENDPOINTS; one dies mid-shard. The stage goes on with
    the other and the shard holds every curated id exactly once, with no error row."""
    alive = StandIn(tmp_path, "--delay", "0.02")
    dies = StandIn(tmp_path, "--delay", "0.02", "--die-after", "30")
    ids = make_workdir(
        tmp_path, model_dir, n=160, hardware=sglang_hardware(alive.port, 8), max_new_tokens=64
    )
    with alive, dies:
        monkeypatch.setenv("DRAFTLINE_SGLANG_ENDPOINTS", f"{alive.url},{dies.url}")
        generate_here(tmp_path, "--shard", "0")
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
        generate_here(tmp_path, "--shard", "0")
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
        if kill:  # some conversations have their second turn, none all of them: mid-way
            done_before = start_and_kill(work, len(ids) + 2)
            assert any(k.endswith("#1") for k in done_before)
            assert len(done_before) < 3 * len(ids)  # each has three turns or more
        generate_here(work, "--shard", "0")
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


def test_a_shard_is_worked_ahead_on_only_when_its_table_is_not_current(tmp_path):
    """No table: work ahead. A table this draftline wrote for the same identity and curated
    shard: leave it. Another identity or curated shard: its stage will run again, work ahead.
    A table nothing is known about (an older draftline's, DVC's checkout): leave it."""
    from draftline.generation.engines.base import Sampling
    from draftline.generation.table_record import (
        Identity,
        ShardPaths,
        mark_current,
        needs_generating,
    )

    paths = ShardPaths("shard-1", tmp_path / "curated.parquet", tmp_path / "out.parquet",
                       tmp_path / "run.json", tmp_path / "journal/shard-1.jsonl")  # fmt: skip
    identity = Identity("m", {"enable_thinking": True}, Sampling(max_new_tokens=8))
    assert not needs_generating(paths, identity)  # nothing curated yet
    paths.curated.write_bytes(b"curated")
    assert needs_generating(paths, identity)  # no table
    paths.output.write_bytes(b"table")
    assert not needs_generating(paths, identity)  # a table without a record
    paths.journal.parent.mkdir()
    mark_current(paths, identity)
    assert not needs_generating(paths, identity)
    assert needs_generating(paths, Identity("other", {}, Sampling(max_new_tokens=8)))
    paths.curated.write_bytes(b"curated again")
    assert needs_generating(paths, identity)
    mark_current(paths, identity)
    paths.output.write_bytes(b"tables")  # replaced by something else
    assert not needs_generating(paths, identity)
