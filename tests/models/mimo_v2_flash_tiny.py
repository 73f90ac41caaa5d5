"""Tiny random-weight mimo_v2_flash checkpoints (MiMoV2FlashForCausalLM: full and sliding layers, the sliding ones with
twice the KV heads and attention sinks, q/k heads 24 wide with v heads 16, partial rotary, V scaled, a dense first
MLP and group-limited sigmoid-routed experts), saved with HF transformers beside the tiny tokenizer of
tests/ignition/tiny_models: the parity oracle's input. `write_mimo_v2` rewrites one in the mimo_v2 layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.ignition.checkpoint_tools import raw_tensors, write_tensors
from tests.ignition.tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, redraw_score_biases, save_checkpoint

FULL, SLIDING = "full_attention", "sliding_attention"
# layers full, sliding, sliding, full; a 17-token window (prompts run far past it); rotary int(24 * 0.334) = 8 dims;
# 2 KV heads on full layers, 4 on sliding ones (HF doubles them); 8 experts top-2 within 1 of 2 groups
CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=24, v_head_dim=16, sliding_window=17, layer_types=[FULL, SLIDING, SLIDING, FULL],
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
    routed_scaling_factor=1.5, max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)


def mimo_model(seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed`: norms around 1, sinks O(1) (they take a visible share
    of the softmax), the router's score bias small, the rest scaled for O(1) activations."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.MiMoV2FlashForCausalLM(T.MiMoV2FlashConfig(**{**CONFIG, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        redraw_score_biases(model, gen)
    return model


def build_mimo(out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    return save_checkpoint(mimo_model(seed, **overrides), out_dir, dtype)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: int) -> torch.Tensor:
    """The mimo_v2 fused qkv_proj: `chunks` shards side by side, each its share of q, k and v rows."""
    return torch.cat([torch.cat(parts) for parts in zip(q.chunk(chunks), k.chunk(chunks), v.chunk(chunks))])


def write_mimo_v2(src: Path, out_dir: Path) -> Path:
    """The checkpoint at `src` as a MiMo-V2.5-style release: model_type mimo_v2 with the remote-code config keys
    (hybrid_layer_pattern, moe_layer_freq, swa_*, sliding_window_size, layernorm_epsilon, sink flags) and a vision
    sub-config, fused qkv_proj (shards = num_key_value_heads), and tensors the text model ignores (an MTP layer, a
    vision tower)."""
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg["rope_parameters"]
    kv = cfg["num_key_value_heads"]
    released = {
        "model_type": "mimo_v2", "architectures": ["MiMoV2ForCausalLM"], "attention_projection_layout": "fused_qkv",
        "hybrid_layer_pattern": [int(t == SLIDING) for t in cfg["layer_types"]],
        "moe_layer_freq": [int(t == "sparse") for t in cfg["mlp_layer_types"]],
        "sliding_window_size": cfg["sliding_window"] - 1, "swa_num_key_value_heads": 2 * kv,
        "swa_num_attention_heads": cfg["num_attention_heads"], "swa_head_dim": cfg["head_dim"],
        "swa_v_head_dim": cfg["v_head_dim"], "rope_theta": rope[FULL]["rope_theta"],
        "swa_rope_theta": rope[SLIDING]["rope_theta"], "partial_rotary_factor": rope[FULL]["partial_rotary_factor"],
        "layernorm_epsilon": cfg["rms_norm_eps"], "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "n_shared_experts": None, "vision_config": {"depth": 1, "hidden_size": 32},
    }
    drop = ("layer_types", "mlp_layer_types", "rope_parameters", "sliding_window", "rms_norm_eps")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps({**{k: v for k, v in cfg.items() if k not in drop}, **released}))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            (out_dir / f.name).write_bytes(f.read_bytes())
    write_tensors(out_dir, _released_tensors(raw_tensors(src), kv))
    return out_dir


def _released_tensors(raw: dict[str, torch.Tensor], chunks: int) -> dict[str, torch.Tensor]:
    """transformers saves the released names already (attention_sink_bias, per-expert weights): fuse q/k/v, add a
    vision tower's tensor (MTP layers: tests/ignition/test_mtp_export.py)."""
    out = {"visual.blocks.0.weight": torch.zeros(4, 4)}
    for name, t in raw.items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            continue
        if name.endswith("q_proj.weight"):
            base = name[: -len("q_proj.weight")]
            out[base + "qkv_proj.weight"] = fuse_qkv(t, raw[base + "k_proj.weight"], raw[base + "v_proj.weight"],
                                                     chunks)
        else:
            out[name] = t
    return out
