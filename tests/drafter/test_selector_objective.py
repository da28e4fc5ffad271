"""DFlash2's selector objective: what each variant trains on, its schedule, and the candidate
logits' gradient (computed without keeping the head's gathered rows)."""

from __future__ import annotations

import pytest
import torch

from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
from draftline.drafter.dflash2 import DFlash2Layout, unary_logits
from draftline.drafter.selector_objective import SelectorObjective, selector_loss

VOCAB, HIDDEN, BLOCK, TOP_K = 40, 16, 4, 3


@pytest.fixture(scope="module")
def drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    head = TargetHead(torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN))
    config = DFlashConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, intermediate_size=32, vocab_size=VOCAB, block_size=BLOCK, mask_token_id=0,
        target_layer_ids=[0], num_target_layers=2, dflash2=DFlash2Layout(2, 8, 4, TOP_K),
    )  # fmt: skip
    drafter = DFlashDrafter(config, head)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_()
    return drafter


def block_case(drafter: DFlashDrafter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states [1, 2, B, H] whose first output's gold token is the unary top-1, the
    second's is outside the top-k; the last block position is unsupervised."""
    hidden = torch.randn(1, 2, BLOCK, HIDDEN, generator=torch.Generator().manual_seed(1))
    order = (hidden @ drafter.target.lm_head_weight.T).argsort(-1, descending=True)
    labels = order[..., 0].clone()  # gold = the unary argmax everywhere...
    labels[0, 1, 1] = order[0, 1, 1, TOP_K + 2]  # ...but here, outside the top-k
    weights = torch.ones(1, 2, BLOCK)
    weights[..., 0] = 0.0  # the anchor
    weights[..., -1] = 0.0
    return hidden.requires_grad_(), labels, weights


def test_strict_topk_skips_outputs_whose_gold_token_is_no_candidate(drafter):
    hidden, labels, weights = block_case(drafter)
    strict = selector_loss(drafter, hidden, labels, weights, SelectorObjective("strict_topk"))
    gold = selector_loss(drafter, hidden, labels, weights, SelectorObjective("gold_insertion"))
    assert strict.counted.tolist() == gold.counted.tolist() == [0.0, 2.0, 2.0, 0.0]
    assert strict.in_top_k.tolist() == [0.0, 1.0, 2.0, 0.0]  # recall@top-k: 3 of 4
    assert gold.in_top_k.tolist() == strict.in_top_k.tolist()  # an insertion is no candidate
    assert gold.weighted_ce > strict.weighted_ce  # the missed output trains with insertion
    # recall@1 never counts an inserted gold token.
    assert (gold.top1 <= gold.in_top_k).all() and (strict.top1 <= strict.in_top_k).all()


def test_stop_gradient_keeps_the_selector_term_off_the_hidden_states(drafter):
    hidden, labels, weights = block_case(drafter)
    for stop, reaches in ((False, True), (True, False)):
        objective = SelectorObjective("strict_topk", stop_gradient=stop)
        hidden.grad = None
        drafter.zero_grad()
        selector_loss(drafter, hidden, labels, weights, objective).weighted_ce.backward()
        assert (hidden.grad is not None and bool(hidden.grad.abs().sum() > 0)) is reaches
        assert drafter.candidate_selector.successor_codebook.grad.abs().sum() > 0


def test_the_selector_weight_warms_up_then_ramps_to_alpha():
    objective = SelectorObjective("strict_topk", alpha=0.5, warmup_ratio=0.1, ramp_ratio=0.2)
    assert [objective.weight(s, 100) for s in (0, 9, 10, 20, 30, 99)] == [
        0.0, 0.0, 0.0, 0.25, 0.5, 0.5
    ]  # fmt: skip
    assert SelectorObjective("none").weight(50, 100) == 0.0
    assert SelectorObjective("strict_topk").weight(0, 100) == 1.0
    with pytest.raises(SystemExit, match="selector_loss"):
        SelectorObjective("kl")


def test_candidate_logits_and_their_gradient_are_the_gathered_rows():
    head = torch.randn(50, HIDDEN, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, 3, 4))
    hidden = torch.randn(2, 3, HIDDEN, dtype=torch.float64, requires_grad=True)
    assert torch.allclose(unary_logits(hidden, head, ids), (head[ids] @ hidden[..., None])[..., 0])
    assert torch.autograd.gradcheck(lambda h: unary_logits(h, head, ids), (hidden,))
