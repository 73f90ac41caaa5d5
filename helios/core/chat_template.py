"""The sandboxed Jinja renderer of prepared chat templates, shared by ignition's probing and helios' frontend.

Owns rendering semantics: the environment is configured like HF transformers' `apply_chat_template`
(trim_blocks, lstrip_blocks, loopcontrols, `{% generation %}`, raise_exception, strftime_now, HF's tojson),
and continue_final_message cuts after the final message exactly as transformers does.
Imports jinja2 only: no torch, no transformers, no ignition.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning travels under; templates mostly read the first (transformers aliases them).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Variables every render defines; the rest of a template's undeclared variables are its kwargs.
RENDER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# Special-token variables transformers passes (its special_tokens_map names).
SPECIAL_TOKEN_NAMES = frozenset(
    {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}
)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(Exception):
    """A template that fails to compile or render. `raised` is True when the template itself called
    raise_exception (a deliberate rejection, e.g. "roles must alternate"), False for a bug or bad input."""

    def __init__(self, message: str, raised: bool = False):
        super().__init__(message)
        self.raised = raised


class _Raised(jinja2.exceptions.TemplateError):
    """What `raise_exception` throws inside the sandbox; surfaced as TemplateError(raised=True)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' assistant-mask marker, rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateDict:
    """`dict(...)` for templates without exposing the type itself (as transformers does)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore-prefixed attributes (no reach into CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message):
    raise _Raised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # NOTE: HF's filter, not jinja's: no HTML escaping, and indent/separators/sort_keys are exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def make_environment(now: Callable[[], datetime] = datetime.now) -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in; `now` feeds strftime_now (fixed in probing)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def plain_data(value: Any) -> Any:
    """Rebuild a value from plain JSON types, so the sandbox never sees objects with unknown methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    return f"<{type(value).__name__}>"


def normalize_messages(messages: list[Mapping[str, Any]]) -> list[dict]:
    """transformers' message preparation: drop None-valued keys, then alias the reasoning fields."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"chat messages must be mappings, got {type(message).__name__}")
        msg = {k: plain_data(v) for k, v in message.items() if v is not None}
        reasoning = next((msg[k] for k in REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


class ChatTemplate:
    """One compiled chat template plus the special tokens it sees as variables (bos_token, eos_token, ...)."""

    def __init__(
        self,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        now: Callable[[], datetime] = datetime.now,
    ):
        self.source = source
        self._env = make_environment(now)
        try:
            self._ast = self._env.parse(source)
            self._template = self._env.from_string(self._ast)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from None
        # NOTE: request kwargs override special tokens, as in transformers ({**special_tokens_map, **kwargs}).
        specials = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        if bos_token is not None:
            specials["bos_token"] = bos_token
        if eos_token is not None:
            specials["eos_token"] = eos_token
        self.special_tokens = specials

    @property
    def variables(self) -> frozenset[str]:
        """Every undeclared variable the template reads (messages, tools, enable_thinking, ...)."""
        return frozenset(jinja2.meta.find_undeclared_variables(self._ast))

    def reads_field(self, name: str) -> bool:
        """Whether the template reads `name` off some value (`x.name` or `x['name']`): e.g. a tool message's
        `is_error`, which few templates express; the frontend lowers differently for the others."""
        for node in self._ast.find_all((jinja2.nodes.Getattr, jinja2.nodes.Getitem)):
            if isinstance(node, jinja2.nodes.Getattr) and node.attr == name:
                return True
            if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
                    and node.arg.value == name:
                return True
        return False

    @property
    def kwargs(self) -> list[str]:
        """The chat_template_kwargs the template reads: undeclared variables no render, special token or global
        defines. NOTE: jinja's analysis also reports names the template assigns in branches or loops (Qwen's
        `content`); those are dropped unless the template tests them with `is defined` (Llama's date_string)."""
        stored, tested = set(), set()
        for node in self._ast.find_all(jinja2.nodes.Name):
            if node.ctx == "store":
                stored.add(node.name)
        for test in self._ast.find_all(jinja2.nodes.Test):
            if test.name in ("defined", "undefined") and isinstance(test.node, jinja2.nodes.Name):
                tested.add(test.node.name)
        defined = RENDER_VARIABLES | SPECIAL_TOKEN_NAMES | set(self.special_tokens) | set(self._env.globals)
        return sorted(self.variables - defined - (stored - tested))

    def render(
        self,
        messages: list[Mapping[str, Any]],
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool | str = False,
        documents: list[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation; continue_final_message (True or a field name) leaves the final message open."""
        if continue_final_message and add_generation_prompt:
            raise TemplateError("continue_final_message and add_generation_prompt cannot be combined")
        chat = normalize_messages(messages)
        final_text = None
        if continue_final_message:
            final_text = self._tag_final(chat, continue_final_message)
        variables = {**self.special_tokens, **plain_data(kwargs)}
        try:
            rendered = self._template.render(
                messages=chat,
                tools=plain_data(tools),
                documents=plain_data(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _Raised as e:
            raise TemplateError(f"chat template rejected the conversation: {e}", raised=True) from None
        except Exception as e:  # NOTE: untrusted template code: any failure is the template's error
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        if final_text is not None:
            rendered = self._cut_final(rendered, final_text)
        return rendered

    def _tag_final(self, chat: list[dict], field: bool | str) -> str:
        """Append the continuation tag to the final message's text; return that text (untagged)."""
        if not chat:
            raise TemplateError("continue_final_message needs a non-empty conversation")
        field = field if isinstance(field, str) else "content"
        last = chat[-1]
        if (final := last.get(field)) is None:
            raise TemplateError(f'continue_final_message: the final message has no "{field}"')
        fields = [field]
        if field in REASONING_FIELDS:
            fields = [f for f in REASONING_FIELDS if last.get(f) == final]
        if not any(f in self.source for f in fields):
            raise TemplateError(f'continue_final_message: the template does not read "{field}"')
        if isinstance(final, (list, tuple)):
            blocks = [dict(b) if isinstance(b, Mapping) else b for b in final]
            for block in reversed(blocks):
                if isinstance(block, dict) and "text" in block:
                    text = block["text"]
                    block["text"] = text + _CONTINUE_TAG
                    last[field] = blocks
                    return text
            raise TemplateError("continue_final_message: the final message has no text block to continue")
        if not isinstance(final, str):
            raise TemplateError("continue_final_message: the final message's content is not text")
        for f in fields:
            last[f] = last[f] + _CONTINUE_TAG
        return final

    @staticmethod
    def _cut_final(rendered: str, final_text: str) -> str:
        tag = _CONTINUE_TAG.strip()
        if final_text.strip() not in rendered or tag not in rendered:
            raise TemplateError("continue_final_message: the template dropped the final message")
        loc = rendered.rindex(tag)
        if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:loc]
        # The template trimmed the message's trailing space (and so the tag's): cut conservatively.
        return rendered[:loc].rstrip()
