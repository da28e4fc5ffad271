"""The embedded default target: a tiny Qwen3 model and its tokenizer, built from nothing.

`build` generates a corpus from the project's own task templates
(`draftline.embedded.sample_prompts`), trains a byte-level BPE tokenizer on it (so any unicode
input tokenizes), then trains a small `Qwen3ForCausalLM` to answer those tasks in Qwen3 thinking
format. Everything is seeded and runs with a fixed torch thread count, so a rebuild on the same
software gives byte-identical files. `thinking_format_rate` measures, by greedy generation, how
many prompts get a well-formed `<think>...</think> answer<|im_end|>` reply.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from draftline.embedded import chat_templates, sample_prompts, tiny_tokenizer
from draftline.embedded.sample_prompts import Message, Task
from draftline.embedded.tiny_tokenizer import END_THINK, IM_END, IM_START, PAD, THINK
from draftline.runtime import atomic

MASK = "<|MASK|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, THINK, END_THINK, MASK]  # ids 0..5, in this order

# The chat template (draftline.embedded.chat_templates.QWEN3).
CHAT_TEMPLATE = chat_templates.QWEN3


@dataclass(frozen=True)
class Optimizer:
    """AdamW with warmup and cosine decay, as both embedded targets train."""

    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01


@dataclass(frozen=True)
class BuildConfig(Optimizer):
    """Everything that decides the built files; recorded next to them as build_config.json
    (sorted keys, so the field order of the classes does not matter)."""

    seed: int = 0
    torch_threads: int = 2
    vocab_size: int = 1536
    num_conversations: int = 6000
    non_thinking_share: float = 0.2
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    steps: int = 450
    batch_size: int = 24


# --- tokenizer ------------------------------------------------------------------------------


def build_tokenizer(corpus: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE trained on `corpus`, its special tokens first (ids 0..5)."""
    return tiny_tokenizer.build_tokenizer(
        corpus,
        vocab_size,
        CHAT_TEMPLATE,
        first=SPECIAL_TOKENS,
        extra_special_tokens={"im_start_token": IM_START, "mask_token": MASK},
    )


# --- training data --------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    num_prompt: int  # loss on input_ids[num_prompt:], the response


def qwen3_reply(task: Task, thinking: bool) -> str:
    return task.thinking_response() if thinking else task.answer


def encode_examples(
    tokenizer: Any,
    examples: Sequence[tuple[list[Message], Task]],
    non_thinking_share: float,
    seed: int,
    reply: Callable[[Task, bool], str] | None = None,
) -> list[Example]:
    """Prompt ids exactly as generation renders them, then the response ids and <|im_end|>.

    `reply(task, thinking)` is the text the model writes after the prompt; by default, Qwen3's
    (the whole think block with thinking on, the answer alone with it off).
    """
    from draftline.core.target import prompt_ids

    if reply is None:
        reply = qwen3_reply

    rng = random.Random(seed)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    out = []
    for messages, task in examples:
        thinking = rng.random() >= non_thinking_share
        prompt = prompt_ids(tokenizer, messages, {"enable_thinking": thinking})
        response = tokenizer(reply(task, thinking), add_special_tokens=False)["input_ids"] + [
            im_end
        ]
        out.append(Example(prompt + response, len(prompt)))
    return out


def _batches(
    examples: list[Example], batch_size: int, steps: int, seed: int
) -> list[list[Example]]:
    """`steps` batches of similar-length examples (little padding), in a seeded order."""
    rng = random.Random(seed)
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].input_ids), i))
    chunks = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    batches: list[list[Example]] = []
    while len(batches) < steps:
        rng.shuffle(chunks)
        batches += [[examples[i] for i in chunk] for chunk in chunks]
    return batches[:steps]


def _collate(batch: list[Example], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, e in enumerate(batch):
        n = len(e.input_ids)
        ids[row, :n] = torch.tensor(e.input_ids)
        labels[row, e.num_prompt : n] = ids[row, e.num_prompt : n]
        mask[row, :n] = 1
    return ids, mask, labels


# --- model ----------------------------------------------------------------------------------


def build_model(config: BuildConfig, tokenizer: Any) -> Any:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    qcfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )
    torch.manual_seed(config.seed)
    model = Qwen3ForCausalLM(qcfg)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, do_sample=False
    )
    return model


def train(
    model: Any, examples: list[Example], config: BuildConfig, pad_id: int, progress: bool
) -> list[float]:
    """AdamW with warmup and cosine decay; returns the loss of every step."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        t = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    losses: list[float] = []
    model.train()
    bar = tqdm(
        _batches(examples, config.batch_size, config.steps, config.seed),
        desc="train",
        disable=not progress,
    )
    for batch in bar:
        ids, mask, labels = _collate(batch, pad_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


# --- thinking-format rate -------------------------------------------------------------------


def reply_is_thinking_format(
    completion: list[int], tokenizer: Any, think_open: bool = False
) -> bool:
    """`<think>` non-empty `</think>` non-empty answer `<|im_end|>`, nothing after the end.

    think_open: the prompt already holds `<think>` (Qwen3.6's template), so the reply starts
    with the reasoning.
    """
    think, end_think, im_end = (
        tokenizer.convert_tokens_to_ids(t) for t in (THINK, END_THINK, IM_END)
    )
    if not think_open:
        if not completion or completion[0] != think:
            return False
        completion = completion[1:]
    if im_end not in completion:
        return False
    body = completion[: completion.index(im_end)]
    if end_think not in body or think in body:
        return False
    split = body.index(end_think)
    reasoning, answer = body[:split], body[split + 1 :]
    return bool(tokenizer.decode(reasoning).strip()) and bool(tokenizer.decode(answer).strip())


def greedy_completions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    batch_size: int = 64,
) -> list[list[int]]:
    """Greedy continuations, each cut after the tokenizer's end-of-turn (eos) token."""
    from draftline.core.continuation import greedy_continuations

    return greedy_continuations(
        model, prompts, max_new_tokens, tokenizer.eos_token_id, batch_size, tokenizer.pad_token_id
    )


def thinking_format_rate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[list[Message]],
    max_new_tokens: int,
    enable_thinking: bool = True,
) -> float:
    """Share of `prompts` answered in thinking format by greedy decoding."""
    from draftline.core.loss_mask import prompt_opens_think, special_ids
    from draftline.core.target import prompt_ids

    ids = [prompt_ids(tokenizer, p, {"enable_thinking": enable_thinking}) for p in prompts]
    completions = greedy_completions(model, tokenizer, ids, max_new_tokens)
    tags = special_ids(tokenizer, IM_END)
    good = sum(
        reply_is_thinking_format(c, tokenizer, prompt_opens_think(p, tags))
        for p, c in zip(ids, completions, strict=True)
    )
    return good / max(1, len(prompts))


# --- the whole build ------------------------------------------------------------------------


def drop_library_version(folder: Path) -> None:
    """Remove `transformers_version` from the saved configs: the fixture's bytes should depend
    on what was built, not on the transformers release that happened to write them."""
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            data = json.loads(path.read_text(encoding="utf-8"))
            data.pop("transformers_version", None)
            atomic.write_json(path, data)


def start_build(torch_threads: int) -> tuple[float, float]:
    """Fix the thread count and deterministic kernels (both decide the float rounding); return
    the wall and CPU clocks the report measures from."""
    import torch

    torch.set_num_threads(torch_threads)
    torch.use_deterministic_algorithms(True)
    return time.perf_counter(), time.process_time()


def build_report(
    model: Any,
    tokenizer: Any,
    encoded: list[Example],
    losses: list[float],
    started: tuple[float, float],
) -> dict[str, Any]:
    """What a build prints: size, loss, response lengths, time."""
    response_lengths = [len(e.input_ids) - e.num_prompt for e in encoded]
    return {
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "first_loss": losses[0],
        "response_tokens_min": min(response_lengths),
        "response_tokens_max": max(response_lengths),
        "wall_s": time.perf_counter() - started[0],
        "cpu_s": time.process_time() - started[1],
    }


def build(
    out_dir: str | Path, config: BuildConfig = BuildConfig(), progress: bool = True
) -> dict[str, Any]:
    """Build tokenizer and model into `out_dir` (atomically); return figures for the report."""
    started = start_build(config.torch_threads)
    examples = sample_prompts.training_prompts(config.seed, config.num_conversations)
    tokenizer = build_tokenizer(tiny_tokenizer.corpus_texts(examples), config.vocab_size)
    encoded = encode_examples(tokenizer, examples, config.non_thinking_share, config.seed)
    model = build_model(config, tokenizer)
    losses = train(model, encoded, config, tokenizer.pad_token_id, progress)

    with atomic.atomic_path(out_dir) as tmp:
        tmp.mkdir()
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        drop_library_version(tmp)
        atomic.write_json(tmp / "build_config.json", asdict(config))
    return build_report(model, tokenizer, encoded, losses, started)


def load_tokenizer_uncached(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
