"""Benchmark: draftline's client and scheduler against vLLM's own offline batch mode, one engine.

The same multi-turn conversations (the bundled sample's, `data/sample/conversations.jsonl`, as
curate normalises them) are generated twice per repeat, on the same CPU, in one run:

- **draftline**: the generate stage's own path, `run_shard` (continuous scheduler, vLLM client,
  journal, table), against the vLLM CPU server that `draftline serve start` launches for
  `hardware=vllm_cpu` (`vllm_server.start`: eager, fp32, its profile's max_num_seqs and KV
  cache), the client keeping the profile's `max_in_flight` requests open;
- **batch**: `vllm.LLM(...).generate` in this process with the server's settings, turn by turn:
  every conversation's turn k in one call, its prompt holding the batch's own earlier answers
  (built by the same `Conversation`), the same token-id prompts, sampling and per-turn seeds.

A third side, for diagnosis only, sends the batch side's turn-by-turn batches through the vLLM
client and server alone (no scheduler, journal or table): what the server path costs by itself.
Output tokens per second of each, and their ratio (goal >= 0.9: the client and scheduler keep
a real engine as busy as its own batch mode). The two sides alternate `--repeats` times (which
goes first alternates too); the median ratio is reported. vLLM's CPU attention needs head_dim
32, 64, ...; the default target is a random-weight Qwen3 of the tiny target's size with head_dim
32 and the embedded tokenizer, built in a second, whose answers end with probability about
1/`--mean-tokens` at every token (temperature 1.0), so conversations go on for several turns
(`--target DIR` takes a trained one instead, e.g. `draftline build-tiny-target --heads 2`).
Runs in the vLLM environment (.venv-vllm, `.ci/vllm` builds it); `--json PATH` writes the
figures. The last line is `ratio median=<x.xxx>`.

    .venv-vllm/bin/python benchmarks/engine_client_vs_batch.py [--repeats 3] [--conversations 96]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from draftline.core.loss_mask import special_ids
from draftline.core.target import load_tokenizer
from draftline.core.turn_prompts import regenerated_turns
from draftline.data.conversations import messages_to_records, normalise
from draftline.generation import server_process, vllm_server
from draftline.generation.engines.base import Result, Sampling
from draftline.generation.engines.sglang import ClientSettings
from draftline.generation.engines.vllm import VLLMEngine, completion_params
from draftline.generation.shards import run_shard
from draftline.generation.table_record import Identity, ShardPaths
from draftline.generation.turns import Conversation
from draftline.runtime import hardware

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data/sample/conversations.jsonl"
END_OF_TURN = "<|im_end|>"


def curated_rows(limit: int) -> list[dict[str, Any]]:
    """The sample's valid conversations as curate keeps them: normalised messages ending in the
    user turn the last answer follows (its bad rows, one per reject reason, and repeated ids
    are left out)."""
    rows, seen = [], set()
    for line in SAMPLE.read_text().splitlines():
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        messages = normalise(raw)
        if not isinstance(messages, list):
            continue
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if messages and messages[-1]["role"] == "user" and raw["id"] not in seen:
            seen.add(raw["id"])
            rows.append({"id": str(raw["id"]), "messages": messages_to_records(messages)})
    rows.sort(key=lambda r: -len(r["messages"]))  # the multi-turn ones first
    return rows[:limit]


def build_target(out: Path, mean_tokens: float) -> Path:
    """A random Qwen3 (head_dim 32) whose next token is uniform over the vocabulary except the
    end of turn, drawn with probability ~1/mean_tokens: the residual stream carries a constant
    dimension that only the end-of-turn row of the head reads."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(REPO / "models/tiny-target")
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=192, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=eot, pad_token_id=0,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0  # the constant dimension
        for layer in model.model.layers:  # no layer writes it
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        # After the final norm that dimension is ~sqrt(hidden); every other logit is 0.
        scale = math.sqrt(config.hidden_size)
        model.lm_head.weight.zero_()
        model.lm_head.weight[eot, 0] = math.log((len(tokenizer) - 1) / (mean_tokens - 1)) / scale
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# vllm-cpu 0.32.0's CLI asks importlib.metadata for the distribution "vllm", but it installs as
# "vllm-cpu": `vllm serve` and `python -m vllm.entrypoints.cli.main` exit before parsing. The
# same module and arguments run with that one lookup answered by the vllm-cpu distribution.
CPU_BUILD_SHIM = (
    "import importlib.metadata as m, runpy, sys; version = m.version; "
    "m.version = lambda name: version('vllm-cpu' if name == 'vllm' else name); "
    "sys.argv[0] = 'vllm'; runpy.run_module(sys.argv.pop(1), run_name='__main__')"
)


def start_server(profile: dict[str, Any], target: Path, port: int, root: Path):
    """`vllm_server.start` (the command and environment `draftline serve start` uses), through
    the shim above where the installed build is vllm-cpu."""
    from importlib import metadata

    model = {"path": str(target)}
    command = vllm_server.server_command(profile, model, port=port)
    env = vllm_server.server_env(profile, model)
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        assert command[1] == "-m", command
        command = [command[0], "-c", CPU_BUILD_SHIM, *command[2:]]
        # Its platform detection reads the same missing version ("+cpu"): name the device.
        env["VLLM_TARGET_DEVICE"] = "cpu"
    vllm_server.check_servable(profile, model)
    return server_process.launch(
        "vllm", command, env, port=port,
        url=vllm_server.server_url(profile, None, port), profile=profile.get("name"), root=root,
    )  # fmt: skip


def conversations(rows: list[dict[str, Any]], sampling: Sampling) -> list[Conversation]:
    from draftline.data.conversations import messages_from_records

    out = []
    for r in rows:
        messages = messages_from_records(r["messages"])
        kwargs = {"enable_thinking": False}
        out.append(Conversation(r["id"], messages, regenerated_turns(messages), kwargs, [], [],
                                sampling))  # fmt: skip
    return out


def run_draftline(
    url: str, rows_path: Path, work: Path, tokenizer: Any, sampling: Sampling, in_flight: int
) -> tuple[int, float]:
    special = special_ids(tokenizer, END_OF_TURN)
    engine = VLLMEngine(
        ClientSettings(endpoints=(url,), max_in_flight=in_flight), sampling, special.end_of_turn
    )
    identity = Identity("bench", {"enable_thinking": False}, sampling, thinking_share=0.0)
    paths = ShardPaths("bench", rows_path, work / "out.parquet", work / "run.json",
                       work / "journal.jsonl")  # fmt: skip
    try:
        metrics = run_shard(paths, engine, tokenizer, identity, special, None,
                            max_error_share=0.0, progress=False)  # fmt: skip
    finally:
        engine.close()
    assert metrics["errors"] == 0, metrics
    return int(metrics["generated_output_tokens"]), float(metrics["run_wall_s"])


def turn_by_turn(rows: list[dict[str, Any]], tokenizer: Any, sampling: Sampling, generate):
    """All conversations' turn k in one `generate(requests) -> [completion ids]` call, then
    turn k + 1, each prompt holding that side's own earlier answers."""
    special = special_ids(tokenizer, END_OF_TURN)
    stops = completion_params(sampling, special.end_of_turn)["stop_token_ids"]
    todo = conversations(rows, sampling)
    tokens, began = 0, time.perf_counter()
    while todo:
        requests = [c.next_request(tokenizer, special) for c in todo]
        asked = [(c, r) for c, r in zip(todo, requests, strict=True) if r is not None]
        for (conversation, request), ids in zip(asked, generate([r for _, r in asked]),
                                                strict=True):  # fmt: skip
            tokens += len(ids)
            reason = "stop" if ids and ids[-1] in stops else "length"
            conversation.results.append(conversation.take(Result(request.id, ids, reason)))
        todo = [c for c in todo if not c.done()]
    return tokens, time.perf_counter() - began


def run_batch(llm: Any, rows: list[dict[str, Any]], tokenizer: Any, sampling: Sampling):
    """vLLM's offline batch mode, turn by turn."""
    from vllm import SamplingParams, TokensPrompt

    params = completion_params(sampling, special_ids(tokenizer, END_OF_TURN).end_of_turn)

    def generate(requests: list[Any]) -> list[list[int]]:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests],
            [
                SamplingParams(
                    max_tokens=r.max_new_tokens or params["max_tokens"],
                    temperature=params["temperature"],
                    top_p=params["top_p"],
                    top_k=params["top_k"],
                    stop_token_ids=params["stop_token_ids"],
                    skip_special_tokens=False,
                    seed=sampling.request_seed(r.id),
                )  # fmt: skip
                for r in requests
            ],
            use_tqdm=False,
        )
        return [list(o.outputs[0].token_ids) for o in outputs]

    return turn_by_turn(rows, tokenizer, sampling, generate)


def run_client_rounds(
    url: str, rows: list[dict[str, Any]], tokenizer: Any, sampling: Sampling, in_flight: int
):
    """Diagnosis: the same turn-by-turn batches through the vLLM client and server alone (no
    scheduler, journal or table): what the server path costs by itself."""
    special = special_ids(tokenizer, END_OF_TURN)
    engine = VLLMEngine(
        ClientSettings(endpoints=(url,), max_in_flight=in_flight), sampling, special.end_of_turn
    )

    def generate(requests: list[Any]) -> list[list[int]]:
        out: dict[str, Result] = {}
        engine.generate(requests, lambda r: out.__setitem__(r.id, r))
        return [out[r.id].completion_ids for r in requests]

    try:
        return turn_by_turn(rows, tokenizer, sampling, generate)
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, help="a head_dim >= 32 Qwen3 folder")
    parser.add_argument("--conversations", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--mean-tokens", type=float, default=48.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    profile = hardware.load_profiles(REPO / "conf")["vllm_cpu"]
    settings = profile["vllm"]
    # vllm-cpu 0.32.0's engine dies ("CPU Generator does not use offset") when a seeded
    # request's prefill is split over steps: a step budget that holds every prefill whole, on
    # both sides.
    budget = int(settings["max_model_len"]) * int(settings["max_num_seqs"])
    settings["extra_args"] = [*settings.get("extra_args", []), "--max-num-batched-tokens",
                              str(budget)]  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="engine-bench-"))
    target = args.target or build_target(work / "target", args.mean_tokens)
    tokenizer = load_tokenizer({"path": str(target), "revision": None})
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0,
                        context_length=int(settings["max_model_len"]))  # fmt: skip
    rows = curated_rows(args.conversations)
    rows_path = work / "curated.parquet"
    pq.write_table(pa.Table.from_pylist(rows), rows_path)
    turns = sum(len(regenerated_turns(json_messages(r))) for r in rows)
    print(f"{len(rows)} conversations, {turns} assistant turns at most; target {target}")

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(settings["kv_cache_gib"]))
    os.environ.setdefault("VLLM_TARGET_DEVICE", str(profile.get("device") or "cpu"))
    from vllm import LLM

    with socket.socket() as s:  # a free port: the profile's may be taken on a shared machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = start_server(profile, target, port, work)
    figures: list[dict[str, float]] = []
    try:
        llm = LLM(
            model=str(target), dtype=settings["dtype"], max_model_len=settings["max_model_len"],
            max_num_seqs=settings["max_num_seqs"], enforce_eager=settings["enforce_eager"],
            seed=settings["seed"], max_num_batched_tokens=budget,
        )  # fmt: skip
        for repeat in range(args.repeats):
            sides: dict[str, tuple[int, float]] = {}
            order = ("draftline", "batch", "client_rounds")
            for side in order if repeat % 2 == 0 else order[::-1]:
                if side == "batch":
                    sides[side] = run_batch(llm, rows, tokenizer, sampling)
                elif side == "client_rounds":
                    sides[side] = run_client_rounds(state.url, rows, tokenizer, sampling,
                                                    int(settings["max_in_flight"]))  # fmt: skip
                else:
                    run = work / f"run-{repeat}"
                    run.mkdir()
                    sides[side] = run_draftline(state.url, rows_path, run, tokenizer, sampling,
                                                int(settings["max_in_flight"]))  # fmt: skip
            rate = {side: tokens / wall for side, (tokens, wall) in sides.items()}
            figure = {
                "draftline_tokens": sides["draftline"][0], "draftline_s": sides["draftline"][1],
                "batch_tokens": sides["batch"][0], "batch_s": sides["batch"][1],
                "draftline_tok_s": rate["draftline"], "batch_tok_s": rate["batch"],
                "ratio": rate["draftline"] / rate["batch"],
                "client_rounds_tok_s": rate["client_rounds"],
                "client_rounds_ratio": rate["client_rounds"] / rate["batch"],
            }  # fmt: skip
            figures.append(figure)
            print(
                f"repeat {repeat}: draftline {figure['draftline_tok_s']:,.1f} tok/s "
                f"({figure['draftline_tokens']} tokens in {figure['draftline_s']:.1f} s), batch "
                f"{figure['batch_tok_s']:,.1f} tok/s ({figure['batch_tokens']} tokens in "
                f"{figure['batch_s']:.1f} s): ratio {figure['ratio']:.3f}; client and server alone "
                f"{figure['client_rounds_tok_s']:,.1f} tok/s, ratio "
                f"{figure['client_rounds_ratio']:.3f}",
                flush=True,
            )
    finally:
        server_process.stop(state, root=work)
    median = statistics.median(f["ratio"] for f in figures)
    alone = statistics.median(f["client_rounds_ratio"] for f in figures)
    if args.json:
        summary = {"repeats": figures, "ratio_median": median, "client_rounds_ratio_median": alone}
        args.json.write_text(json.dumps(summary, indent=1))
    print(f"client and server alone: ratio median {alone:.3f}")
    print(f"ratio median={median:.3f}")
    return 0


def json_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    from draftline.data.conversations import messages_from_records

    return messages_from_records(row["messages"])


if __name__ == "__main__":
    sys.exit(main())
