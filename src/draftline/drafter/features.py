"""Target-layer features: the hidden states of the target layers a DFlash drafter reads.

One function, used by extraction (offline features written to packs) and by online training
(features computed on the fly with the frozen target). Layer id i is the output of decoder layer
i, i.e. HF `hidden_states[i + 1]`. The forward stops right after the last needed layer: later
layers, the final norm and the lm_head never run, which saves their compute and memory.

It works with any HF decoder whose text model keeps its blocks in `.layers`: a causal LM
(`Qwen3ForCausalLM`, `Qwen3_5ForCausalLM`: `model.layers`) or a vision-language wrapper
(`Qwen3_5ForConditionalGeneration`: `model.language_model.layers`), whose text model alone runs
(the vision tower never does). The model's own forward builds masks and positions (padding,
packed sequences, sliding windows), forward hooks collect the chosen layers' outputs, and the
hook on the last one ends the forward (unless it is the decoder's last layer: then the forward
ends by itself, which a sharded target needs, see `needed_layers_only`). Hybrid models (Gated
DeltaNet `linear_attention` layers) carry a recurrent state along the row, so packed sequences
would leak into each other there: they take padded rows only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class _EnoughLayers(Exception):
    """Raised by the hook on the last needed layer to end the forward early."""


# Where the text decoder sits: VL wrapper, causal LM, or the decoder itself.
_TEXT_MODEL_PATHS = ("model.language_model", "language_model", "model", "")


def text_model(model: Any) -> torch.nn.Module:
    """The text decoder (the module holding `.layers`) of a causal LM or a VL wrapper."""
    for path in _TEXT_MODEL_PATHS:
        module = model
        for attr in filter(None, path.split(".")):
            module = getattr(module, attr, None)
        if isinstance(getattr(module, "layers", None), torch.nn.ModuleList):
            return module
    raise TypeError(
        f"{type(model).__name__} has no decoder layers under `.model.layers` or "
        "`.model.language_model.layers`: draftline.drafter.features supports HF decoder-only "
        "models "
        "(Qwen3ForCausalLM, Qwen3_5ForCausalLM) and VL wrappers (Qwen3_5ForConditionalGeneration)"
    )


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The decoder blocks of a causal LM, a VL wrapper's language model or a bare decoder."""
    return text_model(model).layers


def is_hybrid(model: Any) -> bool:
    """Whether the text decoder has recurrent (linear-attention) layers."""
    config = getattr(text_model(model), "config", None)
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


@torch.no_grad()
def target_layer_states(
    model: Any,
    input_ids: torch.Tensor,
    layer_ids: Sequence[int],
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Hidden states of `layer_ids`, concatenated per token in the given order.

    input_ids: [batch, seq] token ids. attention_mask: optional [batch, seq], 1 for real tokens
    (padding, left or right). position_ids: optional [batch, seq]; positions that restart at 0
    inside a row mark packed sequences (HF then keeps them from attending to each other).
    Returns [batch, seq, len(layer_ids) * hidden_size] in the model's dtype, without gradients
    (the target is frozen). Padded positions hold unspecified values.
    """
    layers = decoder_layers(model)
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("layer_ids is empty: name at least one target layer")
    bad = [i for i in ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"layer ids {bad} out of range: the target has {len(layers)} layers")
    if position_ids is not None and is_hybrid(model):
        restarts = position_ids[..., 1:] <= position_ids[..., :-1]
        if bool(restarts.any()):
            raise ValueError(
                "packed sequences (positions that restart inside a row) on a hybrid model: its "
                "linear-attention layers would carry one sequence's state into the next; pass "
                "one sequence per row with an attention_mask instead"
            )
    last = max(ids)
    captured: dict[int, torch.Tensor] = {}

    def keep(layer_id: int):
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if layer_id == last < len(layers) - 1:
                raise _EnoughLayers

        return hook

    handles = [layers[i].register_forward_hook(keep(i)) for i in sorted(set(ids))]
    base = text_model(model)
    try:
        base(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
    except _EnoughLayers:
        pass
    finally:
        for handle in handles:
            handle.remove()
    if last not in captured:
        raise RuntimeError(f"the forward ended before layer {last}: is the model truncated?")
    return torch.cat([captured[i] for i in ids], dim=-1)


def needed_layers_only(model: Any, layer_ids: Sequence[int]) -> torch.nn.Module:
    """The target's text decoder cut after the last of `layer_ids`: what online training keeps.

    The decoder layers after it, and the lm_head (the drafter reads its own copy of the
    target's head), never run for features, so they are not held. The forward of the cut
    decoder runs to its end (no early exit), which FSDP2 needs: a sharded root's
    post-forward must run. `target_layer_states` gives the same states on both.
    """
    base = text_model(model)
    keep = max(int(i) for i in layer_ids) + 1
    config = base.config
    if keep < len(base.layers):
        base.layers = torch.nn.ModuleList(list(base.layers)[:keep])
        config.num_hidden_layers = keep
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types)[:keep]
    return base
