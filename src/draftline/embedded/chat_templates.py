"""Chat templates of the embedded targets: Qwen3's and Qwen3.5/3.6's, reduced to what the
project uses, built from the parts they share (the Jinja text of each is what a tokenizer
stores, so both must stay byte-identical to the committed fixtures' `tokenizer_config.json`).

Both find the last user turn, render system and user turns alike and split an assistant turn's
reasoning from its answer. They differ in which history turns keep their reasoning, in tool
turns (Qwen3.6 only), and in the generation prompt: Qwen3 opens no think block (the model
writes `<think>`), Qwen3.6 opens it in the prompt.
"""

from __future__ import annotations

_LAST_USER_TURN = """\
{%- set ns = namespace(last_query_index=messages|length - 1, found=false) -%}
{%- for message in messages[::-1] -%}
{%- set index = messages|length - 1 - loop.index0 -%}
{%- if not ns.found and message.role == 'user' -%}
{%- set ns.last_query_index = index -%}
{%- set ns.found = true -%}
{%- endif -%}
{%- endfor -%}
"""

_TURNS_HEAD = """\
{%- for message in messages -%}
{%- if message.role == 'system' or message.role == 'user' -%}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set content = message.content -%}
{%- set reasoning = '' -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\\n')
    .split('<think>')[-1].lstrip('\\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
"""

_ASSISTANT_TURN = """\
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n')
    + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + content -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
"""

_TOOL_TURNS = """\
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
{{- '<|im_start|>user' -}}
{%- endif -%}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
"""


def _unknown_role(roles: str) -> str:
    return f"""\
{{%- else -%}}
{{{{- raise_exception('unknown role ' + message.role + ': use {roles}') -}}}}
{{%- endif -%}}
{{%- endfor -%}}
"""


_GENERATION_PROMPT = """\
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
"""

# Qwen3: history assistant turns lose their think block, turns after the last user turn keep
# it; enable_thinking=false pre-fills an empty think block after the generation prompt.
QWEN3 = (
    _LAST_USER_TURN
    + _TURNS_HEAD
    + "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) -%}\n"
    + _ASSISTANT_TURN
    + _unknown_role("system, user or assistant")
    + _GENERATION_PROMPT
    + "{%- endif -%}\n{%- endif -%}\n"
)

# Qwen3.5/3.6: history assistant turns lose their reasoning unless preserve_thinking or after
# the last user query; tool turns are wrapped in a user turn; the generation prompt opens the
# think block (or pre-fills an empty one).
QWEN3_6 = (
    _LAST_USER_TURN
    + _TURNS_HEAD
    + "{%- if (preserve_thinking is defined and preserve_thinking) or\n"
    + "    loop.index0 > ns.last_query_index -%}\n"
    + _ASSISTANT_TURN
    + _TOOL_TURNS
    + _unknown_role("system, user, assistant or tool")
    + _GENERATION_PROMPT
    + "{%- else -%}\n{{- '<think>\\n' -}}\n{%- endif -%}\n{%- endif -%}\n"
)
