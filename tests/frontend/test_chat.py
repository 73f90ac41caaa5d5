from __future__ import annotations

import pytest

from helios.core.manifest import TemplateCaps
from helios.frontend.chat import ChatMessage, ChatRenderer, lower_messages
from helios.frontend.sampling import InvalidRequest

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CAPS = TemplateCaps(present=True, file="template.jinja", system_role=True, continuation=True)


def test_render_with_generation_prompt(tokenizer):
    r = ChatRenderer(CHATML, CAPS, tokenizer)
    p = r.render([ChatMessage(role="user", content="hello")])
    assert p.text.endswith("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(p.token_ids) == p.text
    assert p.token_ids[0] == tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]


def test_continue_final_message(tokenizer):
    r = ChatRenderer(CHATML, CAPS, tokenizer)
    msgs = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="The answer is")]
    p = r.render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert p.text.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(InvalidRequest):
        r.render(msgs, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequest):
        r.render(msgs[:1], add_generation_prompt=False, continue_final_message=True)


def test_kwargs_reach_the_template(tokenizer):
    r = ChatRenderer("{{ greeting }}{{ messages[0]['content'] }}", CAPS, tokenizer)
    assert r.render([ChatMessage(role="user", content="x")], template_kwargs={"greeting": "hey "}).text == "hey x"
    with pytest.raises(InvalidRequest):
        r.render([ChatMessage(role="user", content="x")], template_kwargs={"messages": []})


def test_no_template_and_errors(tokenizer):
    with pytest.raises(InvalidRequest, match="no chat template"):
        ChatRenderer(None, TemplateCaps(present=False), tokenizer).render([ChatMessage(role="user", content="x")])
    r = ChatRenderer("{{ raise_exception('roles must alternate') }}", CAPS, tokenizer)
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        r.render([ChatMessage(role="user", content="x")])
    with pytest.raises(InvalidRequest, match="role"):
        ChatRenderer(CHATML, CAPS, tokenizer).render([ChatMessage(role="robot", content="x")])


def test_system_and_developer_lowering():
    msgs = [ChatMessage(role="system", content="S"), ChatMessage(role="user", content="u"),
            ChatMessage(role="system", content="late")]
    assert lower_messages(msgs, CAPS)[-1] == {"role": "user", "content": "<system>late</system>"}
    inline = TemplateCaps(present=True, inline_system=True)
    assert lower_messages(msgs, inline)[-1] == {"role": "system", "content": "late"}
    dev = [ChatMessage(role="user", content="u"), ChatMessage(role="developer", content="D"),
           ChatMessage(role="system", content="S")]
    out = lower_messages(dev, CAPS)
    assert out[0] == {"role": "system", "content": "<developer>D</developer>\n\n<system>S</system>"}
    assert out[1:] == [{"role": "user", "content": "u"}]
