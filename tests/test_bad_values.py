"""Bad values and full disks end in one or two lines naming the value and the fix, never a
traceback: at compose, when a stage starts (what `dvc exp run -S` composed without us), and
when a write is refused."""

from __future__ import annotations

import errno
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from draftline import cli
from draftline.commands import doctor
from draftline.runtime import config_values, hardware, params

REPO = Path(__file__).resolve().parents[1]
CONF = str(REPO / "conf")


def short(text: str, lines: int = 1) -> str:
    kept = [line for line in text.splitlines() if line.strip()]
    assert 1 <= len(kept) <= lines and "Traceback" not in text, text
    return kept[0]


@pytest.mark.parametrize(
    ("override", "key", "rule"),
    [
        ("data.num_shards=0", "data.num_shards=0", "an integer from 1 to 1024"),
        ("data.num_shards=-1", "data.num_shards=-1", "an integer from 1 to 1024"),
        ("data.num_shards=100000", "data.num_shards=100000", "an integer from 1 to 1024 (each "
         "shard is four DVC stages, and `dvc status` takes minutes past a few thousand stages)"),
        ("generate.max_new_tokens=0", "generate.max_new_tokens=0", "an integer >= 1"),
        ("generate.max_new_tokens=-5", "generate.max_new_tokens=-5", "an integer >= 1"),
        ("generate.max_new_tokens=lots", "generate.max_new_tokens='lots'", "an integer >= 1"),
        ("extract.features=both", "extract.features='both'", "one of offline, online"),
        ("data.eval_fraction=1.5", "data.eval_fraction=1.5", "a number >= 0 and < 1"),
        ("data.eval_fraction=1.0", "data.eval_fraction=1.0",
         "a number >= 0 and < 1 (1 leaves no rows to train on)"),
        # conf/ copies these into generate.* and drafter.*: the key the user set is named.
        ("model.sampling.temperature=-1", "model.sampling.temperature=-1", "a number >= 0"),
        ("model.dflash.num_attention_heads=0", "model.dflash.num_attention_heads=0",
         "an integer >= 1 or null (copied to drafter.num_attention_heads)"),
        ("hardware.sharding=zero3", "hardware.sharding='zero3'", "one of ddp, fsdp"),
    ],
)  # fmt: skip
def test_compose_refuses_a_bad_value_in_one_line(override: str, key: str, rule: str, capsys):
    assert cli.main(["compose", override, "--output", "-", "--config-dir", CONF]) == 1
    line = short(capsys.readouterr().err)
    assert f"{key} must be {rule}" in line
    assert f"draftline compose {key.split('=')[0]}=" in line  # the fix


def test_compose_refuses_no_sources_in_one_line(capsys):
    argv = ["compose", "data.sources=[]", "--output", "-", "--config-dir", CONF]
    assert cli.main(argv) == 1
    line = short(capsys.readouterr().err)
    assert "data.sources=[] names no input" in line
    assert "`draftline compose 'data.sources=[data/my-set]'`" in line


def test_compose_is_fast_up_to_the_shard_bound_and_refuses_past_it_at_once() -> None:
    top = config_values.MAX_SHARDS
    data = params.compose([f"data.num_shards={top}"], CONF)["data"]
    assert data["shard_ids"] == list(range(top)) and len(data["shard_chain"]) == top
    start = time.monotonic()
    with pytest.raises(
        config_values.BadValueError, match=rf"^data.num_shards=100000 must be .*{top}"
    ):
        params.compose(["data.num_shards=100000"], CONF)
    assert time.monotonic() - start < 10  # before the shard lists are built (minutes, 836 MB)


def test_a_relation_between_values_is_checked() -> None:
    data = params.compose(["drafter=dflash_b16", "model=qwen3_6_27b"], CONF)
    data["drafter"]["num_key_value_heads"] = 5  # 32 heads
    (problem,) = config_values.problems(data)
    assert problem.startswith("drafter.num_attention_heads=32 must be a multiple of")


def test_a_plus_typo_names_the_key_it_meant(capsys):
    argv = ["compose", "+generate.max_new_token=64", "--output", "-", "--config-dir", CONF]
    assert cli.main(argv) == 1
    line = short(capsys.readouterr().err)
    assert "+generate.max_new_token adds a key no stage reads" in line
    assert "did you mean generate.max_new_tokens?" in line
    # A key far from every known one is still taken as meant.
    assert params.compose(["+model.config.my_flag=1"], CONF)["model"]["config"]["my_flag"] == 1


def dvc_composed(tmp_path: Path, change: dict) -> Path:
    """params.yaml as `dvc exp run -S` writes it: composed by Hydra, never by `compose`."""
    data = params.compose([], CONF)
    for path, value in change.items():
        node = data
        *head, last = path.split(".")
        for part in head:
            node = node[part]
        node[last] = value
    out = tmp_path / "params.yaml"
    out.write_text(yaml.safe_dump(data))
    return out


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"generate.max_new_tokens": 0}, "generate.max_new_tokens=0 must be an integer >= 1"),
        ({"data.num_shards": 0, "data.shard_ids": []}, "data.num_shards=0 must be an integer"),
        (
            {"model.sampling.temperature": -1, "generate.temperature": -1},
            "model.sampling.temperature=-1 must be a number >= 0",
        ),
        ({"data.sources": []}, "data.sources=[] names no input"),
        (
            {"generate.max_new_token": 64},
            "generate.max_new_token is not a key any stage reads; did you mean "
            "generate.max_new_tokens?",
        ),
    ],
)
def test_a_stage_refuses_what_dvc_exp_run_composed(tmp_path: Path, change, expected):
    p = dvc_composed(tmp_path, change)
    with pytest.raises(SystemExit) as exc:  # the interpreter prints it: one line, rc 1
        cli.main(["generate", "--shard", "0", "--params", str(p)])
    assert str(exc.value).startswith(f"{p}: {expected}") and "\n" not in str(exc.value)


def cut_target(tmp_path: Path, tiny_target_dir: Path) -> Path:
    folder = tmp_path / "my-target"
    shutil.copytree(tiny_target_dir, folder)
    text = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_bytes(text[: len(text) // 2])  # an interrupted copy
    return folder


def test_a_cut_tokenizer_is_caught_by_compose_doctor_and_the_stage(
    tmp_path: Path, tiny_target_dir: Path
):
    folder = cut_target(tmp_path, tiny_target_dir)
    out = tmp_path / "params.yaml"
    argv = ["compose", f"model.path={folder}", "--output", str(out), "--config-dir", CONF]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    line = short(str(exc.value))
    assert line.startswith(f"model.path {folder}: tokenizer.json is not valid JSON")
    assert f"hf download ORG/NAME --local-dir {folder}" in line and not out.exists()

    name, ok, detail = doctor._model_row({"name": "tiny", "path": str(folder)})
    assert (name, ok) == ("model path", False) and "tokenizer.json is not valid JSON" in detail

    out.write_text(params.to_yaml(params.compose([f"model.path={folder}"], CONF)))
    proc = subprocess.run(
        [sys.executable, "-m", "draftline", "curate", "--params", str(out), "--out", "curated"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "tokenizer.json is not valid JSON" in short(proc.stderr)


def test_generate_after_a_failed_curate_fails(tmp_path: Path, tiny_target_dir: Path, monkeypatch):
    """curate writes its (empty) shards before it fails on the reject rate: a hand-run generate
    must not turn them into empty tables and exit 0."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("{not json\n" * 8)
    overrides = [f"model.path={tiny_target_dir}", f"data.sources=[{tmp_path / 'in'}]"]
    Path("params.yaml").write_text(params.to_yaml(params.compose(overrides, CONF)))
    assert cli.main(["curate", "--no-progress"]) == 1
    assert any(Path("data/curated/train").iterdir())  # its 0-row shards
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--shard", "0", "--no-progress"])
    assert "curate failed (100.0% of rows rejected" in str(exc.value)
    assert "dvc repro curate" in str(exc.value)
    assert not Path("data/generated").exists()


def limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def test_a_file_size_limit_is_one_line(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "draftline", "compose", "--output", "p.yaml", "--config-dir", CONF],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
    )
    assert proc.returncode == 1
    line = short(proc.stderr)
    assert "over the file-size limit (`ulimit -f`)" in line and "ulimit -f unlimited" in line


def test_a_full_disk_is_one_line_wherever_it_is_raised() -> None:
    full = OSError(errno.ENOSPC, "No space left on device", "data/extracted/pack-3.safetensors")
    assert cli.short_error(full) == (
        "a write failed writing data/extracted/pack-3.safetensors: the disk is full; free space "
        "(`df -h .`; `draftline plan` gives each stage's size) and rerun"
    )
    try:  # pyarrow raises its own OSError without errno; torch a RuntimeError around it
        try:
            raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0") from inner
    except RuntimeError as outer:
        assert "the disk is full" in (cli.short_error(outer) or "")
    assert cli.short_error(RuntimeError("shape mismatch")) is None  # a bug keeps its traceback


def test_every_profile_has_every_key_a_user_may_set() -> None:
    profiles = {
        p.stem: yaml.safe_load(p.read_text()) for p in Path(CONF, "hardware").glob("*.yaml")
    }
    concrete = {name: keys for name, keys in profiles.items() if not keys.get("detect")}
    common = set.intersection(*(set(keys) for keys in concrete.values()))
    for name, keys in concrete.items():
        assert set(keys) - {"sglang", "vllm", "generate_tok_s_range"} <= common | {"vllm"}, name
    assert "work_ahead_shards" in common
    assert set(hardware.AUTO_KNOBS) <= set(profiles["auto"]) and set(hardware.AUTO_KNOBS) <= common
    # Set without `+` on every profile, auto included (where it overrides the detected one).
    for name in profiles:
        composed = params.compose([f"hardware={name}", "hardware.work_ahead_shards=2"], CONF)
        assert hardware.resolve_profile(composed["hardware"], CONF)["work_ahead_shards"] == 2


def test_plain_json_in_the_committed_targets(tiny_target_dir: Path) -> None:
    """The model-folder check reads what it claims: the committed targets pass it."""
    from draftline.core.target import missing_model

    assert missing_model({"name": "tiny", "path": str(tiny_target_dir)}) is None
    assert json.loads((tiny_target_dir / "tokenizer.json").read_text())


def test_extract_checks_free_space_first_and_names_online_features(tmp_path: Path, monkeypatch):
    from draftline.core.training_rows import SequenceSpan
    from draftline.drafter import extraction
    from draftline.runtime import disk_space

    monkeypatch.setattr(
        disk_space.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1, 0, 10**9)
    )
    pack = extraction.PackPlan(index=0, shard_file=tmp_path / "s.parquet", sequences=[
        extraction.PlannedSequence(id="a", row=0, span=SequenceSpan(None, 0, 100_000, 0, 100_000))
    ])  # fmt: skip
    settings = extraction.ExtractSettings(
        features="offline", max_length=4096, target_layer_ids=[1, 16, 31, 46, 61],
        model_ref="m", hidden_size=5120, pack_tokens=32768, tokens_per_batch=4096,
    )  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        extraction.require_space(tmp_path / "extracted", [pack], settings, world=8)
    assert str(exc.value) == (
        f"extract (offline features) needs about 41.0 GB in {tmp_path / 'extracted'}, and its "
        "disk has 1.0 GB free: free space or put data/extracted on a bigger disk (a link), and "
        "rerun; or train with online features (extract.features=online: token packs only, about "
        "4.0 MB)"
    )
    online = extraction.ExtractSettings(**{**settings.__dict__, "features": "online"})
    extraction.require_space(tmp_path / "extracted", [pack], online, world=8)  # 4 MB fits


def test_generate_checks_free_space_first(tmp_path: Path, tiny_target_dir: Path, monkeypatch):
    from draftline.runtime import disk_space

    monkeypatch.chdir(tmp_path)
    shutil.copytree(REPO / "data/sample", tmp_path / "data/sample")
    overrides = [f"model.path={tiny_target_dir}"]
    Path("params.yaml").write_text(params.to_yaml(params.compose(overrides, CONF)))
    assert cli.main(["curate", "--no-progress"]) == 0
    monkeypatch.setattr(
        disk_space.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1, 0, 1000)
    )
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--shard", "0", "--no-progress"])
    message = str(exc.value)
    assert message.startswith("generate shard-0 (") and "and its disk has 1,000 B free" in message
    assert "x 1.46 turns x 60 tokens) needs about" in message and "bigger disk" in message
    assert not Path("data/generated").exists()


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["follow", "--poll-s", "-5"], "argument --poll-s: must be a number > 0, not -5"),
        (
            ["salvage", "--min-free-mib", "-1"],
            "argument --min-free-mib: must be a number >= 0, not -1",
        ),
    ],
)
def test_a_bad_option_is_refused_by_argparse(tmp_path: Path, argv: list[str], line: str):
    proc = subprocess.run(
        [sys.executable, "-m", "draftline", *argv], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == f"draftline {argv[0]}: error: {line}"


def curate_in(
    tmp_path: Path, tiny_target_dir: Path, *overrides: str
) -> subprocess.CompletedProcess:
    composed = params.compose([f"model.path={tiny_target_dir}", *overrides], CONF)
    (tmp_path / "params.yaml").write_text(params.to_yaml(composed))
    return subprocess.run(
        [sys.executable, "-m", "draftline", "curate", "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )


def test_a_utf16_file_is_named_with_the_command_that_converts_it(
    tmp_path: Path, tiny_target_dir: Path
):
    text = "".join((REPO / "data/sample/conversations.jsonl").read_text().splitlines(True)[:20])
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(text, encoding="utf-16")
    proc = curate_in(tmp_path, tiny_target_dir, "data.sources=[in]")
    assert proc.returncode == 1
    head, line = short(proc.stderr, lines=2), proc.stderr.splitlines()[1]
    assert head == "curate: FAILED: 1 input file is not UTF-8:"
    command = (
        "iconv -f UTF-16 -t UTF-8 in/a.jsonl > in/a.jsonl.utf8 && mv in/a.jsonl.utf8 in/a.jsonl"
    )
    assert line == (
        f"  in/a.jsonl: UTF-16 text, not UTF-8: convert it (`{command}`), or take it out of "
        "data.sources"
    )
    if shutil.which("iconv"):  # the command it gives does convert the file
        subprocess.run(command, shell=True, cwd=tmp_path, check=True)
        assert (tmp_path / "in/a.jsonl").read_text(encoding="utf-8") == text


def test_a_curate_left_with_no_training_rows_fails_naming_the_key(
    tmp_path: Path, tiny_target_dir: Path
):
    rows = (REPO / "data/sample/conversations.jsonl").read_text().splitlines()[:30]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("\n".join(rows) + "\n")
    overrides = ("data.sources=[in]", "data.eval_fraction=0.99999", "data.max_reject_rate=1")
    proc = curate_in(tmp_path, tiny_target_dir, *overrides)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("curate: FAILED: 0 training rows: all ")
    assert "went to eval (data.eval_fraction=0.99999); lower it (`draftline compose " in line


def test_no_rows_read_or_all_rejected_name_the_key_too() -> None:
    from draftline.data.curation import CurateResult
    from draftline.stages.curate import nothing_to_train

    data = {"sources": [], "eval_fraction": 0.1}
    assert "0 rows read from data.sources=[]: point it at" in (
        nothing_to_train(CurateResult(shard_rows=[0, 0]), data, "out") or ""
    )
    rejected = CurateResult(rows_read=5, shard_rows=[0])
    rejected.rejected["malformed_json"] = 5
    assert (nothing_to_train(rejected, data, "out") or "").startswith(
        "all 5 rows were rejected (reasons in out/rejected.parquet): fix the files in data.sources"
    )
    assert nothing_to_train(CurateResult(rows_read=5, shard_rows=[5]), data, "out") is None
