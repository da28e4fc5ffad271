"""Test data for the drafter tests: a tiny random Qwen3 target and extracted packs.

Real components only: a transformers Qwen3 model saved with `save_pretrained`, features from
`draftline.drafter.features.target_layer_states`, packs in the layout of docs/pipeline.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftline.drafter.features import target_layer_states

VOCAB = 96
MASK_ID = VOCAB - 1
LAYER_IDS = [0, 2, 3]


def make_target(folder: Path, hidden: int = 32, layers: int = 4, seed: int = 0) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        # Unit-scale embeddings: with the default 0.02 the tied lm_head gives near-zero logits.
        initializer_range=0.1,
    )
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    return folder


def model_params(target_dir: Path) -> dict:
    return {
        "path": str(target_dir),
        "revision": None,
        "target_layer_ids": LAYER_IDS,
        "mask_token": "<|MASK|>",
        "mask_token_id": MASK_ID,
    }


def generated_sequences(
    target_dir: Path, count: int, seed: int = 0, prompt: int = 6, new_tokens: int = 48
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Random prompts and the target's own greedy continuations (what the pipeline trains on)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB - 1, (count, prompt), generator=g)
    with torch.no_grad():
        out = target.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    mask = torch.zeros(out.shape[1], dtype=torch.uint8)
    mask[prompt:] = 1
    return [(f"{n:016x}", out[n], mask.clone()) for n in range(count)]


def write_packs(
    folder: Path,
    target_dir: Path,
    sequences: list[tuple[str, torch.Tensor, torch.Tensor]],
    offline: bool = True,
    per_pack: int = 16,
) -> Path:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for p in range(0, len(sequences), per_pack):
        chunk = sequences[p : p + per_pack]
        lengths = [ids.numel() for _, ids, _ in chunk]
        tensors = {
            "input_ids": torch.cat([ids for _, ids, _ in chunk]).to(torch.int32),
            "loss_mask": torch.cat([m for _, _, m in chunk]).to(torch.uint8),
            "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        }
        if offline:
            feats = [
                target_layer_states(target, ids[None].long(), LAYER_IDS)[0].to(torch.bfloat16)
                for _, ids, _ in chunk
            ]
            tensors["features"] = torch.cat(feats)
        name = f"pack-{p // per_pack:05d}.safetensors"
        save_file(
            tensors, str(folder / name), metadata={"ids": json.dumps([i for i, _, _ in chunk])}
        )
        shards.append({"file": name, "num_sequences": len(chunk), "num_tokens": sum(lengths)})
    index = {
        "features": "offline" if offline else "online",
        "num_sequences": len(sequences),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "target_layer_ids": LAYER_IDS,
        "hidden_size": target.config.hidden_size,
        "feature_dtype": "bfloat16",
        "model": str(target_dir),
        "shards": shards,
    }
    (folder / "index.json").write_text(json.dumps(index), encoding="utf-8")
    return folder
