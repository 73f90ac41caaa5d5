"""The thinking-token budget of one request: reasoning state read from generated ids, and the forced close.

Owns when the engine forces the prepared reasoning close token instead of sampling: at the cap, while
reasoning is unambiguously open. The output limit is the scheduler's business (a request that has no
capacity left is already finished when this is asked). Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

from helios.engine.messages import ReasoningBudget


class ReasoningBudgetState:
    """Where one request's reasoning stands, from its output ids; survives preemption with the Request.

    NOTE: the engine decides on token ids only, so the cut is deterministic for a seed and independent of
    how fast the server's output pipeline consumes the stream (that pipeline runs on another thread and lags
    the engine). The price is conservatism: a single-token tool opener inside reasoning (Qwen's <tool_call>
    while tools are parsed) may start a call that ends reasoning, or may be a quoted tag in prose; the ids
    cannot tell which, so reasoning stops being "unambiguously open" and the request is never cut. A tool
    opener spelled in several ordinary tokens (Qwen's <function= without <tool_call>) is invisible here: if
    the cap falls inside one, the close is forced anyway and the output pipeline reads the held tag as
    reasoning text (OutputParser.tool_undecided knows, but too late and off the engine's thread).
    """

    __slots__ = ("budget", "is_open", "num_reasoning_tokens")

    def __init__(self, budget: ReasoningBudget) -> None:
        self.budget = budget
        self.is_open = budget.starts_in_reasoning  # reasoning is unambiguously open
        self.num_reasoning_tokens = 0  # output tokens generated while open (delimiters excluded)

    def observe(self, token_id: int) -> None:
        """Fold one appended output token (sampled or forced) into the state."""
        if not self.is_open:
            return  # NOTE: once closed, reasoning is never re-opened for the budget: no later cut
        if token_id == self.budget.close_token_id:
            self.is_open = False
        elif token_id in self.budget.tool_open_token_ids:
            self.is_open = False  # ambiguous from here on (see the class NOTE)
        else:
            self.num_reasoning_tokens += 1

    def forced_token_id(self) -> int | None:
        """The close id when the next output token must be forced: the cap is reached with reasoning open."""
        if self.is_open and self.num_reasoning_tokens >= self.budget.max_reasoning_tokens:
            return self.budget.close_token_id
        return None
