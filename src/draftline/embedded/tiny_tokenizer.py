"""The byte-level BPE tokenizer of both embedded targets, trained on the project's own tasks.

Both targets learn the same merges from the same kind of corpus (so any unicode input
tokenizes) and differ only in where their reserved tokens sit: the tiny Qwen3 target puts them
first (ids 0..5), the Qwen3.6 twin after the learned vocabulary, as the real tokenizer does.
Training is deterministic, so a rebuild writes byte-identical tokenizer files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from draftline.embedded.sample_prompts import Message, Task

# The markers both targets share, as Qwen's tokenizers spell them.
PAD = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
# As in Qwen's tokenizers, <think> and </think> are added but not "special": decoding with
# skip_special_tokens keeps them.
NOT_SPECIAL = frozenset({THINK, END_THINK})


def corpus_texts(examples: Sequence[tuple[list[Message], Task]]) -> list[str]:
    """What the tokenizer learns from: every message and every reasoning + answer."""
    # Role headers as the chat template writes them, so "user\n" etc. become single tokens.
    texts = [f"{m['role']}\n{m['content']}" for messages, _ in examples for m in messages]
    texts += [task.reasoning + "\n" + task.answer for _, task in examples]
    return texts


def build_tokenizer(
    corpus: Sequence[str],
    vocab_size: int,
    chat_template: str,
    *,
    first: Sequence[str] = (),
    after: Sequence[str] = (),
    extra_special_tokens: dict[str, str] | None = None,
) -> Any:
    """Byte-level BPE trained on `corpus` to `vocab_size` entries in all, as a
    PreTrainedTokenizerFast with `chat_template`: `first` reserved before the learned vocabulary
    (ids 0, 1, ...), `after` appended behind it. Every reserved token is special except the
    think markers; <|im_end|> ends a turn and <|endoftext|> pads."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(after),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in first],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    if NOT_SPECIAL & set(first):
        # The trainer marks every reserved token special; clear the flag on the think markers.
        data = json.loads(tok.to_str())
        for added in data["added_tokens"]:
            added["special"] = added["content"] not in NOT_SPECIAL
        tok = Tokenizer.from_str(json.dumps(data))
    if after:
        tok.add_tokens(
            [AddedToken(t, special=t not in NOT_SPECIAL, normalized=False) for t in after]
        )
    extra = {"extra_special_tokens": extra_special_tokens} if extra_special_tokens else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=chat_template,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
        **extra,
    )
