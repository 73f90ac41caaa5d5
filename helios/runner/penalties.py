"""Repetition, frequency and presence penalties on float32 logits (vLLM / OpenAI semantics).

Pure tensor math, elementwise only (IEEE-exact operations: compare, select, multiply, divide,
subtract), so a row gives bit-identical results whatever other rows share its batch. The per-request
token statistics live in helios.runner.sampler.SamplerState; this module imports only torch.
"""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,  # [batch, vocab] float32
    prompt_mask: torch.Tensor,  # [batch, vocab] bool: token in the prompt
    output_counts: torch.Tensor,  # [batch, vocab] int: occurrences of the token in the output so far
    repetition: torch.Tensor,  # [batch] float32, 1.0 = neutral
    frequency: torch.Tensor,  # [batch] float32, 0.0 = neutral
    presence: torch.Tensor,  # [batch] float32, 0.0 = neutral
) -> torch.Tensor:  # [batch, vocab] float32, a new tensor
    """Return the penalized logits, in vLLM's order: repetition, then frequency, then presence.

    - repetition (HF/vLLM): for tokens seen in the prompt or the output, a positive logit is divided by
      the penalty and a non-positive one multiplied by it (division, not multiplication by 1/penalty);
    - frequency (OpenAI): logit -= frequency * count of the token in the output;
    - presence (OpenAI): logit -= presence * (count > 0).
    Neutral values are exact no-ops (x / 1, x * 1, x - 0), so rows without a penalty can share the call.
    """
    rep = repetition.to(logits.dtype)[:, None]  # [batch, 1]
    seen = prompt_mask | (output_counts > 0)  # [batch, vocab]
    rep = torch.where(seen, rep, torch.ones_like(rep))
    x = torch.where(logits > 0, logits / rep, logits * rep)
    counts = output_counts.to(logits.dtype)
    x = x - frequency.to(logits.dtype)[:, None] * counts
    x = x - presence.to(logits.dtype)[:, None] * (output_counts > 0).to(logits.dtype)
    return x
