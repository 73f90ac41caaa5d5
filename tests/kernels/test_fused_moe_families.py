"""Every MoE family's own block on the Triton backend takes helios.kernels.fused_moe (Triton's CPU interpreter here):
built by the family's model class from its tiny checkpoint's Architecture (the family's routing options: moe_cases.
family_builders), the fused block = the torch backend's block with the same random weights, and
helios.runner.cuda_graphs.unsupported_reason no longer refuses the model for its MoE (what may refuse it still is
another part: indexed attention, attention layers that are not helios.layers.attention.Attention)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import require_interpreter

require_interpreter()

from helios.kernels.backend import TritonAttentionBackend  # noqa: E402  (after the interpreter check)
from helios.layers.attention import select_attention_backend  # noqa: E402
from helios.runner.cuda_graphs import unsupported_reason  # noqa: E402
from tests.kernels import moe_cases  # noqa: E402
from tests.kernels.moe_cases import MOE_REFUSAL  # noqa: E402


@pytest.fixture(scope="module")
def arch_of(tmp_path_factory):
    """family -> its tiny checkpoint's Architecture, built on first use."""
    return moe_cases.arch_getter(tmp_path_factory.mktemp("fused-moe-families"))


@pytest.mark.parametrize("family", list(moe_cases.family_builders()))
def test_the_family_block_takes_the_fused_path_and_matches_its_torch_path(arch_of, family):
    arch = arch_of(family)
    eager = moe_cases.unbound_model(arch, select_attention_backend("torch"))
    fused = moe_cases.unbound_model(arch, TritonAttentionBackend())
    cuda = torch.device("cuda")  # a device object only: nothing runs there
    assert unsupported_reason(eager, arch, cuda).startswith(MOE_REFUSAL)
    reason = unsupported_reason(fused, arch, cuda)
    assert reason is None or not reason.startswith(MOE_REFUSAL), reason
    torch_blocks, fused_blocks = moe_cases.moe_blocks(eager), moe_cases.moe_blocks(fused)
    assert all(b.fused for b in fused_blocks.values()) and not any(b.fused for b in torch_blocks.values())
    token_ids = torch.tensor([3, 17, 5])
    for i, name in enumerate(moe_cases.blocks_to_run(family, fused_blocks)):
        pair = [torch_blocks[name], fused_blocks[name]]
        moe_cases.bind_block_weights(pair, arch.moe.num_experts, seed=i)
        x = moe_cases.inputs(3, arch.hidden_size, torch.float32, seed=7 + i)
        with torch.inference_mode():
            want, got = (moe_cases.run_block(b, family, x, token_ids) for b in pair)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{family} {name}: {m}")
