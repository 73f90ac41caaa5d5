"""Responses custom tools (text, Lark and regex grammars) and namespaces, with the official openai SDK.

Declarations are refused by a real `helios serve` (the default core) before anything else is checked. What
the model is shown and how calls come back run in-process around a scripted fake engine whose core declares
the hermes tool parser: the "model" writes fixed <tool_call> envelopes through the byte-level test
tokenizer, and the template prints each presented tool as JSON so the prompt can be read back.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from helios.core.manifest import Limits, Recipe, TemplateCaps
from helios.engine.messages import EngineOutput
from helios.server.app import HeliosApp
from helios.server.config import ServerConfig
from helios.server.runtime import Runtime
from tests.frontend.conftest import byte_level_tok, make_manifest, tokenizer  # noqa: F401 (fixtures)
from tests.server.test_app_fake import FakeEngine

TEMPLATE = ("{% for t in tools or [] %}tool: {{ t | tojson }}\n{% endfor %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
            # NOTE: object arguments reach templates as objects (as HF templates read them): tojson, as they do
            "{% for c in m.tool_calls or [] %} [call {{ c.function.name }} "
            "{% if c.function.arguments is string %}{{ c.function.arguments }}{% else %}"
            "{{ c.function.arguments | tojson }}{% endif %}]{% endfor %}"
            "{{ '\\n' }}"
            "{% endfor %}assistant:")
PHONE = {"type": "grammar", "syntax": "regex", "definition": r"\d{3}-\d{4}"}
LOOKUP = {"type": "custom", "name": "lookup", "description": "Look up a phone number", "format": PHONE}
SQL = {"type": "grammar", "syntax": "lark",
       "definition": 'start: "SELECT " NAME " FROM " NAME\nNAME: /[a-z_]+/'}
CRM = {"type": "namespace", "name": "crm", "description": "Customer records",
       "tools": [{"type": "function", "name": "get_customer", "description": "One customer by id",
                  "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}},
                 {"type": "custom", "name": "query", "format": SQL},
                 {"type": "custom", "name": "note"}]}
TOOLS = [LOOKUP, CRM]


def envelope(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def serve(tokenizer):
    """serve(text) -> (AsyncOpenAI, engine): the model answers `text`, then EOS; engine.prompts records prompts."""
    eos = tokenizer.info.eos_token_ids[0]
    opened = []

    def build(text: str):
        recipe = Recipe(name="test", tool_parser="hermes")
        template = TemplateCaps(present=True, file="t.jinja", tools=True)
        manifest = make_manifest(tokenizer=tokenizer.info, recipe=recipe, template=template,
                                 limits=Limits(context_length=8192, default_max_tokens=16))
        ids = tokenizer.encode(text, add_special_tokens=False)

        def script(req):
            engine.prompts.append(tokenizer.decode(req.prompt_token_ids))
            outs = [EngineOutput(req_id=req.req_id, new_token_ids=ids[i:i + 3],
                                 num_prompt_tokens=len(req.prompt_token_ids)) for i in range(0, len(ids), 3)]
            return outs + [EngineOutput(req_id=req.req_id, new_token_ids=[eos], finished=True, finish_reason="stop",
                                        stop_token=eos)]

        engine = FakeEngine(script)
        engine.prompts = []
        runtime = Runtime(manifest, tokenizer, TEMPLATE, engine, ServerConfig())
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=HeliosApp(runtime, warm=False)),
                                 base_url="http://t")
        opened.append(runtime)
        return openai.AsyncOpenAI(base_url="http://t/v1", api_key="unused", max_retries=0, http_client=http), engine

    yield build
    for runtime in opened:
        runtime.pool.shutdown(wait=False)


def run(coro):
    import asyncio

    return asyncio.run(coro)


def presented(prompt: str) -> dict[str, dict]:
    """The tools the template was given, by presented name."""
    tools = [json.loads(line[6:]) for line in prompt.splitlines() if line.startswith("tool: ")]
    return {t["function"]["name"]: t["function"] for t in tools}


# --- what the model is shown ---------------------------------------------------------------------------


def test_custom_tools_and_namespaces_are_presented_as_functions(serve):
    async def main():
        c, engine = serve("Nothing to call.")
        async with c:
            r = await c.responses.create(model="tiny", input="hi", tools=TOOLS, max_output_tokens=32)
        assert r.status == "completed"
        shown = presented(engine.prompts[0])
        assert sorted(shown) == ["crm__get_customer", "crm__note", "crm__query", "lookup"]
        input_only = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                      "additionalProperties": False}
        for name in ("lookup", "crm__query", "crm__note"):
            assert shown[name]["parameters"] == input_only
        # the grammar's contract is part of the description the model reads
        assert shown["lookup"]["description"].startswith("Look up a phone number\n\n")
        assert "regular expression" in shown["lookup"]["description"]
        assert r"\d{3}-\d{4}" in shown["lookup"]["description"]
        assert "Lark grammar" in shown["crm__query"]["description"] and SQL["definition"] in \
            shown["crm__query"]["description"]
        assert "free-form text" in shown["crm__note"]["description"]
        # a namespace member keeps its own schema; the namespace's description leads its description
        assert shown["crm__get_customer"]["parameters"] == CRM["tools"][0]["parameters"]
        assert shown["crm__get_customer"]["description"] == "Customer records\n\nOne customer by id"

    run(main())


def test_named_custom_choice_presents_only_that_tool(serve):
    async def main():
        c, engine = serve(envelope("crm__query", {"input": "SELECT name FROM users"}))
        async with c:
            r = await c.responses.create(model="tiny", input="who?", tools=TOOLS,
                                         tool_choice={"type": "custom", "name": "crm__query"})
        assert list(presented(engine.prompts[0])) == ["crm__query"]
        [call] = r.output
        assert call.type == "custom_tool_call" and call.name == "query" and call.namespace == "crm"
        assert call.input == "SELECT name FROM users"

    run(main())


def test_custom_and_namespaced_history_is_replayed_as_presented(serve):
    async def main():
        c, engine = serve("Done.")
        history = [
            {"role": "user", "content": "call them"},
            {"type": "custom_tool_call", "call_id": "call_1", "name": "lookup", "input": "555-1234"},
            {"type": "function_call", "call_id": "call_2", "name": "get_customer", "namespace": "crm",
             "arguments": '{"id": 7}'},
            {"type": "custom_tool_call", "call_id": "call_3", "name": "note", "namespace": "crm",
             "input": "line 1\n\"quoted\""},
            {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Ada"},
            {"type": "function_call_output", "call_id": "call_2", "output": "{\"name\": \"Ada\"}"},
            {"type": "custom_tool_call_output", "call_id": "call_3", "output": "noted"},
        ]
        async with c:
            r = await c.responses.create(model="tiny", input=history, tools=TOOLS)
        assert r.status == "completed" and r.output_text == "Done."
        prompt = engine.prompts[0]
        assert '[call lookup {"input": "555-1234"}]' in prompt
        assert '[call crm__get_customer {"id": 7}]' in prompt
        assert '[call crm__note {"input": "line 1\\n\\"quoted\\""}]' in prompt
        assert "tool: Ada\ntool: {\"name\": \"Ada\"}\ntool: noted\n" in prompt

    run(main())


# --- calls restored on output --------------------------------------------------------------------------


def test_custom_call_restored_buffered(serve):
    from openai.types.responses import ResponseCustomToolCall, ResponseFunctionToolCall

    async def main():
        text = ("Checking.\n" + envelope("lookup", {"input": "555-1234"})
                + envelope("crm__get_customer", {"id": 7}) + envelope("crm__note", {"input": "call back"}))
        c, _ = serve(text)
        async with c:
            r = await c.responses.create(model="tiny", input="number?", tools=TOOLS)
        assert r.status == "completed"
        message, lookup, customer, note = r.output
        assert message.type == "message" and r.output_text == "Checking.\n"
        assert isinstance(lookup, ResponseCustomToolCall) and lookup.type == "custom_tool_call"
        assert lookup.name == "lookup" and lookup.input == "555-1234" and lookup.namespace is None
        assert lookup.id.startswith("ctc_") and lookup.call_id.startswith("call_")
        assert lookup.model_extra["status"] == "completed"
        assert isinstance(customer, ResponseFunctionToolCall) and customer.name == "get_customer"
        assert customer.namespace == "crm" and json.loads(customer.arguments) == {"id": 7}
        assert customer.id.startswith("fc_") and customer.status == "completed"
        assert note.type == "custom_tool_call" and note.name == "note" and note.namespace == "crm"
        assert note.input == "call back"
        assert len({lookup.id, customer.id, note.id, lookup.call_id, customer.call_id, note.call_id}) == 6

    run(main())


def test_custom_call_restored_streamed(serve):
    async def main():
        c, _ = serve(envelope("lookup", {"input": "555-1234"}))
        async with c:
            events = [e async for e in await c.responses.create(model="tiny", input="number?", tools=TOOLS,
                                                                 stream=True)]
        types = [e.type for e in events]
        assert types == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.custom_tool_call_input.delta", "response.custom_tool_call_input.done",
                         "response.output_item.done", "response.completed"]
        added, delta, done, item_done, completed = events[2:]
        assert added.item.type == "custom_tool_call" and added.item.input == "" and added.item.name == "lookup"
        assert delta.delta == "555-1234" and done.input == "555-1234"
        assert delta.item_id == done.item_id == added.item.id == item_done.item.id
        assert item_done.item.input == "555-1234"
        assert completed.response.output[0].input == "555-1234"
        assert [e.sequence_number for e in events] == list(range(len(events)))

    run(main())


@pytest.mark.parametrize("name, arguments, words", [
    ("lookup", {"input": "555-12345"}, "does not match its regex grammar: byte 8"),
    ("crm__query", {"input": "SELECT name FROM"}, "does not match its lark grammar"),
    ("lookup", {"number": "555-1234"}, "takes exactly one string argument 'input'"),
    ("crm__note", {"input": 5}, "takes exactly one string argument 'input'"),
])
def test_invalid_custom_input_fails_the_response(serve, name, arguments, words):
    async def main():
        c, _ = serve("Here.\n" + envelope(name, arguments))
        async with c:
            with pytest.raises(openai.InternalServerError) as e:
                await c.responses.create(model="tiny", input="number?", tools=TOOLS)
            events = [e async for e in await c.responses.create(model="tiny", input="number?", tools=TOOLS,
                                                                 stream=True)]
        assert e.value.status_code == 500 and words in e.value.message
        assert events[-1].type == "response.failed" and words in events[-1].response.error.message
        # the call is never emitted; text before it may have been
        assert not any(ev.type.startswith("response.custom_tool_call") for ev in events)
        assert not any(getattr(ev, "item", None) is not None and ev.item.type != "message" for ev in events)
        assert [item.type for item in events[-1].response.output] == ["message"]

    run(main())


def test_required_mode_counts_no_invalid_custom_call(serve):
    async def main():
        c, _ = serve(envelope("lookup", {"input": "nope"}))
        async with c:
            with pytest.raises(openai.InternalServerError, match="regex grammar"):
                await c.responses.create(model="tiny", input="number?", tools=TOOLS, tool_choice="required")

    run(main())


# --- declarations refused before admission (a real server, the default core) --------------------------


@pytest.mark.parametrize("tools, choice, words", [
    ([{**LOOKUP, "format": {**PHONE, "definition": "(ab"}}], None, "custom tool 'lookup': invalid regex grammar"),
    ([{**LOOKUP, "format": {**SQL, "definition": "start: foo"}}], None, "invalid lark grammar"),
    ([{**LOOKUP, "format": {"type": "grammar", "syntax": "gbnf", "definition": "root ::= \"a\""}}], None,
     "unsupported grammar syntax 'gbnf'"),
    ([{**LOOKUP, "format": {"type": "json_schema"}}], None, "unsupported format type 'json_schema'"),
    ([{**LOOKUP, "format": {**PHONE, "definition": "a" * 70_000}}], None, "exceeds 65536 bytes"),
    ([LOOKUP], {"type": "function", "name": "lookup"}, "selects a function tool, but 'lookup' is a custom tool"),
    (TOOLS, {"type": "custom", "name": "crm__get_customer"}, "is a function tool"),
    (TOOLS, {"type": "custom", "name": "query"}, "not declared"),
    ([{"type": "namespace", "name": "a", "tools": [{"type": "custom", "name": "b__c"}]},
      {"type": "namespace", "name": "a__b", "tools": [{"type": "function", "name": "c"}]}], None,
     "ambiguous tool name 'a__b__c'"),
    ([CRM, {"type": "function", "name": "crm__note"}], None, "ambiguous tool name 'crm__note'"),
    ([{"type": "namespace", "name": "n", "tools": [{"type": "namespace", "name": "m", "tools": []}]}], None,
     "unsupported tool type 'namespace' inside namespace 'n'"),
    ([{"type": "namespace", "tools": []}], None, "a namespace tool needs a nonempty name"),
])
def test_declarations_refused(client, tools, choice, words):
    extra = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="smollm2", input="hi", tools=tools, max_output_tokens=4, **extra)
    assert e.value.status_code == 400 and words in e.value.message
    assert e.value.body["param"] in ("tools", "tool_choice")


def test_valid_declarations_reach_the_core_check(client):
    # the default core has no tool parser: a valid declaration passes every check above and stops there
    with pytest.raises(openai.BadRequestError, match="declares no tool-call parser"):
        client.responses.create(model="smollm2", input="hi", tools=TOOLS, max_output_tokens=4,
                                tool_choice={"type": "custom", "name": "lookup"})
