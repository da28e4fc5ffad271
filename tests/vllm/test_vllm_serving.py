"""The pipeline generating through a real vLLM server, and `draftline bench` against vLLM serving
the drafter that pipeline trained.

One throwaway copy of this repository runs `dvc repro` with `hardware=vllm_cpu` on the tiny
target with head_dim 32 (`servable_target`): generate autostarts the vLLM server (eager, fp32)
and every shard goes through `/v1/completions`. The tests then check the stored token ids
against transformers' greedy generate, and serve the exported drafter with vLLM's `dflash`
method to measure the real acceptance length beside evaluate's offline tau on the same
held-out prompts. The figures go to
logs/vllm/figures.json of this checkout (`.ci/vllm` prints them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
import yaml
from helpers.embedded_run import copy_project, run
from helpers.generate_helpers import free_port
from helpers.vllm_figures import record

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
EOT = 2


@pytest.fixture(scope="module")
def project(
    tmp_path_factory: pytest.TempPathFactory, servable_target: Path
) -> Iterator[tuple[Path, int]]:
    """Slow (minutes): vLLM's start (~80 s of imports on one core) and a whole `dvc repro`."""
    repo = copy_project(tmp_path_factory.mktemp("vllm-pipeline"))
    port = free_port()
    run(
        [
            "draftline",
            "compose",
            f"model.path={servable_target}",
            "hardware=vllm_cpu",
            f"hardware.vllm.port={port}",
            "generate.autostart=true",
            # A short training: served and offline acceptance are compared for the same
            # drafter, which need not be a good one (20 epochs: ~3 min more on 2 quiet cores).
            "drafter.epochs=2",
        ],
        repo,
    )
    try:
        run(["dvc", "repro"], repo)
        yield repo, port
    finally:
        run(["draftline", "serve", "stop", "--all"], repo, check=False)


def greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate, one prompt, stopped at the end of turn only."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOT,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def target_model(servable_target: Path) -> Any:
    from draftline.core.target import load_model

    return load_model({"path": str(servable_target)}, device="cpu", dtype="fp32")


def generated_rows(repo: Path) -> pd.DataFrame:
    files = sorted((repo / "data/generated").rglob("*.parquet"))
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def test_generate_through_vllm_stores_the_ids_transformers_generates_greedily(
    project: tuple[Path, int], target_model: Any
) -> None:
    repo, _ = project
    rows = generated_rows(repo)
    assert len(rows) > 100 and rows["engine"].str.startswith("vllm").all(), rows["engine"].unique()
    assert (rows["finish_reason"] == "stop").mean() > 0.9
    budget = int(yaml.safe_load((repo / "params.yaml").read_text())["generate"]["max_new_tokens"])
    single = rows[rows["turns"] == 1].sort_values("id").head(24)
    equal = 0
    for row in single.itertuples():
        prompt, stored = list(row.prompt_ids), list(row.completion_ids)
        expected = greedy(target_model, prompt, budget)
        if EOT in expected:
            expected = expected[: expected.index(EOT) + 1]
        assert stored == expected, f"row {row.id}: vLLM {stored} != transformers {expected}"
        equal += 1
    tokens = int(single["completion_ids"].map(len).sum())
    record(
        stored_rows_checked=equal,
        stored_tokens_checked=tokens,
        generated_rows=len(rows),
        generate_output_tok_s=generate_speed(repo),
    )


def generate_speed(repo: Path) -> dict[str, float]:
    """Output tokens/s of each generate shard, as its run record says."""
    speeds = {}
    found = [*repo.glob("metrics/generate/*.json"), *repo.glob("logs/runs/generate/*.json")]
    for path in sorted(found):
        if path.is_file():
            figures = json.loads(path.read_text())
            if isinstance(figures, dict) and figures.get("output_tok_s") is not None:
                speeds[path.stem] = float(figures["output_tok_s"])
    return speeds


def test_bench_measures_the_served_acceptance_length_beside_offline_tau(
    project: tuple[Path, int],
) -> None:
    """vLLM serves the exported drafter (`dflash`); bench sends evaluate's held-out prompts
    greedily (beside tau) and at the serving temperature (beside tau_sampled)."""
    repo, _ = project
    run(["draftline", "serve", "stop", "--all"], repo)
    port = free_port()
    started = run(
        ["draftline", "serve", "start", "--drafter", "models/drafter", "--port", str(port)], repo
    )
    assert "vLLM (vllm_cpu) healthy" in started.stdout
    url = f"http://127.0.0.1:{port}"
    figures: dict[str, Any] = {}
    for temperature in ("0", "0.6"):
        done = run(["draftline", "bench", "--url", url, "--temperature", temperature], repo)
        bench = json.loads((repo / "logs/runs/bench.json").read_text())
        assert bench["engine"] == "vllm" and bench["requests"] > 0, done.stdout
        assert bench["verify_steps"] > 0 and bench["acceptance_length"] >= 1.0, bench
        if temperature == "0":
            # Greedy, the drafter's tokens are accepted at all: more than one token per target
            # forward (measured: 1.107 served, tau 1.111 offline, after 2 epochs).
            assert bench["accepted_tokens"] > 0 and bench["acceptance_length"] > 1.0, bench
        figures[f"t{temperature}"] = {
            "acceptance_length": bench["acceptance_length"],
            "output_tok_s": bench["output_tok_s"],
            "requests": bench["requests"],
            "completion_tokens": bench["completion_tokens"],
        }
    evaluate = json.loads((repo / "reports/evaluate.json").read_text())
    assert bench["offline_tau"] == evaluate["tau"]
    figures["offline_tau"] = evaluate["tau"]
    figures["offline_tau_sampled"] = evaluate["tau_sampled"]
    figures["eval_prompts"] = evaluate["num_prompts"]
    record(bench=figures)
