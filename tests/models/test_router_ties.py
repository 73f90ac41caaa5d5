"""tests/models/router_ties.model_router_gaps, which the GPU batched check's router-tie rule (tests/gpu/family_cuda.
router_tie) reads: per MoE layer and position, the gap between the k-th and (k+1)-th expert's softmax probability,
checked against the same quantity computed here from each router's own input and weight."""

from __future__ import annotations

import torch

from tests.models.hybrid_harness import prompt
from tests.models.hybrid_tiny import hybrid_model
from tests.models.router_ties import model_router_gaps


def test_router_gaps_are_each_routers_top_k_margin_at_every_position():
    model = hybrid_model("qwen3_next").float()
    top_k = model.config.num_experts_per_tok
    inputs = {}

    def keep(name):
        def hook(module, args, output):
            inputs[name] = args[0].detach()
        return hook

    handles = [m.register_forward_hook(keep(name)) for name, m in model.named_modules() if name.endswith("mlp.gate")]
    ids = prompt(13, seed=3)
    with torch.no_grad():
        want_logits = model(torch.tensor([ids])).logits[0, -1]
    for h in handles:
        h.remove()
    gaps, logits = model_router_gaps(model, ids)
    assert [name for name, _ in gaps] == sorted(inputs, key=lambda n: int(n.split(".")[2]))
    assert len(gaps) == model.config.num_hidden_layers  # every layer of the tiny config is MoE
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    for name, per_position in gaps:
        gate = model.get_submodule(name)
        probs = torch.softmax(torch.nn.functional.linear(inputs[name].reshape(-1, gate.weight.shape[1]), gate.weight)
                              .float(), dim=-1)
        top = probs.topk(top_k + 1, dim=-1).values
        want = (top[:, top_k - 1] - top[:, top_k]).tolist()
        assert len(per_position) == len(ids) and min(per_position) >= 0
        torch.testing.assert_close(torch.tensor(per_position), torch.tensor(want), rtol=0, atol=1e-7)
    assert not any(h for m in model.modules() for h in m._forward_hooks.values())  # its hooks removed
