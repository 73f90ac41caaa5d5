"""The default core (SmolLM2-135M-Instruct from its GGUF) against HF transformers' own GGUF loading:
weights tensor by tensor, tokenizer on a hard corpus, chat template text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from helios.core.chat_template import ChatTemplate
from helios.core.load import load_core

CORPUS = [
    "Hello, world!",
    "The capital of France is",
    "  leading spaces and\ttabs\n\nnewlines   \n",
    "naïve café — “quotes” ½ € ß ø",
    "emoji: 🤖🚀👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷",
    "中文分词测试，日本語のテキスト，한국어",
    "def f(x):\n    return [i ** 2 for i in range(x)]  # squares\n",
    "numbers 1234567890 3.14159 -42 1e-5",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
    "    ",
]


@pytest.fixture(scope="module")
def core(default_core_path):
    return load_core(default_core_path)


def test_weights_equal_transformers_gguf_loading(core, smollm2_hf_model):
    a = core.manifest.arch
    sd = smollm2_hf_model.state_dict()
    nq, nkv, hd = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.head_dim
    exact = dict(rtol=0, atol=0)
    torch.testing.assert_close(core.tensors["embed.weight"], sd["model.embed_tokens.weight"], **exact)
    torch.testing.assert_close(core.tensors["norm.weight"], sd["model.norm.weight"], **exact)
    assert "lm_head.weight" not in core.tensors and a.tie_word_embeddings
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        qkv = core.tensors[f"layers.{i}.attn.qkv.weight"]
        torch.testing.assert_close(qkv[:nq], sd[p + "self_attn.q_proj.weight"], **exact)
        torch.testing.assert_close(qkv[nq : nq + nkv], sd[p + "self_attn.k_proj.weight"], **exact)
        torch.testing.assert_close(qkv[nq + nkv :], sd[p + "self_attn.v_proj.weight"], **exact)
        torch.testing.assert_close(core.tensors[f"layers.{i}.attn.o.weight"], sd[p + "self_attn.o_proj.weight"], **exact)
        gate_up = core.tensors[f"layers.{i}.mlp.gate_up.weight"]
        f = a.intermediate_size
        torch.testing.assert_close(gate_up[:f], sd[p + "mlp.gate_proj.weight"], **exact)
        torch.testing.assert_close(gate_up[f:], sd[p + "mlp.up_proj.weight"], **exact)
        torch.testing.assert_close(core.tensors[f"layers.{i}.mlp.down.weight"], sd[p + "mlp.down_proj.weight"], **exact)
        torch.testing.assert_close(core.tensors[f"layers.{i}.attn_norm.weight"], sd[p + "input_layernorm.weight"], **exact)
        torch.testing.assert_close(core.tensors[f"layers.{i}.mlp_norm.weight"], sd[p + "post_attention_layernorm.weight"], **exact)
    assert (a.num_layers, a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads, a.head_dim) == (30, 576, 1536, 9, 3, 64)
    assert a.vocab_size == 49152 and a.rope_theta == 100000


def _has_numeric(text: str) -> bool:
    return any(ch.isnumeric() for ch in text)


def test_tokenizer_matches_transformers(core, smollm2_hf_tokenizer):
    """Exact ids and text against transformers' GGUF tokenizer, with one deliberate difference.

    NOTE: GGUF's pre-tokenizer "smollm" isolates every numeric character before the GPT-2 split (as
    SmolLM2's own tokenizer.json and llama.cpp do; the vocabulary has no "Ġ1"-style tokens). transformers'
    GGUF loader has no "smollm" case and falls back to the plain GPT-2 split, which merges " ½" or " 1"
    into pieces the model never saw. So: on text without numeric characters we equal transformers
    exactly; on all text we equal transformers' tokenizer with SmolLM2's original pre-tokenizer.
    """
    from tokenizers import pre_tokenizers

    tok = Tokenizer.from_file(str(core.tokenizer_path))
    fixed = Tokenizer.from_str(smollm2_hf_tokenizer.backend_tokenizer.to_str())
    fixed.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for text in CORPUS:
        ours = tok.encode(text, add_special_tokens=False).ids
        theirs = smollm2_hf_tokenizer.encode(text, add_special_tokens=False)
        if not _has_numeric(text):
            assert ours == theirs, text
        assert ours == fixed.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ours, skip_special_tokens=False) == smollm2_hf_tokenizer.decode(ours)
        assert tok.decode(ours, skip_special_tokens=True) == smollm2_hf_tokenizer.decode(ours, skip_special_tokens=True)
    assert sum(_has_numeric(t) for t in CORPUS) >= 2 and sum(not _has_numeric(t) for t in CORPUS) >= 6
    t = core.manifest.tokenizer
    assert (t.bos_token_id, t.eos_token_ids[0], t.unk_token_id, t.add_bos_token) == (1, 2, 0, False)


def test_chat_template_renders_like_transformers(core, smollm2_hf_tokenizer):
    tpl = ChatTemplate(core.template_source, bos_token="<|im_start|>", eos_token="<|im_end|>")
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            ours = tpl.render(messages, add_generation_prompt=gen)
            theirs = smollm2_hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours == theirs
    caps = core.manifest.template
    assert caps.present and caps.default_system and caps.generation_prompt == "<|im_start|>assistant\n"
    assert caps.tools is False and caps.reasoning is None


def test_default_core_manifest(core):
    m = core.manifest
    assert m.dtype == "float32" and m.logprobs.prompt_logprobs and m.logprobs.max_top_logprobs == 20
    assert m.model.aliases == ["smollm2-135m-instruct"]
    assert m.recipe.name == "smollm2"
    assert json.loads(Path(core.tokenizer_path).read_text())  # canonical JSON
