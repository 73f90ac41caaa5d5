"""The recipes' new families on the GPU (issues 20 and 21): decode b=1 and b=64 and a 4096-token prefill at published
shapes with random bf16 weights, HF transformers on the same weights beside. Not part of `make test`; run on the
lent H200 (`--tiny --device cpu` runs the same code on tiny configs here, a check of the plumbing only).

Families (transformers' config defaults = the published shapes; a MoE at a subset of its layers, each at its
published shape, so that HF's model and helios' copies fit one H200 together):
  qwen3_5       dense gated-delta hybrid, 32 layers: 24 GDN + 8 gated attention, hidden 4096 (~9B)  [issue 20]
  qwen3_5_moe   MoE gated-delta hybrid (256 experts top-8 + shared, hidden 2048), 20 of 40 layers    [issue 20]
  mimo_v2_flash MoE with sliding windows (128-token window, sinks; 256 experts top-8, hidden 4096), its first 4 of
                48 layers (full, 3 sliding; dense, 3 MoE)                                                [issue 21]
  kimi_linear   MoE with MLA (latent 512 + rope 64 per token) beside KDA layers (256 experts top-8, hidden 2304),
                14 of 27 layers                                                                          [issue 21]

Limits (per step, over the copy bandwidth measured in this run): decode reads the weights once (a MoE: the experts
the step's tokens route to: the active experts of one token at b=1, at b=64 the expected distinct share under
uniform routing, 1 - (1 - k/E)^b: 87% for 64 tokens x top-8 of 256), the KV of the attention layers (a sliding layer's at most its window; MLA's latent rows), and
each request's recurrent state read and written (float32). Prefill: 2 x active params x tokens + attention FLOPs
(causal: n^2 x heads x (qk + v dims); sliding: 2 n W heads (qk + v)) over the measured bf16 matmul rate.
Usage: python benchmarks/gpu_hybrid.py [--families qwen3_5,qwen3_5_moe,mimo_v2_flash,kimi_linear] [--batches 1,64]
       [--skip-hf] [--profile 1,64] [--variants 'HELIOS_PDL=1;...']
       [--prefill-variants 'HELIOS_MOE_PREFILL=grouped;...'] [--dump-fla OUT.json] [--tiny --device cpu]
HELIOS_* switches (helios.switches) apply to every runner; --variants times batch 1 again under each switch set.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_decode import copy_bandwidth, matmul_rate  # noqa: E402
from helios.engine.messages import EngineRequest, SamplingParams  # noqa: E402
from helios.switches import Switches  # noqa: E402

# the process's execution switches, read once here (`HELIOS_PDL=1 python3 benchmarks/gpu_hybrid.py` runs with them)
SWITCHES = Switches.from_environ(os.environ)

PAGE = 16
PROMPT, NEW = 128, 64


def hf_config(family: str, tiny: bool = False):
    """(HF model class, its config): the published shape at the layer count the docstring gives, or a tiny one."""
    import transformers as T

    if family == "qwen3_5":
        cls, cfg = T.Qwen3_5ForCausalLM, T.Qwen3_5TextConfig()
    elif family == "qwen3_5_moe":
        cls, cfg = T.Qwen3_5MoeForCausalLM, T.Qwen3_5MoeTextConfig(num_hidden_layers=20)
    elif family == "mimo_v2_flash":
        base = T.MiMoV2FlashConfig()
        cls, cfg = T.MiMoV2FlashForCausalLM, T.MiMoV2FlashConfig(
            num_hidden_layers=4, layer_types=base.layer_types[:4], mlp_layer_types=base.mlp_layer_types[:4])
    elif family == "kimi_linear":
        base = T.KimiLinearConfig()
        cls, cfg = T.KimiLinearForCausalLM, T.KimiLinearConfig(
            num_hidden_layers=14, layer_types=base.layer_types[:14], mlp_layer_types=base.mlp_layer_types[:14])
    else:
        raise SystemExit(f"unknown family {family!r}")
    if family in LAYERS:  # fewer layers (--layers): the first n of the pattern, e.g. to fit an 80 GB card
        cfg = cut_layers(cfg, LAYERS[family])
    if tiny:  # the same family and layer pattern, every width small
        shrink = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=24, vocab_size=30010, shared_expert_intermediate_size=32,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, v_head_dim=16, kv_lora_rank=32, qk_rope_head_dim=8,
                      qk_nope_head_dim=16, linear_head_dim=16, linear_num_heads=4, num_experts=8, n_routed_experts=8,
                      num_experts_per_tok=2, num_experts_per_token=2, sliding_window=32, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
        if family == "kimi_linear":  # MLA: a K/V head per query head
            shrink["num_key_value_heads"] = shrink["num_attention_heads"]
        d = cfg.to_dict()
        cfg = type(cfg)(**{**d, **{k: v for k, v in shrink.items() if k in d}})
    return cls, cfg


LAYERS: dict[str, int] = {}  # --layers: family -> layer count


def cut_layers(cfg, n: int):
    """The config at its first n layers: num_hidden_layers and every per-layer list (layer_types, mlp_layer_types)."""
    d = cfg.to_dict()
    total = d["num_hidden_layers"]
    if not 1 <= n <= total:
        raise SystemExit(f"--layers {cfg.model_type}={n}: between 1 and {total}")
    cut = {k: v[:n] for k, v in d.items() if isinstance(v, list) and len(v) == total}
    return type(cfg)(**{**d, **cut, "num_hidden_layers": n})


def hf_model(family: str, device: str = "cuda", tiny: bool = False):
    """The HF model of `family` with random bf16 weights (seeded: the same weights every call), and its config."""
    cls, cfg = hf_config(family, tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16).eval()
    return model, cfg


def helios_tensors(model, cfg, device: str = "cuda"):
    """The HF model's weights through ignition's arch module, on `device` (views where no transform applies)."""
    from ignition.archs import convert
    from ignition.sources.base import Checkpoint, LazyTensor

    sd = model.state_dict()
    lazy = {k: LazyTensor(tuple(v.shape), "bfloat16", (lambda v=v: v)) for k, v in sd.items()}
    ckpt = Checkpoint(config=cfg.to_dict(), tensors=lazy, tokenizer_json="{}", tokenizer_config={},
                      chat_template=None, identifier=f"random-{cfg.model_type}")
    arch, plan = convert(ckpt, torch.bfloat16)
    return arch, {name: produce().to(device) for name, produce in plan}


def is_expert(name: str, tensor: torch.Tensor) -> bool:
    """A routed experts' stacked weight ([E, out, in]: layers.N.moe.gate_up / .down)."""
    return ".moe." in name and tensor.dim() == 3


def kv_bytes(arch, batch: int, ctx: int) -> float:
    """Bytes the attention layers' KV of `batch` requests at context ctx take (bf16): each KV layer's values per
    token (MLA: its latent and rope key) over min(ctx, window) tokens for a sliding layer."""
    from helios.runner.kv_cache import KVCache

    total = 0
    for i in arch.kv_layers:
        sliding = arch.layer_types and arch.layer_types[i] == "sliding" and arch.sliding_window
        total += KVCache.values_per_token(arch, i) * (min(ctx, arch.sliding_window) if sliding else ctx)
    return 2.0 * batch * total


def decode_bytes(arch, t: dict, batch: int, ctx: int) -> float:
    """Bytes one decode step must move: weights (MoE experts: top-k of one token at b=1, all at b>=64), the attention
    layers' KV up to ctx, each request's state read + written."""
    from helios.runner.state_cache import StateCache

    expert_bytes = sum(v.numel() * v.element_size() for k, v in t.items() if is_expert(k, v))
    dense = sum(v.numel() * v.element_size() for k, v in t.items() if k != "embed.weight" and not is_expert(k, v))
    moe = arch.moe
    if moe is not None:
        # the expected share of experts `batch` tokens touch, routing uniform (b=1: top-k of E exactly; b=64, top-8
        # of 256: 87%); a skewed routing touches fewer, so this counts at least the bytes a real step reads
        share = 1.0 - (1.0 - moe.num_experts_per_tok / moe.num_experts) ** batch
        expert_bytes *= share
    state = 2 * batch * StateCache.bytes_per_slot(arch, torch.bfloat16) if arch.recurrent is not None else 0
    return dense + expert_bytes + kv_bytes(arch, batch, ctx) + state + batch * arch.hidden_size * 2


def engine(runner, arch, batch: int):
    from helios.engine.config import SchedulerConfig
    from helios.engine.engine_core import EngineCore

    recurrent = arch.recurrent is not None
    windows = dict(sliding_window=arch.sliding_window, window_pages=runner.window_pages) if runner.window_pages else {}
    config = SchedulerConfig(max_concurrency=batch, max_num_batched_tokens=max(4096, batch), prefill_chunk_size=4096,
                             page_size=PAGE, num_pages=runner.num_pages, max_model_len=8192,
                             num_state_slots=runner.state_cache.num_slots if recurrent else 0,
                             state_chunk=arch.recurrent.chunk_size if recurrent else 0, **windows)
    runner.requests.clear()
    return EngineCore(config, runner)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_decode(runner, arch, batch: int, device: str = "cuda") -> float:
    eng = engine(runner, arch, batch)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    vocab = min(30000, arch.vocab_size - 10)
    for r in range(batch):
        eng.add_request(EngineRequest(req_id=f"b{batch}-{r}", prompt_token_ids=[(r * 31 + j) % vocab + 10
                                                                                for j in range(PROMPT)],
                                      sampling=params))
    for _ in range(8):  # prefill and the first decode steps outside the clock
        eng.step()
    sync(device)
    t0, steps = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if eng.error:
            raise RuntimeError(eng.error)
    sync(device)
    return batch * steps / (time.perf_counter() - t0)


def kernel_table(prof, steps: int, label: str, rows: int = 25) -> list[str]:
    """A torch.profiler run's GPU ops per step: span and busy time, then the kernels by total time (count per step,
    mean duration). Graph replays show their kernels one by one."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    kernels = sorted((float(e["ts"]), float(e.get("dur", 0)), e["name"]) for e in trace.get("traceEvents", [])
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not kernels:
        return [f"profile {label}: no GPU events traced"]
    span = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
    busy, cur_s, cur_e = 0.0, kernels[0][0], kernels[0][0] + kernels[0][1]
    for ts, dur, _ in kernels[1:]:
        if ts > cur_e:
            busy, cur_s, cur_e = busy + cur_e - cur_s, ts, ts + dur
        else:
            cur_e = max(cur_e, ts + dur)
    busy += cur_e - cur_s
    groups: dict[str, list[float]] = {}
    for _, dur, name in kernels:
        groups.setdefault(name[:90], []).append(dur)
    lines = [f"profile {label}: {len(kernels) / steps:.0f} GPU ops/step, span {span / steps:.1f} us/step, busy "
             f"{busy / steps:.1f} us/step"]
    for name, durs in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        lines.append(f"  {sum(durs) / steps:9.1f} us/step  x{len(durs) / steps:5.1f}  {sum(durs) / len(durs):7.1f} us  "
                     f"{name}")
    return lines


def profile_decode(runner, arch, batch: int, steps: int = 8) -> list[str]:
    """Kernels of `steps` engine decode steps at `batch` under torch.profiler (kernel_table)."""
    from torch.profiler import ProfilerActivity, profile

    eng = engine(runner, arch, batch)
    vocab = min(30000, arch.vocab_size - 10)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for r in range(batch):
        eng.add_request(EngineRequest(req_id=f"p{batch}-{r}", prompt_token_ids=[(r * 37 + j) % vocab + 10
                                                                                for j in range(PROMPT)],
                                      sampling=params))
    for _ in range(8):
        eng.step()
    sync("cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        sync("cuda")
    while eng.has_unfinished_requests():
        eng.step()
    return kernel_table(prof, steps, f"decode b={batch}")


def profile_prefill(runner, arch, n: int = 4096) -> list[str]:
    """Kernels of one n-token prefill (after timed_prefill's warm-up) under torch.profiler (kernel_table)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = min(30000, arch.vocab_size - 10)
    eng = engine(runner, arch, 1)
    eng.add_request(EngineRequest(req_id="prof", prompt_token_ids=[(11 * j + 5) % vocab + 10 for j in range(n)],
                                  sampling=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
    sync("cuda")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], with_stack=False) as prof:
        while eng.has_unfinished_requests():
            eng.step()
        sync("cuda")
    return kernel_table(prof, 1, f"prefill {n}", rows=30) + host_table(prof, f"prefill {n}")


def layer_host_times(runner, arch, n: int = 4096) -> list[str]:
    """Host time of one n-token prefill by model part: forward hooks on each layer's direct children (mixer, MoE,
    MLP, norms) time their Python calls (launches queue; nothing waits unless the part synchronizes), against the
    whole step's host and device time. A part whose host time exceeds its kernels' keeps the GPU waiting."""
    model = runner.model
    spent: dict[str, float] = {}
    starts: dict[int, float] = {}
    handles = []

    def pre(module, _args):
        starts[id(module)] = time.perf_counter()

    def post_for(key: str):
        def post(module, _args, _out):
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - starts.pop(id(module))
        return post

    # NOTE: the children only: the fused path calls a layer's forward_fused, which no module hook sees
    for i, layer in enumerate(model.layers):
        kind = arch.layer_types[i] if arch.layer_types else "attention"
        for name, child in layer.named_children():
            handles.append(child.register_forward_pre_hook(pre))
            handles.append(child.register_forward_hook(post_for(f"{kind}.{name}")))
    vocab = min(30000, arch.vocab_size - 10)
    try:
        eng = engine(runner, arch, 1)
        eng.add_request(EngineRequest(req_id="host", prompt_token_ids=[(13 * j + 7) % vocab + 10 for j in range(n)],
                                      sampling=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
        sync(runner.device.type)
        t0 = time.perf_counter()
        steps = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        host = time.perf_counter() - t0
        sync(runner.device.type)
        wall = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    lines = [f"host times prefill {n}: {steps} steps, host {host * 1e3:.1f} ms (the steps' calls), "
             f"wall {wall * 1e3:.1f} ms (to the device's end)"]
    for key, sec in sorted(spent.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {sec * 1e3:8.2f} ms  {key}")
    return lines


def host_table(prof, label: str, rows: int = 30) -> list[str]:
    """The host side of a profiled run: CUDA runtime / driver calls (launches, synchronizations, copies) by total
    time, then the torch ops and Python-launched Triton kernels by self CPU time: where a host-bound step spends it."""
    events = prof.key_averages()
    runtime = [e for e in events if e.key.startswith("cu")]  # cuda* (runtime) and cu* (driver) calls
    ops = [e for e in events if not e.key.startswith("cu")]
    total = sum(e.self_cpu_time_total for e in events)
    lines = [f"host {label}: {total / 1e3:.1f} ms of self CPU time in {sum(e.count for e in events)} recorded events"]
    for e in sorted(runtime, key=lambda e: -e.cpu_time_total)[:12]:
        per_call = e.cpu_time_total / max(e.count, 1)
        lines.append(f"  {e.cpu_time_total / 1e3:8.2f} ms  x{e.count:6d}  {per_call:7.1f} us  {e.key[:80]}")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:rows]:
        lines.append(f"  {e.self_cpu_time_total / 1e3:8.2f} ms self  x{e.count:6d}  {e.cpu_time_total / 1e3:8.2f} ms "
                     f"total  {e.key[:80]}")
    return lines


def timed_prefill(runner, arch, n: int = 4096, device: str = "cuda") -> float:
    best = 0.0
    vocab = min(30000, arch.vocab_size - 10)
    for rep in range(3):
        eng = engine(runner, arch, 1)
        ids = [(7 * j + 1009 * rep) % vocab + 10 for j in range(n)]  # another prompt each time: no prefix hit
        eng.add_request(EngineRequest(req_id=f"p{rep}", prompt_token_ids=ids,
                                      sampling=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
        sync(device)
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        sync(device)
        if rep:  # the first compiles / autotunes
            best = max(best, n / (time.perf_counter() - t0))
    return best


def prefill_flops(arch, t: dict, n: int) -> float:
    params = sum(v.numel() for k, v in t.items() if k != "embed.weight" and not is_expert(k, v))
    if arch.moe is not None:
        experts = sum(v.numel() for k, v in t.items() if is_expert(k, v))
        params += experts * arch.moe.num_experts_per_tok / arch.moe.num_experts
    if arch.mla is not None:  # prefill's expanded form
        qk, v = arch.mla.qk_nope_head_dim + arch.mla.qk_rope_head_dim, arch.mla.v_head_dim
    else:
        qk, v = arch.head_dim, arch.v_head_dim or arch.head_dim
    attn = 0.0
    for i in arch.attention_layers:
        if arch.layer_types and arch.layer_types[i] == "sliding" and arch.sliding_window:
            attn += 2.0 * n * min(n, arch.sliding_window) * arch.num_heads * (qk + v)
        else:  # causal: n^2 / 2 query-key pairs, 2 FLOPs each, for QK^T and PV
            attn += 1.0 * n * n * arch.num_heads * (qk + v)
    return 2 * params * n + attn


def hf_decode(model, new: int = NEW, device: str = "cuda") -> float:
    """HF generate at batch 1 on its torch reference ops (with fla installed it would take fla's kernels, whose
    autotuning for its shapes takes minutes on a fresh machine)."""
    from tests.gpu.family_cuda import hf_torch_path

    hf_torch_path(model)
    ids = torch.randint(10, min(30000, model.config.vocab_size), (1, PROMPT), device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        sync(device)
    return new / (time.perf_counter() - t0)


def free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def variant_switches(variant: str) -> Switches:
    """The process's switches with a variant's space-separated NAME=VALUE pairs on top."""
    return Switches.from_environ(dict(os.environ, **dict(pair.split("=", 1) for pair in variant.split())))


def build_runner(arch, t: dict, batches: list[int], device: str, switches: Switches = SWITCHES):
    """The runner at the benchmark's largest batch: KV pages for every request and one 4096-token prompt, a sliding
    layers' window group sized as compose sizes it, a state slot per request of a hybrid."""
    from helios.engine.kv_groups import window_pages_per_request
    from helios.runner.kv_cache import KVCache
    from helios.runner.model_runner import ModelRunner

    num_pages = max(batches) * ((PROMPT + NEW) // PAGE + 2) + 4096 // PAGE + 64
    window_pages = 0
    if KVCache.window_layers(arch):
        window_pages = max(batches) * window_pages_per_request(arch.sliding_window, PAGE, 4096)
    return ModelRunner(arch, t, num_pages, PAGE, device=device, dtype=torch.bfloat16, max_model_len=8192,
                       num_state_slots=max(batches) if arch.recurrent is not None else 0, window_pages=window_pages,
                       switches=switches)


def run_family(family: str, batches: list[int], bandwidth: float, matmul: float, hf: bool, device: str = "cuda",
               tiny: bool = False, profile_batches: tuple[int, ...] = (), variants: tuple[str, ...] = (),
               prefill_variants: tuple[str, ...] = ()) -> None:
    t0 = time.perf_counter()
    model, cfg = hf_model(family, device, tiny)
    arch, t = helios_tensors(model, cfg, device)
    del model  # HF's copy comes back (same seed, same weights) after helios' runs: both would not fit together
    free(device)
    num_params = sum(v.numel() for k, v in t.items())
    print(f"== {family}: {num_params / 1e9:.1f} B params, {len(arch.recurrent_layers)} recurrent + "
          f"{len(arch.attention_layers)} attention layers (built in {time.perf_counter() - t0:.0f} s)", flush=True)
    t0 = time.perf_counter()
    runner = build_runner(arch, t, batches, device)
    print(f"runner: {runner.startup.summary()} ({time.perf_counter() - t0:.1f} s); graphs: {runner.startup.graphs}",
          flush=True)
    for batch in batches:
        tps = timed_decode(runner, arch, batch, device)
        limit = bandwidth / decode_bytes(arch, t, batch, PROMPT + NEW // 2) * batch
        print(f"helios {family} decode b={batch:3}: {tps:8.1f} tok/s  limit {limit:8.1f}  ({tps / limit:.1%})  "
              f"launches {dict(runner.launches)}", flush=True)
        if batch in profile_batches and device == "cuda":
            print("\n".join(profile_decode(runner, arch, batch)), flush=True)
    for variant in variants:  # batch 1 again under other switches, over the same weights
        other = build_runner(arch, t, [1], device, variant_switches(variant))
        tps = timed_decode(other, arch, 1, device)
        limit = bandwidth / decode_bytes(arch, t, 1, PROMPT + NEW // 2)
        print(f"helios {family} decode b=  1, {variant}: {tps:8.1f} tok/s  limit {limit:8.1f}  ({tps / limit:.1%})"
              f"  launches {dict(other.launches)}", flush=True)
        if 1 in profile_batches and device == "cuda":
            print("\n".join(profile_decode(other, arch, 1)), flush=True)
        del other
        free(device)
    n = 256 if tiny else 4096

    def prefill(on, label: str = "") -> None:
        tps = timed_prefill(on, arch, n, device)
        achieved = prefill_flops(arch, t, n) * tps / n
        print(f"helios {family} prefill {n}{label}: {tps:8.0f} tok/s = {achieved / 1e12:.0f} TFLOP/s "
              f"({achieved / matmul:.1%} of the matmul rate)", flush=True)
        if profile_batches and device == "cuda":
            print("\n".join(profile_prefill(on, arch, n)), flush=True)
            print("\n".join(layer_host_times(on, arch, n)), flush=True)
    prefill(runner)
    for variant in prefill_variants:  # the prefill again under other switches, over the same weights
        other = build_runner(arch, t, [1], device, variant_switches(variant))
        prefill(other, f", {variant}")
        del other
        free(device)
    hf_limit = bandwidth / decode_bytes(arch, t, 1, PROMPT + NEW // 2)
    del runner, t
    free(device)
    if hf:
        model, _ = hf_model(family, device, tiny)
        tps = hf_decode(model, device=device)
        print(f"HF transformers {family} generate b=1: {tps:8.1f} tok/s ({tps / hf_limit:.1%})", flush=True)
        del model
        free(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", default="qwen3_5,qwen3_5_moe,mimo_v2_flash,kimi_linear")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs of the same families (a plumbing check)")
    parser.add_argument("--dump-fla", type=Path, help="write fla's tuned choices here after the runs "
                        "(helios.kernels.fla_tuning; the table to carry is helios/kernels/fla_<device>.json)")
    parser.add_argument("--profile", default="", help="batches whose decode steps get a kernel profile (comma list)")
    parser.add_argument("--variants", default="", help="switch sets to time batch 1 again with, same weights: "
                        "';'-separated, each space-separated NAME=VALUE (e.g. 'HELIOS_PDL=1;HELIOS_PDL=1 HELIOS_GEMV=all')")
    parser.add_argument("--prefill-variants", default="", help="switch sets to time the prefill again with "
                        "(as --variants, e.g. 'HELIOS_MOE_PREFILL=grouped')")
    parser.add_argument("--layers", default="", help="family=N pairs (comma list): the first N layers of that family's "
                        "pattern instead of the default count (kimi_linear's 14 do not fit an 80 GB card beside HF's copy)")
    args = parser.parse_args()
    families = args.families.split(",")
    if args.device == "cuda" and len(families) > 1:
        # a process per family: one family's leftovers (allocator caches, the runner's graphs) made the next one's
        # build run out of an H100's memory (session 26: kimi_linear, then mimo_v2_flash)
        # the other arguments as given: "--families X" and "--families=X" dropped
        rest = [a for i, a in enumerate(sys.argv[1:])
                if not a.startswith("--families") and not (i > 0 and sys.argv[i] == "--families")]
        for family in families:
            subprocess.run([sys.executable, __file__, *rest, f"--families={family}"], check=False)
        return
    for pair in filter(None, args.layers.split(",")):
        family, _, count = pair.partition("=")
        LAYERS[family] = int(count)
    print(f"switches: {SWITCHES}", flush=True)
    if args.device == "cuda":
        bandwidth, matmul = copy_bandwidth(), matmul_rate()
        print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e9:.0f} GB/s, bf16 matmul {matmul / 1e12:.0f} "
              f"TFLOP/s", flush=True)
    else:  # no limits to speak of here: the fractions printed are against a nominal 1 GB/s and 1 TFLOP/s
        bandwidth, matmul = 1e9, 1e12
    for family in families:
        run_family(family, [int(b) for b in args.batches.split(",")], bandwidth, matmul, not args.skip_hf,
                   args.device, args.tiny, tuple(int(b) for b in args.profile.split(",") if b),
                   tuple(v for v in args.variants.split(";") if v.strip()),
                   tuple(v for v in args.prefill_variants.split(";") if v.strip()))
        if args.dump_fla and args.device == "cuda":  # after each family: a run cut short keeps what it tuned
            dump_fla(args.dump_fla)


def dump_fla(path: Path) -> None:
    import fla
    import triton

    from helios.kernels import fla_tuning

    n = fla_tuning.dump(path, torch.cuda.get_device_name(), {
        "fla-core": fla.__version__, "triton": triton.__version__, "torch": torch.__version__.split("+")[0]})
    print(f"fla choices written: {n} to {path}", flush=True)


if __name__ == "__main__":
    main()
