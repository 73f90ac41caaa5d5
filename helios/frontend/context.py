"""The frozen model context: what request preparation reads about the served model, and nothing more.

Owns `ModelLimits` (the serving limits resolved at start-up that shape a request: context length, the default
output budget, the default thinking budget) and `ModelContext` (manifest, limits, tokenizer, chat renderer,
structured output's compiler). Functions that only need these take a ModelContext, not the server's Runtime.
No torch; must not import the server or the engine's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from msgspec import Struct

from helios.core.manifest import Manifest
from helios.frontend.chat import ChatRenderer
from helios.frontend.grammar import OutputCompiler
from helios.frontend.tokenizer import Tokenizer


class ModelLimits(Struct, frozen=True, kw_only=True):
    """Serving limits a request is prepared under (resolved from the config and the core at start-up)."""

    max_model_len: int  # prompt + output tokens
    default_max_tokens: int  # the output budget of a request that names none
    thinking_token_budget: int | None = None  # `[server] thinking_token_budget`: the default reasoning cap


@dataclass(frozen=True)
class ModelContext:
    manifest: Manifest
    limits: ModelLimits
    tokenizer: Tokenizer
    chat: ChatRenderer
    output_grammars: OutputCompiler  # structured output's grammars over the model's vocabulary
    control_ids: frozenset[int] = field(init=False)  # BOS/PAD/UNK: specials the output parsers never see

    def __post_init__(self) -> None:
        info = self.manifest.tokenizer
        ids = frozenset(i for i in (info.bos_token_id, info.pad_token_id, info.unk_token_id) if i is not None)
        object.__setattr__(self, "control_ids", ids)

    @classmethod
    def build(cls, manifest: Manifest, limits: ModelLimits, tokenizer: Tokenizer,
              template_source: str | None) -> ModelContext:
        """The context of a loaded core: the chat renderer over its template, and structured output's compiler
        (the end of a grammar allows the EOS ids)."""
        return cls(manifest, limits, tokenizer, ChatRenderer(template_source, manifest.template, tokenizer),
                   OutputCompiler(tokenizer.to_json, manifest.arch.vocab_size, manifest.tokenizer.eos_token_ids))
