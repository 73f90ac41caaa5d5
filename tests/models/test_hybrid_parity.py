"""Parity of the hybrid families (gated delta rule + gated attention: qwen3_5, qwen3_5_moe, qwen3_next) against
HF transformers on tiny random checkpoints, through the real path: an HF directory, ignition's float32 export,
helios.core.load, the ModelRunner with its paged KV and state slots, and the engine (state slots, chunked
prefill on the recurrent grid, state checkpoints and their host tiers); the checks are tests/models/hybrid_harness'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helios.core.load import load_core
from tests.models.hybrid_harness import (
    check_batched_equals_alone,
    check_greedy_matches_generate,
    check_logits_and_prompt_logprobs,
    check_second_turn,
    check_tiers,
    prompt,
)
from tests.models.hybrid_tiny import HYBRID_FAMILIES, build_hybrid


def export_hybrid(family: str, root: Path, dtype: str = "float32"):
    """(HF model, LoadedCore) of the family's tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    from ignition.export import ExportOptions, export_core

    src = build_hybrid(family, root / "hf")
    core = load_core(export_core(src, root / "core", ExportOptions(dtype=dtype, prompt_logprobs=True)))
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return hf, core


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid(request, tmp_path_factory):
    hf, core = export_hybrid(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, core


def test_the_export_is_hybrid(hybrid):
    family, hf, core = hybrid
    arch = core.manifest.arch
    assert arch.family == family and arch.layer_types == ["linear", "linear", "linear", "full"]
    assert arch.recurrent.kind == "gated_delta" and arch.attn_output_gate and arch.rotary_dim == 4


def test_logits_and_prompt_logprobs_match(hybrid):
    _, hf, core = hybrid
    check_logits_and_prompt_logprobs(hf, core, prompt(150))


def test_greedy_matches_generate(hybrid):
    _, hf, core = hybrid
    check_greedy_matches_generate(hf, core, prompt(90, seed=5))


def test_sixteen_requests_together_give_what_each_gives_alone(hybrid):
    _, _, core = hybrid
    check_batched_equals_alone(core, [prompt(7 + 23 * i, seed=10 + i) for i in range(16)])


def test_a_second_turn_reuses_the_first_turns_state(hybrid):
    _, _, core = hybrid
    metrics = check_second_turn(core, prompt(100, seed=21), prompt(30, seed=22)).metrics()
    assert metrics.checkpoint_captures["endpoint"] >= 2 and metrics.reused_tokens == 128


def test_a_checkpoint_comes_back_from_host_dram_and_disk_and_after_a_restart(hybrid, tmp_path):
    family, _, core = hybrid
    if family != "qwen3_5":
        pytest.skip("the tiers are the engine's and runner's, not a family's: one family covers them")
    check_tiers(core, tmp_path)
