"""Tool calls and reasoning through the three chat APIs, in-process around a scripted fake engine.

The fake model "generates" fixed text (Hermes <tool_call>{json}</tool_call> envelopes, <think> reasoning)
through the byte-level test tokenizer; the core declares the hermes tool parser and, where asked, the think
reasoning parser. Checks the protocol shapes (buffered and SSE), tool_choice, parallel_tool_calls, strict.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from helios.core.manifest import Limits, ReasoningSyntax, Recipe, TemplateCaps
from helios.engine.messages import EngineOutput
from helios.server.app import HeliosApp
from helios.server.config import ServerConfig
from helios.server.runtime import Runtime
from helios.frontend.tools import REQUIRED_INSTRUCTION
from tests.frontend.conftest import byte_level_tok, make_manifest, tokenizer  # noqa: F401 (fixtures)
from tests.server.test_app_fake import FakeEngine

TEMPLATE = ("{% for t in tools or [] %}tool: {{ t['function']['name'] }}\n{% endfor %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CHAT = {"messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 200, "tools": [WEATHER, TIME]}
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather of a city",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
                   {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
MESSAGES = {"messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 200,
            "tools": ANTHROPIC_TOOLS}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]},
                   {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
RESPONSES = {"input": "weather in Paris?", "max_output_tokens": 200, "tools": RESPONSES_TOOLS}
AV = {"anthropic-version": "2023-06-01"}


@pytest.fixture
def serve(tokenizer):
    """serve(text, recipe=..., reasoning=...) -> (client, engine): the model answers `text`, then EOS."""
    eos = tokenizer.info.eos_token_ids[0]

    def build(text: str, tool_parser: str | None = "hermes", reasoning: ReasoningSyntax | None = None,
              chunk: int = 3, finish: str = "stop"):
        recipe = Recipe(name="test", tool_parser=tool_parser, reasoning_parser="think" if reasoning else None)
        template = TemplateCaps(present=True, file="t.jinja", tools=True, reasoning=reasoning)
        manifest = make_manifest(tokenizer=tokenizer.info, recipe=recipe, template=template,
                                 limits=Limits(context_length=4096, default_max_tokens=16))
        ids = tokenizer.encode(text, add_special_tokens=False)

        def script(req):
            outs = [EngineOutput(req_id=req.req_id, new_token_ids=ids[i:i + chunk],
                                 num_prompt_tokens=len(req.prompt_token_ids)) for i in range(0, len(ids), chunk)]
            if finish == "stop":
                outs.append(EngineOutput(req_id=req.req_id, new_token_ids=[eos], finished=True, finish_reason="stop",
                                         stop_token=eos))
            else:
                outs.append(EngineOutput(req_id=req.req_id, new_token_ids=[], finished=True, finish_reason=finish))
            return outs

        engine = FakeEngine(script)
        engine.prompts = []
        inner = engine.script

        def recording(req):
            engine.prompts.append(tokenizer.decode(req.prompt_token_ids))
            return inner(req)

        engine.script = recording
        runtime = Runtime(manifest, tokenizer, TEMPLATE, engine, ServerConfig())
        app = HeliosApp(runtime, warm=False)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t"), engine

    return build


def _data(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line[6:] != "[DONE]"]


def _named(text: str) -> list[tuple[str, dict]]:
    out, name = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
    return out


def run(coro):
    return asyncio.run(coro)


# --- Chat Completions ----------------------------------------------------------------------------------


def test_chat_tool_call_buffered_and_streamed(serve):
    async def main():
        c, engine = serve("Let me check.\n" + CALL)
        async with c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            s = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        assert msg["content"] == "Let me check.\n"  # text before an envelope is kept as generated
        [call] = msg["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert "tool: get_weather\ntool: get_time\n" in engine.prompts[0]  # the template got the tools
        chunks = _data(s.text)
        assert s.text.rstrip().endswith("data: [DONE]")
        deltas = [ch["choices"][0]["delta"] for ch in chunks]
        calls = [d["tool_calls"] for d in deltas if d.get("tool_calls")]
        assert len(calls) == 1 and calls[0][0]["index"] == 0 and calls[0][0]["function"]["name"] == "get_weather"
        assert json.loads(calls[0][0]["function"]["arguments"]) == {"city": "Paris"}
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
        assert text == "Let me check.\n"
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    run(main())


def test_chat_tool_choice_none_leaves_syntax_as_text(serve):
    async def main():
        c, _ = serve(CALL)
        async with c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"})
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == CALL and choice["message"]["tool_calls"] == []
        assert choice["finish_reason"] == "stop"

    run(main())


def test_chat_required_mode_instruction_and_failure(serve):
    async def main():
        c, engine = serve("It is sunny.")
        async with c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"})
            s = await c.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required", "stream": True})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "tool_choice" in r.json()["error"]["message"]
        assert REQUIRED_INSTRUCTION in engine.prompts[0]
        events = _data(s.text)
        assert "error" in events[-1] and "[DONE]" not in s.text
        assert all(ch["choices"][0]["finish_reason"] is None for ch in events[:-1] if ch.get("choices"))

    run(main())


def test_chat_required_mode_passes_with_a_call(serve):
    async def main():
        c, _ = serve(CALL)
        async with c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
        assert r.json()["choices"][0]["message"]["content"] is None

    run(main())


def test_chat_named_choice_presents_one_tool_and_hides_text(serve):
    async def main():
        c, engine = serve("Sure.\n" + CALL)
        choice = {"type": "function", "function": {"name": "get_weather"}}
        async with c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "tool_choice": choice})
            bad = await c.post("/v1/chat/completions",
                               json={**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_weather"
        assert "tool: get_weather\n" in engine.prompts[0] and "get_time" not in engine.prompts[0]
        assert bad.status_code == 500  # the model called another tool than the named one

    run(main())


def test_chat_parallel_tool_calls_false(serve):
    async def main():
        c, _ = serve(CALL + "\n" + CALL2)
        async with c:
            ok = await c.post("/v1/chat/completions", json=CHAT)
            r = await c.post("/v1/chat/completions", json={**CHAT, "parallel_tool_calls": False})
            s = await c.post("/v1/chat/completions", json={**CHAT, "parallel_tool_calls": False, "stream": True})
        calls = ok.json()["choices"][0]["message"]["tool_calls"]
        assert [t["function"]["name"] for t in calls] == ["get_weather", "get_time"]
        assert r.status_code == 500 and "parallel_tool_calls" in r.json()["error"]["message"]
        events = _data(s.text)
        streamed = [ch for ch in events[:-1] if ch["choices"] and ch["choices"][0]["delta"].get("tool_calls")]
        assert len(streamed) == 1  # the first call may already be delivered
        assert "error" in events[-1] and "[DONE]" not in s.text

    run(main())


@pytest.mark.parametrize("body, param", [
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]}, "tools"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
def test_chat_tool_request_errors(serve, body, param):
    async def main():
        c, _ = serve("x")
        async with c:
            r = await c.post("/v1/chat/completions", json={**CHAT, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param

    run(main())


def test_tools_on_a_core_without_a_tool_parser_are_400(serve):
    async def main():
        c, _ = serve("x", tool_parser=None)
        async with c:
            chat = await c.post("/v1/chat/completions", json=CHAT)
            none = await c.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"})
            msgs = await c.post("/v1/messages", json=MESSAGES, headers=AV)
            resp = await c.post("/v1/responses", json=RESPONSES)
        assert chat.status_code == 400 and "tool-call parser" in chat.json()["error"]["message"]
        assert none.status_code == 200
        assert msgs.status_code == 400 and resp.status_code == 400

    run(main())


def test_chat_reasoning_content_and_usage(serve):
    syntax = ReasoningSyntax(open="<think>", close="</think>")
    async def main():
        c, _ = serve("<think>Paris is in France.</think>It is sunny.", reasoning=syntax)
        async with c:
            r = await c.post("/v1/chat/completions", json={"messages": CHAT["messages"], "max_tokens": 200})
            s = await c.post("/v1/chat/completions", json={"messages": CHAT["messages"], "max_tokens": 200,
                                                           "stream": True, "stream_options": {"include_usage": True}})
        body = r.json()
        msg = body["choices"][0]["message"]
        assert msg["reasoning_content"] == "Paris is in France." and msg["content"] == "It is sunny."
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
        chunks = _data(s.text)
        reasoning = "".join(ch["choices"][0]["delta"].get("reasoning_content") or "" for ch in chunks if ch["choices"])
        content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
        assert reasoning == "Paris is in France." and content == "It is sunny."
        assert chunks[-1]["usage"] == body["usage"]

    run(main())


def test_truncated_envelope_is_omitted_and_reports_length(serve):
    async def main():
        c, _ = serve(CALL[:30], finish="length")
        async with c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            req = await c.post("/v1/chat/completions", json={**CHAT, "tool_choice": "required"})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
        assert req.status_code == 500

    run(main())


# --- Anthropic Messages --------------------------------------------------------------------------------


def test_messages_tool_use_buffered_and_streamed(serve):
    async def main():
        c, _ = serve("Checking.\n" + CALL)
        async with c:
            r = await c.post("/v1/messages", json=MESSAGES, headers=AV)
            s = await c.post("/v1/messages", json={**MESSAGES, "stream": True}, headers=AV)
        body = r.json()
        assert body["stop_reason"] == "tool_use"
        text, tool = body["content"]
        assert text == {"type": "text", "text": "Checking.\n"}
        assert tool["type"] == "tool_use" and tool["name"] == "get_weather" and tool["input"] == {"city": "Paris"}
        assert tool["id"].startswith("toolu_")
        events = _named(s.text)
        starts = [e for n, e in events if n == "content_block_start"]
        assert [b["content_block"]["type"] for b in starts] == ["text", "tool_use"]
        assert starts[1]["content_block"]["name"] == "get_weather" and starts[1]["content_block"]["input"] == {}
        partial = "".join(e["delta"]["partial_json"] for n, e in events
                          if n == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
        assert json.loads(partial) == {"city": "Paris"}
        delta = next(e for n, e in events if n == "message_delta")
        assert delta["delta"]["stop_reason"] == "tool_use" and events[-1][0] == "message_stop"

    run(main())


def test_messages_any_and_disable_parallel_tool_use(serve):
    async def main():
        c, engine = serve("No tools needed.")
        async with c:
            r = await c.post("/v1/messages", json={**MESSAGES, "tool_choice": {"type": "any"}}, headers=AV)
            s = await c.post("/v1/messages", json={**MESSAGES, "tool_choice": {"type": "any"}, "stream": True},
                             headers=AV)
        assert r.status_code == 500 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
        assert REQUIRED_INSTRUCTION in engine.prompts[0]
        events = _named(s.text)
        assert events[-1][0] == "error" and not any(n == "message_stop" for n, _ in events)
        c, _ = serve(CALL + CALL2)
        choice = {"type": "auto", "disable_parallel_tool_use": True}
        async with c:
            ok = await c.post("/v1/messages", json=MESSAGES, headers=AV)
            bad = await c.post("/v1/messages", json={**MESSAGES, "tool_choice": choice}, headers=AV)
        assert [b["name"] for b in ok.json()["content"]] == ["get_weather", "get_time"]
        assert bad.status_code == 500

    run(main())


def test_messages_thinking_blocks(serve):
    syntax = ReasoningSyntax(open="<think>", close="</think>")
    async def main():
        c, _ = serve("<think>Hmm.</think>" + CALL, reasoning=syntax)
        async with c:
            r = await c.post("/v1/messages", json=MESSAGES, headers=AV)
        types = [b["type"] for b in r.json()["content"]]
        assert types == ["thinking", "tool_use"] and r.json()["content"][0]["thinking"] == "Hmm."

    run(main())


# --- Responses -----------------------------------------------------------------------------------------


def test_responses_function_call_buffered_and_streamed(serve):
    async def main():
        c, _ = serve(CALL)
        async with c:
            r = await c.post("/v1/responses", json=RESPONSES)
            s = await c.post("/v1/responses", json={**RESPONSES, "stream": True})
        body = r.json()
        assert body["status"] == "completed"
        [item] = body["output"]
        assert item["type"] == "function_call" and item["name"] == "get_weather"
        assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
        assert json.loads(item["arguments"]) == {"city": "Paris"} and item["status"] == "completed"
        events = _named(s.text)
        names = [n for n, _ in events]
        i = names.index("response.output_item.added")
        assert names[i:i + 4] == ["response.output_item.added", "response.function_call_arguments.delta",
                                  "response.function_call_arguments.done", "response.output_item.done"]
        assert events[i][1]["item"]["type"] == "function_call" and events[i][1]["item"]["arguments"] == ""
        assert json.loads(events[i + 2][1]["arguments"]) == {"city": "Paris"}
        assert names[-1] == "response.completed"
        assert events[-1][1]["response"]["output"][0]["call_id"] == events[i][1]["item"]["call_id"]

    run(main())


def test_responses_required_named_parallel_and_hosted(serve):
    async def main():
        c, _ = serve("Just text.")
        async with c:
            r = await c.post("/v1/responses", json={**RESPONSES, "tool_choice": "required"})
            s = await c.post("/v1/responses", json={**RESPONSES, "tool_choice": "required", "stream": True})
            hosted = await c.post("/v1/responses", json={**RESPONSES, "tools": [{"type": "web_search"}]})
            strict_tools = [{**RESPONSES_TOOLS[0], "strict": True}]
            strict = await c.post("/v1/responses", json={**RESPONSES, "tools": strict_tools})
        assert r.status_code == 500
        assert _named(s.text)[-1][0] == "response.failed"
        assert hosted.status_code == 400 and strict.status_code == 400
        c, _ = serve(CALL + CALL2)
        async with c:
            bad = await c.post("/v1/responses", json={**RESPONSES, "parallel_tool_calls": False})
            named = await c.post("/v1/responses", json={**RESPONSES, "tool_choice": {"type": "function",
                                                                                     "name": "get_weather"}})
        assert bad.status_code == 500
        assert named.status_code == 500  # the second call names another tool

    run(main())


def test_responses_reasoning_item_and_usage(serve):
    syntax = ReasoningSyntax(open="<think>", close="</think>")
    async def main():
        c, _ = serve("<think>Think.</think>Answer.", reasoning=syntax)
        async with c:
            r = await c.post("/v1/responses", json={"input": "q", "max_output_tokens": 100})
        body = r.json()
        assert [i["type"] for i in body["output"]] == ["reasoning", "message"]
        assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "Think."}]
        assert body["usage"]["output_tokens_details"]["reasoning_tokens"] > 0

    run(main())
