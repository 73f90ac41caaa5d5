"""Where a rendered chat prompt's stable prefix and its messages end, in tokens: the positions a hybrid model's
scheduler may keep state checkpoints at (EngineRequest.anchor_end / message_ends, the `anchor` and `message` roles
of helios/engine/state_checkpoints.py).

The template is rendered again for a prefix of the conversation followed by a sentinel message: the longest common
prefix of that text with the whole prompt's text ends where the prefix's last message ends (plus the next message's
opening markup where it matches), whatever markup the template puts around messages. The offset is the count of the
prompt's tokens wholly inside that text. A boundary is only a hint: a checkpoint is named by its tokens' page hashes,
so a misplaced one costs a copy, never a wrong answer. No torch; must not import the engine's internals.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from helios.frontend.chat import ChatMessage, ChatPrompt, ChatRenderer
from helios.frontend.sampling import InvalidRequest

# the latest messages' ends only: each costs a render of the conversation, and a conversation's earlier ends were
# the previous turns' message ends and endpoints already
MAX_MESSAGE_BOUNDARIES = 4
SENTINEL = "\x00"  # the probe message's text: no rendered prompt continues with it


def message_boundaries(renderer: ChatRenderer, messages: list[ChatMessage], prompt: ChatPrompt,
                       tools: list[dict] | None = None,
                       template_kwargs: dict[str, Any] | None = None) -> tuple[int, list[int]]:
    """(anchor_end, message_ends) of `prompt`, the render of `messages`: the end of the leading system and developer
    messages with the tools (the prefix every conversation under the same instructions shares; 0 when there are
    neither), and the ends of the latest messages before the last one (the endpoint covers that), ascending."""
    num_lead = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    anchor = 0
    if num_lead or tools:
        anchor = _boundary(renderer, messages[:num_lead], prompt, tools, template_kwargs)
    first = max(num_lead + 1, len(messages) - MAX_MESSAGE_BOUNDARIES)
    ends = {_boundary(renderer, messages[:k], prompt, tools, template_kwargs) for k in range(first, len(messages))}
    return anchor, sorted(e for e in ends if e > anchor)


def _boundary(renderer: ChatRenderer, prefix: list[ChatMessage], prompt: ChatPrompt, tools: list[dict] | None,
              template_kwargs: dict[str, Any] | None) -> int:
    """The prompt tokens wholly inside its common text with `prefix` + a sentinel message (a user's, else an
    assistant's for templates that insist on alternation); 0 when the template renders neither."""
    for role in ("user", "assistant"):
        try:
            text = renderer.render_text([*prefix, ChatMessage(role=role, content=SENTINEL)], tools=tools,
                                        add_generation_prompt=False, template_kwargs=template_kwargs)
        except InvalidRequest:
            continue
        return bisect_right(prompt.token_ends, _common_prefix(text, prompt.text))
    return 0


def _common_prefix(a: str, b: str) -> int:
    """len of the longest common prefix of a and b (a binary search over slice compares: C speed on long prompts)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
