"""Tiny tokenizers built in the test (byte-level BPE and a SentencePiece-style byte-fallback BPE)."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from helios.core.manifest import TokenizerInfo
from helios.frontend.tokenizer import Tokenizer

CORPUS = ["hello world", "the capital of France is Paris.", "héllo wörld", "你好世界", "emoji 🎉 party"] * 20


@pytest.fixture(scope="session")
def byte_level_tok() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="session")
def sp_tok() -> tokenizers.Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁he", "▁hell", "▁hello", "▁w", "or", "▁wor", "▁world"]:
        vocab[piece] = len(vocab)
    merges = [("h", "e"), ("l", "l"), ("▁", "he"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"), ("o", "r"),
              ("▁w", "or"), ("▁wor", "l"), ("▁worl", "d")]
    vocab["▁worl"] = len(vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


@pytest.fixture(scope="session")
def tokenizer(byte_level_tok) -> Tokenizer:
    eos = byte_level_tok.token_to_id("<|im_end|>")
    info = TokenizerInfo(bos_token_id=byte_level_tok.token_to_id("<|endoftext|>"), eos_token_ids=[eos])
    return Tokenizer(byte_level_tok, info, vocab_size=320)


def make_manifest(**over):
    """A small valid manifest; keyword overrides replace whole sections."""
    from helios.core import manifest as m

    fields = dict(
        format_version=m.FORMAT_VERSION,
        ignition_version="test",
        model=m.ModelIdentity(id="org/tiny-model", name="tiny", aliases=["tiny"]),
        arch=m.Architecture(
            family="llama", vocab_size=320, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
            num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
            tie_word_embeddings=True,
        ),
        recipe=m.Recipe(name="test"),
        dtype="float32",
        tokenizer=m.TokenizerInfo(bos_token_id=0, eos_token_ids=[2]),
        template=m.TemplateCaps(present=False),
        sampling=m.Sampling(
            defaults=m.SamplingDefaults(temperature=0.7, top_p=0.9, top_k=20, seed=5),
            ranges=m.SamplingRanges(temperature=m.Range(min=0.05, max=2.0), top_k=m.Range(min=-1, max=100)),
        ),
        logprobs=m.LogprobCaps(max_top_logprobs=5, prompt_logprobs=True),
        vision=m.Vision(),
        limits=m.Limits(context_length=128, default_max_tokens=16),
        graph_plan=m.GraphPlan(decode_buckets=[1], prefill_chunk_size=64, max_concurrency=4, page_size=16,
                               logprob_outputs=5),
    )
    fields.update(over)
    return m.Manifest(**fields)
