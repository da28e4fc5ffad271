"""The prompt of each assistant turn, built from token ids, against the chat template's own
rendering, on the embedded targets' real tokenizers and templates (Qwen3 and the Qwen3.6 twin)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from draftline.core.loss_mask import loss_mask, special_ids
from draftline.core.target import render_prompt
from draftline.core.turn_prompts import TurnPromptError, regenerated_turns, turn_prompt

ROOT = Path(__file__).resolve().parents[2]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "How many items are in this list: lemon, yogurt?"},
    {"role": "assistant", "content": "(the dataset's answer)"},
    {"role": "user", "content": "Please repeat this sentence exactly: Umar likes birds."},
    {"role": "assistant", "content": "(another)"},
    {"role": "user", "content": "Say the opposite of hot."},
]


def tokenizer(name: str):
    return AutoTokenizer.from_pretrained(ROOT / "models" / name)


def completion(tok, reasoning: str, answer: str, opened: bool) -> list[int]:
    """Engine-style completion ids: the think block (opened by the prompt or not), the answer
    and the end-of-turn token, as the tokenizer splits them."""
    text = ("" if opened else "<think>\n") + f"{reasoning}\n</think>\n\n{answer}<|im_end|>"
    return tok(text, add_special_tokens=False)["input_ids"]


def rendered(tok, messages, answers, kwargs) -> str:
    """The template's text with each answer's text as the assistant turn's content."""
    history = [dict(m) for m in messages]
    for i, ids in answers.items():
        history[i] = {"role": "assistant", "content": tok.decode(ids[:-1])}
    return render_prompt(tok, history, kwargs)


@pytest.mark.parametrize(
    ("model", "kwargs"),
    [
        ("tiny-target", {"enable_thinking": True}),
        ("tiny-target", {"enable_thinking": False}),
        ("tiny-qwen36", {"enable_thinking": True}),
        ("tiny-qwen36", {"enable_thinking": True, "preserve_thinking": True}),
    ],
)
def test_the_prompt_from_ids_equals_the_templates_rendering(model, kwargs):
    tok = tokenizer(model)
    special = special_ids(tok, "<|im_end|>")
    opened = model == "tiny-qwen36"
    answers = {
        2: completion(tok, "Two items are listed.", "The list has two items.", opened),
        4: completion(tok, "Repeat it.", "Umar likes birds.", opened),
    }
    prompt = turn_prompt(tok, CONVERSATION, answers, kwargs, special)
    text = rendered(tok, CONVERSATION, answers, kwargs)
    assert prompt.ids == tok(text, add_special_tokens=False)["input_ids"]
    # Each span is the answer as the template shows it, its end-of-turn token included.
    kept = [tok.decode(prompt.ids[s:e]) for s, e in prompt.spans]
    if kwargs.get("preserve_thinking"):
        assert kept == [tok.decode(answers[2]), tok.decode(answers[4])]
    else:  # history turns lose their reasoning
        assert kept == ["The list has two items.<|im_end|>", "Umar likes birds.<|im_end|>"]
    mask = loss_mask(len(prompt.ids), [], prompt.spans)
    assert sum(mask) == sum(e - s for s, e in prompt.spans) and mask[-1] == 0


def test_the_engines_ids_are_kept_even_when_not_the_tokenizers_own_split():
    """A sampled answer may split a word as the tokenizer never would: the prompt keeps the
    engine's ids (decoding to the same text), never re-tokenizing the answer."""
    tok = tokenizer("tiny-target")
    special = special_ids(tok, "<|im_end|>")
    vocab = tok.get_vocab()
    word = next(
        w
        for w in sorted(vocab)
        if w.isalpha() and len(w) >= 5 and w[:2] in vocab and w[2:] in vocab
    )
    odd_split = [vocab[word[:2]], vocab[word[2:]]]
    answer = completion(tok, "Think.", "Yes", opened=False)
    answer = answer[:-1] + odd_split + answer[-1:]  # "Yes<word as two pieces><|im_end|>"
    messages = CONVERSATION[:4]
    prompt = turn_prompt(tok, messages, {2: answer}, {"enable_thinking": True}, special)
    ((start, end),) = prompt.spans
    assert prompt.ids[end - 3 : end - 1] == odd_split
    text = rendered(tok, messages, {2: answer}, {"enable_thinking": True})
    assert tok.decode(prompt.ids) == text
    assert prompt.ids != tok(text, add_special_tokens=False)["input_ids"]


def test_tool_turns_and_tool_calls_are_rendered_by_the_template_and_kept():
    """A tool-calling assistant turn is kept (the tool result answers that call); the answer
    after the tool result is the target's."""
    tok = tokenizer("tiny-qwen36")
    special = special_ids(tok, "<|im_end|>")
    messages = [
        {"role": "user", "content": "What is 6 times 7?"},
        {
            "role": "assistant",
            "content": "I will use the calculator.",
            "tool_calls": [{"type": "function", "function": {"name": "mul", "arguments": {}}}],
        },
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "(the dataset's answer)"},
        {"role": "user", "content": "Thanks."},
    ]
    assert regenerated_turns(messages) == [3, 5]
    assert regenerated_turns(messages, "last") == [5]
    answers = {3: completion(tok, "The tool said 42.", "It is 42.", opened=True)}
    kwargs = {"enable_thinking": True}
    prompt = turn_prompt(tok, messages, answers, kwargs, special)
    text = rendered(tok, messages, answers, kwargs)
    assert prompt.ids == tok(text, add_special_tokens=False)["input_ids"]
    assert "<tool_response>\n42\n</tool_response>" in text and "calculator" in text
    assert [tok.decode(prompt.ids[s:e]) for s, e in prompt.spans] == ["It is 42.<|im_end|>"]


def test_a_template_that_rewrites_the_answer_is_an_error_not_a_silent_retokenization():
    tok = tokenizer("tiny-target")
    special = special_ids(tok, "<|im_end|>")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{{ m.content | upper if m.role == 'assistant' else m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    answer = completion(tok, "Think.", "lower case answer", opened=False)
    with pytest.raises(TurnPromptError, match="rewrote assistant turn 2"):
        turn_prompt(tok, CONVERSATION[:4], {2: answer}, {}, special)


def test_regenerated_turns_rejects_an_unknown_choice():
    with pytest.raises(ValueError, match="regenerate_turns"):
        regenerated_turns(CONVERSATION, "some")
    assert regenerated_turns(CONVERSATION) == [2, 4, 6]
