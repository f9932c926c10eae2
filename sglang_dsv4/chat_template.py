"""The tiny checkpoint's chat template: DeepSeek-V4's chat (non-thinking) format, tools included.

A conversation renders as

    <｜begin▁of▁sentence｜>{system}[TOOLS]<｜User｜>{user}<｜Assistant｜></think>{reply}[CALLS]
    <｜end▁of▁sentence｜>
    <｜User｜><tool_result>{output}</tool_result>\\n\\n<tool_result>{output}</tool_result><｜Assistant｜></think>...

* system messages come first, joined by a blank line; ``TOOLS`` (when the request defines tools) follows
  them: a ``## Tools`` section saying how to call them and one JSON schema line per tool
  (``{"name", "description", "parameters"}``);
* a run of user messages and tool results shares one ``<｜User｜>`` turn, separated by blank lines, each
  result in ``<tool_result>`` tags;
* ``CALLS``, an assistant message's tool calls, is one DSML block after a blank line::

      <｜DSML｜tool_calls>
      <｜DSML｜invoke name="bash">
      <｜DSML｜parameter name="command" string="true">ls</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

  a string argument is written as is (``string="true"``), any other value as JSON (``string="false"``);
  the arguments must be a JSON object already parsed (SGLang's chat serving parses them before rendering);
* the generation prompt is ``<｜Assistant｜></think>``: the reply starts without reasoning.

The layout (markers, DSML block, tool-result turns, schema lines) is V4's as its own encoder renders it;
the prose of the tools section is this project's. ``｜DSML｜``, ``<think>`` and ``</think>`` are special
tokens of the tiny tokenizer, as in V4's.
"""

from __future__ import annotations

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML]

TOOLS_PREAMBLE = (
    "\n\n## Tools\n\n"
    'Call a tool by writing a "<｜DSML｜tool_calls>" block:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'Write string parameters as they are with string="true", and every other value as JSON with string="false".\n\n'
    "### Available Tool Schemas\n\n"
)
TOOLS_CLOSING = "\n\nCall only the tools above, with the parameters their schemas define.\n"

_TOOLS = (
    "{%- macro render_tools() -%}"
    "{{ tools_preamble }}"
    "{%- for tool in tools -%}"
    "{%- set function = tool['function'] if tool.get('function') else tool -%}"
    "{{ {'name': function['name'], 'description': function.get('description') or '',"
    " 'parameters': function.get('parameters') or {}} | tojson }}"
    "{%- if not loop.last -%}{{ nl }}{%- endif -%}"
    "{%- endfor -%}"
    "{{ tools_closing }}"
    "{%- endmacro -%}"
)

_CALLS = (
    "{{ nl + nl }}<｜DSML｜tool_calls>"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set function = call['function'] -%}"
    "{%- if function['arguments'] is string -%}"
    "{{ raise_exception('tool call arguments must be a JSON object, not a string: parse them before rendering') }}"
    "{%- endif -%}"
    "{{ nl }}<｜DSML｜invoke name=\"{{ function['name'] }}\">"
    "{%- for name, value in function['arguments'].items() -%}"
    "{{ nl }}<｜DSML｜parameter name=\"{{ name }}\" string=\"{{ 'true' if value is string else 'false' }}\">"
    "{{ value if value is string else value | tojson }}</｜DSML｜parameter>"
    "{%- endfor -%}"
    "{{ nl }}</｜DSML｜invoke>"
    "{%- endfor -%}"
    "{{ nl }}</｜DSML｜tool_calls>"
)

CHAT_TEMPLATE = (
    "{%- set nl = '\n' -%}"
    "{%- set tools_preamble = " + repr(TOOLS_PREAMBLE).replace("\\n", "\n") + " -%}"
    "{%- set tools_closing = " + repr(TOOLS_CLOSING).replace("\\n", "\n") + " -%}"
    + _TOOLS
    + "{{ bos_token }}"
    "{%- set ns = namespace(previous='',"
    " tools_pending=tools is defined and tools is not none and tools | length > 0) -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- set content = message['content'] if message['content'] is string else"
    " (message['content'] or []) | map(attribute='text') | join('') -%}"
    "{%- if role != 'system' and ns.tools_pending -%}{{ render_tools() }}{%- set ns.tools_pending = false -%}"
    "{%- endif -%}"
    "{%- if role == 'system' -%}{%- if ns.previous == 'system' -%}{{ nl + nl }}{%- endif -%}{{ content }}"
    "{%- elif role == 'user' or role == 'tool' -%}"
    "{%- if ns.previous in ('user', 'tool') -%}{{ nl + nl }}{%- else -%}<｜User｜>{%- endif -%}"
    "{%- if role == 'tool' -%}<tool_result>{{ content }}</tool_result>{%- else -%}{{ content }}{%- endif -%}"
    "{%- elif role == 'assistant' -%}<｜Assistant｜></think>{{ content }}"
    "{%- if message.get('tool_calls') -%}" + _CALLS + "{%- endif -%}{{ eos_token }}"
    "{%- else -%}{{ raise_exception('unknown message role: ' + role) }}"
    "{%- endif -%}"
    "{%- set ns.previous = role -%}"
    "{%- endfor -%}"
    "{%- if ns.tools_pending -%}{{ render_tools() }}{%- endif -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜></think>{%- endif -%}"
)
