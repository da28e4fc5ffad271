"""A tiny twin of Qwen3.6-27B, built from nothing: the production target's shape in miniature.

The real target is a hybrid (Gated DeltaNet + gated attention) vision-language checkpoint
(`Qwen3_5ForConditionalGeneration`) whose chat template opens the think block in the prompt. Every
stage must handle that layout, so the twin reproduces it on disk exactly, at toy scale:

- `config.json`: `model_type: qwen3_5`, a `text_config` (`qwen3_5_text`) with
  `linear_attention` x3 then `full_attention` repeated, gated attention, `head_dim` != hidden /
  heads, partial rotary 0.25 with mrope sections, untied embeddings and more embedding rows than
  tokenizer entries, and a tiny `vision_config`;
- sharded bf16 safetensors with `model.safetensors.index.json`; keys `model.language_model.*`,
  `model.visual.*`, `mtp.*` (an untrained multi-token-prediction layer, as the real checkpoint
  ships one) and `lm_head.weight`;
- a byte-level BPE tokenizer whose special tokens come after the learned vocabulary in the real
  target's order (`<|endoftext|>` first, `<think>`/`</think>` later, then `<|audio_start|>`),
  with no `<|MASK|>` (the mask is an explicit id, as for the real target);
- a chat template that behaves like Qwen3.6's: thinking on by default with the generation prompt
  ending `<|im_start|>assistant\\n<think>\\n`, thinking off pre-filling
  `<think>\\n\\n</think>\\n\\n`, earlier turns' reasoning dropped unless `preserve_thinking`.

The language model is trained briefly on the project's own templated tasks (the same corpus as
`draftline.embedded.tiny_target`) so greedy decoding answers in thinking format. Facts of the
real model: `conf/model/qwen3_6_27b.yaml`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftline.embedded import chat_templates, sample_prompts, tiny_target, tiny_tokenizer
from draftline.embedded.sample_prompts import Message, Task
from draftline.embedded.tiny_tokenizer import END_THINK, IM_END, IM_START, PAD, THINK
from draftline.runtime import atomic

EOS = PAD  # <|endoftext|> ends text and pads, as in the real tokenizer
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
AUDIO_START, AUDIO_END = "<|audio_start|>", "<|audio_end|>"
# Appended after the BPE vocabulary in this order, as in the real tokenizer (248044 onwards).
ADDED_TOKENS = [
    EOS, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD,
    THINK, END_THINK, AUDIO_START, AUDIO_END,
]  # fmt: skip
# The DFlash mask: an existing special token that text never uses, as 248070 (`<|audio_start|>`)
# is for the real target, which has no `<|MASK|>`.
MASK_STAND_IN = AUDIO_START

# The chat template (draftline.embedded.chat_templates.QWEN3_6).
CHAT_TEMPLATE = chat_templates.QWEN3_6


@dataclass(frozen=True)
class BuildConfig(tiny_target.Optimizer):
    """Everything that decides the built files; recorded next to them as build_config.json."""

    seed: int = 0
    # One thread: the hybrid layers' torch fallback (batched triangular solves) slows down
    # badly with more threads on a busy 2-core machine, and the count fixes the float rounding.
    torch_threads: int = 1
    vocab_size: int = 1536  # BPE merges target; the embedding has extra rows (embedding_rows)
    embedding_rows: int = 1664  # > tokenizer entries, as the real 248320 > 248077
    num_conversations: int = 4000
    non_thinking_share: float = 0.2
    hidden_size: int = 64
    intermediate_size: int = 192
    # linear_attention x3 then full_attention, twice: layers 3 and 7 are full attention.
    num_hidden_layers: int = 8
    full_attention_interval: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # != hidden / heads (16), as 256 != 5120 / 24 for the real target
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (2, 1, 1)  # sums to rotary dims / 2 = 32 * 0.25 / 2
    rope_theta: float = 10_000_000.0
    max_position_embeddings: int = 1024
    vision_depth: int = 1
    vision_hidden_size: int = 32
    steps: int = 300
    batch_size: int = 16
    # Model files are split like the hub's: text weights in one shard, vision + MTP in another.
    num_shards: int = 2


# --- tokenizer ------------------------------------------------------------------------------


def build_tokenizer(corpus: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE trained on `corpus`, the special tokens appended after it."""
    return tiny_tokenizer.build_tokenizer(corpus, vocab_size, CHAT_TEMPLATE, after=ADDED_TOKENS)


# --- training data --------------------------------------------------------------------------


def encode_examples(
    tokenizer: Any,
    examples: Sequence[tuple[list[Message], Task]],
    non_thinking_share: float,
    seed: int,
) -> list[tiny_target.Example]:
    """Prompt ids exactly as generation renders them, then what the model writes after them.

    With thinking on the prompt already holds `<think>\\n`, so the reply starts with the
    reasoning; with thinking off the empty think block is in the prompt and the reply is the
    answer alone.
    """

    def reply(task: Task, thinking: bool) -> str:
        return f"{task.reasoning}\n{END_THINK}\n\n{task.answer}" if thinking else task.answer

    return tiny_target.encode_examples(tokenizer, examples, non_thinking_share, seed, reply)


# --- model ----------------------------------------------------------------------------------


def model_config(config: BuildConfig, tokenizer: Any) -> Any:
    from transformers import Qwen3_5Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ADDED_TOKENS}
    layer_types = [
        "full_attention" if (i + 1) % config.full_attention_interval == 0 else "linear_attention"
        for i in range(config.num_hidden_layers)
    ]
    text = {
        "vocab_size": config.embedding_rows,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "layer_types": layer_types,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
            "mrope_section": list(config.mrope_section),
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "eos_token_id": ids[EOS],
        "pad_token_id": None,
        "bos_token_id": None,
        "dtype": "bfloat16",
    }
    vision = {
        "depth": config.vision_depth,
        "hidden_size": config.vision_hidden_size,
        "intermediate_size": 2 * config.vision_hidden_size,
        "num_heads": 2,
        "out_hidden_size": config.hidden_size,
        "num_position_embeddings": 64,
    }
    return Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
        architectures=["Qwen3_5ForConditionalGeneration"],
        dtype="bfloat16",
    )


def build_model(config: BuildConfig, tokenizer: Any) -> Any:
    """`Qwen3_5ForConditionalGeneration` with seeded random weights (fp32 for training)."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(config.seed)
    return Qwen3_5ForConditionalGeneration(model_config(config, tokenizer)).float()


def mtp_weights(state: dict[str, Any], config: BuildConfig) -> dict[str, Any]:
    """An untrained multi-token-prediction layer under `mtp.*`, shaped like the real one (a
    full-attention decoder layer, the fc that fuses embedding and hidden state, three norms):
    loaders must ignore it."""
    import torch

    gen = torch.Generator().manual_seed(config.seed + 1)
    full = config.full_attention_interval - 1  # a full-attention layer to copy shapes from
    prefix = f"model.language_model.layers.{full}."
    h = config.hidden_size
    out = {
        "mtp.fc.weight": torch.randn(h, 2 * h, generator=gen) * 0.02,
        "mtp.norm.weight": torch.ones(h),
        "mtp.pre_fc_norm_embedding.weight": torch.ones(h),
        "mtp.pre_fc_norm_hidden.weight": torch.ones(h),
    }
    for key, value in state.items():
        if key.startswith(prefix):
            out["mtp.layers.0." + key[len(prefix) :]] = (
                torch.randn(value.shape, generator=gen) * 0.02 if value.ndim >= 2 else value
            )
    return out


def save_checkpoint(model: Any, folder: Path, config: BuildConfig) -> None:
    """bf16 safetensors shards + `model.safetensors.index.json`, as the hub checkpoint is laid
    out; written with the project's deterministic writer so a rebuild is byte-identical."""
    import torch

    state = {k: v.detach() for k, v in model.state_dict().items()}
    state.update(mtp_weights(state, config))
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(state.items())}
    text = {k: v for k, v in state.items() if not k.startswith(("model.visual.", "mtp."))}
    other = {k: v for k, v in state.items() if k not in text}
    shards = [text, other]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for name, tensors in zip(names, shards, strict=True):
        atomic.write_safetensors(folder / name, tensors, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(v.numel() * v.element_size() for v in state.values())
    atomic.write_json(
        folder / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
    )


def generation_config(tokenizer: Any) -> dict[str, Any]:
    """Stop at end of turn or end of text, as the real target's generation_config.json does.
    Greedy, unlike the real target (whose authors advise sampling in thinking mode): a
    sub-million-parameter model stays in format only at its most likely tokens."""
    im_end, eos = (tokenizer.convert_tokens_to_ids(t) for t in (IM_END, EOS))
    return {
        "bos_token_id": None,
        "do_sample": False,
        "eos_token_id": [im_end, eos],
        "pad_token_id": eos,
    }


# --- the whole build ------------------------------------------------------------------------


def build(
    out_dir: str | Path, config: BuildConfig = BuildConfig(), progress: bool = True
) -> dict[str, Any]:
    """Build tokenizer and model into `out_dir` (atomically); return figures for the report."""
    started = tiny_target.start_build(config.torch_threads)
    examples = sample_prompts.training_prompts(config.seed, config.num_conversations)
    tokenizer = build_tokenizer(tiny_tokenizer.corpus_texts(examples), config.vocab_size)
    encoded = encode_examples(tokenizer, examples, config.non_thinking_share, config.seed)
    model = build_model(config, tokenizer)
    losses = tiny_target.train(model, encoded, config, tokenizer.pad_token_id, progress)

    with atomic.atomic_path(out_dir) as tmp:
        tmp.mkdir()
        tokenizer.save_pretrained(tmp)
        model.config.save_pretrained(tmp)
        atomic.write_json(tmp / "generation_config.json", generation_config(tokenizer))
        tiny_target.drop_library_version(tmp)
        save_checkpoint(model, tmp, config)
        atomic.write_json(tmp / "build_config.json", asdict(config))
    return tiny_target.build_report(model, tokenizer, encoded, losses, started)
