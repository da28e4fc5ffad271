"""The Hydra tree: every combination composes, profiles are consistent, compose --check works."""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftline.runtime import params
from draftline.runtime.hardware import GPUInfo, load_profiles, match_profile, resolve_profile

CONF = Path(__file__).resolve().parents[1] / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


COMBOS = list(
    itertools.product(
        options("model"),
        options("data"),
        options("drafter"),
        options("hardware"),
        options("quality"),
    )
)


def dflash_layer_ids(num_layers: int, k: int) -> list[int]:
    if k == 1:
        return [num_layers // 2]
    return [round(1 + i * (num_layers - 4) / (k - 1)) for i in range(k)]


def test_groups_have_the_expected_options() -> None:
    assert {"tiny", "qwen3_6_27b", "qwen3_8b"} <= set(options("model"))
    assert {"sample", "sharegpt"} <= set(options("data"))
    assert {"dflash_b16", "dflash_tiny"} <= set(options("drafter"))
    assert {"cpu", "pro6000x4", "b200x8", "vllm_cpu", "vllm_b200x8", "auto"} <= set(
        options("hardware")
    )
    assert len(COMBOS) >= 48


@pytest.mark.parametrize(("model", "data", "drafter", "hw", "quality"), COMBOS)
def test_every_combination_composes(model: str, data: str, drafter: str, hw: str, quality: str):
    cfg = params.compose(
        [
            f"model={model}",
            f"data={data}",
            f"drafter={drafter}",
            f"hardware={hw}",
            f"quality={quality}",
        ],
        CONF,
    )
    assert cfg["model"]["name"] == model and cfg["hardware"]["name"] == hw
    assert cfg["data"]["shard_ids"] == list(range(cfg["data"]["num_shards"]))
    # Interpolations resolved: stage sections follow the chosen model and drafter.
    assert cfg["generate"]["max_new_tokens"] == cfg["model"]["max_new_tokens"]
    assert cfg["extract"]["max_length"] == cfg["drafter"]["max_length"]
    # Hardware is the only group that says how to run: no hardware key leaks elsewhere.
    for section, values in cfg.items():
        if section != "hardware" and isinstance(values, dict):
            assert not {"engine", "dp_size", "micro_batch_size"} & values.keys(), section


@pytest.mark.parametrize("model", ["tiny", "qwen3_6_27b", "qwen3_8b"])
def test_target_layer_ids_follow_the_dflash_rule(model: str) -> None:
    cfg = yaml.safe_load((CONF / "model" / f"{model}.yaml").read_text())
    ids = cfg["target_layer_ids"]
    assert ids == dflash_layer_ids(cfg["num_hidden_layers"], len(ids))
    assert len(set(ids)) == len(ids) and max(ids) < cfg["num_hidden_layers"]


def test_production_target_matches_reference() -> None:
    cfg = yaml.safe_load((CONF / "model" / "qwen3_6_27b.yaml").read_text())
    assert cfg["num_hidden_layers"] == 64 and cfg["hidden_size"] == 5120
    assert cfg["vocab_size"] == 248320 and cfg["target_layer_ids"] == [1, 16, 31, 46, 61]
    assert cfg["chat_template_kwargs"]["enable_thinking"] is True


def test_gpu_profiles_are_data_parallel_as_measured() -> None:
    profiles = load_profiles(CONF)
    assert profiles["pro6000x4"]["sglang"]["dp_size"] == 4
    assert profiles["b200x8"]["sglang"]["dp_size"] == 8
    assert profiles["b200x8"]["sglang"]["tp_size"] == 1
    # What is served (precision, speculative decoding) is the model's: no profile may set it.
    what = {"quantization", "kv_cache_dtype", "speculative", "checkpoint"}
    assert not [n for n, p in profiles.items() if what & set(p.get("sglang") or {})]
    assert not [n for n, p in profiles.items() if what & set(p.get("vllm") or {})]
    assert profiles["pro6000x4"]["throughput"]["generate_tok_s"] == 1600


@pytest.mark.parametrize("model", ["qwen3_6_27b", "qwen3_8b", "tiny"])
def test_the_vllm_gpu_profile_composes_for_cuda(model: str) -> None:
    """vLLM on 8 B200: CUDA, bf16, 8 data-parallel engines with CUDA graphs; the served
    context is the model's, and `hardware=auto` keeps choosing the SGLang profile there."""
    hw = params.compose([f"model={model}", "hardware=vllm_b200x8"], CONF)["hardware"]
    assert (hw["engine"], hw["device"], hw["precision"]) == ("vllm", "cuda", "bf16")
    vllm = hw["vllm"]
    assert vllm["dp_size"] == 8 and vllm["dtype"] == "auto" and vllm["enforce_eager"] is False
    assert vllm["max_model_len"] is None and vllm["kv_cache_gib"] is None
    assert vllm["max_in_flight"] >= vllm["dp_size"] * vllm["max_num_seqs"]
    assert match_profile([GPUInfo("NVIDIA B200", 183359)] * 8, load_profiles(CONF)) == "b200x8"


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        ([], "cpu"),
        ([GPUInfo("NVIDIA B200", 183359)] * 8, "b200x8"),
        ([GPUInfo("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97887)] * 4, "pro6000x4"),
        # Fewer GPUs than a profile needs: fall back rather than over-subscribe.
        ([GPUInfo("NVIDIA B200", 183359)] * 2, "cpu"),
        ([GPUInfo("NVIDIA H100 80GB HBM3", 81559)] * 8, "cpu"),
    ],
)
def test_auto_matches_the_node(gpus: list[GPUInfo], expected: str) -> None:
    assert match_profile(gpus, load_profiles(CONF)) == expected


def test_auto_resolves_to_a_concrete_profile_here() -> None:
    auto = params.compose(["hardware=auto"], CONF)["hardware"]
    resolved = resolve_profile(auto, CONF)
    assert resolved["resolved_from"] == "auto"
    assert resolved["name"] in load_profiles(CONF)
    assert "engine" in resolved


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "draftline", *args], cwd=cwd, capture_output=True, text=True
    )


def test_committed_params_are_the_default_composition(repo_root: Path) -> None:
    result = run_cli("compose", "--check", cwd=repo_root)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_writes_and_check_detects_staleness(tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "params.yaml"
    conf = str(repo_root / "conf")
    written = run_cli(
        "compose",
        "hardware=b200x8",
        "data.num_shards=3",
        "--output",
        str(out),
        "--config-dir",
        conf,
        cwd=tmp_path,
    )
    assert written.returncode == 0, written.stderr
    data = yaml.safe_load(out.read_text())
    assert data["hardware"]["name"] == "b200x8" and data["data"]["shard_ids"] == [0, 1, 2]
    # Checked against other overrides than those it was composed with.
    stale = run_cli(
        "compose", "--check", "hardware=b200x8", "--output", str(out), "--config-dir", conf,
        cwd=tmp_path,
    )  # fmt: skip
    assert stale.returncode == 1 and "stale" in stale.stdout
    unknown = run_cli(
        "compose", "hardware=nope", "--output", str(out), "--config-dir", conf, cwd=tmp_path
    )
    assert unknown.returncode != 0 and "nope" in unknown.stderr


def test_inconsistent_shard_list_names_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"data": {"num_shards": 3, "shard_ids": [0, 1]}}))
    with pytest.raises(SystemExit, match="draftline compose data.num_shards=3"):
        params.load(path)


def test_target_id_follows_the_files_not_their_folder(tmp_path: Path, tiny_target_dir: Path):
    from draftline.core.target import target_id

    copy = tmp_path / "elsewhere"
    shutil.copytree(tiny_target_dir, copy)
    assert target_id(str(copy)) == target_id(str(tiny_target_dir))
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert target_id(str(copy)) != target_id(str(tiny_target_dir))
    assert target_id("Qwen/Qwen3-8B", "abc123") == "hub:Qwen/Qwen3-8B@abc123"


def test_composed_target_id_is_the_hash_of_the_target_folder(repo_root: Path, monkeypatch) -> None:
    from draftline.core.target import target_id

    monkeypatch.chdir(repo_root)  # model.path is relative to the repository root
    composed = params.compose([], repo_root / "conf")
    assert composed["model"]["target_id"] == target_id(str(repo_root / "models/tiny-target"))


def test_check_honours_the_overrides_params_was_composed_with(tmp_path: Path, repo_root: Path):
    out = tmp_path / "params.yaml"
    conf = ["--output", str(out), "--config-dir", str(repo_root / "conf")]
    overrides = ["model=qwen3_8b", "data=sharegpt", "data.sources=[a,b]"]
    assert run_cli("compose", *overrides, *conf, cwd=tmp_path).returncode == 0
    checked = run_cli("compose", "--check", *conf, cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout
    assert "up to date with `draftline compose model=qwen3_8b data=sharegpt" in checked.stdout
    # A hand edit is still stale, and the fix names the recorded overrides.
    out.write_text(out.read_text().replace("max_reject_rate: 0.5", "max_reject_rate: 0.9"))
    stale = run_cli("compose", "--check", *conf, cwd=tmp_path)
    assert stale.returncode == 1
    assert "run `draftline compose model=qwen3_8b data=sharegpt 'data.sources=[a,b]'`" in (
        stale.stdout
    )
    # Overrides given to --check win over the recorded ones.
    assert run_cli("compose", "--check", "model=tiny", *conf, cwd=tmp_path).returncode == 1


def test_compose_to_stdout_and_through_a_fifo(tmp_path: Path, repo_root: Path):
    conf = ["--config-dir", str(repo_root / "conf")]
    printed = run_cli("compose", "hardware=b200x8", "--output", "-", *conf, cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith("# draftline compose hardware=b200x8\n")
    assert yaml.safe_load(printed.stdout)["hardware"]["name"] == "b200x8"
    assert not (tmp_path / "-").exists()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so the writer does not block
    try:
        written = run_cli("compose", "--output", str(fifo), *conf, cwd=tmp_path)
        assert written.returncode == 0, written.stderr
        assert stat.S_ISFIFO(fifo.lstat().st_mode), "the FIFO was replaced by a file"
        text = os.read(reader, 1 << 20).decode()
    finally:
        os.close(reader)
    assert yaml.safe_load(text)["model"]["name"] == "tiny"


def test_a_typo_in_a_group_file_fails_with_one_line_naming_the_key(tmp_path: Path) -> None:
    """A user's conf/model file with `num_hiden_layers` would otherwise reach params.yaml."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    mine = (CONF / "model" / "tiny.yaml").read_text()
    (conf / "model" / "mine.yaml").write_text(
        mine.replace("name: tiny", "name: mine").replace("num_hidden_layers", "num_hiden_layers")
    )
    done = run_cli(
        "compose", "model=mine", "--output", "-", "--config-dir", str(conf), cwd=tmp_path
    )
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "unknown key model.num_hiden_layers; did you mean model.num_hidden_layers?" in lines[0]
    # The same check in every group, nested keys included.
    (conf / "quality" / "default.yaml").write_text(
        (CONF / "quality" / "default.yaml").read_text() + "guard_windw: 4\n"
    )
    with pytest.raises(params.config_schema.UnknownKeyError, match="quality.guard_windw"):
        params.compose([], conf)


def test_an_unknown_override_fails_and_plus_adds_a_key_on_purpose() -> None:
    with pytest.raises(params.config_schema.UnknownKeyError) as err:
        params.compose(["data.sorces=[x]"], CONF)
    assert str(err.value) == "unknown key data.sorces; did you mean data.sources?"
    with pytest.raises(params.config_schema.UnknownKeyError, match="unknown key zzz; no part"):
        params.compose(["zzz.qq=1"], CONF)
    added = params.compose(["+model.my_note=kept", "++data.my_tag=2"], CONF)
    assert added["model"]["my_note"] == "kept" and added["data"]["my_tag"] == 2
    # Free-form sections stay free-form.
    kwargs = params.compose(["+model.chat_template_kwargs.preserve_thinking=true"], CONF)
    assert kwargs["model"]["chat_template_kwargs"]["preserve_thinking"] is True


@pytest.mark.parametrize(
    "path", ["/nonexistent/model", "./nope", "../nope/model", "models/tiny-targt"]
)
def test_a_local_model_path_that_does_not_exist_fails_at_compose(
    path: str, tmp_path: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(repo_root)  # models/ exists here: models/tiny-targt is a local path
    composed = params.compose([f"model.path={path}"], CONF)
    with pytest.raises(SystemExit) as err:
        params.check_model_path(composed)
    message = str(err.value)
    assert message.startswith(f"model.path {path} does not exist on this machine")
    assert "\n" not in message and "draftline compose model=tiny model.path=" in message


def test_hub_ids_stay_hub_ids(repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(repo_root)
    for path in ("Qwen/Qwen3-8B", "models/tiny-target"):
        params.check_model_path(params.compose([f"model.path={path}"], CONF))
    composed = params.compose(["model.path=Qwen/Qwen3-8B"], CONF)
    assert composed["model"]["target_id"] == "hub:Qwen/Qwen3-8B@unpinned"
    done = run_cli("compose", "model.path=/nonexistent/model", "--output", "-", cwd=repo_root)
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
