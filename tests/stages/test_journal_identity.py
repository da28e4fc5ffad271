"""A journal resumes only the run that decides the same tokens: the weights (computed from the
files now, not the folder's name), the engine, template and sampling. A journal of another
identity is set aside in a named folder and kept; nothing of it reaches the table.

`draftline generate` runs on the local engine (and the SGLang stand-in as a real HTTP server
for the change of engine), in this process: each run reads the journal, the weights and
params.yaml afresh, so no interpreter start is needed. An unpinned hub id is served from a
Hugging Face cache laid out as the hub client writes it, offline (the hub client's cache folder
and offline switch, which it reads from $HF_HUB_CACHE and $HF_HUB_OFFLINE at import, set on
its `constants` module instead).
"""

from __future__ import annotations

import json
import shutil
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

JOURNAL = Path(".draftline/journal/generate/shard-0.jsonl")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_random_target(tmp_path_factory.mktemp("target"))


def change_a_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    name = next(n for n in sorted(tensors) if n.endswith("lm_head.weight") or "embed" in n)
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, weights, metadata={"format": "pt"})


def generate(work: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    """Stage generate@0 in this process: its run log and what it printed."""
    capsys.readouterr()
    generate_here(work, "--shard", "0")
    run_log = json.loads((work / "logs/runs/generate/shard-0.json").read_text())
    return run_log, capsys.readouterr().out


def all_turns(work: Path) -> int:
    table = pq.read_table(work / "data/generated/train/shard-0.parquet").to_pylist()
    return sum(r["turns"] for r in table)


def assert_set_aside(run_log: dict, stdout: str, work: Path) -> None:
    aside = Path(run_log["journal_set_aside"] or "")
    assert "set aside, not resumed" in stdout and (work / aside).is_file()
    assert aside.parent.name.startswith("shard-0.jsonl.set-aside-")
    assert run_log["resumed_samples"] == 0 and run_log["generated_turns"] == all_turns(work)


def test_changed_weights_in_the_same_folder_resume_nothing(tmp_path, model_dir, capsys):
    from draftline.core.target import target_id

    target = shutil.copytree(model_dir, tmp_path / "target")
    work = tmp_path / "work"
    make_workdir(work, target, n=8, max_new_tokens=8)
    first, _ = generate(work, capsys)
    assert first["target_id"] == target_id(str(target))
    again, _ = generate(work, capsys)  # same weights: the kept journal rebuilds the table
    assert again["generated_turns"] == 0 and again["resumed_samples"] == 8

    old_id = target_id(str(target))
    change_a_tensor(target)
    changed, stdout = generate(work, capsys)
    assert changed["target_id"] == target_id(str(target)) != old_id
    assert_set_aside(changed, stdout, work)

    # params.yaml still naming the old weights: the stage stops and names the fix.
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["model"]["target_id"] = old_id
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(SystemExit, match="holds other weights") as stopped:  # exit status 1
        generate_here(work, "--shard", "0")
    assert "draftline compose" in str(stopped.value.code)


def hub_snapshot(cache: Path, repo: str, commit: str, files: Path) -> None:
    """`repo` at `commit` in a Hugging Face cache, `refs/main` pointing at it."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(files, folder / "snapshots" / commit)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs/main").write_text(commit)


def test_an_unpinned_hub_id_is_keyed_on_the_commit_its_cache_resolves(
    tmp_path, model_dir, monkeypatch, capsys
):
    import huggingface_hub.constants

    cache, work, repo = tmp_path / "hub", tmp_path / "work", "example-org/tiny"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub_snapshot(cache, repo, "a" * 40, model_dir)
    make_workdir(work, Path(repo), n=8, max_new_tokens=8)  # model.path: the hub id, no revision
    first, _ = generate(work, capsys)
    assert first["target_id"] == f"hub:{repo}@{'a' * 40}"
    again, _ = generate(work, capsys)
    assert again["generated_turns"] == 0

    changed_files = shutil.copytree(model_dir, tmp_path / "changed")
    change_a_tensor(changed_files)
    hub_snapshot(cache, repo, "b" * 40, changed_files)  # the hub moved main: new weights
    changed, stdout = generate(work, capsys)
    assert changed["target_id"] == f"hub:{repo}@{'b' * 40}"
    assert_set_aside(changed, stdout, work)


def test_an_unpinned_hub_id_not_in_the_cache_resumes_nothing(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    from draftline.stages.generate import weights_key

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    model = {"path": "example-org/absent", "revision": None, "target_id": "hub:x@unpinned"}
    first, second = weights_key(model), weights_key(model)
    assert first.startswith("unidentified:") and first != second  # never equal: never resumed
    assert "cannot be identified offline" in capsys.readouterr().out
    pinned = {**model, "revision": "c" * 40}
    assert weights_key(pinned) == f"hub:example-org/absent@{'c' * 40}"


def test_another_engine_resumes_nothing(tmp_path, model_dir, capsys):
    make_workdir(tmp_path, model_dir, n=8, max_new_tokens=8)
    generate(tmp_path, capsys)
    server = StandIn(tmp_path)
    make_workdir(tmp_path, model_dir, n=8, max_new_tokens=8, hardware=sglang_hardware(server.port))
    with server:
        on_sglang, stdout = generate(tmp_path, capsys)
        asked = len(server.rids())
    assert_set_aside(on_sglang, stdout, tmp_path)
    assert asked == all_turns(tmp_path)  # every turn asked of the new engine
    journal = [json.loads(line) for line in (tmp_path / JOURNAL).read_text().splitlines()]
    assert journal[0]["identity"]["engine"].startswith("sglang")


def test_another_served_checkpoint_resumes_nothing(tmp_path, model_dir, capsys):
    """`model.serving.checkpoint` (here a local folder standing in for a pre-quantized copy of
    the target) joins the engine's identity as the weights it holds: the tokens of the target's
    own weights are set aside, and the new journal names the checkpoint's content hash."""
    from draftline.core.target import target_id

    server = StandIn(tmp_path)
    make_workdir(tmp_path, model_dir, n=8, max_new_tokens=8, hardware=sglang_hardware(server.port))
    served = shutil.copytree(model_dir, tmp_path / "served")
    change_a_tensor(served)
    with server:
        first, _ = generate(tmp_path, capsys)
        params = yaml.safe_load((tmp_path / "params.yaml").read_text())
        params["model"]["serving"] = {"checkpoint": {"path": str(served), "revision": None}}
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        changed, stdout = generate(tmp_path, capsys)
    assert_set_aside(changed, stdout, tmp_path)
    assert changed["target_id"] == first["target_id"] == target_id(str(model_dir))  # bf16 target
    journal = [json.loads(line) for line in (tmp_path / JOURNAL).read_text().splitlines()]
    engine = journal[0]["identity"]["engine"]
    assert f'"checkpoint":"{target_id(str(served))}"' in engine
