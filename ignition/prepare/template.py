"""Chat-template probing: render a prepared template on marker conversations and record its capabilities.

Owns how TemplateCaps is derived (system roles, tools, continuation, generation prompt, reasoning
delimiters and their single-token ids, template kwargs). Renders with helios.core.chat_template (the same
renderer helios serves with), or with a native encoder (helios.core.native_encoding) for DeepSeek V4 / V4.1, Kimi K3,
so the probe describes what helios will actually produce.
"""

from __future__ import annotations

from datetime import datetime
from os.path import commonprefix

import msgspec
from tokenizers import Tokenizer

from helios.core.chat_template import ChatTemplate, TemplateError
from helios.core.native_encoding import NativeEncoder, native_encoder
from helios.core.manifest import ReasoningSyntax, TemplateCaps
from ignition.errors import ExportError

TEMPLATE_FILE = "template.jinja"
# Reasoning delimiter pairs we recognize, most specific first (so "<think>" never shadows a namespaced one).
KNOWN_REASONING = (
    ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),  # Kimi K3's XTML think channel (helios/core/kimi_encoding.py)
    ("<mm:think>", "</mm:think>"),  # MiniMax
    ("<seed:think>", "</seed:think>"),  # Seed-OSS
    ("<|channel>thought", "<channel|>"),  # Gemma 4: the open spans several tokens, the close is one
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Command-A reasoning
    ("\u25c1think\u25b7", "\u25c1/think\u25b7"),  # Kimi's ◁think▷
    ("<think>", "</think>"),
)
# NOTE: a fixed clock keeps probe results (and so the core's bytes) independent of the export date.
_PROBE_NOW = datetime(2025, 1, 1)
_SYS = "FLARE_PROBE_SYSTEM"
_SYS2 = "FLARE_PROBE_INLINE_SYSTEM"
_USER = "FLARE_PROBE_USER"
_USER2 = "FLARE_PROBE_USER_TWO"
_ASSISTANT = "FLARE_PROBE_ASSISTANT"
_TOOL_NAME = "flare_probe_tool"
_TOOL = {
    "type": "function",
    "function": {
        "name": _TOOL_NAME,
        "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def probe(template_source: str | None, tokenizer_json: str, special_tokens: dict) -> TemplateCaps:
    """TemplateCaps of `template_source` (None or empty: TemplateCaps(present=False)).

    special_tokens are the template's special-token variables ({"bos_token": "<s>", "eos_token": ...}).
    Raises ExportError when the template cannot compile or cannot render a single user message.
    """
    if not template_source:
        return TemplateCaps(present=False)
    try:
        template = ChatTemplate(template_source, special_tokens=special_tokens, now=lambda: _PROBE_NOW)
    except TemplateError as e:
        raise ExportError(str(e)) from None
    return _probe(template, template_source, tokenizer_json)


def probe_native(kind: str, tokenizer_json: str) -> TemplateCaps:
    """TemplateCaps of a native encoder (helios/core/native_encoding.py), probed like a template: the same
    marker conversations through the encoder helios serves with; no template file."""
    encoder = native_encoder(kind)
    caps = _probe(encoder, "".join(encoder.reasoning_delimiters), tokenizer_json)
    return msgspec.structs.replace(caps, file=None, kind=encoder.kind)


def _probe(template: ChatTemplate | NativeEncoder, source: str, tokenizer_json: str) -> TemplateCaps:
    """The probe of a ChatTemplate or a native encoder; `source` is the text searched for reasoning delimiters."""
    tokenizer = _load_tokenizer(tokenizer_json)
    user = [{"role": "user", "content": _USER}]
    try:
        closed = template.render(user, add_generation_prompt=False)
        opened = template.render(user, add_generation_prompt=True)
    except TemplateError as e:
        raise ExportError(f"the chat template cannot render one user message: {e}") from None
    generation_prompt = _suffix(closed, opened)
    with_system = _try(template, [{"role": "system", "content": _SYS}, *user])
    return TemplateCaps(
        present=True,
        file=TEMPLATE_FILE,
        inline_system=_inline_system(template),
        system_role=with_system is not None and _SYS in with_system,
        default_system=_default_system(closed, with_system),
        tools=_tools(template, closed),
        continuation=_continuation(template),
        generation_prompt=generation_prompt,
        reasoning=_reasoning(source, generation_prompt, tokenizer),
        kwargs=template.kwargs,
    )


def _load_tokenizer(tokenizer_json: str) -> Tokenizer:
    try:
        return Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise ExportError(f"tokenizer.json does not parse: {e}") from None


def _try(template: ChatTemplate, messages: list[dict], **kwargs) -> str | None:
    """The rendering without a generation prompt, or None when the template rejects the conversation."""
    kwargs.setdefault("add_generation_prompt", False)
    try:
        return template.render(messages, **kwargs)
    except TemplateError:
        return None


def _suffix(closed: str, opened: str) -> str:
    # Normally the generation prompt is appended; otherwise take what follows the common prefix.
    if opened.startswith(closed):
        return opened[len(closed) :]
    return opened[len(commonprefix([closed, opened])) :]


def _inline_system(template: ChatTemplate) -> bool:
    """A non-initial system message renders in place, both right after a user turn and after an assistant turn.

    NOTE: the second shape catches templates (Gemma 3) that accept [user, system, user] only because their
    role-alternation check happens to line up, and reject the same system message one turn later.
    """
    user, user2 = {"role": "user", "content": _USER}, {"role": "user", "content": _USER2}
    system = {"role": "system", "content": _SYS2}
    shapes = ([user, system, user2], [user, {"role": "assistant", "content": _ASSISTANT}, system, user2])
    for messages in shapes:
        text = _try(template, messages)
        if text is None or _SYS2 not in text or _USER2 not in text:
            return False
        # A template that hoists every system message to the top does not render it inline.
        if not text.index(_USER) < text.index(_SYS2) < text.index(_USER2):
            return False
    return True


def _default_system(closed: str, with_system: str | None) -> bool:
    """The template injects a system turn when none is given.

    With [system S, user U] the text before U is lead + S + tail (tail: system end + user framing).
    Without a system message, an injected turn shows as lead + <default text> + tail before U; the default text is
    not empty (a template that frames system text with nothing, as DeepSeek's encoders, renders lead + tail).
    """
    if with_system is None or _SYS not in with_system:
        return False
    before_user = with_system[: with_system.index(_USER)]
    cut = before_user.index(_SYS)
    lead, tail = before_user[:cut], before_user[cut + len(_SYS) :]
    plain = closed[: closed.index(_USER)] if _USER in closed else ""
    return len(plain) > len(lead) + len(tail) and plain.startswith(lead) and plain.endswith(tail)


def _tools(template: ChatTemplate, closed: str) -> bool:
    text = _try(template, [{"role": "user", "content": _USER}], tools=[_TOOL])
    return text is not None and text != closed and _TOOL_NAME in text


def _continuation(template: ChatTemplate) -> bool:
    messages = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
    text = _try(template, messages, continue_final_message=True)
    return text is not None and text.endswith(_ASSISTANT)


def _single_token_id(tokenizer: Tokenizer, text: str) -> int | None:
    """The id of `text` when the tokenizer both knows it as one token and encodes it to exactly that token."""
    token_id = tokenizer.token_to_id(text)
    if token_id is None:
        return None
    return token_id if tokenizer.encode(text, add_special_tokens=False).ids == [token_id] else None


def _reasoning(source: str, generation_prompt: str, tokenizer: Tokenizer) -> ReasoningSyntax | None:
    for open_, close in KNOWN_REASONING:
        if close in source and (open_ in source or open_ in generation_prompt):
            return ReasoningSyntax(
                open=open_,
                close=close,
                open_token_id=_single_token_id(tokenizer, open_),
                close_token_id=_single_token_id(tokenizer, close),
                starts_in_reasoning=generation_prompt.rstrip().endswith(open_),
            )
    return None
