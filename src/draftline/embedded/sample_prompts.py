"""The bundled prompt set (`data/sample/conversations.jsonl`) and the task templates behind it.

Every conversation is generated from project-written templates by a seeded generator, so
`draftline build-sample` rewrites the file byte for byte. Each user turn is one task (explain a
topic, reverse words, repeat a sentence, ...) whose reasoning and answer are deterministic
functions of that turn's text; the tiny target is trained on the same tasks
(`draftline.embedded.tiny_target`), which makes its output learnable for a drafter.

The file also holds deliberately bad rows, one group per curate reject reason
(docs/pipeline.md), so every rejection path runs on the default data.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from draftline.embedded.task_words import (
    ACTIVITIES,
    ANIMALS,
    ASK_TOPIC,
    COLOR,
    COLORS,
    COUNT,
    FOLLOW_UPS,
    GOALS,
    GREETING,
    NAMES,
    NUMBER_WORDS,
    OPPOSITE,
    OPPOSITES,
    PLACES,
    PLAN,
    REPEAT,
    REVERSE,
    SPECIAL_SENTENCES,
    STORY,
    SYSTEM_PROMPTS,
    TIMES,
    TOPICS,
    WORDS,
)

Message = dict[str, str]

SAMPLE_SEED = 20260
NUM_VALID = 330
FILE_NAME = "conversations.jsonl"


@dataclass(frozen=True)
class Task:
    """One user request with the response the tiny target is trained to give."""

    kind: str
    user: str
    reasoning: str
    answer: str

    def thinking_response(self) -> str:
        """Assistant text in Qwen3 thinking format (without the end-of-turn token)."""
        return f"<think>\n{self.reasoning}\n</think>\n\n{self.answer}"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


# --- task makers: each returns one Task from the random generator ---------------------------


def _ask_topic(rng: random.Random) -> Task:
    topic = rng.choice(sorted(TOPICS))
    category, purpose = TOPICS[topic]
    user = rng.choice(ASK_TOPIC).format(topic=topic)
    reasoning = (
        f"The user asks about {topic}. {_capital(topic)} is a {category}. "
        f"The main idea is that it helps to {purpose}."
    )
    answer = (
        f"{_capital(topic)} is a {category}. We use it to {purpose}, "
        f"so the short version is: {topic} helps to {purpose}."
    )
    return Task("ask_topic", user, reasoning, answer)


def _reverse_words(rng: random.Random) -> Task:
    words = rng.sample(WORDS, rng.randint(3, 5))
    back = list(reversed(words))
    user = rng.choice(REVERSE).format(words=" ".join(words))
    reasoning = (
        f"There are {NUMBER_WORDS[len(words) - 2]} words: {', '.join(words)}. "
        f"Reading them from the last to the first gives {', '.join(back)}."
    )
    answer = f"Here they are in reverse order: {' '.join(back)}."
    return Task("reverse_words", user, reasoning, answer)


def _sentence(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return rng.choice(SPECIAL_SENTENCES)
    name, act, place = rng.choice(NAMES), rng.choice(ACTIVITIES), rng.choice(PLACES)
    return f"{name} likes to {act} in the {place} {rng.choice(TIMES)}."


def _repeat_sentence(rng: random.Random) -> Task:
    sentence = _sentence(rng)
    user = rng.choice(REPEAT).format(sentence=sentence)
    reasoning = (
        f"The user wants the sentence repeated exactly. The sentence is: {sentence} "
        "I will copy it without changes."
    )
    answer = f"Sure. Here is the sentence: {sentence}"
    return Task("repeat_sentence", user, reasoning, answer)


def _opposite_word(rng: random.Random) -> Task:
    word = rng.choice(sorted(OPPOSITES))
    opposite = OPPOSITES[word]
    user = rng.choice(OPPOSITE).format(word=word)
    reasoning = (
        f"The word is {word}. A word with the opposite meaning is {opposite}. "
        f"For example, if something is not {word}, it may be {opposite}."
    )
    answer = f"The opposite of {word} is {opposite}."
    return Task("opposite_word", user, reasoning, answer)


def _fruit_color(rng: random.Random) -> Task:
    fruit = rng.choice(sorted(COLORS))
    color = COLORS[fruit]
    user = rng.choice(COLOR).format(fruit=fruit)
    reasoning = (
        f"The question is about a {fruit}. A ripe {fruit} is usually {color}. "
        "I will answer with the color and one short sentence."
    )
    answer = f"A ripe {fruit} is {color}. Most people know a {fruit} by its {color} color."
    return Task("fruit_color", user, reasoning, answer)


def _count_items(rng: random.Random) -> Task:
    items = rng.sample(WORDS, rng.randint(2, 6))
    count = NUMBER_WORDS[len(items) - 2]
    user = rng.choice(COUNT).format(items=", ".join(items))
    steps = ", ".join(f"{w} is {i + 1}" for i, w in enumerate(items))
    reasoning = f"I count the items one by one: {steps}. So there are {count} items."
    answer = f"The list has {count} items: {', '.join(items)}."
    return Task("count_items", user, reasoning, answer)


def _greeting(rng: random.Random) -> Task:
    name = rng.choice(NAMES)
    user = rng.choice(GREETING).format(name=name)
    reasoning = (
        f"The user says hello and tells me the name {name}. "
        f"I should greet {name} back and offer help."
    )
    answer = f"Hello, {name}! It is nice to meet you. How can I help you today, {name}?"
    return Task("greeting", user, reasoning, answer)


def _make_plan(rng: random.Random) -> Task:
    goal = rng.choice(GOALS)
    user = rng.choice(PLAN).format(goal=goal)
    reasoning = (
        f"The goal is to {goal}. A good plan has three steps: start small, "
        "practice on a schedule, and check progress each week."
    )
    answer = (
        f"Here is a plan to {goal}. Step 1: start small. Step 2: practice a little every day. "
        f"Step 3: check your progress each week and adjust."
    )
    return Task("make_plan", user, reasoning, answer)


def _short_story(rng: random.Random) -> Task:
    animal, place = rng.choice(ANIMALS), rng.choice(PLACES)
    user = rng.choice(STORY).format(animal=animal, place=place)
    reasoning = (
        f"The story needs a {animal} and the {place}. "
        f"I will write three sentences: the {animal} arrives, finds something, and goes home happy."
    )
    answer = (
        f"One day a little {animal} came to the {place}. "
        f"In the {place} the {animal} found a shiny key. "
        f"The {animal} took the key home and smiled all evening."
    )
    return Task("short_story", user, reasoning, answer)


TASK_MAKERS: list[Callable[[random.Random], Task]] = [
    _ask_topic, _reverse_words, _repeat_sentence, _opposite_word, _fruit_color,
    _count_items, _greeting, _make_plan, _short_story,
]  # fmt: skip


def make_task(rng: random.Random) -> Task:
    return rng.choice(TASK_MAKERS)(rng)


def make_prompt(rng: random.Random, p_system: float = 0.25) -> tuple[list[Message], Task]:
    """A prompt (optional system, alternating turns, ending in a user turn) and its last task.

    Earlier assistant turns carry the earlier tasks' answers; some also carry their think
    block, which the chat template strips from the history as Qwen3's does.
    """
    messages: list[Message] = []
    if rng.random() < p_system:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    num_turns = rng.choices([1, 2, 3], weights=[65, 25, 10])[0]
    task = make_task(rng)
    for turn in range(num_turns):
        if turn > 0:
            reply = task.thinking_response() if rng.random() < 0.2 else task.answer
            messages.append({"role": "assistant", "content": reply})
            task = make_task(rng)
            messages.append({"role": "user", "content": rng.choice(FOLLOW_UPS) + task.user})
        else:
            messages.append({"role": "user", "content": task.user})
    return messages, task


# --- the bundled file -----------------------------------------------------------------------

_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


def _sharegpt(row_id: str, messages: list[Message]) -> dict:
    turns = [{"from": _FROM[m["role"]], "value": m["content"]} for m in messages]
    return {"id": row_id, "conversations": turns}


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _canonical(messages: list[Message]) -> str:
    return json.dumps(messages, ensure_ascii=False, sort_keys=True)


@dataclass(frozen=True)
class SampleRow:
    """One line of the bundled file; `prompt` is what curate keeps (None when rejected)."""

    line: str
    prompt: list[Message] | None
    expected_reason: str | None


def _bad_rows(rng: random.Random, valid: list[SampleRow]) -> list[SampleRow]:
    """One small group of rows per curate reject reason (docs/pipeline.md)."""
    rows: list[SampleRow] = []

    def bad(reason: str, line: str) -> None:
        rows.append(SampleRow(line, None, reason))

    def turns(n_user: int) -> list[dict]:
        """`n_user` exchanges of well-formed human/gpt turns."""
        conv = []
        for _ in range(n_user):
            task = make_task(rng)
            conv += [{"from": "human", "value": task.user}, {"from": "gpt", "value": task.answer}]
        return conv

    # malformed_json: cut-off lines, Python-style quotes, trailing commas, plain text.
    bad("malformed_json", valid[3].line[: len(valid[3].line) // 2])
    bad("malformed_json", valid[17].line[:-2])
    bad("malformed_json", "{'id': 'bad-quotes', 'conversations': [{'from': 'human'}]}")
    bad("malformed_json", '{"id": "bad-comma", "conversations": [],}')
    bad("malformed_json", "this line is not JSON at all")
    bad("malformed_json", '{"id": "bad-string", "conversations": [{"from": "human", "value": "hi')
    # unknown_format: JSON objects that are neither ShareGPT, messages nor prompt rows.
    bad("unknown_format", _line({"id": "bad-format-1", "text": "Tell me about the moon."}))
    bad("unknown_format", _line({"id": "bad-format-2", "dialogue": ["hello", "hi"]}))
    # unknown_role
    for i, role in enumerate(["robot", "narrator", "wizard", "alien", "oracle"]):
        conv = turns(1)
        conv.insert(0, {"from": role, "value": "I am not a known role."})
        bad("unknown_role", _line({"id": f"bad-role-{i}", "conversations": conv}))
    # empty_turn: empty or blank user / assistant values.
    for i, (pos, value) in enumerate([(0, ""), (0, "   "), (1, ""), (2, "\n\t"), (1, " ")]):
        conv = turns(2)
        conv[pos] = {**conv[pos], "value": value}
        bad("empty_turn", _line({"id": f"bad-empty-{i}", "conversations": conv}))
    # broken_alternation: two user turns (or two assistant turns) in a row.
    for i in range(5):
        conv = turns(2)
        j = 1 if i % 2 == 0 else 2
        dup_from = "human" if j == 1 else "gpt"
        conv.insert(j, {"from": dup_from, "value": conv[j - 1]["value"] + " Also, one more thing."})
        bad("broken_alternation", _line({"id": f"bad-alternation-{i}", "conversations": conv}))
    # no_user_turn
    reply = make_task(rng).answer
    bad(
        "no_user_turn",
        _line({"id": "bad-nouser-0", "conversations": [{"from": "gpt", "value": reply}]}),
    )
    sys_only = [{"from": "system", "value": SYSTEM_PROMPTS[0]}, {"from": "gpt", "value": reply}]
    bad("no_user_turn", _line({"id": "bad-nouser-1", "conversations": sys_only}))
    # prompt_too_long: far over data.max_prompt_tokens (256) with the tiny tokenizer.
    for i in range(2):
        long_text = " ".join(_sentence(rng) for _ in range(60))
        conv = [{"from": "human", "value": "Please repeat this sentence exactly: " + long_text}]
        bad("prompt_too_long", _line({"id": f"bad-long-{i}", "conversations": conv}))
    # duplicate: exact copies of earlier valid lines.
    for k in (5, 40, 77, 120, 200, 260):
        bad("duplicate", valid[k].line)
    return rows


def build_rows(seed: int = SAMPLE_SEED, num_valid: int = NUM_VALID) -> list[SampleRow]:
    """All rows of the bundled file, in file order (bad rows spread among the valid ones)."""
    rng = random.Random(seed)
    valid: list[SampleRow] = []
    seen: set[str] = set()
    while len(valid) < num_valid:
        messages, task = make_prompt(rng)
        key = _canonical(messages)
        if key in seen:
            continue  # keep accidental duplicates out: only the deliberate ones are rejected
        seen.add(key)
        stored = list(messages)
        if rng.random() < 0.07:
            # Ends with the assistant's reply: valid, curate trims it back to the last user turn.
            reply = task.thinking_response() if rng.random() < 0.5 else task.answer
            stored.append({"role": "assistant", "content": reply})
        row_id = f"sample-{len(valid):04d}"
        valid.append(SampleRow(_line(_sharegpt(row_id, stored)), messages, None))
    bad = _bad_rows(rng, valid)
    rows = list(valid)
    for row in bad:
        rows.insert(rng.randrange(len(rows) + 1), row)
    return rows


def valid_prompts(rows: list[SampleRow] | None = None) -> list[list[Message]]:
    """Prompts of the bundled rows that curate keeps (each ends in a user turn)."""
    return [row.prompt for row in (rows if rows is not None else build_rows()) if row.prompt]


def training_prompts(seed: int, count: int) -> list[tuple[list[Message], Task]]:
    """Prompts from the same distribution as the bundled ones, for training the tiny target."""
    rng = random.Random(seed)
    return [make_prompt(rng) for _ in range(count)]
