from __future__ import annotations

from helios.core.manifest import TokenizerInfo
from helios.frontend.tokenizer import Tokenizer, gpt2_byte_decoder
from tests.frontend.conftest import CORPUS


def test_gpt2_byte_table_is_a_bijection():
    table = gpt2_byte_decoder()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 32 and table["!"] == 33


def test_byte_level_bytes_concatenate_to_the_text(tokenizer):
    for text in CORPUS[:5] + ["unseen 🎉🎉 中文 text"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode_bytes(ids) == text.encode()
        assert tokenizer.decode(ids) == text


def test_special_tokens_and_padding_ids(tokenizer):
    eos = tokenizer.info.eos_token_ids[0]
    assert eos in tokenizer.special_ids
    assert tokenizer.token_bytes[eos] == b"<|im_end|>"
    assert len(tokenizer.token_bytes) == 320 and tokenizer.token_bytes[319] == b""
    assert tokenizer.decode([eos, 319], skip_special_tokens=True) == ""
    assert tokenizer.encode("a<|im_end|>", add_special_tokens=False)[-1] == eos


def test_bos_policy_comes_from_the_manifest(byte_level_tok):
    bos = byte_level_tok.token_to_id("<|endoftext|>")
    with_bos = Tokenizer(byte_level_tok, TokenizerInfo(bos_token_id=bos, add_bos_token=True), 300)
    without = Tokenizer(byte_level_tok, TokenizerInfo(bos_token_id=bos), 300)
    assert with_bos.encode("hello") == [bos, *without.encode("hello")]
    assert with_bos.encode("hello", add_special_tokens=False) == without.encode("hello")
    assert with_bos.encode("") == [bos] and without.encode("") == []
    assert with_bos.bos_token == "<|endoftext|>"


def test_sentencepiece_pieces_and_byte_fallback(sp_tok):
    tok = Tokenizer(sp_tok, TokenizerInfo(bos_token_id=1, eos_token_ids=[2]), sp_tok.get_vocab_size())
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.token_bytes[ids[0]] == b" hello"
    ids = tok.encode("hé", add_special_tokens=False)  # é is not in the vocab: two <0xNN> tokens
    pieces = [tok.token_bytes[i] for i in ids]
    assert b"".join(pieces).endswith("é".encode()) and b"\xc3" in pieces and b"\xa9" in pieces
    assert tok.token_text(ids[-1]) == "\ufffd"
