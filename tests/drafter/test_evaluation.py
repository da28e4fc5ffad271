"""Offline tau: the chained walk on hand-made drafts, the batched walk against the step-by-step
reference with a real drafter, greedy continuations, and the evaluate stage end to end."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import yaml
from helpers.evaluation_helpers import LAYER_IDS, MASK_ID, B, make_drafter, save_word_tokenizer
from helpers.tiny_qwen3 import END_OF_TURN, VOCAB, generated_row, tiny_qwen3, write_shard

from draftline.core.continuation import greedy_continuations
from draftline.drafter.evaluation import (
    Cycle,
    Sampling,
    TauReport,
    anchor_drafts,
    chained_walk,
    expected_commit,
    judge,
    sampled_commits,
    sampling_distribution,
    target_logits,
    walk_batched,
    walk_step_by_step,
)
from draftline.drafter.features import target_layer_states
from draftline.stages import evaluate as evaluate_stage

pytestmark = pytest.mark.float_kernels

torch.set_num_threads(1)


def perfect(tokens):
    return lambda a: tokens[a + 1 : a + B]


def test_perfect_drafter_commits_whole_blocks():
    prompt, tokens = 5, list(range(5 + 10 * B + 1))  # 10 full blocks after the prompt
    cycles = chained_walk(tokens, prompt, perfect(tokens))
    assert [c.committed for c in cycles] == [B] * 10
    report = TauReport(B)
    report.add(cycles)
    assert report.tau == B


def test_always_wrong_drafter_commits_one_token_per_cycle():
    tokens = list(range(30))
    cycles = chained_walk(tokens, 6, lambda a: [-1] * (B - 1))
    assert len(cycles) == 30 - 1 - 6
    assert all(c.accepted == 0 and c.committed == 1 for c in cycles)
    assert [c.verifiable for c in cycles[-3:]] == [3, 2, 1]  # fewer tokens left to judge


def test_walk_chains_anchors_by_commits_and_stops_at_the_end():
    tokens = list(range(20))
    visited = []

    def two_right(a):  # the first two drafts right, the third wrong
        visited.append(a)
        return [a + 1, a + 2, -1]

    cycles = chained_walk(tokens, 3, two_right)
    assert visited == [3, 6, 9, 12, 15, 18]
    assert [c.committed for c in cycles] == [3, 3, 3, 3, 3, 1]  # 1 token left after 18
    # A perfect block near the end commits only what is left.
    assert judge([8, 9, 10], [8, 9]) == Cycle(accepted=2, verifiable=2, committed=2)


def test_summary_rates_and_histogram():
    report = TauReport(B)
    report.add([Cycle(3, 3, 4), Cycle(1, 3, 2)])
    report.add([Cycle(0, 3, 1)])
    s = report.summary()
    assert s["tau"] == pytest.approx((3 + 1) / 2)  # prompts averaged: (3 + 1) / 2
    assert s["tau_per_cycle"] == pytest.approx(7 / 3)
    assert s["acceptance_rate"] == {"1": 2 / 3, "2": 1 / 2, "3": 1.0}
    assert s["accepted_at_least"] == {"1": 2 / 3, "2": 1 / 3, "3": 1 / 3}
    assert s["commit_histogram"] == {"1": 1, "2": 1, "3": 0, "4": 1}


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(num_layers=6)


def simulate_speculative_sampling(p: torch.Tensor, q: torch.Tensor, left: int, n: int) -> float:
    """Mean commit of `n` simulated cycles: draft j ~ q_j, accepted with probability
    min(1, p_j(x) / q_j(x)); the first rejection (or the end of the tokens left) stops."""
    g = torch.Generator().manual_seed(0)
    width = min(p.shape[0], left)
    drafts = torch.stack([torch.multinomial(q[j], n, True, generator=g) for j in range(width)], 1)
    ratio = (p[torch.arange(width), drafts] / q[torch.arange(width), drafts]).clamp(max=1)
    accepted = (torch.rand(n, width, generator=g) < ratio).long().cumprod(1).sum(1)
    return float((accepted + 1).clamp(max=left).float().mean())


@pytest.mark.parametrize("left", [10, 3, 1])
def test_expected_commit_matches_a_simulation_of_speculative_sampling(left):
    """The closed form against 400,000 simulated cycles on a 6-token vocabulary (block 5)."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(2 * torch.randn(4, 6, generator=g), -1)
    q = torch.softmax(2 * torch.randn(4, 6, generator=g), -1)
    alpha = torch.minimum(p, q).sum(-1)
    closed = float(expected_commit(alpha[None], torch.tensor([left]))[0])
    simulated = simulate_speculative_sampling(p, q, left, 400_000)
    assert closed == pytest.approx(simulated, abs=0.01)
    assert 1.0 <= closed <= min(left, 5)


def test_sampling_distribution_applies_temperature_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.equal(sampling_distribution(logits, Sampling(0.0)), torch.tensor([[1.0, 0, 0, 0]]))
    full = sampling_distribution(logits, Sampling(1.0))
    assert torch.allclose(full, torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = sampling_distribution(logits, Sampling(1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[0.625, 0.375, 0, 0]]))
    # top-p 0.8: 0.5 + 0.3 reaches it, so the smallest such set is the first two tokens.
    assert torch.allclose(sampling_distribution(logits, Sampling(1.0, top_p=0.8)), top2)
    hot = sampling_distribution(logits, Sampling(0.5))
    assert hot[0, 0] > 0.5 and torch.allclose(hot.sum(-1), torch.ones(1))


def test_at_temperature_zero_the_expected_commit_is_the_greedy_commit_at_every_anchor(target):
    """On the target's own greedy continuation, temperature 0 makes both distributions one-hot:
    the expected commit at each anchor is what the greedy judge commits there."""
    drafter = make_drafter(target, seed=1)
    prompt = torch.randint(3, VOCAB - 1, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    tokens = prompt + greedy_continuations(target, [prompt], 14, END_OF_TURN, batch_size=1)[0]
    feats = target_layer_states(target, torch.tensor([tokens]), LAYER_IDS)[0]
    logits = target_logits(target, tokens, len(prompt))
    sampled = sampled_commits(drafter, feats, tokens, len(prompt), logits, Sampling(0.0))
    anchors = range(len(prompt), len(tokens) - 1)
    drafts = anchor_drafts(drafter, feats, torch.tensor(tokens), torch.tensor(list(anchors)))
    greedy = [
        judge(d.tolist(), tokens[a + 1 :]).committed for a, d in zip(anchors, drafts, strict=True)
    ]
    assert sampled == [float(c) for c in greedy]
    hot = sampled_commits(drafter, feats, tokens, len(prompt), logits, Sampling(1.0))
    assert all(1.0 <= c <= B for c in hot)


def test_batched_drafts_equal_one_block_at_a_time(target):
    drafter = make_drafter(target)
    tokens = torch.randint(0, VOCAB - 1, (30,), generator=torch.Generator().manual_seed(0))
    feats = target_layer_states(target, tokens[None], LAYER_IDS)[0]
    anchors = torch.arange(2, 29)
    batched = anchor_drafts(drafter, feats, tokens, anchors)
    for a, row in zip(anchors.tolist(), batched, strict=True):
        assert torch.equal(row, drafter.draft_block(feats[:a], int(tokens[a])))


def sequence_with_known_acceptance(target, drafter, prompt_len: int, cycles: int, seed: int):
    """Tokens built so that at each visited anchor exactly `accepted[i]` drafts are right.

    The target is causal, so the features of a prefix are those of the whole sequence: the
    drafts at anchor a can be computed before the tokens after a are chosen.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB - 1, (prompt_len + 1,), generator=g).tolist()
    accepted = []
    a = prompt_len
    for _ in range(cycles):
        feats = target_layer_states(target, torch.tensor([tokens[:a]]), LAYER_IDS)[0]
        drafts = drafter.draft_block(feats, tokens[a]).tolist()
        k = int(torch.randint(0, B, (1,), generator=g))  # 0..B-1 right drafts
        wrong = [] if k == B - 1 else [(drafts[k] + 1) % (VOCAB - 1)]
        tokens = tokens[: a + 1] + drafts[:k] + wrong
        if k == B - 1:  # a full block: the bonus token is free
            tokens.append(int(torch.randint(0, VOCAB - 1, (1,), generator=g)))
        accepted.append(k)
        a += k + 1
    return tokens, accepted


def test_walks_recover_a_known_acceptance_pattern(target):
    drafter = make_drafter(target)
    tokens, accepted = sequence_with_known_acceptance(target, drafter, 5, cycles=12, seed=3)
    assert len(set(accepted)) > 2  # a mix of short and long acceptances
    feats = target_layer_states(target, torch.tensor([tokens]), LAYER_IDS)[0]
    batched = walk_batched(drafter, feats, tokens, 5)
    assert [c.accepted for c in batched] == accepted
    assert [c.committed for c in batched] == [k + 1 for k in accepted]
    assert batched == walk_step_by_step(drafter, feats, tokens, 5)
    report = TauReport(B)
    report.add(batched)
    assert report.tau == pytest.approx(sum(k + 1 for k in accepted) / len(accepted))


def test_greedy_continuations_match_a_token_by_token_argmax(target):
    prompts = [[5, 9, 11], [4] * 7, [20, 21]]
    got = greedy_continuations(target, prompts, max_new_tokens=6, end_of_turn_id=END_OF_TURN,
                               batch_size=2)  # fmt: skip
    for prompt, continuation in zip(prompts, got, strict=True):
        ids = list(prompt)
        for _ in range(6):
            with torch.no_grad():
                nxt = int(target(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == END_OF_TURN:
                break
        assert continuation == ids[len(prompt) :]


def test_evaluate_stage_reports_trained_and_untrained_tau(target, tmp_path):
    from draftline.cli import main
    from draftline.drafter.evaluation import evaluate_drafter
    from draftline.drafter.export import export_drafter

    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    save_word_tokenizer(target_dir)
    g = torch.Generator().manual_seed(5)
    rows = [
        generated_row(n, torch.randint(3, VOCAB - 1, (int(4 + n % 5),), generator=g).tolist(),
                      [7, END_OF_TURN])
        for n in range(6)
    ]  # fmt: skip
    for n, row in enumerate(rows):
        row["thinking"] = n % 2 == 0  # a thinking mix (data.thinking_share)
    eval_file = write_shard(tmp_path / "eval.parquet", rows)
    export_drafter(make_drafter(target, seed=1), tmp_path / "drafter")
    drafter_params = {
        "num_hidden_layers": 2, "block_size": B, "gamma": 4.0, "max_anchors": 8,
        "global_batch_size": 2, "lr": 1e-3, "weight_decay": 0.0, "warmup_ratio": 0.0,
        "epochs": 1, "grad_clip": 1.0, "seed": 0,
    }  # fmt: skip
    params = {
        "model": {"path": str(target_dir), "revision": None, "target_layer_ids": LAYER_IDS,
                  "mask_token": "<|MASK|>", "mask_token_id": MASK_ID,
                  "end_of_turn_token": "<|im_end|>"},
        "drafter": drafter_params,
        "evaluate": {"max_new_tokens": 12, "max_prompts": 5, "temperature": 0.7, "top_p": 0.9,
                     "top_k": 20},
        "hardware": {"name": "cpu", "engine": "local", "device": "cpu", "precision": "fp32",
                     "local": {"batch_size": 4}, "extract_tokens_per_batch": 64},
    }  # fmt: skip
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    plots = tmp_path / "plots"
    code = main([
        "evaluate", f"--params={tmp_path / 'params.yaml'}", f"--eval={eval_file}",
        f"--drafter={tmp_path / 'drafter'}", f"--metrics={tmp_path / 'evaluate.json'}",
        f"--plots={plots}", f"--run-log={tmp_path / 'run.json'}",
        f"--report={tmp_path / 'report.json'}",
    ])  # fmt: skip
    assert code == 0
    m = json.loads((tmp_path / "run.json").read_text())  # the full record
    # The DVC metrics are tau greedy, sampled and per thinking mode (these rows are a mix; one
    # input file, no benchmarks), in that order (`dvc exp show`'s columns); the report has every
    # result, the untrained tau included, and the identity.
    metrics = (tmp_path / "evaluate.json").read_text()
    keys = ("tau", "tau_sampled", "tau_thinking", "tau_no_thinking")
    assert list(json.loads(metrics).items()) == [(k, m[k]) for k in keys]
    assert "tau_untrained" not in metrics
    results = [k for k in (*evaluate_stage.RESULT_KEYS, "model", "data", "drafter") if k in m]
    assert json.loads((tmp_path / "report.json").read_text()) == {k: m[k] for k in results}
    assert m["num_prompts"] == 5 and m["hardware_profile"] == "cpu"
    for key in ("tau", "tau_untrained", "tau_sampled", "tau_sampled_untrained"):
        assert 1.0 <= m[key] <= B
    assert m["tau_ratio"] == pytest.approx(m["tau"] / m["tau_untrained"])
    assert m["trained"]["num_tokens"] == sum(
        json.loads(json.dumps(m["trained"]["commit_histogram"]))[k] * int(k)
        for k in m["trained"]["commit_histogram"]
    )
    # The untrained baseline is the seed-0 drafter; recompute its tau independently.
    prompts = [r["prompt_ids"] for r in sorted(rows, key=lambda r: r["id"])[:5]]
    conts = greedy_continuations(target, prompts, 12, END_OF_TURN, batch_size=1)
    seqs = [(p + c, len(p)) for p, c in zip(prompts, conts, strict=True)]
    feats = [
        target_layer_states(target, torch.tensor([s]), LAYER_IDS)[0].to(torch.bfloat16)
        for s, _ in seqs
    ]
    logits = [target_logits(target, s, start) for s, start in seqs]
    sampling = Sampling(0.7, top_p=0.9, top_k=20)
    baseline = evaluate_drafter(make_drafter(target, seed=0), seqs, feats, logits, sampling)
    assert m["tau_untrained"] == pytest.approx(baseline.tau)
    assert m["tau_sampled_untrained"] == pytest.approx(baseline.tau_sampled)
    # tau per thinking mode: the trained drafter on each mode's prompts alone.
    trained = make_drafter(target, seed=1)
    modes = [r["thinking"] for r in sorted(rows, key=lambda r: r["id"])[:5]]
    for mode, key in ((True, "tau_thinking"), (False, "tau_no_thinking")):
        picked = [i for i, m_ in enumerate(modes) if m_ is mode]
        alone = evaluate_drafter(trained, [seqs[i] for i in picked], [feats[i] for i in picked])
        assert m[key] == pytest.approx(alone.tau), key
    with open(plots / "acceptance.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["position"] for r in table] == ["1", "2", "3"]
    assert set(table[0]) == {"position", "trained", "untrained"}
    assert (plots / "tau_histogram.csv").read_text().startswith("committed,trained,untrained")


def test_a_subset_report_is_the_report_of_those_prompts():
    def cycles(*committed: int) -> list[Cycle]:
        return [Cycle(committed=c, accepted=c - 1, verifiable=7) for c in committed]

    per_prompt = [cycles(4, 2), cycles(1), cycles(8, 8, 2)]
    whole = TauReport(8, per_prompt, [[3.0], [1.0], [5.0, 6.0]])
    part = whole.subset([0, 2])
    alone = TauReport(8, [per_prompt[0], per_prompt[2]], [[3.0], [5.0, 6.0]])
    assert part.tau == alone.tau == pytest.approx((3 + 6) / 2)
    assert part.tau_sampled == alone.tau_sampled == pytest.approx((3 + 5.5) / 2)
