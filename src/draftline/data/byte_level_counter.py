"""Exact token counts of a byte-level BPE tokenizer without encoding whole texts: a text is cut
at the spaces where a pre-token always starts and each piece's count is cached, so curation
counts millions of prompts with few calls into the tokenizer. Used only for a tokenizer it
models exactly (`ByteLevelTokenCounter.verified`); a text it cannot count goes to the tokenizer.
"""

from __future__ import annotations

import json
import random
import re
from functools import lru_cache
from typing import Any

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
