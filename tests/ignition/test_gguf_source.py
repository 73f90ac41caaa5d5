"""open_gguf against transformers' own GGUF loading: tensors, config, tokenizer; and bad input.

Tensors must be bit-identical (torch.equal): transformers dequantizes with the same gguf.quants code and undoes
llama.cpp's Q/K permutation and Gemma's +1 norms with the same float32 arithmetic. Tokenizers must encode and
decode identically, except where SmolLM2's `smollm` split deliberately follows llama.cpp (see gguf_tokenizer).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize
from tokenizers import Tokenizer, pre_tokenizers

from ignition.errors import ExportError
from ignition.sources.gguf import GGUFFile, open_gguf
from ignition.sources.gguf_tokenizer import bytes_to_unicode

CORPUS = [
    "The capital of France is",
    "Hello, world! How's it going? I'm fine, you'll see; they'd agree. IT'S LOUD",
    "  leading spaces, trailing spaces   ",
    "runs     of      spaces\tand\t\ttabs\n\nnew\r\nlines\n\n\n\nend",
    "unicode: naïve café, Straße, Ærøskøbing, e\u0301 (combining), a\u200bb (zero width), x\u00a0y (nbsp)",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "CJK: 你好，世界！日本語のテキストです。한국어 텍스트. Fullwidth: ＡＢＣ１２３",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\tif x > 0:\n\t\tprint(f'{x:>10}')\n",
    'json: {"a": [1, 2, 3], "b": null, "c": "\\u00e9"}',
    "numbers: 0 7 42 3.14159 -2.5e-10 1,000,000 2024-06-01 0x1F 123456789 9999",
    "x  1, y   22, z\n  333\t\t4 [\n    5,\n    6\n]",  # whitespace runs before digits
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|im_end|><|im_start|> <|im_start|>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "<bos><start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n<eos><pad>",
    "",
    " ",
    "\n",
    "a" * 64,
]


def open_oracle_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def open_oracle_model(gguf: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def assert_tensors_match(ckpt, model) -> None:
    """Every checkpoint tensor equals transformers' parameter of the same name, bit for bit."""
    state = model.state_dict()
    expected = set(state)
    if ckpt.config["tie_word_embeddings"]:
        assert "lm_head.weight" not in ckpt.tensors
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
        expected.discard("lm_head.weight")
    assert set(ckpt.tensors) == expected
    for name, lazy in ckpt.iter_tensors():
        tensor = lazy.load()
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == lazy.shape, name
        assert torch.equal(tensor, state[name]), name


def assert_config_matches(ckpt, model) -> None:
    ours, theirs = ckpt.config, model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        # Qwen2Config has no head_dim attribute: its attention uses hidden_size // num_attention_heads
        default = theirs.hidden_size // theirs.num_attention_heads if key == "head_dim" else None
        assert ours[key] == getattr(theirs, key, default), key
    # transformers keeps the float32 metadata's binary value; we write its shortest decimal (1e-05)
    assert np.float32(ours["rms_norm_eps"]) == np.float32(theirs.rms_norm_eps)
    rope = theirs.rope_parameters
    assert ours["rope_theta"] == rope.get("full_attention", rope)["rope_theta"]
    assert ours["model_type"] == theirs.model_type
    assert ours["architectures"][0] == type(model).__name__


def assert_tokenizer_matches(ckpt, oracle, divergent_split=None) -> int:
    """Same ids (with and without BOS insertion and special-token matching) and same decoded text.

    With `divergent_split`, texts that this pre-tokenizer splits differently from the oracle's are compared
    against the oracle's backend with `divergent_split` installed instead; returns how many there were.
    """
    ours = Tokenizer.from_str(ckpt.tokenizer_json)
    patched = None
    if divergent_split is not None:
        patched = Tokenizer.from_str(oracle.backend_tokenizer.to_str())
        patched.pre_tokenizer = divergent_split
    diverged = 0
    for text in CORPUS:
        reference = oracle
        oracle_split = oracle.backend_tokenizer.pre_tokenizer
        if patched is not None and _splits(divergent_split, text) != _splits(oracle_split, text):
            reference, diverged = None, diverged + 1
        for add_special in (False, True):
            for split_special in (False, True):
                ours.encode_special_tokens = split_special
                if reference is None:
                    patched.encode_special_tokens = split_special
                    want = patched.encode(text, add_special_tokens=add_special).ids
                else:
                    want = oracle(text, add_special_tokens=add_special, split_special_tokens=split_special)["input_ids"]
                ids = ours.encode(text, add_special_tokens=add_special).ids
                assert ids == want, (text, add_special, split_special)
                for skip in (False, True):
                    assert ours.decode(ids, skip_special_tokens=skip) == oracle.decode(ids, skip_special_tokens=skip)
    ours.encode_special_tokens = False
    # single tokens decode alike too: byte-level pieces, byte fallback, whitespace tokens, specials
    for token_id in range(0, ours.get_vocab_size(), 97):
        assert ours.decode([token_id], skip_special_tokens=False) == oracle.decode([token_id]), token_id
    config = ckpt.tokenizer_config
    for key in ("bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token", "add_eos_token"):
        assert config[key] == getattr(oracle, key), key
    assert ckpt.chat_template == oracle.chat_template == config["chat_template"]
    return diverged


def _splits(pre_tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def assert_data_ends_at_file_end(reader: GGUFReader, path: Path) -> None:
    """The assembled chunks form exactly one GGUF: nothing missing, nothing trailing."""
    assert max(t.data_offset + t.n_bytes for t in reader.tensors) == os.path.getsize(path)


# ---------------------------------------------------------------- SmolLM2-135M-Instruct (llama, Q4_1)


@pytest.fixture(scope="module")
def smollm2_ckpt(smollm2_gguf):
    return open_gguf(smollm2_gguf)


def test_smollm2_tensors_equal_transformers(smollm2_ckpt, smollm2_hf_model):
    # covers llama's Q/K un-permutation (every attn_q/attn_k is Q4_1) and the Q8_0 embedding
    assert_tensors_match(smollm2_ckpt, smollm2_hf_model)
    assert smollm2_ckpt.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == "Q4_1"
    assert smollm2_ckpt.tensors["model.norm.weight"].dtype == "float32"


def test_smollm2_config(smollm2_ckpt, smollm2_hf_model, smollm2_gguf):
    assert_config_matches(smollm2_ckpt, smollm2_hf_model)
    config = smollm2_ckpt.config
    assert (config["rms_norm_eps"], config["rope_theta"], config["tie_word_embeddings"]) == (1e-5, 100000.0, True)
    assert smollm2_ckpt.identifier == "SmolLM2-135M-Instruct.Q4_1"
    assert smollm2_ckpt.source_files == [smollm2_gguf]


def test_smollm2_tokenizer_matches_transformers(smollm2_ckpt, smollm2_hf_tokenizer):
    # transformers has no `smollm` split and uses GPT-2's; llama.cpp (and SmolLM2's own tokenizer.json)
    # split off every digit first. Only texts with whitespace runs before digits tokenize differently.
    smollm = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert assert_tokenizer_matches(smollm2_ckpt, smollm2_hf_tokenizer, divergent_split=smollm) >= 1
    ours, theirs = json.loads(smollm2_ckpt.tokenizer_json), json.loads(smollm2_hf_tokenizer.backend_tokenizer.to_str())
    assert ours.pop("pre_tokenizer")["pretokenizers"][0] == {"type": "Digits", "individual_digits": True}
    theirs.pop("pre_tokenizer")
    assert ours == theirs  # vocabulary, merges, added tokens, post-processor, decoder: all transformers'
    assert smollm2_ckpt.tokenizer_config["bos_token"] == "<|im_start|>"
    assert smollm2_ckpt.tokenizer_config["add_bos_token"] is False
    assert "You are a helpful AI assistant named SmolLM" in smollm2_ckpt.chat_template


def test_smollm2_digits_split_like_llama_cpp(smollm2_ckpt, smollm2_hf_tokenizer):
    ours = Tokenizer.from_str(smollm2_ckpt.tokenizer_json)
    # llama.cpp: "\p{N}" first, then GPT-2's regex in each piece, so the run of spaces stays whole
    assert ours.encode("x  1").tokens == ["x", "ĠĠ", "1"]
    assert smollm2_hf_tokenizer.convert_ids_to_tokens(smollm2_hf_tokenizer.encode("x  1")) == ["x", "Ġ", "Ġ", "1"]
    assert ours.encode("<|im_start|>user").tokens == ["<|im_start|>", "user"]


# ---------------------------------------------------------------- real models marked slow


# The oracles (GBs of float32) are conftest's GgufOracles, shared with tests/models/test_real_models.py: the last
# test marked gguf_oracle frees them.
@pytest.fixture(scope="class")
def qwen_ckpt(qwen25_coder_gguf):
    assert_data_ends_at_file_end(GGUFFile(qwen25_coder_gguf), qwen25_coder_gguf)
    return open_gguf(qwen25_coder_gguf)


@pytest.fixture(scope="class")
def qwen_oracle(qwen25_coder_oracle):
    return qwen25_coder_oracle.model


@pytest.mark.slow
@pytest.mark.gguf_oracle("qwen25_coder_oracle")
class TestQwen25Coder:
    """qwen2 family, Q5_0/Q8_0/Q4_K/Q6_K, q/k/v biases, separate output.weight, the qwen2 split regex."""

    def test_tensors(self, qwen_ckpt, qwen_oracle):
        assert qwen_ckpt.tensors["model.embed_tokens.weight"].dtype == "Q5_0"
        assert_tensors_match(qwen_ckpt, qwen_oracle)

    def test_config(self, qwen_ckpt, qwen_oracle):
        assert_config_matches(qwen_ckpt, qwen_oracle)
        assert qwen_ckpt.config["model_type"] == "qwen2" and qwen_ckpt.config["tie_word_embeddings"] is False

    def test_tokenizer(self, qwen_ckpt, qwen25_coder_oracle):
        oracle = qwen25_coder_oracle.tokenizer
        assert assert_tokenizer_matches(qwen_ckpt, oracle) == 0
        assert json.loads(qwen_ckpt.tokenizer_json) == json.loads(oracle.backend_tokenizer.to_str())
        assert "<tool_call>" in qwen_ckpt.chat_template


@pytest.fixture(scope="class")
def gemma_reader(gemma3_270m_gguf):
    reader = GGUFFile(gemma3_270m_gguf)
    assert_data_ends_at_file_end(reader, gemma3_270m_gguf)
    return reader


@pytest.fixture(scope="class")
def gemma_ckpt(gemma3_270m_gguf, gemma_reader):
    return open_gguf(gemma3_270m_gguf)


@pytest.fixture(scope="class")
def gemma_oracle(gemma3_270m_oracle):
    return gemma3_270m_oracle.model


@pytest.mark.slow
@pytest.mark.gguf_oracle("gemma3_270m_oracle")
class TestGemma3:
    """gemma3 family, Q4_K/Q5_0/Q6_K/Q8_0, norms stored as 1 + w, sentencepiece vocabulary, no template."""

    def test_tensors(self, gemma_ckpt, gemma_oracle):
        assert_tensors_match(gemma_ckpt, gemma_oracle)

    def test_norms_are_hf_convention(self, gemma_ckpt, gemma_reader):
        raw = {t.name: np.array(t.data) for t in gemma_reader.tensors if t.name.endswith("norm.weight")}
        assert len(raw) == 6 * 18 + 1
        got = gemma_ckpt.tensors["model.layers.3.post_feedforward_layernorm.weight"].load()
        assert torch.equal(got, torch.from_numpy(raw["blk.3.post_ffw_norm.weight"]) - 1.0)

    def test_config(self, gemma_ckpt, gemma_oracle):
        assert_config_matches(gemma_ckpt, gemma_oracle)
        ours, theirs = gemma_ckpt.config, gemma_oracle.config
        for key in ("sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping",
                    "attn_logit_softcapping", "hidden_activation"):
            assert ours[key] == getattr(theirs, key), key
        assert ours["rope_local_base_freq"] == theirs.rope_parameters["sliding_attention"]["rope_theta"]
        assert ours["model_type"] == "gemma3_text" and ours["tie_word_embeddings"] is True

    def test_tokenizer(self, gemma_ckpt, gemma3_270m_oracle):
        oracle = gemma3_270m_oracle.tokenizer
        assert assert_tokenizer_matches(gemma_ckpt, oracle) == 0
        assert json.loads(gemma_ckpt.tokenizer_json) == json.loads(oracle.backend_tokenizer.to_str())
        assert gemma_ckpt.chat_template is None and gemma_ckpt.tokenizer_config["add_bos_token"] is True


# ---------------------------------------------------------------- tiny synthetic files, one per family

_TOKENS = [*bytes_to_unicode().values(), "Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
_TOKEN_TYPES = [1] * 258 + [3, 3, 3, 4]


def add_byte_level_tokenizer(writer: GGUFWriter) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(_TOKENS)
    writer.add_token_types(_TOKEN_TYPES)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(260)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], tokenizer=add_byte_level_tokenizer,
               **meta) -> Path:
    """A small but complete GGUF: hyperparameters, a tokenizer, then the tensors (HF-oriented arrays)."""
    writer = GGUFWriter(str(path), arch)
    for key, value in {"block_count": 2, "context_length": 128, "embedding_length": 64, "feed_forward_length": 64,
                       "attention.head_count": 4, "attention.head_count_kv": 2, **meta}.items():
        add = writer.add_float32 if isinstance(value, float) else writer.add_uint32
        add(f"{arch}.{key}", value)
    writer.add_layer_norm_rms_eps(1e-6)
    tokenizer(writer)
    for name, (array, qtype) in tensors.items():
        if qtype == Q.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif array.dtype == np.uint8:  # already blocks
            writer.add_tensor(name, array, raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(array.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_tensors(arch: str, rng: np.random.Generator) -> tuple[dict[str, tuple[np.ndarray, Q]], dict]:
    """Random tensors in llama.cpp's names, a mix of float and block types; plus the metadata they imply."""
    head_dim = 128 if arch.startswith("qwen3") else 16  # transformers reads no key_length for qwen3
    hidden, heads, kv_heads, ffn, vocab, experts = 64, 4, 2, 64, len(_TOKENS), 4
    moe_ffn = 768  # transformers ignores expert_feed_forward_length, so use its default width

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    t = {"token_embd.weight": (r(vocab, hidden), Q.Q8_0), "output_norm.weight": (r(hidden), Q.F32)}
    if arch != "gemma3":
        t["output.weight"] = (r(vocab, hidden), Q.Q4_0)
    for i in range(2):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": (r(hidden), Q.F32), p + "ffn_norm.weight": (r(hidden), Q.F32),
              p + "attn_q.weight": (r(heads * head_dim, hidden), Q.Q5_1),
              p + "attn_k.weight": (r(kv_heads * head_dim, hidden), Q.F32),
              p + "attn_v.weight": (r(kv_heads * head_dim, hidden), Q.Q4_1),
              p + "attn_output.weight": (r(hidden, heads * head_dim), Q.Q5_0)}
        if arch == "qwen2":
            for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                t[p + f"attn_{x}.bias"] = (r(n * head_dim), Q.F32)
        if arch != "llama" and arch != "qwen2":
            t |= {p + "attn_q_norm.weight": (r(head_dim), Q.F32), p + "attn_k_norm.weight": (r(head_dim), Q.F32)}
        if arch == "gemma3":
            t |= {p + "post_attention_norm.weight": (r(hidden), Q.F32), p + "post_ffw_norm.weight": (r(hidden), Q.F32)}
        if arch == "qwen3moe":
            t |= {p + "ffn_gate_inp.weight": (r(experts, hidden), Q.F32),
                  p + "ffn_gate_exps.weight": (r(experts, moe_ffn, hidden), Q.Q8_0),
                  p + "ffn_up_exps.weight": (r(experts, moe_ffn, hidden), Q.F32),
                  p + "ffn_down_exps.weight": (r(experts, hidden, moe_ffn), Q.Q4_0)}
        else:
            t |= {p + "ffn_gate.weight": (r(ffn, hidden), Q.Q8_0), p + "ffn_up.weight": (r(ffn, hidden), Q.F32),
                  p + "ffn_down.weight": (r(hidden, ffn), Q.Q8_0)}
    meta: dict = {"rope.freq_base": 10000.0}
    if arch != "llama":
        meta |= {"attention.key_length": head_dim, "attention.value_length": head_dim}
    if arch == "gemma3":
        meta["attention.sliding_window"] = 16
    if arch == "qwen3moe":
        meta |= {"expert_count": experts, "expert_used_count": 2, "expert_feed_forward_length": moe_ffn}
    return t, meta


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3"])
def test_tiny_family_matches_transformers(tmp_path, arch):
    tensors, meta = tiny_tensors(arch, np.random.default_rng(0))
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, tensors, **meta)
    ckpt = open_gguf(path)
    state = open_oracle_model(path).state_dict()
    if arch == "qwen3moe":  # transformers fuses the experts: gate_up_proj [E, 2F, H], down_proj [E, H, F]
        for i in range(2):
            experts = [f"model.layers.{i}.mlp.experts.{e}." for e in range(meta["expert_count"])]
            load = lambda name: torch.stack([ckpt.tensors.pop(p + name).load() for p in experts])  # noqa: E731
            gate_up = torch.cat([load("gate_proj.weight"), load("up_proj.weight")], dim=1)
            assert torch.equal(gate_up, state[f"model.layers.{i}.mlp.experts.gate_up_proj"])
            assert torch.equal(load("down_proj.weight"), state[f"model.layers.{i}.mlp.experts.down_proj"])
        assert ckpt.config["num_experts"] == 4 and ckpt.config["moe_intermediate_size"] == 768
    for name, lazy in ckpt.iter_tensors():
        assert torch.equal(lazy.load(), state[name]), name
    assert set(ckpt.tensors) | {"lm_head.weight"} >= {n for n in state if "experts" not in n}
    ours = Tokenizer.from_str(ckpt.tokenizer_json)
    assert ours.encode("<|im_start|>the<think>").tokens == ["<|im_start|>", "t", "he", "<think>"]


def test_llama_qk_rows_unpermuted_to_hf_order(tmp_path):
    """HF q/k -> llama.cpp's permute -> GGUF -> open_gguf gives back the HF tensors exactly."""
    tensors, meta = tiny_tensors("llama", np.random.default_rng(1))
    rng = np.random.default_rng(2)
    hf_q, hf_k = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal((32, 64)).astype(np.float32)

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    tensors["blk.0.attn_q.weight"] = (permute(hf_q, 4), Q.F32)
    tensors["blk.0.attn_k.weight"] = (permute(hf_k, 2), Q.F32)
    ckpt = open_gguf(write_gguf(tmp_path / "llama.gguf", "llama", tensors, **meta))
    assert torch.equal(ckpt.tensors["model.layers.0.self_attn.q_proj.weight"].load(), torch.from_numpy(hf_q))
    assert torch.equal(ckpt.tensors["model.layers.0.self_attn.k_proj.weight"].load(), torch.from_numpy(hf_k))
    assert ckpt.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == "float32"


def test_llama_sentencepiece_matches_transformers(tmp_path):
    """tokenizer.ggml.model = llama outside Gemma: Llama-2 style pieces, merges rebuilt from scores, byte fallback."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello", "or", "ld", "wor",
              "world", "▁world", "▁w"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]

    def add_sentencepiece(writer: GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)

    path = write_gguf(tmp_path / "spm.gguf", "llama", {}, tokenizer=add_sentencepiece)
    ckpt = open_gguf(path)
    ours, oracle = Tokenizer.from_str(ckpt.tokenizer_json), open_oracle_tokenizer(path)
    for text in ["hello world", " hello  world", "hello\nworld", "héllo wörld 😀", "<s>hello</s>", "world", ""]:
        for add_special in (False, True):
            ids = ours.encode(text, add_special_tokens=add_special).ids
            assert ids == oracle.encode(text, add_special_tokens=add_special), (text, add_special)
            assert ours.decode(ids, skip_special_tokens=True) == oracle.decode(ids, skip_special_tokens=True)
    assert ckpt.tokenizer_config["add_bos_token"] is True  # llama.cpp's default for sentencepiece
    assert ours.encode("hello world").tokens == ["<s>", "▁hello", "▁world"]


# ---------------------------------------------------------------- bad input: one clear line each


def _one_line_error(path: Path) -> str:
    with pytest.raises(ExportError) as info:
        open_gguf(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(path.name)
    return message


def test_gguf_file_reads_what_the_gguf_reader_reads(tmp_path):
    """GGUFFile (the reader over a plain view of its map) gives gguf.GGUFReader's fields and tensors, byte for byte."""
    path = tmp_path / "m.gguf"
    tensors, _ = tiny_tensors("llama", np.random.default_rng(3))
    write_gguf(path, "llama", tensors)
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 10
    for a, b in zip(ours.fields.values(), theirs.fields.values()):
        assert a.types == b.types and a.data == b.data and [p.tobytes() for p in a.parts] == [
            p.tobytes() for p in b.parts], a.name
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data.tobytes()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data.tobytes()) for t in theirs.tensors]
    assert type(ours.tensors[0].data) is np.ndarray  # no memmap subclass: plain slicing


def test_unsupported_tensor_type_fails_at_open(tmp_path):
    tensors, meta = tiny_tensors("llama", np.random.default_rng(0))
    tensors["blk.1.ffn_up.weight"] = (np.zeros((64, 64 // 32 * 18), dtype=np.uint8), Q.IQ4_NL)  # 18 B per 32
    message = _one_line_error(write_gguf(tmp_path / "iq4.gguf", "llama", tensors, **meta))
    assert message == "iq4.gguf: tensor blk.1.ffn_up.weight has unsupported GGUF type IQ4_NL"


def test_unknown_architecture(tmp_path):
    tensors, meta = tiny_tensors("llama", np.random.default_rng(0))
    message = _one_line_error(write_gguf(tmp_path / "mamba.gguf", "mamba", tensors, **meta))
    assert "unsupported GGUF architecture 'mamba'" in message


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    assert "not a readable GGUF file" in _one_line_error(path)
