"""GPU check and decode timing on one CUDA device (run on the lent H200; not part of `make test`).

1. Parity: a tiny random llama core exported by ignition, greedy ids on CUDA (Triton and torch
   attention backends, float32 and bf16) against the CPU path; float32 logits against CPU.
2. Ceilings: device copy bandwidth and bf16 matmul rate measured in this run.
3. Decode: an 8B llama shape with random bf16 weights, batch-1 (and a few batch sizes) through the
   current eager runner, beside HF transformers' eager generate on the same weights; our figure as a
   fraction of the limit (weight + KV bytes per token over the measured copy bandwidth).
Usage: python benchmarks/gpu_decode.py [--skip-8b]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helios.core.manifest import Architecture  # noqa: E402
from helios.engine.messages import EngineRequest, SamplingParams  # noqa: E402


def copy_bandwidth() -> float:
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_()
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    return 2 * n * reps / (e0.elapsed_time(e1) / 1e3)


def matmul_rate() -> float:
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    reps = 20
    for _ in range(reps):
        a @ b
    e1.record()
    torch.cuda.synchronize()
    return 2 * m**3 * reps / (e0.elapsed_time(e1) / 1e3)


def parity() -> list[str]:
    from helios.core.load import load_core
    from helios.runner.model_runner import ModelRunner
    from ignition.export import ExportOptions, export_core
    from tests.ignition.tiny_models import build_tiny
    from tests.models.engine_harness import greedy, make_engine, run, tokens

    lines = []
    tmp = Path(tempfile.mkdtemp())
    for family in ("llama", "qwen3", "gemma3"):
        src = build_tiny(family, tmp / f"src-{family}", seed=0)
        core = load_core(export_core(src, tmp / f"core-{family}", ExportOptions(dtype="float32")))
        prompt = [(7 * i + 3) % 250 + 3 for i in range(37)]
        cpu = make_engine(core, num_pages=64, page_size=16, chunk=16)
        ref = tokens(run(cpu, [EngineRequest(req_id="a", prompt_token_ids=prompt, sampling=greedy(32))])["a"])
        ref_logits = ModelRunner(core.manifest.arch, core.tensors, 64, 16).forward_logits(prompt)
        for backend in ("torch", "triton"):
            for dtype in (torch.float32, torch.bfloat16):
                tensors = {k: v.to("cuda", dtype) for k, v in core.tensors.items()}
                runner = ModelRunner(core.manifest.arch, tensors, 64, 16, device="cuda", attention_backend=backend)
                logits = runner.forward_logits(prompt).float().cpu()
                err = (logits - ref_logits).norm() / ref_logits.norm()
                eng = make_engine(core, num_pages=64, page_size=16, chunk=16)
                eng.runner = ModelRunner(core.manifest.arch, tensors, 64, 16, device="cuda", attention_backend=backend)
                out = tokens(run(eng, [EngineRequest(req_id="a", prompt_token_ids=prompt, sampling=greedy(32))])["a"])
                same = sum(x == y for x, y in zip(out, ref))
                lines.append(f"parity {family:7} {backend:6} {str(dtype)[6:]:9} rel-err {err:.2e}  greedy {same}/32 equal")
    return lines


LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=8192, tie_word_embeddings=False)


def decode_8b(bandwidth: float) -> list[str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from helios.engine.config import SchedulerConfig
    from helios.engine.engine_core import EngineCore
    from helios.runner.model_runner import ModelRunner

    a = LLAMA_8B
    cfg = LlamaConfig(vocab_size=a["vocab_size"], hidden_size=a["hidden_size"], intermediate_size=a["intermediate_size"],
                      num_hidden_layers=a["num_layers"], num_attention_heads=a["num_heads"],
                      num_key_value_heads=a["num_kv_heads"], rms_norm_eps=a["rms_norm_eps"], rope_theta=a["rope_theta"],
                      max_position_embeddings=a["max_position_embeddings"], tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    sd = hf.state_dict()
    t = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
         "lm_head.weight": sd["lm_head.weight"]}
    for i in range(a["num_layers"]):
        p = f"model.layers.{i}."
        t[f"layers.{i}.attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        t[f"layers.{i}.mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        t[f"layers.{i}.attn.qkv.weight"] = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        t[f"layers.{i}.attn.o.weight"] = sd[p + "self_attn.o_proj.weight"]
        t[f"layers.{i}.mlp.gate_up.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        t[f"layers.{i}.mlp.down.weight"] = sd[p + "mlp.down_proj.weight"]
    arch = Architecture(family="llama", **a)
    weight_bytes = sum(v.numel() * v.element_size() for k, v in t.items() if k != "embed.weight")
    weight_bytes += a["hidden_size"] * 2
    lines = []
    prompt_len, new = 128, 64
    for batch in (1, 16, 64):
        page = 16
        pages = batch * ((prompt_len + new) // page + 2)
        config = SchedulerConfig(max_concurrency=batch, max_num_batched_tokens=max(2048, batch), prefill_chunk_size=2048,
                                 page_size=page, num_pages=pages, max_model_len=4096)
        engine = EngineCore(config, ModelRunner(arch, t, pages, page, device="cuda", dtype=torch.bfloat16))
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        for r in range(batch):
            engine.add_request(EngineRequest(req_id=f"r{r}", prompt_token_ids=[(r * 31 + j) % 30000 + 10 for j in range(prompt_len)], sampling=params))
        engine.step()
        engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        tps = batch * steps / (time.perf_counter() - t0)
        kv_bytes = batch * (prompt_len + new // 2) * a["num_layers"] * 2 * a["num_kv_heads"] * a["head_dim"] * 2
        limit = bandwidth / (weight_bytes + kv_bytes) * batch
        lines.append(f"helios eager decode batch {batch:3}: {tps:8.1f} tok/s  limit {limit:8.1f}  ({tps / limit:.1%})")
        del engine
        torch.cuda.empty_cache()
    ids = torch.randint(10, 30000, (1, prompt_len), device="cuda")
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        torch.cuda.synchronize()
        lines.append(f"HF transformers eager generate batch 1: {new / (time.perf_counter() - t0):8.1f} tok/s")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-8b", action="store_true")
    args = parser.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    bw = copy_bandwidth()
    mm = matmul_rate()
    lines = [f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s"]
    lines += parity()
    print("\n".join(lines), flush=True)
    if not args.skip_8b:
        lines += decode_8b(bw)
    print("\n=== summary ===")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
