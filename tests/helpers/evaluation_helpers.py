"""The evaluation tests' drafter over the tiny random Qwen3 (helpers/tiny_qwen3.py), and a real
tokenizer for it that the evaluate stage can load."""

from __future__ import annotations

from pathlib import Path

import torch

from draftline.drafter.dflash import DFlashConfig, DFlashDrafter, TargetHead
from helpers.tiny_qwen3 import END_OF_TURN, VOCAB

B = 4
LAYER_IDS = [1, 2, 4]
MASK_ID = VOCAB - 1


def make_drafter(target, seed: int = 0) -> DFlashDrafter:
    config = DFlashConfig.from_target(
        target.config.to_dict(), num_hidden_layers=2, block_size=B, mask_token_id=MASK_ID,
        target_layer_ids=LAYER_IDS,
    )  # fmt: skip
    torch.manual_seed(seed)
    return DFlashDrafter(config, TargetHead.from_model(target)).eval()


def save_word_tokenizer(folder: Path) -> None:
    """A real tokenizer for the stage: one word per id, with the chat and mask specials."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab["<|im_end|>"], vocab["<|MASK|>"] = END_OF_TURN, MASK_ID
    del vocab[f"w{END_OF_TURN}"], vocab[f"w{MASK_ID}"]
    core = Tokenizer(WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0").save_pretrained(folder)
