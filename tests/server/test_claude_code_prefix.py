"""Prefix reuse for Claude-Code-shaped conversations on /v1/messages, with the stock anthropic SDK (no extra headers).

Claude Code's first system block is an attribution line, `x-anthropic-billing-header: cc_version=...;
cc_entrypoint=...;`, to which some versions add a per-request hash (`cch=...`). helios drops that line from the
prompt (helios.frontend.chat.drop_attribution), so a follow-up turn reuses the earlier turn's whole prompt
whatever the line holds: the second turn must report at least 90% of its prompt as cache reads.
"""

from __future__ import annotations

import secrets
import uuid

import pytest

RULES = "".join(f"Rule {i}: keep each edit minimal, explain it in one line, and run the tests after it.\n"
                for i in range(120))


@pytest.fixture(scope="module")
def stock(server):
    import anthropic

    with anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=300) as c:
        yield c


def _system(hashed: bool, nonce: str) -> list[dict]:
    line = "x-anthropic-billing-header: cc_version=2.1.296.d1c; cc_entrypoint=sdk-cli;"
    if hashed:
        line += f" cch={secrets.token_hex(5)};"  # a new value on every request
    return [{"type": "text", "text": line},
            {"type": "text", "text": "You are a coding agent working in the user's repository.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": f"Session {nonce}.\n{RULES}"}]


def _ask(client, system, messages):
    return client.messages.create(model="smollm2-135m-instruct", max_tokens=12, system=system,
                                  messages=messages)


@pytest.mark.parametrize("hashed", [False, True])
def test_second_turn_reuses_the_first(stock, hashed):
    nonce = uuid.uuid4().hex  # nothing earlier in the session shares this prefix
    first = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nThe repository has 3 files.\n</system-reminder>"},
        {"type": "text", "text": "Read settings.py and tell me the codename."}]}]
    one = _ask(stock, _system(hashed, nonce), first)
    assert one.usage.cache_read_input_tokens < one.usage.input_tokens  # the first turn was not cached already
    reply = [{"type": "text", "text": b.text} for b in one.content if b.type == "text"] or [
        {"type": "text", "text": "OK"}]
    second = [*first, {"role": "assistant", "content": reply},
              {"role": "user", "content": "Thanks. Now say it again."}]
    two = _ask(stock, _system(hashed, nonce), second)
    prompt = two.usage.input_tokens + two.usage.cache_read_input_tokens
    assert prompt > one.usage.input_tokens + one.usage.cache_read_input_tokens
    assert two.usage.cache_read_input_tokens >= 0.9 * prompt, two.usage


def test_attribution_line_leaves_the_prompt(stock):
    """Counting tokens: the line, hashed or not, adds nothing; the rest of the system text still counts."""
    messages = [{"role": "user", "content": "Hi."}]
    system = _system(True, "n")
    with_line = stock.messages.count_tokens(model="smollm2-135m-instruct", system=system, messages=messages)
    without = stock.messages.count_tokens(model="smollm2-135m-instruct", system=system[1:], messages=messages)
    shorter = stock.messages.count_tokens(model="smollm2-135m-instruct", system=system[2:], messages=messages)
    assert with_line.input_tokens == without.input_tokens > shorter.input_tokens
