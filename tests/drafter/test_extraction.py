"""Extraction: packs equal HF features, are written atomically, resume after a kill, and are
the same with one process or two (torchrun, gloo, CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from helpers.extraction_helpers import LAYER_IDS, MAX_LENGTH, settings
from helpers.tiny_qwen3 import END_OF_TURN, generated_row, random_rows, tiny_qwen3, write_shard

from draftline.core.loss_mask import loss_mask
from draftline.core.training_rows import window
from draftline.drafter.extraction import ExtractSettings, extract, length_batches, plan_packs
from draftline.drafter.packs import load_pack, read_index

pytestmark = pytest.mark.float_kernels
torch.set_num_threads(1)
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(num_layers=6)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    """Two shards, long-tailed lengths, one failed request and one prompt longer than max."""
    folder = tmp_path_factory.mktemp("generated") / "train"
    rows = random_rows(0, 30, seed=0)
    rows.append(generated_row(100, [5] * 10, [], "error"))
    rows.append(generated_row(101, [5] * (MAX_LENGTH + 3), [6, 2]))
    return [
        write_shard(folder / "shard-0.parquet", rows),
        write_shard(folder / "shard-1.parquet", random_rows(30, 20, seed=1)),
    ]


@pytest.fixture(scope="module")
def offline_dir(tmp_path_factory, shards, model) -> Path:
    out = tmp_path_factory.mktemp("offline")
    extract(shards, out, settings(), model_loader=lambda: model, progress=False)
    return out


def all_rows(shards: list[Path]) -> dict[str, dict]:
    import pyarrow.parquet as pq

    return {r["id"]: r for s in shards for r in pq.read_table(s).to_pylist()}


def pack_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("pack-*.safetensors"))


def assert_same_packs(a: Path, b: Path, ignore_index_keys: set[str] = frozenset()) -> None:
    assert [p.name for p in pack_files(a)] == [p.name for p in pack_files(b)]
    for pa, pb in zip(pack_files(a), pack_files(b), strict=True):
        da, db = load_pack(pa), load_pack(pb)
        assert da.keys() == db.keys()
        assert da["ids"] == db["ids"]
        for key in da.keys() - {"ids"}:
            assert torch.equal(da[key], db[key]), f"{pa.name}: {key} differs"
    index_a, index_b = read_index(a), read_index(b)
    for key in ignore_index_keys:
        index_a.pop(key), index_b.pop(key)
    assert index_a == index_b


def test_plan_drops_failed_rows_and_cuts_long_prompts_from_their_start(shards):
    plan = plan_packs(shards, MAX_LENGTH, 300)
    assert plan.dropped == {"error": 1, "no_supervised_tokens": 0}
    planned = [s for p in plan.packs for s in p.sequences]
    assert len(planned) == 51 and len({s.id for s in planned}) == 51
    assert all(p.num_tokens <= 300 or len(p.sequences) == 1 for p in plan.packs)
    assert max(s.num_tokens for s in planned) == MAX_LENGTH and plan.truncated > 0
    # The prompt longer than max_length loses its start; its completion is kept whole.
    long_prompt = next(s for s in planned if s.span.prompt_tokens == MAX_LENGTH + 3)
    assert (long_prompt.span.prompt_cut, long_prompt.span.completion_cut) == (5, 0)
    assert plan.yields.prompt_tokens_cut >= 5 and plan.yields.cut_sequences == plan.truncated


def test_length_batches_respect_the_token_budget():
    lengths = [3, 4, 4, 9, 10, 30, 31, 200]
    batches = list(length_batches(lengths, 32))
    assert [i for b in batches for i in b] == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 32
    assert batches[-1] == [7]  # longer than the budget: alone


def test_offline_packs_hold_ids_masks_and_hf_features(offline_dir, shards, model):
    rows = all_rows(shards)
    index = read_index(offline_dir)
    assert index["features"] == "offline" and index["num_sequences"] == 51
    assert index["hidden_size"] == 32 and index["target_layer_ids"] == LAYER_IDS
    assert [s["file"] for s in index["shards"]] == [p.name for p in pack_files(offline_dir)]
    seen = 0
    for path in pack_files(offline_dir):
        pack = load_pack(path)
        assert pack["input_ids"].dtype == torch.int32 and pack["loss_mask"].dtype == torch.uint8
        assert pack["features"].dtype == torch.bfloat16
        offsets = pack["offsets"].tolist()
        assert offsets[0] == 0 and offsets[-1] == len(pack["input_ids"])
        for i, sid in enumerate(pack["ids"]):
            row, (lo, hi) = rows[sid], offsets[i : i + 2]
            prompt, completion = row["prompt_ids"], row["completion_ids"]
            start, end = window(len(prompt), len(completion), MAX_LENGTH)
            ids = (prompt + completion)[start:end]
            mask = loss_mask(len(prompt), completion)[start:end]
            assert pack["input_ids"][lo:hi].tolist() == ids
            assert pack["loss_mask"][lo:hi].tolist() == mask
            with torch.no_grad():
                hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            want = torch.cat([hs[j + 1][0] for j in LAYER_IDS], -1).to(torch.bfloat16)
            torch.testing.assert_close(pack["features"][lo:hi], want, rtol=1e-2, atol=1e-2)
            seen += 1
    assert seen == 51


def test_online_packs_are_the_offline_packs_without_features(offline_dir, shards, tmp_path):
    def no_model():
        raise AssertionError("online extraction must not load the target")

    extract(shards, tmp_path, settings("online"), model_loader=no_model, progress=False)
    assert read_index(tmp_path)["features"] == "online"
    for on, off in zip(pack_files(tmp_path), pack_files(offline_dir), strict=True):
        a, b = load_pack(on), load_pack(off)
        assert "features" not in a and a["ids"] == b["ids"]
        for key in ("input_ids", "loss_mask", "offsets"):
            assert torch.equal(a[key], b[key])


def test_rerun_skips_complete_packs_and_redoes_stale_ones(offline_dir, shards, model, tmp_path):
    out = tmp_path / "out"
    extract(shards, out, settings(), model_loader=lambda: model, progress=False)
    again = extract(shards, out, settings(), model_loader=lambda: model, progress=False)
    assert again.packs_written == 0 and again.tokens_this_run == 0
    # A different max_length changes the plan: every pack is redone, stale extras removed.
    changed = extract(shards, out, settings(max_length=40), model_loader=lambda: model,
                      progress=False)  # fmt: skip
    assert changed.packs_skipped == 0
    assert len(pack_files(out)) == len(read_index(out)["shards"])
    assert read_index(out)["max_length"] == 40


KILLED_RUN = """
import sys, time
from pathlib import Path
import safetensors.torch
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from helpers.extraction_helpers import settings
from helpers.tiny_qwen3 import tiny_qwen3
from draftline.drafter.extraction import extract

real_save = safetensors.torch.save_file

def save_then_hang(tensors, filename, metadata=None):
    if "pack-00002" in filename:  # half-write the temporary, then wait to be killed
        Path(filename).write_bytes(b"partial")
        print("WRITING", flush=True)
        time.sleep(600)
    return real_save(tensors, filename, metadata=metadata)

safetensors.torch.save_file = save_then_hang
shards = [Path(p) for p in {shards!r}]
extract(shards, Path({out!r}), settings(), model_loader=lambda: tiny_qwen3(num_layers=6),
        progress=False)
"""


def test_pack_killed_mid_write_is_redone_and_index_comes_last(offline_dir, shards, model, tmp_path):
    out = tmp_path / "out"
    script = KILLED_RUN.format(
        tests=str(TESTS),
        shards=[str(s) for s in shards],
        out=str(out),
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "WRITING"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    names = sorted(p.name for p in out.iterdir())
    assert [n for n in names if not n.startswith(".")] == [
        "pack-00000.safetensors",
        "pack-00001.safetensors",
    ]  # no index, no partial pack under its final name
    assert any(n.startswith(".pack-00002") and n.endswith(".tmp") for n in names)

    mtimes = {p.name: p.stat().st_mtime_ns for p in pack_files(out)}
    resumed = extract(shards, out, settings(), model_loader=lambda: model, progress=False)
    assert resumed.packs_skipped == 2
    assert {p.name: p.stat().st_mtime_ns for p in pack_files(out)[:2]} == mtimes
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert max(p.stat().st_mtime_ns for p in pack_files(out)) <= (
        (out / "index.json").stat().st_mtime_ns
    )
    assert_same_packs(out, offline_dir)


def stage_workdir(root: Path, shards: list[Path], model_dir: Path, processes: int) -> Path:
    """A repository-like folder for `draftline extract`: params, shards, verdict."""
    root.mkdir()
    for s in shards:
        (root / "data/generated/train").mkdir(parents=True, exist_ok=True)
        (root / "data/generated/train" / s.name).write_bytes(s.read_bytes())
    (root / "data/validated").mkdir(parents=True)
    (root / "data/validated/verdict.json").write_text(json.dumps({"passed": True}))
    params = {
        "model": {"path": str(model_dir), "revision": None, "hidden_size": 32,
                  "target_layer_ids": LAYER_IDS},
        "extract": {"features": "offline", "max_length": MAX_LENGTH, "pack_tokens": 300},
        "data": {"shard_ids": list(range(len(shards)))},
        "hardware": {"name": "cpu", "engine": "local", "device": "cpu", "precision": "fp32",
                     "processes_per_node": processes, "extract_tokens_per_batch": 256,
                     "num_threads": 1},
    }  # fmt: skip
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return root


def run_extract_stage(workdir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "draftline", "extract", "--no-progress"], cwd=workdir,
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_two_processes_write_the_same_packs_as_one(shards, model, tmp_path):
    """The stage with 2 processes per node reruns itself under torchrun (gloo, CPU); its packs
    equal those of the same stage with 1 process bit for bit, on any CPU and kernels. Both are
    the stage as a user runs it (same loader, one thread per process), so only the world size
    differs: a reference computed in this test process ran with whatever thread count earlier
    test modules left, and a 2-thread matmul rounds differently from a 1-thread one on some CPUs
    (AVX2, generic kernels)."""
    model_dir = tmp_path / "target"
    model.save_pretrained(model_dir)
    runs = {}
    for processes in (1, 2):
        workdir = stage_workdir(tmp_path / f"p{processes}", shards, model_dir, processes)
        done = run_extract_stage(workdir)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[processes] = workdir
    metrics = json.loads((runs[2] / "logs/runs/extract.json").read_text())  # the full record
    assert metrics["world_size"] == 2 and metrics["hardware_profile"] == "cpu"
    assert metrics["num_sequences"] == 51 and metrics["tokens_per_s"] > 0
    assert metrics["bytes_per_token"] == metrics["bytes_written"] / metrics["num_tokens"]
    assert json.loads((runs[1] / "logs/runs/extract.json").read_text())["world_size"] == 1
    assert len(pack_files(runs[2] / "data/extracted")) > 1  # both ranks wrote packs
    assert_same_packs(runs[2] / "data/extracted", runs[1] / "data/extracted")


def test_stage_refuses_data_that_did_not_pass_validation(shards, tmp_path):
    from draftline.cli import main

    workdir = stage_workdir(tmp_path / "w", shards, tmp_path / "no-model", processes=1)
    verdict = workdir / "data/validated/verdict.json"
    argv = [
        "extract", f"--params={workdir / 'params.yaml'}", f"--verdict={verdict}",
        f"--shards={workdir / 'data/generated/train'}", f"--out={workdir / 'data/extracted'}",
        f"--metrics={workdir / 'metrics/extract.json'}",
    ]  # fmt: skip
    verdict.write_text(json.dumps({"passed": False}))
    with pytest.raises(SystemExit, match="refused"):
        main(argv)
    verdict.unlink()
    with pytest.raises(SystemExit, match="dvc repro validate"):
        main(argv)
    assert not (workdir / "data/extracted").exists()


def test_packs_of_other_weights_are_redone_not_resumed(shards, tmp_path, model):
    """Same folder name (`model_ref`), other weights (`weights_id`): no pack is skipped."""
    from dataclasses import replace

    out = tmp_path / "packs"
    before = replace(settings(), weights_id="sha256:aaaa")
    first = extract(shards, out, before, model_loader=lambda: model, progress=False)
    again = extract(shards, out, before, model_loader=lambda: model, progress=False)
    assert again.packs_skipped == len(pack_files(out)) > 0
    after = replace(settings(), weights_id="sha256:bbbb")
    changed = extract(shards, out, after, model_loader=lambda: model, progress=False)
    assert changed.packs_skipped == 0 and first.packs_skipped == 0


def multi_turn_row(n: int) -> dict:
    """A two-turn conversation as generate writes it: turn 1's prompt shows turn 0's answer
    without its reasoning (the template drops it), at positions `history_spans`."""
    reasoning, answer = [7] * 30, [8] * 6 + [END_OF_TURN]
    p0 = [3, 4, 5]
    p1 = p0 + answer + [6, 6]  # turn 0's answer as history, then the user's next message
    c1 = [9] * 20 + [END_OF_TURN]
    row = generated_row(n, p1, c1)
    row.update(
        history_spans=[[len(p0), len(p0) + len(answer)]],
        turns=2,
        turn_finish_reasons=["stop", "stop"],
        turn_prompt_ids=[p0, p1],
        turn_completion_ids=[reasoning + answer, c1],
        turn_prompt_tokens=[len(p0), len(p1)],
        turn_completion_tokens=[len(reasoning + answer), len(c1)],
    )
    return row


def test_turn_rows_train_every_turn_in_its_own_context_and_report_the_yield(tmp_path):
    """extract.rows=turn: one sequence per turn, its own prompt and whole completion (every
    generated token supervised once: yield 1); `conversation`: the last turn with the earlier
    answer as history, its reasoning never trained on."""
    shard = write_shard(tmp_path / "gen" / "shard-0.parquet", [multi_turn_row(n) for n in range(3)])
    row = multi_turn_row(0)
    generated = sum(row["turn_completion_tokens"]) * 3
    for rows, per_row, supervised in (
        ("turn", 2, generated),
        ("conversation", 1, 3 * (len(row["completion_ids"]) + 7)),
    ):
        out = tmp_path / rows
        config = ExtractSettings(**{**settings("online").__dict__, "rows": rows})
        result = extract([shard], out, config, progress=False)
        assert result.index["num_sequences"] == 3 * per_row
        assert result.index["num_supervised_tokens"] == supervised
        assert result.yields["generated_tokens"] == generated
        assert result.yields["supervised_tokens"] == supervised
        [pack] = [load_pack(p) for p in pack_files(out)]
        offsets = pack["offsets"].tolist()
        for i, sid in enumerate(pack["ids"]):
            ids = pack["input_ids"][offsets[i] : offsets[i + 1]].tolist()
            mask = pack["loss_mask"][offsets[i] : offsets[i + 1]].tolist()
            if rows == "turn":
                k = int(sid.rsplit("#", 1)[1])
                prompt, completion = row["turn_prompt_ids"][k], row["turn_completion_ids"][k]
                assert ids == prompt + completion
                assert mask == [0] * len(prompt) + [1] * len(completion)
            else:
                assert ids == row["prompt_ids"] + row["completion_ids"]
                assert sum(mask) == len(row["completion_ids"]) + 7  # + the answer in history
    turn_yield = 1.0
    conversation_yield = 3 * (len(row["completion_ids"]) + 7) / generated
    assert conversation_yield < 0.5 < turn_yield
