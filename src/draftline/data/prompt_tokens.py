"""Exact prompt-token counts for curation's budget, fast.

Token counts are those of `draftline.core.target.prompt_ids` (the chat template with the
generation prompt, then the tokenizer). Two fast paths give the same numbers sooner, each used
only where it provably equals the slow one: `Qwen3PromptFormatter` renders Qwen3-style prompts
without jinja (for templates checked line by line), and `ByteLevelTokenCounter` counts byte-level
BPE tokens per pre-tokenized piece with a cache instead of encoding whole texts. Everything else
goes through the chat template and the tokenizer. A conversation the chat template refuses (it
raises on it, e.g. a `tool` turn the template has no branch for) becomes a `template_rejects`
rejection, not an error.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import re
from functools import lru_cache
from typing import Any

from draftline.data.conversations import Message, uses_tools
from draftline.data.input_files import Rejection


class PromptTokenCounter:
    """Token counts of prompts rendered with the target's chat template (+ generation prompt).

    Counts equal `len(draftline.core.target.prompt_ids(...))`. Prompts far over the budget are only
    partly tokenized: the rendered text is cut at a space between two letters (a pre-tokenizer
    boundary, so the prefix's tokens are a prefix of the full text's tokens); when that prefix
    alone is over budget, its count is a lower bound and the row is rejected without tokenizing
    the rest. Counts at or under the budget are always exact.

    `fast=False` turns both fast paths off (rendering with jinja, counting with `encode_batch`);
    with `fast=True` each is used only when `verified` accepts it for this tokenizer, and the
    formatter only for conversations without tool turns or calls.
    """

    def __init__(
        self,
        tokenizer: Any,
        template_kwargs: dict[str, Any] | None,
        max_tokens: int,
        prefix_chars_per_token: int = 8,
        fast: bool = True,
    ) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise SystemExit(
                "curate needs a fast (Rust) tokenizer for the target: the model folder must hold "
                "tokenizer.json"
            )
        self.tokenizer = tokenizer
        # The tokenizer pickled, in a copy sent to a worker that renders with the formatter.
        self._tokenizer_pickle: bytes | None = None
        self.template_kwargs = dict(template_kwargs or {})
        self.max_tokens = max_tokens
        backend = tokenizer.backend_tokenizer
        if backend.truncation is not None or backend.padding is not None:
            # transformers encodes prompts without truncation or padding; so must we.
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(backend.to_str())
            backend.no_truncation()
            backend.no_padding()
        self.backend = backend
        added = [t["content"] for t in json.loads(backend.to_str()).get("added_tokens") or []]
        # Cutting is safe only where no added token spans a space (it would be cut in two).
        cut_safe = not any(any(c.isspace() for c in token) for token in added)
        self.prefix_chars = max_tokens * prefix_chars_per_token if cut_safe else None
        self.formatter: Qwen3PromptFormatter | None = None
        self.fast_counter: ByteLevelTokenCounter | None = None
        if fast:
            self.formatter = Qwen3PromptFormatter.verified(
                tokenizer, self._apply_template, self.template_kwargs
            )
            if not getattr(tokenizer, "split_special_tokens", False):
                self.fast_counter = ByteLevelTokenCounter.verified(backend)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.formatter is not None:
            # Only jinja rendering needs the tokenizer (and transformers): a worker loads it on
            # the first conversation the formatter leaves to jinja, most never do.
            state["tokenizer"] = None
            state["_tokenizer_pickle"] = self._tokenizer_pickle or pickle.dumps(self.tokenizer)
        return state

    def _template_tokenizer(self) -> Any:
        if self.tokenizer is None:
            assert self._tokenizer_pickle is not None
            self.tokenizer = pickle.loads(self._tokenizer_pickle)
        return self.tokenizer

    def _apply_template(self, conversations: list[list[Message]]) -> list[str]:
        """Prompts rendered by the chat template; raises what the template raises."""
        if not conversations:
            return []
        texts = self._template_tokenizer().apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return list(texts)

    def _render_jinja(self, conversations: list[list[Message]]) -> list[str | Rejection]:
        try:
            return list(self._apply_template(conversations))
        except Exception:  # noqa: BLE001 - one conversation fails the batch; find which below
            return [self._render_one(c) for c in conversations]

    def _render_one(self, messages: list[Message]) -> str | Rejection:
        try:
            return self._apply_template([messages])[0]
        except Exception as err:  # noqa: BLE001 - what the template raises is its verdict
            return Rejection("template_rejects", str(err) or type(err).__name__)

    def render(self, conversations: list[list[Message]]) -> list[str | Rejection]:
        """Prompts as the chat template renders them (each conversation ends in a user or tool
        turn), or `template_rejects` for a conversation the template raises on."""
        formatter = self.formatter
        if formatter is None:
            return self._render_jinja(conversations)
        # The formatter knows system/user/assistant text only: tools go through the template.
        tools = [uses_tools(c) for c in conversations]
        texts: list[str | Rejection] = [
            "" if t else formatter.render(c) for c, t in zip(conversations, tools, strict=True)
        ]
        slow = [i for i, t in enumerate(tools) if t]
        for i, text in zip(slow, self._render_jinja([conversations[i] for i in slow]), strict=True):
            texts[i] = text
        return texts

    def count(self, conversations: list[list[Message]]) -> list[tuple[int, bool] | Rejection]:
        """(tokens, exact) per conversation, or the template's rejection; exact is False only
        for a lower bound over budget."""
        rendered = self.render(conversations)
        counts = iter(self._count_texts([t for t in rendered if isinstance(t, str)]))
        return [next(counts) if isinstance(t, str) else t for t in rendered]

    def _count_texts(self, texts: list[str]) -> list[tuple[int, bool]]:
        pieces = [_cut_at_word_boundary(t, self.prefix_chars) for t in texts]
        counts = self.lengths(pieces)
        result = [(n, True) for n in counts]
        recount = []
        for i, (text, piece, n) in enumerate(zip(texts, pieces, counts, strict=True)):
            if len(piece) < len(text):
                if n > self.max_tokens:
                    result[i] = (n, False)
                else:
                    recount.append(i)
        if recount:
            for i, n in zip(recount, self.lengths([texts[i] for i in recount]), strict=True):
                result[i] = (n, True)
        return result

    def lengths(self, texts: list[str]) -> list[int]:
        """Exact token counts of texts (no special tokens added)."""
        if self.fast_counter is None:
            return self._encode_lengths(texts)
        counts = [self.fast_counter.count(t) for t in texts]
        slow = [i for i, n in enumerate(counts) if n is None]
        if slow:
            for i, n in zip(slow, self._encode_lengths([texts[i] for i in slow]), strict=True):
                counts[i] = n
        return counts  # type: ignore[return-value]

    def _encode_lengths(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [len(e) for e in encode(texts, add_special_tokens=False)]


def _cut_at_word_boundary(text: str, limit: int | None) -> str:
    """`text` cut before a space that sits between two letters, at or before `limit` chars.

    Returns `text` itself when it is short enough, `limit` is None or no such space is near the
    limit.
    """
    if limit is None or len(text) <= limit:
        return text
    pos = limit
    floor = limit // 2
    while pos > floor:
        pos = text.rfind(" ", floor, pos)
        if pos <= 0:
            break
        if text[pos - 1].isalpha() and text[pos + 1].isalpha():
            return text[:pos]
    return text


# ---------------------------------------------------------------------------------------------
# Fast path 1: rendering prompts without jinja.

# sha256 of the chat templates `Qwen3PromptFormatter` has been checked against, line by line.
# The formatter is used for no other template: a probe can show a difference, never equality.
CHECKED_TEMPLATES = {
    # models/tiny-target (draftline.embedded.tiny_target.CHAT_TEMPLATE): for a conversation that
    # ends in a user turn, `last_query_index` is that turn, so every assistant turn takes the `else`
    # branch (answer only, think block dropped) and the generation prompt follows.
    "b90ba154c4716c24cb5e15aeb3c526407783d16b547ce22ecc0fa99c018ad026": "tiny-target",
}


class Qwen3PromptFormatter:
    """The Qwen3-style chat template for prompts, in plain Python (jinja is ~10x slower).

    Only for normalised conversations without tool turns or calls (optional system first, then
    user and assistant alternating, ending in a user turn) with the generation prompt added:
    there every assistant turn comes before the last user turn, so the template shows only its
    answer (the text after the last `</think>`, leading newlines dropped) and never a think
    block.
    """

    def __init__(self, enable_thinking: Any = None) -> None:
        self.generation = "<|im_start|>assistant\n"
        if enable_thinking is False:  # jinja: `enable_thinking is false`
            self.generation += "<think>\n\n</think>\n\n"

    def render(self, messages: list[Message]) -> str:
        parts = []
        for message in messages:
            role, content = message["role"], message["content"]
            if role == "assistant" and "</think>" in content:
                content = content.split("</think>")[-1].lstrip("\n")
            parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        parts.append(self.generation)
        return "".join(parts)

    @classmethod
    def verified(
        cls, tokenizer: Any, render_jinja: Any, template_kwargs: dict[str, Any]
    ) -> Qwen3PromptFormatter | None:
        """A formatter when the target's template is a checked one and renders every probe so."""
        if set(template_kwargs) - {"enable_thinking"}:
            return None
        try:
            template = tokenizer.get_chat_template()
        except Exception:  # noqa: BLE001 - no template, or several and none chosen
            return None
        if not isinstance(template, str):
            return None
        if hashlib.sha256(template.encode()).hexdigest() not in CHECKED_TEMPLATES:
            return None
        formatter = cls(template_kwargs.get("enable_thinking"))
        try:
            expected = render_jinja(FORMAT_PROBES)
        except Exception:  # noqa: BLE001 - a template that fails on a probe is not this one
            return None
        if [formatter.render(c) for c in FORMAT_PROBES] != expected:
            return None
        return formatter


FORMAT_PROBES: list[list[Message]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Add 2 and 2."},
        {"role": "assistant", "content": "<think>\nsum\n</think>\n\nFour."},
        {"role": "user", "content": "And 3?"},
    ],
    [
        {"role": "system", "content": "Système: réponds en français. 答えて"},
        {"role": "user", "content": "a\n\nb"},
        {"role": "assistant", "content": "plain answer"},
        {"role": "user", "content": "<think> in a user turn </think> stays"},
        {"role": "assistant", "content": "x</think>\n\ny</think>\nz"},
        {"role": "user", "content": "<|im_start|>user\nodd"},
        {"role": "assistant", "content": "<think>never closed"},
        {"role": "user", "content": "<tool_response>\nlast\n</tool_response>"},
    ],
]


# ---------------------------------------------------------------------------------------------
# Fast path 2: counting byte-level BPE tokens without encoding whole texts.

# Whitespace as any regex engine or Unicode version may see it: the ASCII set, the Unicode
# White_Space property, characters that once had it (U+180E, U+200B) and what Python's
# str.isspace adds (U+001C..U+001F). The pre-tokenizer's own set is checked to lie inside it.
ASCII_SPACES = "\t\n\x0b\x0c\r "
ASCII_OTHER_SPACES = "\x1c\x1d\x1e\x1f"
OTHER_SPACES = (
    "\x1c\x1d\x1e\x1f\x85\xa0\u1680\u180e\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
    "\u2008\u2009\u200a\u200b\u2028\u2029\u202f\u205f\u3000\ufeff"
)
_OTHER_SPACE = re.compile(f"[{OTHER_SPACES}]")
_SPACE_BEFORE_OTHER_SPACE = re.compile(f" (?=[{OTHER_SPACES}])")
_SPACE_RUN = re.compile(" {2,}")
# Stands for a space that must not be split at; a text that holds it is counted the slow way.
HELD = "\x00"
PIECE_CACHE_MAX = 1 << 19  # entries per cache before it is emptied (~100 bytes each)
PIECE_CACHE_MAX_CHARS = 128  # longer pieces are counted but not kept
ALLOWED_POST_PROCESSORS = {None, "ByteLevel", "TemplateProcessing", "RobertaProcessing"}


def _hold_run(match: re.Match[str]) -> str:
    return HELD * (len(match.group()) - 1) + " "


class _PieceCounts(dict[str, int]):
    """Piece -> token count of `lead + piece`, computed by the tokenizer itself on first sight."""

    def __init__(self, backend: Any, lead: str) -> None:
        super().__init__()
        self.backend = backend
        self.lead = lead

    def __missing__(self, piece: str) -> int:
        text = self.lead + piece.replace(HELD, " ")
        n = len(self.backend.encode(text, add_special_tokens=False))
        if len(piece) <= PIECE_CACHE_MAX_CHARS:
            if len(self) >= PIECE_CACHE_MAX:
                self.clear()
            self[piece] = n
        return n


class ByteLevelTokenCounter:
    """Exact token counts for a byte-level BPE tokenizer with the GPT-2 pre-tokenizer.

    The tokenizer splits a text at its added tokens (one token each) and pre-tokenizes each
    part on its own with `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|
    \\s+(?!\\S)|\\s+`; BPE then runs on each pre-token alone. In that pattern a pre-token
    holds a space only as its first character or inside a run of whitespace, and a run of
    whitespace followed by a non-space is one pre-token up to its last character (all of it at
    the end of the text). So a space followed by a character that is not whitespace always
    starts a pre-token, and the text before it pre-tokenizes alone exactly as it does in the
    whole: it ends in a non-space, or in whitespace that is one pre-token either way. Cutting a
    part at every such space and adding up the pieces' counts gives the exact count, whatever
    the pieces hold. Every other space (followed by whitespace, or last) is held: replaced by
    HELD so it is not cut at, and put back before the piece is counted. Each piece's count
    comes from a cache filled by the tokenizer itself.

    `verified` checks that the tokenizer is of this kind, that its whitespace lies within
    ASCII_SPACES + OTHER_SPACES, and that counts agree on probes. `count` returns None for a
    text it leaves to the slow path.
    """

    def __init__(self, backend: Any, added: list[str]) -> None:
        self.backend = backend
        self.added = added
        # Longest first: with `verified`'s no-overlap condition any order finds the same tokens.
        alternatives = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        self.special = re.compile(alternatives) if added else None
        self.first = _PieceCounts(backend, "")
        self.rest = _PieceCounts(backend, " ")

    def __getstate__(self) -> tuple[Any, list[str]]:
        return self.backend, self.added

    def __setstate__(self, state: tuple[Any, list[str]]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def count(self, text: str) -> int | None:
        if HELD in text:
            return None
        parts = self.special.split(text) if self.special is not None else [text]
        total = len(parts) - 1
        if text.isascii():
            other = any(c in text for c in ASCII_OTHER_SPACES)
        else:
            other = _OTHER_SPACE.search(text) is not None
        first, rest = self.first, self.rest
        for part in parts:
            if not part:
                continue
            if "  " in part:
                part = _SPACE_RUN.sub(_hold_run, part)
            for space in "\t\n\x0b\x0c\r":
                if space in part:
                    part = part.replace(" " + space, HELD + space)
            if other:
                part = _SPACE_BEFORE_OTHER_SPACE.sub(HELD, part)
            if part[-1] == " ":
                part = part[:-1] + HELD
            pieces = part.split(" ")
            total += first[pieces[0]]
            if len(pieces) > 1:
                total += sum(map(rest.__getitem__, pieces[1:]))
        return total

    @classmethod
    def verified(cls, backend: Any) -> ByteLevelTokenCounter | None:
        """A counter when the tokenizer is one it models exactly and agrees on every probe."""
        if not _models_byte_level(
            backend.to_str(), bool(getattr(backend, "encode_special_tokens", False))
        ):
            return None
        added = [t["content"] for t in json.loads(backend.to_str()).get("added_tokens") or []]
        if not _spaces_within(backend):
            return None
        counter = cls(backend, added)
        probes = _count_probes(added)
        expected = backend.encode_batch(probes, add_special_tokens=False)
        for text, encoding in zip(probes, expected, strict=True):
            if counter.count(text) != len(encoding):
                return None
        return counter


def _models_byte_level(spec_json: str, encode_special_tokens: bool) -> bool:
    """Whether a tokenizer (its JSON) is the kind `ByteLevelTokenCounter` counts exactly."""
    spec = json.loads(spec_json)
    pre = spec.get("pre_tokenizer") or {}
    model = spec.get("model") or {}
    post = (spec.get("post_processor") or {}).get("type")
    added = spec.get("added_tokens") or []
    tokens = [t.get("content") or "" for t in added]
    if (
        encode_special_tokens
        or spec.get("normalizer") is not None
        or spec.get("truncation") is not None
        or spec.get("padding") is not None
        or pre.get("type") != "ByteLevel"
        or not pre.get("use_regex", True)
        or pre.get("add_prefix_space")
        or model.get("type") != "BPE"
        or model.get("dropout")
        or post not in ALLOWED_POST_PROCESSORS
        or any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added)
        or not all(tokens)
        or any(HELD in t for t in tokens)
    ):
        return False
    # No added token inside another, and none whose end can begin one (itself included): then
    # every occurrence of every token is disjoint from the others, and any scan finds them all.
    for a in tokens:
        for b in tokens:
            if a != b and a in b:
                return False
            if any(a.endswith(b[:k]) for k in range(1, min(len(a), len(b)))):
                return False
    return True


@lru_cache(maxsize=8)
def _spaces_checked(pre_tokenizer_json: str) -> bool:
    from tokenizers import Tokenizer

    spec = {"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}
    spec["pre_tokenizer"] = json.loads(pre_tokenizer_json)
    pre = Tokenizer.from_str(json.dumps(spec)).pre_tokenizer
    known = set(ASCII_SPACES + OTHER_SPACES)
    chars = [chr(c) for c in range(0x10000) if not 0xD800 <= c < 0xE000 and chr(c) not in known]
    # In "x" c " " c "y" a pre-token holds a space past its first character only when c is
    # whitespace to the pre-tokenizer (then "c c" is one run); the "|" keeps the groups apart.
    for start in range(0, len(chars), 8192):
        group = chars[start : start + 8192]
        text = "|".join(f"x{c} {c}y" for c in group)
        for _, (begin, end) in pre.pre_tokenize_str(text):
            if " " in text[begin + 1 : end]:
                return False
    return True


def _spaces_within(backend: Any) -> bool:
    """Whether every character the pre-tokenizer takes for whitespace is one we hold for it."""
    pre = json.loads(backend.to_str()).get("pre_tokenizer")
    return _spaces_checked(json.dumps(pre, sort_keys=True))


def _count_probes(added: list[str]) -> list[str]:
    """Texts that exercise every pre-tokenizer rule, whitespace runs and added tokens."""
    probes = [
        "Hello world, it's 2024: don't  stop\n\n  now\t\tplease   ",
        "I'M HERE 'S 'T 're 've 'll 'd x'd 12345 a1b2 ...!!! (x) [y] {z}",
        "  leading and trailing  \n \n\r\n\x0b\x0c end \x1c\x1d\x1e\x1f\x85\xa0 x",
        "ünïcödé 中文字符 日本語のテキスト 한국어 emoji 🙂👍🏽 ½ ² ٣ Ⅻ",
        "a  b   c    d     e\n f \n g\n\n h \t i\t j  ",
        " ",
        "  ",
        "   x",
        "x   ",
        "\n",
        "".join(added) + " a" + " b ".join(added) + "\n",
        " ".join(added) + "  " + "  ".join(added) + " ",
    ]
    alphabet = [
        "a", "Z", "word", "7", "42", "'", "'s", "'ll", ".", ",", "!?", "-", "_", " ", " ", " ",
        "  ", "\n", "\n\n", "\t", "\r\n", "\x0b", "\x0c", "é", "中文", "🙂", "\xa0", "\u3000",
        "\x1c", "\u2009", *added,
    ]  # fmt: skip
    rng = random.Random(0)
    for _ in range(600):
        probes.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))))
    for space in ASCII_SPACES + OTHER_SPACES:
        probes.append(f"a{space} b {space}c {space} d{space}{space} e  {space}")
    return probes
