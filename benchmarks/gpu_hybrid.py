"""Hybrid models on the GPU (issue 20's bars): decode b=1 and b=64 and a 4096-token prefill of a dense and a MoE
gated-delta hybrid at published shapes with random bf16 weights, HF transformers on the same weights beside.
Not part of `make test`; run on the lent H200.

Shapes: transformers' Qwen3_5TextConfig defaults (dense, 32 layers: 24 GDN + 8 gated attention, hidden 4096, ~9B)
and Qwen3_5MoeTextConfig defaults (256 experts top-8 + a shared expert, hidden 2048: ~35B-A3B) at 20 of its 40
layers. The
weights reach helios through ignition's own arch module (the checkpoint handed over in memory: no core on disk).

Limits (per step, over the copy bandwidth measured in this run): decode reads the weights once (a MoE: the experts
the step's tokens route to, counted from the router's choices where that is cheap; here bounded below by the
active experts of one token at b=1 and by the distinct experts of the step at b=64, taken as all at b=64 since 64
tokens x top-8 of 256 touch nearly all), the KV of the attention layers, and each request's recurrent state read
and written (float32). Prefill: 2 x params x tokens + the causal attention FLOPs over the measured bf16 matmul rate.
Usage: python benchmarks/gpu_hybrid.py [--families qwen3_5,qwen3_5_moe] [--batches 1,64] [--skip-hf]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_decode import copy_bandwidth, matmul_rate  # noqa: E402
from helios.engine.messages import EngineRequest, SamplingParams  # noqa: E402

PAGE = 16
PROMPT, NEW = 128, 64


def hf_model(family: str):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    # NOTE: the MoE at half its 40 layers (each layer at its published shape): the HF model and helios' stacked
    # expert copies of the whole one would not fit one H200 together
    cls, cfg = {"qwen3_5": (Qwen3_5ForCausalLM, Qwen3_5TextConfig()),
                "qwen3_5_moe": (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(num_hidden_layers=20))}[family]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(cfg).to(torch.bfloat16).eval()
    return model, cfg


def helios_tensors(model, cfg):
    """The HF model's weights through ignition's arch module, on the GPU (views where no transform applies)."""
    from ignition.archs import convert
    from ignition.sources.base import Checkpoint, LazyTensor

    sd = model.state_dict()
    lazy = {k: LazyTensor(tuple(v.shape), "bfloat16", (lambda v=v: v)) for k, v in sd.items()}
    ckpt = Checkpoint(config=cfg.to_dict(), tensors=lazy, tokenizer_json="{}", tokenizer_config={},
                      chat_template=None, identifier=f"random-{cfg.model_type}")
    arch, plan = convert(ckpt, torch.bfloat16)
    return arch, {name: produce().to("cuda") for name, produce in plan}


def is_expert(name: str, tensor: torch.Tensor) -> bool:
    """A routed experts' stacked weight ([E, out, in]: layers.N.moe.gate_up / .down)."""
    return ".moe." in name and tensor.dim() == 3


def decode_bytes(arch, t: dict, batch: int, ctx: int) -> float:
    """Bytes one decode step must move: weights (MoE experts: top-k of one token at b=1, all at b>=64), the attention
    layers' KV up to ctx, each request's state read + written."""
    from helios.runner.state_cache import StateCache

    expert_bytes = sum(v.numel() * v.element_size() for k, v in t.items() if is_expert(k, v))
    dense = sum(v.numel() * v.element_size() for k, v in t.items() if k != "embed.weight" and not is_expert(k, v))
    moe = arch.moe
    if moe is not None:
        share = 1.0 if batch >= 64 else min(1.0, batch * moe.num_experts_per_tok / moe.num_experts)
        expert_bytes *= share
    kv = batch * ctx * len(arch.attention_layers) * 2 * arch.num_kv_heads * arch.head_dim * 2
    state = 2 * batch * StateCache.bytes_per_slot(arch, torch.bfloat16)
    return dense + expert_bytes + kv + state + batch * arch.hidden_size * 2


def engine(runner, arch, batch: int):
    from helios.engine.config import SchedulerConfig
    from helios.engine.engine_core import EngineCore

    config = SchedulerConfig(max_concurrency=batch, max_num_batched_tokens=max(4096, batch), prefill_chunk_size=4096,
                             page_size=PAGE, num_pages=runner.num_pages, max_model_len=8192,
                             num_state_slots=runner.state_cache.num_slots, state_chunk=arch.recurrent.chunk_size)
    runner.requests.clear()
    return EngineCore(config, runner)


def timed_decode(runner, arch, batch: int) -> float:
    eng = engine(runner, arch, batch)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for r in range(batch):
        eng.add_request(EngineRequest(req_id=f"b{batch}-{r}", prompt_token_ids=[(r * 31 + j) % 30000 + 10
                                                                                for j in range(PROMPT)],
                                      sampling=params))
    for _ in range(8):  # prefill and the first decode steps outside the clock
        eng.step()
    torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if eng.error:
            raise RuntimeError(eng.error)
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def timed_prefill(runner, arch, n: int = 4096) -> float:
    best = 0.0
    for rep in range(3):
        eng = engine(runner, arch, 1)
        ids = [(7 * j + 1009 * rep) % 30000 + 10 for j in range(n)]  # another prompt each time: no prefix hit
        eng.add_request(EngineRequest(req_id=f"p{rep}", prompt_token_ids=ids,
                                      sampling=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        torch.cuda.synchronize()
        if rep:  # the first compiles / autotunes
            best = max(best, n / (time.perf_counter() - t0))
    return best


def prefill_flops(arch, t: dict, n: int) -> float:
    params = sum(v.numel() for k, v in t.items() if k != "embed.weight" and not is_expert(k, v))
    if arch.moe is not None:
        experts = sum(v.numel() for k, v in t.items() if is_expert(k, v))
        params += experts * arch.moe.num_experts_per_tok / arch.moe.num_experts
    attn = 2 * n * n * arch.num_heads * arch.head_dim * len(arch.attention_layers)  # causal QK^T + PV
    return 2 * params * n + attn


def hf_decode(model, new: int = NEW) -> float:
    """HF generate at batch 1 on its torch reference ops (with fla installed it would take fla's kernels, whose
    autotuning for its shapes takes minutes on a fresh machine)."""
    from tests.gpu.family_cuda import hf_torch_path

    hf_torch_path(model)
    ids = torch.randint(10, 30000, (1, PROMPT), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        torch.cuda.synchronize()
    return new / (time.perf_counter() - t0)


def run_family(family: str, batches: list[int], bandwidth: float, matmul: float, hf: bool) -> None:
    from helios.runner.model_runner import ModelRunner

    t0 = time.perf_counter()
    model, cfg = hf_model(family)
    arch, t = helios_tensors(model, cfg)
    num_params = sum(v.numel() for k, v in t.items())
    print(f"== {family}: {num_params / 1e9:.1f} B params, {len(arch.recurrent_layers)} GDN + "
          f"{len(arch.attention_layers)} attention layers (built in {time.perf_counter() - t0:.0f} s)", flush=True)
    num_pages = max(batches) * ((PROMPT + NEW) // PAGE + 2) + 4096 // PAGE + 64
    t0 = time.perf_counter()
    runner = ModelRunner(arch, t, num_pages, PAGE, device="cuda", dtype=torch.bfloat16, max_model_len=8192,
                         num_state_slots=max(batches))
    print(f"runner: {runner.startup.summary()} ({time.perf_counter() - t0:.1f} s); graphs: {runner.startup.graphs}",
          flush=True)
    for batch in batches:
        tps = timed_decode(runner, arch, batch)
        limit = bandwidth / decode_bytes(arch, t, batch, PROMPT + NEW // 2) * batch
        print(f"helios {family} decode b={batch:3}: {tps:8.1f} tok/s  limit {limit:8.1f}  ({tps / limit:.1%})  "
              f"launches {dict(runner.launches)}", flush=True)
    tps = timed_prefill(runner, arch)
    achieved = prefill_flops(arch, t, 4096) * tps / 4096
    print(f"helios {family} prefill 4096: {tps:8.0f} tok/s = {achieved / 1e12:.0f} TFLOP/s "
          f"({achieved / matmul:.1%} of the matmul rate)", flush=True)
    del runner
    torch.cuda.empty_cache()
    if hf:
        tps = hf_decode(model)
        limit = bandwidth / decode_bytes(arch, t, 1, PROMPT + NEW // 2)
        print(f"HF transformers {family} generate b=1: {tps:8.1f} tok/s ({tps / limit:.1%})", flush=True)
    del model, t
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="qwen3_5,qwen3_5_moe")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    bandwidth, matmul = copy_bandwidth(), matmul_rate()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e9:.0f} GB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s",
          flush=True)
    for family in args.families.split(","):
        run_family(family, [int(b) for b in args.batches.split(",")], bandwidth, matmul, not args.skip_hf)


if __name__ == "__main__":
    main()
