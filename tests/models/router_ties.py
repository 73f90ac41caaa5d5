"""Router near-ties of a tiny MoE family's HF float32 model on one request of the batched GPU check
(tests/gpu/family_cuda.check_batched_on_cuda: request i's prompt is hybrid_harness.prompt(7 + 23 i, seed=10 + i)),
followed by the tokens it generated: for each MoE layer, the gap between the k-th and the (k+1)-th expert's
probability at the last positions. A gap near float32 rounding is a routing tie: a batch and a row alone may pick
different experts there, and the output then moves by far more than a rounding (the tie rule of the test sees the
output logits only). Session 27: qwen3_next's request 2 after [117, 23, 141, 285, 166] has layer 2 at 1.75e-05, where
the 16-together test parts (output 5: 80 together, 79 alone, 0.224 apart).

Usage: python -m tests.models.router_ties qwen3_next --request 2 --tokens 117,23,141,285,166 [--last 6]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from tests.models.hybrid_harness import prompt
from tests.models.hybrid_tiny import HYBRID_FAMILIES, build_hybrid


def router_gaps(family: str, ids: list[int], workdir: Path) -> tuple[list[tuple[str, list[float]]], torch.Tensor]:
    """((MoE gate module name, top-k vs next expert probability gap per position), the last position's logits)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(build_hybrid(family, workdir / "hf"),
                                                              dtype=torch.float32).eval()
    return model_router_gaps(model, ids)


@torch.no_grad()
def model_router_gaps(model, ids: list[int]) -> tuple[list[tuple[str, list[float]]], torch.Tensor]:
    """router_gaps of a loaded HF model (softmax routers: every `*mlp.gate` module whose first output is
    [tokens, num_experts] router logits), run on `ids` on the model's device."""
    top_k, num_experts = model.config.num_experts_per_tok, model.config.num_experts
    gaps: list[tuple[str, list[float]]] = []

    def hook(name):
        def record(module, inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            probs = torch.softmax(logits.reshape(-1, num_experts).float(), dim=-1)
            top = probs.topk(top_k + 1, dim=-1).values
            gaps.append((name, (top[:, top_k - 1] - top[:, top_k]).tolist()))
        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules()
               if name.endswith("mlp.gate")]
    try:
        device = next(model.parameters()).device
        logits = model(torch.tensor([ids], device=device)).logits[0, -1]
    finally:
        for handle in handles:
            handle.remove()
    return gaps, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=[f for f in HYBRID_FAMILIES if f != "qwen3_5"])
    parser.add_argument("--request", type=int, default=0)
    parser.add_argument("--tokens", default="", help="the tokens generated so far (comma list)")
    parser.add_argument("--last", type=int, default=6, help="positions shown per layer")
    args = parser.parse_args()
    ids = prompt(7 + 23 * args.request, seed=10 + args.request)
    ids += [int(t) for t in args.tokens.split(",") if t]
    with tempfile.TemporaryDirectory() as tmp:
        gaps, logits = router_gaps(args.family, ids, Path(tmp))
    for name, per_position in gaps:
        shown = " ".join(f"{g:.2e}" for g in per_position[-args.last:])
        print(f"{name}: last {args.last} positions {shown}; smallest anywhere {min(per_position):.2e}")
    top = torch.log_softmax(logits.float(), dim=-1).topk(3)
    print("next token, top 3:", [(int(i), round(float(v), 4)) for v, i in zip(top.values, top.indices)])


if __name__ == "__main__":
    main()
