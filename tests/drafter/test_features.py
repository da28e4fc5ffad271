"""draftline.drafter.features: target-layer states equal HF's and the forward stops early."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_qwen3 import VOCAB, tiny_qwen3

from draftline.drafter.features import target_layer_states

pytestmark = pytest.mark.float_kernels

torch.set_num_threads(1)
LAYER_IDS = [1, 2, 4]  # of 6 layers: layer 5 and the final norm are never needed


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(num_layers=6)


def hf_states(model, input_ids, layer_ids, attention_mask=None) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def test_states_equal_hf_hidden_states(model):
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    got = target_layer_states(model, ids, LAYER_IDS)
    assert got.shape == (3, 17, len(LAYER_IDS) * model.config.hidden_size)
    torch.testing.assert_close(got, hf_states(model, ids, LAYER_IDS), rtol=0, atol=0)
    assert not got.requires_grad


def test_order_follows_layer_ids(model):
    ids = torch.randint(0, VOCAB, (1, 9))
    h = model.config.hidden_size
    forward = target_layer_states(model, ids, [1, 4])
    backward = target_layer_states(model, ids, [4, 1])
    torch.testing.assert_close(backward, torch.cat([forward[..., h:], forward[..., :h]], -1))


def test_padded_batch_equals_each_sequence_alone(model):
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (12, 5, 9)]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    batch = target_layer_states(model, ids, LAYER_IDS, attention_mask=mask)
    for i, s in enumerate(seqs):
        alone = hf_states(model, s[None], LAYER_IDS)[0]
        torch.testing.assert_close(batch[i, : len(s)], alone, rtol=1e-5, atol=1e-5)


def test_packed_sequences_do_not_see_each_other(model):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, VOCAB, (7,), generator=g), torch.randint(0, VOCAB, (5,), generator=g)
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    packed = target_layer_states(model, torch.cat([a, b])[None], LAYER_IDS, position_ids=positions)
    torch.testing.assert_close(packed[0, 7:], hf_states(model, b[None], LAYER_IDS)[0])


class _MustNotRun(torch.nn.Module):
    def forward(self, *args, **kwargs):
        raise AssertionError("a layer after the last needed one ran")


def test_later_layers_norm_and_head_never_run(model):
    ids = torch.randint(0, VOCAB, (2, 8))
    expected = hf_states(model, ids, LAYER_IDS)
    truncated = tiny_qwen3(num_layers=6)  # same seed: same weights
    truncated.model.layers[5] = _MustNotRun()
    truncated.model.norm = _MustNotRun()
    truncated.lm_head = _MustNotRun()
    calls = []
    for i, layer in enumerate(truncated.model.layers[:5]):
        layer.register_forward_hook(lambda *_a, i=i: calls.append(i))
    got = target_layer_states(truncated, ids, LAYER_IDS)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert calls == [0, 1, 2, 3, 4]  # layers up to the last id (4), each once
    # The early stop leaves the model usable for a normal forward afterwards.
    assert target_layer_states(truncated, ids, [0]).shape[-1] == model.config.hidden_size


def test_bad_layer_ids_say_what_is_wrong(model):
    with pytest.raises(ValueError, match="out of range"):
        target_layer_states(model, torch.zeros(1, 3, dtype=torch.long), [1, 6])
    with pytest.raises(ValueError, match="empty"):
        target_layer_states(model, torch.zeros(1, 3, dtype=torch.long), [])
