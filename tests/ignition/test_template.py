"""Chat templates: helios' renderer equals transformers' apply_chat_template; ignition's probe results."""

from __future__ import annotations

from datetime import datetime

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from helios.core.chat_template import ChatTemplate, TemplateError
from helios.core.manifest import ReasoningSyntax, TemplateCaps
from ignition.errors import ExportError
from ignition.prepare.template import probe

# Qwen3's chat template (tools, <think> history handling, enable_thinking).
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Gemma 3's chat template: system folded into the first user turn, strict role alternation.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# A DeepSeek-R1-style template whose generation prompt opens reasoning.
R1_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<|User|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|Assistant|>{{ m.content.split('</think>')[-1] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)

CHATML_SPECIALS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — in °C.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def make_tokenizer(specials=(), tokens=(), words=("hello", "world")) -> Tokenizer:
    """A tiny word-level tokenizer: `specials` as special added tokens, `tokens` as plain added tokens."""
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tokens])
    return tok


def hf_tokenizer(template: str, specials: dict):
    from transformers import PreTrainedTokenizerFast

    tok = make_tokenizer(specials=sorted(set(specials.values())))
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **specials)


@pytest.fixture(scope="module")
def smollm2_template(smollm2_gguf):
    import gguf

    field = gguf.GGUFReader(str(smollm2_gguf)).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


SIMPLE = [{"role": "user", "content": "Hi there!"}]
WITH_SYSTEM = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Capital of France? Ünïcødé 日本"},
]
PREFILL = [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moon "}]
QWEN3_TOOL_CHAT = [
    {"role": "system", "content": "You help with weather."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The user wants weather; call the tool.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": '{"temp_c": 21}'},
    {"role": "tool", "content": '{"note": "sunny"}'},
]
QWEN3_HISTORY = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4", "tool_calls": None},
    {"role": "user", "content": "and 3+3?"},
]

CASES = [
    ("simple", SIMPLE, {}),
    ("system", WITH_SYSTEM, {}),
    ("tools", QWEN3_TOOL_CHAT, {"tools": TOOLS}),
    ("history", QWEN3_HISTORY, {}),
    ("no_thinking", QWEN3_HISTORY, {"enable_thinking": False}),
]


def _assert_same(template: str, specials: dict, messages, **kwargs):
    ours = ChatTemplate(template, special_tokens=specials).render(messages, **kwargs)
    theirs = hf_tokenizer(template, specials).apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours == theirs
    return ours


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name, messages, kwargs", CASES, ids=[c[0] for c in CASES])
def test_qwen3_matches_transformers(name, messages, kwargs, add_generation_prompt):
    _assert_same(QWEN3_TEMPLATE, CHATML_SPECIALS, messages, add_generation_prompt=add_generation_prompt, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [SIMPLE, WITH_SYSTEM, PREFILL], ids=["simple", "system", "prefill"])
def test_smollm2_matches_transformers(smollm2_template, messages, add_generation_prompt):
    out = _assert_same(smollm2_template, CHATML_SPECIALS, messages, add_generation_prompt=add_generation_prompt)
    assert out.startswith("<|im_start|>system\n") and out.endswith(
        "<|im_start|>assistant\n" if add_generation_prompt else "<|im_end|>\n"
    )


@pytest.mark.parametrize(
    "template, specials",
    [
        (QWEN3_TEMPLATE, CHATML_SPECIALS),
        (GEMMA3_TEMPLATE, {"bos_token": "<bos>", "eos_token": "<eos>"}),
        ("smollm2", CHATML_SPECIALS),
    ],
    ids=["qwen3", "gemma3", "smollm2"],
)
def test_continue_final_message_matches_transformers(request, template, specials):
    if template == "smollm2":
        template = request.getfixturevalue("smollm2_template")
    out = _assert_same(template, specials, PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert out.rstrip().endswith("Autumn moon")
    blocks = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Yes, "}]}]
    if template is GEMMA3_TEMPLATE:  # the only one of the three that reads content blocks
        _assert_same(template, specials, blocks, add_generation_prompt=False, continue_final_message=True)


def test_renderer_environment_features():
    tpl = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson(indent=2) }}{% endfor %}"
        "|{% generation %}{{ strftime_now('%Y-%m-%d') }}{% endgeneration %}|{{ bos_token }}",
        bos_token="<s>",
        now=lambda: datetime(2024, 7, 4),
    )
    out = tpl.render([{"role": "user", "content": "héllo <b>"}, {"role": "user", "content": "x"}])
    assert out == '{\n  "role": "user",\n  "content": "héllo <b>"\n}|2024-07-04|<s>'
    assert tpl.kwargs == []


def test_template_errors():
    with pytest.raises(TemplateError, match="syntax error"):
        ChatTemplate("{% if %}")
    with pytest.raises(TemplateError) as e:
        ChatTemplate(GEMMA3_TEMPLATE).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.raised and "alternate" in str(e.value)
    with pytest.raises(TemplateError) as e:
        ChatTemplate("{{ ''.__class__.__mro__ }}").render(SIMPLE)
    assert not e.value.raised
    with pytest.raises(TemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(SIMPLE)
    with pytest.raises(TemplateError, match="cannot be combined"):
        ChatTemplate(QWEN3_TEMPLATE).render(PREFILL, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(TemplateError, match="dropped the final message"):
        ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}{# content #}").render(
            PREFILL, add_generation_prompt=False, continue_final_message=True
        )


# --- probing ---------------------------------------------------------------------------------------------


def test_probe_qwen3():
    tok = make_tokenizer(specials=["<|im_start|>", "<|im_end|>"], tokens=["<think>", "</think>"])
    caps = probe(QWEN3_TEMPLATE, tok.to_str(), CHATML_SPECIALS)
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    assert caps == TemplateCaps(
        present=True,
        file="template.jinja",
        inline_system=True,
        system_role=True,
        default_system=False,
        tools=True,
        continuation=True,
        generation_prompt="<|im_start|>assistant\n",
        reasoning=ReasoningSyntax(open="<think>", close="</think>", open_token_id=think, close_token_id=end),
        kwargs=["enable_thinking"],
    )


def test_probe_smollm2(smollm2_template):
    tok = make_tokenizer(specials=["<|im_start|>", "<|im_end|>"])
    caps = probe(smollm2_template, tok.to_str(), CHATML_SPECIALS)
    assert caps == TemplateCaps(
        present=True,
        file="template.jinja",
        inline_system=True,
        system_role=True,
        default_system=True,
        tools=False,
        continuation=True,
        generation_prompt="<|im_start|>assistant\n",
        reasoning=None,
        kwargs=[],
    )


def test_probe_gemma3():
    tok = make_tokenizer(specials=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"])
    caps = probe(GEMMA3_TEMPLATE, tok.to_str(), {"bos_token": "<bos>", "eos_token": "<eos>"})
    assert caps.system_role and not caps.inline_system and not caps.default_system and not caps.tools
    assert caps.continuation and caps.generation_prompt == "<start_of_turn>model\n"
    assert caps.reasoning is None and caps.kwargs == []


def test_probe_reasoning_starts_open_and_multi_token_delimiters():
    # <think> is a single token here, </think> is not (it splits into pieces): only the open gets an id.
    tok = make_tokenizer(specials=["<s>"], tokens=["<think>"])
    caps = probe(R1_TEMPLATE, tok.to_str(), {"bos_token": "<s>"})
    assert caps.generation_prompt == "<|Assistant|><think>\n"
    assert caps.reasoning == ReasoningSyntax(
        open="<think>", close="</think>", open_token_id=tok.token_to_id("<think>"), starts_in_reasoning=True
    )
    assert not caps.system_role and not caps.inline_system and not caps.tools


def test_probe_gemma4_style_delimiters():
    src = (
        "{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>{% endfor %}"
        "{% if add_generation_prompt %}<|turn>model\n{% if enable_thinking %}<|channel>thought\n{% endif %}"
        "{% endif %}{# strips <channel|> #}{{ '' if reasoning_effort is undefined else '' }}"
    )
    tok = make_tokenizer(specials=["<|turn>", "<turn|>"], tokens=["<|channel>", "<channel|>"])
    caps = probe(src, tok.to_str(), {})
    assert caps.reasoning.open == "<|channel>thought" and caps.reasoning.open_token_id is None
    assert caps.reasoning.close == "<channel|>" and caps.reasoning.close_token_id == tok.token_to_id("<channel|>")
    assert not caps.reasoning.starts_in_reasoning
    assert caps.kwargs == ["enable_thinking", "reasoning_effort"]


def test_probe_hoisted_system_is_not_inline():
    # Collects every system message at the top: renders, but not in place.
    src = (
        "{% for m in messages if m.role == 'system' %}[SYS]{{ m.content }}{% endfor %}"
        "{% for m in messages if m.role != 'system' %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    )
    caps = probe(src, make_tokenizer().to_str(), {})
    assert caps.system_role and not caps.inline_system and not caps.default_system


def test_probe_absent_and_broken_templates():
    tok = make_tokenizer().to_str()
    assert probe(None, tok, {}) == TemplateCaps(present=False)
    assert probe("", tok, {}) == TemplateCaps(present=False)
    with pytest.raises(ExportError, match="syntax error"):
        probe("{% for %}", tok, {})
    with pytest.raises(ExportError, match="cannot render one user message"):
        probe("{{ raise_exception('no') }}", tok, {})
    with pytest.raises(ExportError, match="tokenizer.json"):
        probe(QWEN3_TEMPLATE, "{not json", CHATML_SPECIALS)


def test_template_kwargs():
    src = (
        "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
        "{%- for m in messages %}{%- set text = m.content %}{{ text }}{%- endfor %}"
        "{%- if tools_in_user_message %}{{ custom_tools }}{% endif %}{{ eos_token }}{{ pad_token }}"
    )
    tpl = ChatTemplate(src, eos_token="</s>")
    assert tpl.kwargs == ["custom_tools", "date_string", "tools_in_user_message"]
    assert "text" not in tpl.kwargs and "messages" in tpl.variables
    assert ChatTemplate(QWEN3_TEMPLATE).kwargs == ["enable_thinking"]
