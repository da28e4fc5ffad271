"""Conversations: a raw row normalised to chat messages, and messages to and from the table.

Rows are ShareGPT (`conversations`: from/value), OpenAI-style (`messages`: role/content, with
assistant `tool_calls` and `tool` turns) or prompt rows (`prompt`, optional `system`); reading
the files they are stored in is `draftline.data.input_files`. A row that cannot be used becomes a
`Rejection` with a reason from `REASONS`; nothing here raises on bad data.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson
import pyarrow as pa

from draftline.data.input_files import Rejection

# Rejection reasons, in the order the checks run (docs/pipeline.md).
REASONS = (
    "malformed_json",
    "unknown_format",
    "unknown_role",
    "empty_turn",
    "broken_alternation",
    "no_user_turn",
    "duplicate",
    "template_rejects",
    "prompt_too_long",
)

USER_ROLES = frozenset({"user", "human"})
ASSISTANT_ROLES = frozenset(
    {"assistant", "gpt", "chatgpt", "bard", "model", "bing", "claude", "ai", "bot"}
)
SYSTEM_ROLES = frozenset({"system"})
# Tool results: `function`/`observation` (ShareGPT-style data), `ipython` (Llama 3.1).
TOOL_ROLES = frozenset({"tool", "function", "observation", "ipython"})
# A ShareGPT turn whose value is the assistant's tool call(s) as JSON.
CALL_ROLE = "function_call"

# {"role", "content"}, plus "tool_calls" (a non-empty list) only on an assistant that calls tools:
# a message without calls has exactly those two keys, so its canonical JSON (and id) is as it was.
Message = dict[str, Any]


def normalise(value: Any) -> list[Message] | Rejection:
    """The row's prompt as messages, or why it cannot be one.

    Roles become system/user/assistant/tool; content is stripped of surrounding whitespace; an
    empty system prompt is dropped; assistant tool calls are kept (`_tool_calls`); the
    conversation is cut after its last user or tool turn (the target regenerates what follows).
    The kept prefix must be: optional system, then a user turn, then turns in an order a chat
    can take (`_order_error`), with no empty turn but an assistant turn that only calls tools.
    """
    if not isinstance(value, dict):
        return Rejection("unknown_format", f"row is a JSON {_json_type(value)}, not an object")
    # A null key counts as absent: a Parquet file of mixed rows has every column in every row.
    if value.get("conversations") is not None:
        turns, role_key, content_key = value["conversations"], "from", "value"
    elif value.get("messages") is not None:
        turns, role_key, content_key = value["messages"], "role", "content"
    elif value.get("prompt") is not None:
        turns = [{"role": "user", "content": value["prompt"]}]
        role_key, content_key = "role", "content"
    else:
        keys = ", ".join(sorted(map(str, value.keys()))[:8]) or "none"
        return Rejection(
            "unknown_format", f"no 'conversations', 'messages' or 'prompt' value (keys: {keys})"
        )
    if not isinstance(turns, list):
        return Rejection("unknown_format", f"turns are a JSON {_json_type(turns)}, not an array")

    messages: list[Message] = []
    system = value.get("system")
    if system is not None:
        if not isinstance(system, str):
            return Rejection("unknown_format", f"'system' is a JSON {_json_type(system)}")
        if system.strip():
            messages.append({"role": "system", "content": system.strip()})
    for index, turn in enumerate(turns):
        message = _message(index, turn, role_key, content_key)
        if isinstance(message, Rejection):
            return message
        if message["role"] == "system" and not message["content"] and not messages:
            continue  # an empty system prompt says nothing
        messages.append(message)

    if all(m["role"] != "user" for m in messages):
        return Rejection("no_user_turn", f"{len(messages)} turns, none from the user")
    last = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool"))
    messages = messages[: last + 1]
    for index, message in enumerate(messages):
        if not message["content"] and "tool_calls" not in message:
            return Rejection("empty_turn", f"turn {index} ({message['role']}) is empty")
    error = _order_error(messages)
    if error is not None:
        return Rejection("broken_alternation", error)
    return messages


def _message(index: int, turn: Any, role_key: str, content_key: str) -> Message | Rejection:
    """One turn as a message (tool calls included), or why it cannot be one."""
    if not isinstance(turn, dict):
        return Rejection("unknown_format", f"turn {index} is a JSON {_json_type(turn)}")
    # Accept either key pair in either format: datasets mix them.
    role_raw = turn.get(role_key, turn.get("role", turn.get("from")))
    content_raw = turn.get(content_key, turn.get("content", turn.get("value")))
    role = _role(role_raw)
    if role is None:
        return Rejection("unknown_role", f"turn {index}: role {role_raw!r}")
    if role == CALL_ROLE:
        calls = _tool_calls(_parsed(content_raw))
        if isinstance(calls, str):
            return Rejection("unknown_format", f"turn {index} ({CALL_ROLE}): {calls}")
        return {"role": "assistant", "content": "", "tool_calls": calls}
    content = _content(content_raw)
    if content is None:
        return Rejection(
            "unknown_format", f"turn {index}: content is a JSON {_json_type(content_raw)}"
        )
    message: Message = {"role": role, "content": content}
    # Null or [] is no call: a Parquet file of mixed turns has the key on every turn.
    if turn.get("tool_calls"):
        if role != "assistant":
            return Rejection("unknown_format", f"turn {index}: tool_calls on a {role} turn")
        calls = _tool_calls(turn["tool_calls"])
        if isinstance(calls, str):
            return Rejection("unknown_format", f"turn {index}: {calls}")
        message["tool_calls"] = calls
    return message


def _parsed(value: Any) -> Any:
    """A JSON text parsed (ShareGPT stores calls as text), anything else as it is."""
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _tool_calls(value: Any) -> list[dict[str, Any]] | str:
    """Tool calls in the OpenAI form, or what is wrong with them.

    Takes a list of calls or one call, each `{"type": "function", "function": {name, arguments},
    "id"?}` or flat `{name, arguments}` (ShareGPT-style); gives `{"type": "function",
    "function": {"name", "arguments"}}` plus `id` when the call had one.
    """
    calls = value if isinstance(value, list) else [value]
    if not calls:
        return "no tool call"
    result = []
    for number, raw in enumerate(calls):
        call = _tool_call(raw)
        if isinstance(call, str):
            return f"tool call {number}: {call}"
        result.append(call)
    return result


def _tool_call(raw: Any) -> dict[str, Any] | str:
    if not isinstance(raw, dict):
        return f"a JSON {_json_type(raw)}, not an object"
    if raw.get("type") not in (None, "function"):
        return f"type {raw['type']!r}, not 'function'"
    function = raw["function"] if raw.get("function") is not None else raw
    if not isinstance(function, dict):
        return f"function is a JSON {_json_type(function)}"
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"name {name!r}"
    arguments = _arguments(function.get("arguments"))
    if arguments is None:
        return f"arguments are a JSON {_json_type(function.get('arguments'))}"
    call: dict[str, Any] = {
        "type": "function",
        "function": {"name": name.strip(), "arguments": arguments},
    }
    if isinstance(raw.get("id"), str) and raw["id"]:
        call["id"] = raw["id"]
    return call


def _arguments(value: Any) -> Any:
    """Call arguments: an object (a JSON text of one is parsed, so templates that `tojson` them
    render them once), other text as it is, absent as {}; None when they are neither."""
    if value is None:
        return {}
    if isinstance(value, str):
        parsed = _parsed(value)
        return parsed if isinstance(parsed, dict) else value
    if not isinstance(value, dict):
        return None
    try:
        # Through JSON and back: memory then holds exactly what the Parquet column reads back.
        return orjson.loads(orjson.dumps(value))
    except orjson.JSONEncodeError:
        return None


def _order_error(messages: list[Message]) -> str | None:
    """Why the turns are in an order no chat takes, or None: after an optional system prompt,
    user first; the assistant answers a user or a tool; tools answer a call (or run after
    another tool); the user speaks after the assistant."""
    start = 1 if messages[0]["role"] == "system" else 0
    previous: Message | None = None
    for index in range(start, len(messages)):
        role = messages[index]["role"]
        expected = _next_roles(previous)
        if role not in expected:
            roles = ",".join(m["role"] for m in messages)
            return f"turn {index} is {role}, expected {' or '.join(expected)} (roles: {roles})"
        previous = messages[index]
    return None


def _next_roles(previous: Message | None) -> tuple[str, ...]:
    if previous is None:
        return ("user",)
    if previous["role"] == "user":
        return ("assistant",)
    if previous["role"] == "tool":
        return ("assistant", "tool")
    return ("user", "tool") if "tool_calls" in previous else ("user",)


def _role(value: Any) -> str | None:
    """system/user/assistant/tool, CALL_ROLE for a ShareGPT call turn, None when unknown."""
    if not isinstance(value, str):
        return None
    role = value.strip().lower()
    if role in USER_ROLES:
        return "user"
    if role in ASSISTANT_ROLES:
        return "assistant"
    if role in SYSTEM_ROLES:
        return "system"
    if role in TOOL_ROLES:
        return "tool"
    if role == CALL_ROLE:
        return CALL_ROLE
    return None


def _content(value: Any) -> str | None:
    """Text of a message: a string, or OpenAI-style text parts joined; None when not text."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in value
    ):
        return "".join(p["text"] for p in value).strip()
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__
    )


def canonical_json(value: Any) -> bytes:
    """The canonical JSON the id hashes (of messages) and the table stores (of tool calls):
    sorted keys, no whitespace, UTF-8."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def uses_tools(messages: list[Message]) -> bool:
    """Whether a conversation has tool turns or calls (not every chat template renders them)."""
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def messages_to_records(messages: list[Message]) -> list[dict[str, str | None]]:
    """Messages as the curated table stores them: `tool_calls` as canonical JSON text, or null."""
    return [
        {
            "role": m["role"],
            "content": m["content"],
            "tool_calls": canonical_json(m["tool_calls"]).decode() if "tool_calls" in m else None,
        }
        for m in messages
    ]


def messages_from_records(records: Iterable[dict[str, Any]]) -> list[Message]:
    """Messages read back from the curated table's `messages` column (a row's list of structs),
    in the form they had when normalised: `tool_calls` parsed, and absent where null."""
    messages: list[Message] = []
    for record in records:
        message: Message = {"role": record["role"], "content": record["content"]}
        if record.get("tool_calls") is not None:
            message["tool_calls"] = orjson.loads(record["tool_calls"])
        messages.append(message)
    return messages


def written_turns(table: pa.Table) -> int:
    """Assistant turns the target writes over `table`'s conversations when it regenerates them
    all (`core.turn_prompts.regenerated_turns`): every assistant message without tool calls,
    and the final answer each conversation ends in."""
    import pyarrow.compute as pc

    flat = pc.list_flatten(table.column("messages"))
    earlier = pc.and_(
        pc.equal(pc.struct_field(flat, "role"), "assistant"),
        pc.is_null(pc.struct_field(flat, "tool_calls")),
    )
    return int(pc.sum(earlier).as_py() or 0) + len(table)
