"""Tiny random-weight HF checkpoints of every family, saved with HF transformers, plus a usable tokenizer.

`build_tiny(family, out_dir)` writes a directory AutoModelForCausalLM.from_pretrained and ignition's
open_hf_dir both read: the parity oracle's input. Same family + seed -> the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3")
VOCAB_SIZE = 300
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 2, 0

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "def main():\n    print('hello')\n    return 0\n",
    "Flare exports checkpoints into prepared cores and serves them over HTTP.",
    "one two three four five six seven eight nine ten",
    "the cat sat on the mat; the dog sat on the log.",
]

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)

# What each family's tiny config exercises (for the parity tests):
#   llama      llama3 rope scaling, tied embeddings, head_dim from hidden/heads
#   qwen2      q/k/v biases, untied lm_head
#   qwen3      q/k norms, explicit head_dim 32 (Nq*D != hidden), tied embeddings
#   qwen3_moe  4 experts top-2 with norm_topk_prob, layer 1 dense via mlp_only_layers
#   gemma3     sliding (window 8) + full layer, query_pre_attn_scalar 24, local rope base, sandwich norms
_FAMILY_CONFIG = {
    "llama": dict(
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "qwen2": dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(head_dim=32, tie_word_embeddings=True),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False),
    "gemma3": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def tiny_config(family: str, **overrides):
    """The transformers config of the family's tiny model (overrides win)."""
    import transformers as T

    classes = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "qwen3": T.Qwen3Config,
               "qwen3_moe": T.Qwen3MoeConfig, "gemma3": T.Gemma3TextConfig}
    if family not in classes:
        raise ValueError(f"unknown family {family!r} (have {FAMILIES})")
    return classes[family](**{**_COMMON, **_FAMILY_CONFIG[family], **overrides})


def tiny_model(family: str, seed: int = 0, **overrides):
    """The HF model with every parameter re-drawn from `seed` (norm weights too, so 1+w matters)."""
    import transformers as T

    classes = {"llama": T.LlamaForCausalLM, "qwen2": T.Qwen2ForCausalLM, "qwen3": T.Qwen3ForCausalLM,
               "qwen3_moe": T.Qwen3MoeForCausalLM, "gemma3": T.Gemma3ForCausalLM}
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = classes[family](config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:  # gemma norms multiply by 1+w around 1; others by w around 1
                center = 0.0 if family == "gemma3" else 1.0
                p.copy_(center + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # [.., out, in]: keep activations O(1)
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def build_tokenizer():
    """A byte-level BPE (any text encodes) with the specials first and VOCAB_SIZE - merges up to 300 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def write_tokenizer(out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with a ChatML chat_template)."""
    tok = build_tokenizer()
    assert tok.get_vocab_size() <= VOCAB_SIZE
    (out_dir / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "chat_template": CHATML_TEMPLATE,
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "model_max_length": _COMMON["max_position_embeddings"],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True))


def build_tiny(family: str, out_dir: Path, seed: int = 0, sharded: bool = False,
               dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Save the family's tiny model (in `dtype`; several shards with `sharded`) and a tokenizer to `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = tiny_model(family, seed, **overrides).to(dtype)
    # the embedding alone is 300 x 64 floats (75 KiB), so 100KB shards split every family into a few files
    model.save_pretrained(out_dir, max_shard_size="100KB" if sharded else "2GB")
    write_tokenizer(out_dir)
    return out_dir


def redraw_score_biases(model, gen: torch.Generator) -> None:
    """Re-draw the routers' score-correction biases (e_score_correction_bias: buffers, not parameters) small from
    `gen`, after the family's parameters; call under torch.no_grad()."""
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def save_checkpoint(model, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A family builder's last step: the HF model (cast to `dtype`) and a tokenizer saved to `out_dir` (made if
    missing); returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out_dir)
    write_tokenizer(out_dir)
    return out_dir
